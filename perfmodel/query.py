"""What `specbatch query` answers: the candidates at one batch size, from a model or from a table.

    chain_answer(fitted, acceptance, b, L, max_k)           -> QueryAnswer  (none and chains k = 1..max_k, by k)
    strategy_answer(fitted, acceptance, b, tree, L, ...)    -> QueryAnswer  (--tree auto: every strategy, ranked;
                                                                             --tree SPEC: none and that strategy)
    table_answer(table, b, L)                               -> QueryAnswer  (the table's own choice)

Every prediction is `strategy.StepModel`'s, as for tables and plots. `QueryAnswer.to_json()` is the object
`specbatch query --json` prints; its keys depend on the answer's kind (chains keep their k-only shape).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from .acceptance import AcceptanceModel, expected_tokens
from .errors import PerfModelError
from .jsonio import file_sha256
from .kernel_notes import describe, row_gap_notes, step_edge
from .model import FittedModel, query_strategies, step_model
from .strategy import StrategyCandidate, StrategyChoice
from .table import Table
from .tree import Strategy, parse_tree
from .uncertainty import choice_tie_notes

KINDS = ("chains", "strategies", "table")  # no --tree | --tree auto or SPEC | --table


@dataclass(frozen=True)
class QueryCandidate:
    strategy: Strategy
    step_ms: float | None  # None from a table: unknown without E (trees) or beyond the table's batch sizes
    tokens_per_step: float | None  # per sequence: E(strategy)
    tokens_per_s: float | None  # whole batch: b * E / S
    draft_passes: float | None = None  # expected per step; a table does not record it

    @property
    def k(self) -> int:
        return self.strategy.k

    @classmethod
    def predicted(cls, candidate: StrategyCandidate) -> "QueryCandidate":
        return cls(candidate.strategy, candidate.step_ms, candidate.tokens_per_step, candidate.tokens_per_s,
                   candidate.draft_passes)

    def to_json(self, kind: str) -> dict:
        numbers = {"step_ms": self.step_ms, "tokens_per_step": self.tokens_per_step, "tokens_per_s": self.tokens_per_s}
        if kind == "chains":
            return {"k": self.k, **numbers}
        named = {"strategy": self.strategy.describe(), "k": self.k, **numbers}
        return named if kind == "table" else {**named, "draft_passes": self.draft_passes}


@dataclass(frozen=True)
class QueryAnswer:
    kind: str  # one of KINDS
    batch_size: int
    context_len: int
    best_strategy: Strategy
    candidates: tuple[QueryCandidate, ...]  # chains: k = 0..max_k; strategies: ranked, or none and the one
    notes: tuple[str, ...] = ()  # beyond what the profile measured, and ties (as `table`'s); not in to_json

    def __post_init__(self):
        if self.kind not in KINDS:
            raise PerfModelError(f"query answer: kind {self.kind!r} is not one of {', '.join(KINDS)}")

    @property
    def best_k(self) -> int:
        return self.best_strategy.k

    def to_json(self) -> dict:
        obj = {"batch_size": self.batch_size, "context_len": self.context_len, "best_k": self.best_k}
        if self.kind != "chains":
            obj["best_strategy"] = self.best_strategy.to_json()
        obj["candidates"] = [c.to_json(self.kind) for c in self.candidates]
        return obj


def chain_answer(fitted: FittedModel, acceptance: AcceptanceModel, batch_size: int, context_len: int | None = None,
                 max_k: int | None = None) -> QueryAnswer:
    """Every k in 0..max_k (default: the profile's) at one batch size, in k order; the best k wins, ties
    to the smaller k. `context_len` defaults to the profile's middle one."""
    context = fitted.default_context_len() if context_len is None else context_len
    max_k = fitted.grid.max_k if max_k is None else max_k
    choice = query_strategies(fitted, acceptance, batch_size, context, max_k, strategies="chain")
    by_k = sorted(choice.ranked, key=lambda c: c.k)
    return QueryAnswer("chains", batch_size, context, choice.best.strategy,
                       tuple(QueryCandidate.predicted(c) for c in by_k),
                       tuple(fitted.extrapolation_notes(batch_size, [context], max_k)
                             + choice_tie_notes(choice, acceptance)
                             + kernel_step_notes(fitted, acceptance, choice.best.strategy, batch_size, context)))


def kernel_step_notes(fitted: FittedModel, acceptance: AcceptanceModel, strategy: Strategy, batch_size: int,
                      context_len: int) -> list[str]:
    """The kernel step the choice's verify pass sits just past, or the unresolved gap it lies in
    (`perfmodel.kernel_notes`); none for fits without steps."""
    edge = step_edge(fitted, step_model(fitted, acceptance), strategy, batch_size, context_len)
    return ([] if edge is None else [describe(edge)]) + row_gap_notes(fitted, batch_size)


def check_stage2_file(fitted: FittedModel, path: str | os.PathLike, source: str = "model") -> None:
    """The n-gram file given for the second stage must be the one the profile measured (same sha256)."""
    if fitted.stage2 is None:
        raise PerfModelError(f"--stage2: {source} has no second-stage measurements; run calibrate with --stage2 {path}")
    if file_sha256(Path(path)) != fitted.stage2.sha256:
        raise PerfModelError(f"--stage2 {path}: the model measured another n-gram file ({fitted.stage2.file}, "
                             f"sha256 {fitted.stage2.sha256[:12]}); calibrate with this one first")


def strategy_answer(fitted: FittedModel, acceptance: AcceptanceModel, batch_size: int, tree: str,
                    context_len: int | None = None, max_k: int | None = None,
                    stage2: str | os.PathLike | None = None, source: str = "model",
                    strategies: str = "all") -> QueryAnswer:
    """`tree` "auto": every candidate strategy ranked (chains, grown trees, and with the second stage when
    the model measured it; `strategies` "tree" leaves the second stage out, as `table --strategies` does,
    so the best here is the table's choice at this point); a tree spec (`tree.parse_tree`): no speculation
    and that strategy, with the second stage when `stage2` (the n-gram file, checked against the model's)
    is given. `source` names the model in errors."""
    context = fitted.default_context_len() if context_len is None else context_len
    if stage2 is not None:
        check_stage2_file(fitted, stage2, source)
    if tree == "auto":
        choice = query_strategies(fitted, acceptance, batch_size, context, max_k, strategies)
        ranked = choice.ranked
    else:
        strategy = Strategy(parse_tree(tree), stage2=stage2 is not None)
        model = step_model(fitted, acceptance)
        ranked = (model.evaluate(Strategy(None), batch_size, context), model.evaluate(strategy, batch_size, context))
        by_goodput = tuple(sorted(ranked, key=lambda c: -c.tokens_per_s))  # stable: equals keep their order
        choice = StrategyChoice(batch_size, context, by_goodput, ranked[0].tokens_per_s)
    best = max(ranked, key=lambda c: c.tokens_per_s)  # the first of equals: the simpler strategy
    notes = (fitted.strategy_notes([c.strategy for c in ranked]) + choice_tie_notes(choice, acceptance)
             + kernel_step_notes(fitted, acceptance, best.strategy, batch_size, context)
             + ([] if fitted.composition is None else [fitted.composition.summary()]))
    return QueryAnswer("strategies", batch_size, context, best.strategy,
                       tuple(QueryCandidate.predicted(c) for c in ranked), tuple(notes))


def table_answer(table: Table, batch_size: int, context_len: int | None = None) -> QueryAnswer:
    """The table's own choice with the goodput it predicted (None beyond its largest batch size, whose
    numbers belong to another batch size). The step time follows from G = b * E / S when E is known:
    chains, from the E(k) the table was computed with (measured, else from per-position acceptance, as
    the model does); trees leave it None. No `context_len`: the table's middle bucket (the shorter of the
    two middle ones), as a model's query takes the profile's middle context."""
    if context_len is None:
        context_len = table.buckets[(len(table.buckets) - 1) // 2].context_len
    strategy = table.strategy(batch_size, context_len)
    bucket = table.bucket_for(context_len)
    per_position = table.acceptance.get("per_position")
    measured = table.acceptance.get("tokens_per_step") or ()
    tokens = None
    if strategy.kind != "tree" and strategy.k < len(measured):
        tokens = measured[strategy.k]
    elif strategy.kind != "tree" and per_position:
        tokens = expected_tokens(per_position, strategy.k)
    goodput = step_ms = None
    if batch_size <= bucket.max_batch:
        goodput = bucket.entries[batch_size - 1].predicted_tokens_per_s
        if tokens is not None:
            step_ms = batch_size * tokens / goodput * 1e3
    return QueryAnswer("table", batch_size, bucket.context_len, strategy,
                       (QueryCandidate(strategy, step_ms, tokens, goodput),))
