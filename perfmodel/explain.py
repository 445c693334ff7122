"""Why a prediction misses: one (batch size, strategy) run's predicted and measured step, term by term.

The predicted step (`StepModel.schedule`, the overhead model, E(strategy)) beside the passes a generation
really ran at the full batch size, each timed on its own (`MeasuredSteps`); each pass group's difference
splits exactly into "mix" (how many passes of that width ran) and "pass time" (how long each took), so the
terms add up to the step-time difference, and tokens per step into E against what the steps drew (with
its 95 % sampling interval) and "cut at max new tokens". The identity, the effects' first-order reading
and the assumptions: docs/validation.md, "explain: the error, term by term".
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .acceptance import tokens_variance
from .errors import PerfModelError
from .strategy import StepModel
from .tree import Strategy
from .uncertainty import Z95

OVERHEAD = "overhead"  # the term outside forward passes (n-gram queries included)
CORRECTION = "in-situ step correction"  # the model's own factor on a step (perfmodel.steps)
TOKENS = "tokens per step"
CUT = "cut at max new tokens"


@dataclass(frozen=True)
class PassTally:
    """Measured passes of one role and width at the full batch size, over all the steps counted."""

    role: str  # "draft" | "target"
    new_tokens: int  # tokens fed per row
    count: int
    seconds: float  # summed


@dataclass(frozen=True)
class MeasuredSteps:
    """The full-batch steps of one or more runs at one batch size: what the measured side needs."""

    batch_size: int
    steps: int
    step_seconds: float  # summed wall time of those steps (passes and everything between them)
    tokens: int  # tokens those steps added, all rows together
    passes: tuple[PassTally, ...]
    # what those steps produced before the cut at max_new_tokens, all rows together, and the sum over steps of
    # (a step's drawn tokens per row)^2, for the sampling interval; None from stats that did not keep them
    drawn_tokens: int | None = None
    drawn_square_sum: float | None = None

    @property
    def tokens_per_step(self) -> float:
        """Per row, as E is (kept tokens: what the goodput counts)."""
        return self.tokens / (self.steps * self.batch_size)

    @property
    def drawn_tokens_per_step(self) -> float:
        """Per row, before the cut at max_new_tokens: the draws of E (the kept tokens where not recorded)."""
        return (self.drawn_tokens if self.drawn_tokens is not None else self.tokens) / (self.steps * self.batch_size)

    @property
    def drawn_variance(self) -> float | None:
        """The sample variance of a step's drawn tokens per row; None below 2 steps or without the squares."""
        if self.drawn_square_sum is None or self.steps < 2:
            return None
        mean = self.drawn_tokens_per_step
        return max(0.0, (self.drawn_square_sum - self.steps * mean * mean) / (self.steps - 1))

    def drawn_halfwidth(self, model_variance: float = 0.0) -> float | None:
        """The 95 % sampling half-width of `drawn_tokens_per_step`, from the larger of the sample variance and
        `model_variance` (what the model says a step's tokens per row spread by): a few steps that happen to
        agree must not claim a precision the model says they cannot have. None without the squares."""
        variance = self.drawn_variance
        return None if variance is None else Z95 * math.sqrt(max(variance, model_variance) / self.steps)

    @property
    def step_ms(self) -> float:
        return self.step_seconds / self.steps * 1e3

    def merged(self, other: "MeasuredSteps") -> "MeasuredSteps":
        """Two runs (rounds) pooled: counts and seconds add."""
        if other.batch_size != self.batch_size:
            raise PerfModelError(f"explain: cannot pool steps at batch sizes {self.batch_size} and {other.batch_size}")
        tally: dict[tuple[str, int], list] = defaultdict(lambda: [0, 0.0])
        for p in self.passes + other.passes:
            tally[(p.role, p.new_tokens)][0] += p.count
            tally[(p.role, p.new_tokens)][1] += p.seconds
        both = self.drawn_square_sum is not None and other.drawn_square_sum is not None
        return MeasuredSteps(self.batch_size, self.steps + other.steps, self.step_seconds + other.step_seconds,
                             self.tokens + other.tokens,
                             tuple(PassTally(r, n, c, s) for (r, n), (c, s) in sorted(tally.items())),
                             self.drawn_tokens + other.drawn_tokens if both else None,
                             self.drawn_square_sum + other.drawn_square_sum if both else None)

    def to_json(self) -> dict[str, Any]:
        return {"batch_size": self.batch_size, "steps": self.steps, "step_seconds": self.step_seconds,
                "tokens": self.tokens, "drawn_tokens": self.drawn_tokens, "drawn_square_sum": self.drawn_square_sum,
                "passes": [{"role": p.role, "new_tokens": p.new_tokens, "count": p.count, "seconds": p.seconds}
                           for p in self.passes]}


