"""Goodput of every step strategy, and the best one per batch size.

A strategy (`perfmodel.tree.Strategy`) is no speculation, a chain of k draft tokens or a tree, each
chain or tree with or without the n-gram second stage. For one batch size b and context length L:

    G(b, strategy, L) = b * E(strategy) / S(b, strategy, L)

E (tokens a row gains per step):
- none: 1;
- a chain of k (also one that a tree grower happened to return): the chain's E(k), from the measured
  step-aligned E(k) when the profile has it, else from per-position acceptance (`AcceptanceModel`);
  the second stage changes the cost of drafting, never the tokens, so E is the same with it;
- a tree: replayed on the recorded greedy rank sequences when the acceptance has them
  (`simulate_tree_steps`: exact for greedy, dependencies between depths included), else
  `expected_tree_tokens(tree, rank_acceptance)` = 1 + sum of the nodes' probabilities of being
  on the accepted path (independent depths: it over-counts after a rank-1 branch). A tree needs the
  profile's rank acceptance; chains never use it, so a chain and
  a tree are compared on two measurements of the same pair (both step-aligned).

S (expected step time): the forward passes the runtime makes (`schedule.step_passes` for plain chains,
`schedule.tree_step` / `schedule.staged_step` for trees and staged steps, `schedule.head_step_passes` and
`schedule.head_tree_step` for a head's chains and trees, whose k = 0 still runs the head: the speedup's baseline
is decoding without it), each weighted by its
expected count, plus the n-gram queries (expected queries x query_overhead_ms + expected
contexts x query_ms_per_context), plus the step overhead (`OverheadModel.step_overhead_ms`), times
the in-situ step correction when the model has one (`steps.StepCorrection`, at the strategy's
verified draft tokens: the ratios between widths as calibrate measured them side by side).

The candidates (`candidate_strategies`): none; chains k = 1..max_k; trees grown greedily from the
rank acceptance (`grow_tree`, depth up to the rank table's) at TREE_SIZES nodes up to a limit; each
chain and tree also with the second stage when the profile measured one. Ties go to the earlier
candidate in that order (the simpler strategy).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from .acceptance import AcceptanceModel, accept_all_probability
from .errors import PerfModelError
from .overhead import OverheadModel
from .profile import HEAD_DRAFTERS, Stage2Info
from .schedule import (TreeStep, head_step_passes, head_tree_step, leaf_end_probability, staged_step, step_passes,
                       tree_step)
from .steps import StepCorrection
from .tree import Strategy, chain, expected_tree_tokens, grow_tree, node_probabilities, simulate_tree_steps

# (role, batch_size, new_tokens, context_len) -> milliseconds of one forward pass
LatencyFn = Callable[[str, int, int, int], float]

TREE_SIZES = (4, 6, 8, 12, 16, 24, 32, 48, 64)  # nodes of the grown trees: roughly x1.5 apart
MAX_TREE_NODES = 64  # default limit: a 64-node tree already verifies 65 tokens per row
FAMILIES = ("chain", "tree", "all")  # chains only | chains and trees | and both with the second stage


def candidate_strategies(max_k: int, rank_acceptance: Sequence[Sequence[float]] | None = None,
                         stage2: bool = False, family: str = "all",
                         max_tree_nodes: int = MAX_TREE_NODES) -> tuple[Strategy, ...]:
    """The strategies a table chooses among, simplest first, without duplicates.

    Trees only with `rank_acceptance`, no deeper than `max_k`; the second stage only with `stage2` and family "all".

    >>> [s.describe() for s in candidate_strategies(2, stage2=True)]
    ['none', 'chain k=1', 'chain k=2', 'chain k=1 +ngram', 'chain k=2 +ngram']
    """
    if family not in FAMILIES:
        raise PerfModelError(f"strategies: {family!r} is not one of {', '.join(FAMILIES)}")
    if max_k < 0 or max_tree_nodes < 0:
        raise PerfModelError(f"strategies: need max_k >= 0 and max_tree_nodes >= 0, found {max_k}, {max_tree_nodes}")
    chains = [chain(k) for k in range(1, max_k + 1)]
    trees = []
    if family != "chain" and rank_acceptance and max_k > 0:  # max_k bounds a tree's depth too (its k)
        trees = [grow_tree(rank_acceptance, n, max_depth=min(len(rank_acceptance), max_k)) for n in TREE_SIZES
                 if n <= max_tree_nodes]
    staged = family == "all" and stage2
    ordered = ([Strategy(None)] + [Strategy(c) for c in chains] + [Strategy(c, True) for c in chains if staged]
               + [Strategy(t) for t in trees] + [Strategy(t, True) for t in trees if staged])
    return tuple(dict.fromkeys(ordered))


@dataclass(frozen=True)
class StrategyCandidate:
    strategy: Strategy
    step_ms: float  # expected: draft_ms + target_ms + ngram_ms + overhead_ms
    tokens_per_step: float  # per sequence: E(strategy)
    tokens_per_s: float  # whole batch: b * E / S
    draft_ms: float
    target_ms: float
    ngram_ms: float  # second-stage queries; 0 without it
    overhead_ms: float
    draft_passes: float  # expected draft passes (rounds, with the second stage)
    correction_ms: float = 0.0  # the in-situ step correction (steps.StepCorrection), at the verified width

    @property
    def k(self) -> int:
        return self.strategy.k


@dataclass(frozen=True)
class StrategyChoice:
    batch_size: int
    context_len: int
    ranked: tuple[StrategyCandidate, ...]  # best first; equal goodput keeps the simpler strategy first
    baseline_tokens_per_s: float  # no speculation

    @property
    def best(self) -> StrategyCandidate:
        return self.ranked[0]

    @property
    def runner_up(self) -> StrategyCandidate | None:
        return self.ranked[1] if len(self.ranked) > 1 else None

    @property
    def speedup(self) -> float:
        """The best strategy's goodput over no speculation at the same batch size and context."""
        return self.best.tokens_per_s / self.baseline_tokens_per_s

    @property
    def margin(self) -> float | None:
        """(G(best) - G(runner-up)) / G(best): how decided the choice is."""
        if self.runner_up is None:
            return None
        return (self.best.tokens_per_s - self.runner_up.tokens_per_s) / self.best.tokens_per_s