def measured_from_stats(stats: dict[str, Any], batch_size: int) -> MeasuredSteps | None:
    """The full-batch steps of one generation, from its stats: the generator's per-step lists
    (`batch_size_per_step`, `step_s`, `step_tokens`, optionally `step_tokens_drawn`), its per-pass shapes
    (`draft_passes`, `target_passes`: [batch, new tokens] per pass) and each pass's seconds (`draft_pass_s`,
    `target_pass_s`, same order).
    A pass at batch b belongs to a full-batch step: the batch only shrinks. None without full-batch steps."""
    full = [i for i, b in enumerate(stats["batch_size_per_step"]) if b == batch_size]
    if not full:
        return None
    tally: dict[tuple[str, int], list] = defaultdict(lambda: [0, 0.0])
    for role in ("draft", "target"):
        shapes, seconds = stats[f"{role}_passes"], stats[f"{role}_pass_s"]
        if len(shapes) != len(seconds):
            raise PerfModelError(f"explain: {len(shapes)} {role} passes but {len(seconds)} pass times")
        for (b, n), s in zip(shapes, seconds):
            if b == batch_size:
                tally[(role, int(n))][0] += 1
                tally[(role, int(n))][1] += float(s)
    drawn = stats.get("step_tokens_drawn")
    return MeasuredSteps(batch_size, len(full), sum(stats["step_s"][i] for i in full),
                         sum(stats["step_tokens"][i] for i in full),
                         tuple(PassTally(r, n, c, s) for (r, n), (c, s) in sorted(tally.items())),
                         sum(drawn[i] for i in full) if drawn else None,
                         sum((drawn[i] / batch_size) ** 2 for i in full) if drawn else None)


@dataclass(frozen=True)
class Term:
    """One part of a step, per step: a pass group (role, width) or the overhead (role None)."""

    name: str  # "draft n=1", "target n=5", "overhead"
    predicted_ms: float
    measured_ms: float
    role: str | None = None
    new_tokens: int | None = None
    predicted_count: float | None = None  # passes per step
    measured_count: float | None = None
    predicted_pass_ms: float | None = None  # the fitted latency of one such pass
    measured_pass_ms: float | None = None  # mean over the measured passes; None when none ran
    experts_touched: float | None = None  # a mixture of experts: the model's distinct experts per layer in one pass

    @property
    def mix_ms(self) -> float:
        """(c_p - c_m) * t_p: the part of the difference due to how many such passes ran."""
        if self.role is None:
            return 0.0
        return (self.predicted_count - self.measured_count) * self.predicted_pass_ms

    @property
    def time_ms(self) -> float:
        """c_m * (t_p - t_m), or the whole difference for the overhead."""
        return self.predicted_ms - self.measured_ms - self.mix_ms


@dataclass(frozen=True)
class Explanation:
    batch_size: int
    context_len: int
    strategy: str  # Strategy.describe()
    steps: int  # measured full-batch steps behind the figures
    predicted_tokens_per_step: float
    measured_tokens_per_step: float
    predicted_step_ms: float
    measured_step_ms: float
    terms: tuple[Term, ...]
    measured_drawn_tokens_per_step: float | None = None  # before the cut at max_new_tokens
    drawn_halfwidth: float | None = None  # its 95 % sampling half-width

    @property
    def predicted_tokens_per_s(self) -> float:
        return self.batch_size * self.predicted_tokens_per_step / self.predicted_step_ms * 1e3

    @property
    def measured_tokens_per_s(self) -> float:
        return self.batch_size * self.measured_tokens_per_step / self.measured_step_ms * 1e3

    @property
    def error(self) -> float:
        """Predicted / measured goodput - 1."""
        return self.predicted_tokens_per_s / self.measured_tokens_per_s - 1.0

    def effects(self) -> list[tuple[str, float]]:
        """(label, first-order push of the predicted goodput above the measured one), largest first."""
        drawn = self.measured_drawn_tokens_per_step
        if drawn is None:
            found = [(TOKENS, self.predicted_tokens_per_step / self.measured_tokens_per_step - 1.0)]
        else:  # (E_p / E_drawn) (E_drawn / E_kept) = E_p / E_kept
            found = [(TOKENS, self.predicted_tokens_per_step / drawn - 1.0),
                     (CUT, drawn / self.measured_tokens_per_step - 1.0)]
        for term in self.terms:
            if term.role is None:
                found.append((term.name, -term.time_ms / self.measured_step_ms))
                continue
            found.append((f"{term.name}: pass time", -term.time_ms / self.measured_step_ms))
            found.append((f"{term.name}: mix", -term.mix_ms / self.measured_step_ms))
        return sorted(found, key=lambda item: -abs(item[1]))

    @property
    def culprit(self) -> tuple[str, float]:
        return self.effects()[0]

    @property
    def tokens_interval(self) -> tuple[float, float] | None:
        """The tokens effect's 95 % sampling interval, E_p / (E_drawn -+ half-width) - 1; None without one."""
        drawn, half = self.measured_drawn_tokens_per_step, self.drawn_halfwidth
        if drawn is None or half is None:
            return None
        high = self.predicted_tokens_per_step / (drawn - half) - 1.0 if drawn > half else math.inf
        return self.predicted_tokens_per_step / (drawn + half) - 1.0, high

    @property
    def tokens_within_noise(self) -> bool | None:
        """Whether the measured E is within its sampling interval of the predicted one (None: unknown)."""
        interval = self.tokens_interval
        return None if interval is None else interval[0] <= 0.0 <= interval[1]

    def to_json(self) -> dict[str, Any]:
        name, effect = self.culprit
        return {
            "batch_size": self.batch_size, "context_len": self.context_len, "strategy": self.strategy,
            "steps": self.steps,
            "tokens_per_step": {"predicted": self.predicted_tokens_per_step, "measured": self.measured_tokens_per_step,
                                "measured_drawn": self.measured_drawn_tokens_per_step,
                                "drawn_halfwidth95": self.drawn_halfwidth,
                                "effect_ci95": [x if math.isfinite(x) else None for x in self.tokens_interval]
                                if self.tokens_interval else None,
                                "within_noise": self.tokens_within_noise},
            "step_ms": {"predicted": self.predicted_step_ms, "measured": self.measured_step_ms},
            "tokens_per_s": {"predicted": self.predicted_tokens_per_s, "measured": self.measured_tokens_per_s},
            "error": self.error,
            "terms": [{"name": t.name, "role": t.role, "new_tokens": t.new_tokens, "predicted_ms": t.predicted_ms,
                       "measured_ms": t.measured_ms, "predicted_count": t.predicted_count,
                       "measured_count": t.measured_count, "predicted_pass_ms": t.predicted_pass_ms,
                       "measured_pass_ms": t.measured_pass_ms, "mix_ms": t.mix_ms, "time_ms": t.time_ms,
                       **({} if t.experts_touched is None else {"experts_touched": t.experts_touched})}
                      for t in self.terms],
            "effects": [{"term": label, "effect": value} for label, value in self.effects()],
            "culprit": {"term": name, "effect": effect},
        }


def explain(model: StepModel, strategy: Strategy, measured: MeasuredSteps, context_len: int,
            experts_touched: Callable[[str, int, int], float | None] | None = None) -> Explanation:
    """Predicted against measured, term by term (see the module docstring). `experts_touched(role, b, n)`: the
    expert term of a mixture of experts' passes (FittedModel.experts_touched), shown beside their times."""
    b = measured.batch_size
    if measured.steps < 1:
        raise PerfModelError("explain: no full-batch steps were measured")
    candidate = model.evaluate(strategy, b, context_len)
    predicted_counts: dict[tuple[str, int], float] = defaultdict(float)
    for p in model.schedule(strategy, b).passes:
        predicted_counts[(p.role, p.new_tokens)] += p.weight
    measured_by_key = {(p.role, p.new_tokens): p for p in measured.passes}
    terms = []
    for role, n in sorted(set(predicted_counts) | set(measured_by_key), key=lambda key: (key[0] != "draft", key)):
        c_p = predicted_counts.get((role, n), 0.0)
        tally = measured_by_key.get((role, n))
        c_m = tally.count / measured.steps if tally else 0.0
        t_p = float(model.latency_ms(role, b, n, context_len))
        t_m = tally.seconds / tally.count * 1e3 if tally and tally.count else None
        experts = None if experts_touched is None else experts_touched(role, b, n)
        terms.append(Term(f"{role} n={n}", c_p * t_p, c_m * (t_m or 0.0), role, n, c_p, c_m, t_p, t_m, experts))
    passes_ms = sum(t.measured_ms for t in terms)
    # rows draw independently under the model: a step's mean over b rows spreads by Var / b (chains; a
    # tree's spread is left to the sample)
    model_variance = tokens_variance(model.acceptance.per_position, strategy.k) / b \
        if strategy.kind == "chain" and strategy.k > 0 else 0.0
    terms.append(Term(OVERHEAD, candidate.overhead_ms + candidate.ngram_ms, measured.step_ms - passes_ms))
    if candidate.correction_ms:  # a model term with nothing measured beside it: its effect is its own size
        terms.append(Term(CORRECTION, candidate.correction_ms, 0.0))
    return Explanation(b, context_len, strategy.describe(), measured.steps, candidate.tokens_per_step,
                       measured.tokens_per_step, candidate.step_ms, measured.step_ms, tuple(terms),
                       measured.drawn_tokens_per_step if measured.drawn_tokens is not None else None,
                       measured.drawn_halfwidth(model_variance))


def explanation_lines(explanation: Explanation, top: int = 3) -> Sequence[str]:
    """A few words per effect, for notes: 'draft n=1: pass time +12.3%'."""
    return [f"{label} {100 * value:+.1f}%" for label, value in explanation.effects()[:top]]