@dataclass(frozen=True)
class StepModel:
    """Everything a step's yield and time depend on: pass latency, overhead, acceptance, second stage."""

    latency_ms: LatencyFn
    overhead: OverheadModel
    acceptance: AcceptanceModel
    stage2: Stage2Info | None = None
    step_correction: StepCorrection | None = None  # step times relative to each other, measured in situ
    # latency_ms also takes an array of n (FittedModel.latency_ms does): `prefetch` then fills the cache in
    # one call per role; with a scalar-only function it does nothing and the cache fills pass by pass
    vectorized_latency: bool = False
    # (role, b, n, L) -> ms, filled as strategies are evaluated: trees share most pass shapes
    _latency_cache: dict = field(default_factory=dict, compare=False, repr=False)
    _replay_cache: dict = field(default_factory=dict, compare=False, repr=False)  # tree -> (E, P(leaf end))
    # (b, strategy) -> (passes, overhead ms): neither depends on the context, which an online policy
    # (runtime.adaptive) asks about at every new length
    _schedule_cache: dict = field(default_factory=dict, compare=False, repr=False)
    # who drafts: "draft_model", or a head ("eagle3", "mtp": `schedule.head_step_passes` / `head_tree_step`)
    drafter: str = "draft_model"

    @property
    def head(self) -> bool:
        return self.drafter in HEAD_DRAFTERS

    def _latency(self, role: str, batch_size: int, new_tokens: int, context_len: int) -> float:
        key = (role, batch_size, new_tokens, context_len)
        if key not in self._latency_cache:
            self._latency_cache[key] = float(self.latency_ms(role, batch_size, new_tokens, context_len))
        return self._latency_cache[key]

    def prefetch(self, batch_size: int, context_len: int, max_new_tokens: int) -> None:
        """Fill the latency cache for both roles' passes of 1..max_new_tokens tokens at (b, L) with one
        array call per role: a new (b, L) then costs one vectorized evaluation instead of one per pass
        shape (about 0.3 ms each for a `roofline+monotone` fit on a CPU)."""
        cache = self._latency_cache
        if not self.vectorized_latency or all((role, batch_size, max_new_tokens, context_len) in cache
                                              for role in ("target", "draft")):
            return
        widths = np.arange(1, max_new_tokens + 1)
        for role in ("target", "draft"):
            values = np.asarray(self.latency_ms(role, batch_size, widths, context_len), dtype=float).reshape(-1)
            for n, value in zip(widths.tolist(), values.tolist()):
                cache.setdefault((role, batch_size, n, context_len), value)

    def _rank_acceptance(self, strategy: Strategy) -> Sequence[Sequence[float]]:
        if self.acceptance.rank_acceptance is None:
            raise PerfModelError(f"strategy {strategy.describe(40)}: a tree needs per-depth, per-rank acceptance "
                                 "(rank_acceptance), which this acceptance lacks; measure it with calibrate or "
                                 "use a chain")
        return self.acceptance.rank_acceptance

    def _replayed(self, strategy: Strategy) -> tuple[float, float] | None:
        """(E, P(leaf end)) of a tree replayed on the recorded greedy rank sequences, when there are some."""
        if self.acceptance.rank_sequences is None:
            return None
        if strategy.tree not in self._replay_cache:
            self._replay_cache[strategy.tree] = simulate_tree_steps(strategy.tree, self.acceptance.rank_sequences)
        return self._replay_cache[strategy.tree]

    def tokens_per_step(self, strategy: Strategy) -> float:
        """E(strategy): see the module docstring; a tree is replayed on recorded ranks when the acceptance
        has them (exact for greedy), else the product of per-depth rank acceptances."""
        if strategy.kind == "tree":
            replayed = self._replayed(strategy)
            if replayed is not None:
                return replayed[0]
            return expected_tree_tokens(strategy.tree, self._rank_acceptance(strategy))
        return self.acceptance.expected_tokens(strategy.k)

    def leaf_end_probability(self, strategy: Strategy) -> float:
        """P(a row's accepted path ends at a leaf): all k for chains, as `schedule.step_passes` has it."""
        if strategy.kind == "chain":
            return accept_all_probability(self.acceptance.per_position, strategy.k)
        replayed = self._replayed(strategy)
        if replayed is not None:
            return replayed[1]
        probabilities = node_probabilities(strategy.tree, self._rank_acceptance(strategy))
        return leaf_end_probability(strategy.tree, probabilities)

    def schedule(self, strategy: Strategy, batch_size: int) -> TreeStep:
        """The passes (and n-gram queries) of one step of `strategy` over `batch_size` rows."""
        if batch_size < 1:
            raise PerfModelError(f"batch size must be >= 1, found {batch_size}")
        if self.head:
            if strategy.stage2:
                raise PerfModelError(f"strategy {strategy.describe(40)}: a head ({self.drafter}) drafts without the "
                                     "second stage")
            if strategy.kind == "tree":
                self._rank_acceptance(strategy)  # a tree's yield needs it: refused here, in one line, without
                return head_tree_step(strategy.tree, batch_size)
            return TreeStep(head_step_passes(batch_size, strategy.k))
        if strategy.tree is None or (strategy.kind == "chain" and not strategy.stage2):
            return TreeStep(step_passes(batch_size, strategy.k, self.acceptance.per_position))
        p_leaf_end = self.leaf_end_probability(strategy)
        if not strategy.stage2:
            return tree_step(strategy.tree, batch_size, p_leaf_end)
        if self.stage2 is None:
            raise PerfModelError(f"strategy {strategy.describe(40)}: the second stage needs the profile's stage2 "
                                 "measurements (n-gram guess accuracy and query cost), which this model lacks")
        return staged_step(strategy.tree, batch_size, p_leaf_end, self.stage2.guess_accuracy)

    def evaluate(self, strategy: Strategy, batch_size: int, context_len: int) -> StrategyCandidate:
        key = (batch_size, strategy)
        if key not in self._schedule_cache:
            self._schedule_cache[key] = (self.schedule(strategy, batch_size),
                                         self.overhead.step_overhead_ms(batch_size, strategy))
        step, overhead_ms = self._schedule_cache[key]
        times = [p.weight * self._latency(p.role, batch_size, p.new_tokens, context_len) for p in step.passes]
        forward_ms = sum(times)  # summed in pass order
        ngram_ms = 0.0
        if step.ngram_queries:
            ngram_ms = (step.ngram_queries * self.stage2.query_overhead_ms
                        + step.ngram_contexts * self.stage2.query_ms_per_context)
        step_ms = forward_ms + ngram_ms + overhead_ms
        correction_ms = 0.0
        if self.step_correction is not None:
            correction_ms = (self.step_correction.factor(batch_size, strategy.draft_tokens) - 1.0) * step_ms
        step_ms += correction_ms
        tokens = self.tokens_per_step(strategy)
        is_draft = [p.role == "draft" for p in step.passes]
        return StrategyCandidate(
            strategy=strategy, step_ms=step_ms, tokens_per_step=tokens,
            tokens_per_s=batch_size * tokens / step_ms * 1e3,
            draft_ms=sum(t for t, d in zip(times, is_draft) if d),
            target_ms=sum(t for t, d in zip(times, is_draft) if not d),
            ngram_ms=ngram_ms, overhead_ms=overhead_ms, draft_passes=step.draft_passes, correction_ms=correction_ms)

    def choose(self, strategies: Sequence[Strategy], batch_size: int, context_len: int) -> StrategyChoice:
        """Evaluate every strategy (no speculation is always added: it is the speedup's baseline) and
        rank them by goodput."""
        if batch_size < 1:
            raise PerfModelError(f"batch size must be >= 1, found {batch_size}")
        ordered = tuple(dict.fromkeys((Strategy(None),) + tuple(strategies)))
        candidates = [self.evaluate(s, batch_size, context_len) for s in ordered]
        order = np.argsort([-c.tokens_per_s for c in candidates], kind="stable")
        plain = self.plain_decoding(batch_size, context_len) if self.head else candidates[0]
        baseline = plain.tokens_per_s
        return StrategyChoice(batch_size, context_len, tuple(candidates[i] for i in order), baseline)

    def plain_decoding(self, batch_size: int, context_len: int) -> StrategyCandidate:
        """Decoding without any drafter: one target pass of one token a step. With a draft model that is k = 0;
        a head still makes its pass at k = 0 (`schedule.head_step_passes`), so its k = 0 is not the baseline."""
        target_ms = self._latency("target", batch_size, 1, context_len)
        overhead_ms = self.overhead.step_overhead_ms(batch_size, Strategy(None))
        step_ms = target_ms + overhead_ms
        return StrategyCandidate(Strategy(None), step_ms, 1.0, batch_size / step_ms * 1e3, 0.0, target_ms, 0.0,
                                 overhead_ms, 0.0)

