"""What the step stage of `fit` keeps: how each timing source predicted the measured steps, and the
in-situ step correction learnt from calibrate's lockstep steps.

The correction. The fitted step model is smooth in the tokens a pass verifies; the runtime's steps are
not quite (kernel and thread-scheduling steps in the token count). calibrate runs the ks of one batch
size and sweep in lockstep (same prompts, a step of each in turn), so the machine's speed is common to
them and cancels in the paired residual:

    r(b, k, s) = log(measured step ms / predicted step ms)
    d(b, k, s) = r(b, k, s) - mean over the ks of (b, s) of r
    c(b, k)    = mean over sweeps of d, shrunk towards 0: c * max(0, 1 - se^2 / c^2)   (positive-part James-Stein)

k counts the draft tokens the target verifies per row, so every strategy takes exp(c) at its own width:
a chain of k (with or without the second stage) at k, a tree of N nodes at N, no speculation at 0.
Between measured batch sizes c is linear in log b, between measured widths linear in k; beyond the
measured ones it is held at the edge. The factors average to 0 over the measured ks at each b: they move
the model's ratios between strategies, never its level. It is applied only when, fitted on all sweeps
but one, it predicts the held-out sweep better than the model alone; fewer than three sweeps or one k
per batch size leave nothing to pair or validate: no correction.
"""
from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

import numpy as np

from .errors import PerfModelError
from .fields import at, integer, json_object, listed, number, record, string
from .jsonio import rounded

ISOLATED, INSITU, COMBINED = "isolated", "in-situ", "isolated+in-situ"
SOURCES = (ISOLATED, INSITU, COMBINED)  # the order breaks ties: isolated first


@dataclass(frozen=True)
class BatchSizeError:
    """Held-out errors at one batch size: each role refitted without the source's rows at b."""

    batch_size: int
    steps: int  # measured step rows (one per k) at b
    step_mape_pct: float | None  # None: too few rows left to refit without b
    pass_mape_pct: float | None  # the source's own rows at b (None: it has none there)
    insitu_pass_mape_pct: float | None  # the in-situ rows at b


@dataclass(frozen=True)
class StepError:
    batch_size: int
    k: int
    context_len: int
    measured_ms: float
    predicted_ms: float  # by the source's full fit

    @property
    def error_pct(self) -> float:
        return 100.0 * (self.predicted_ms - self.measured_ms) / self.measured_ms


@dataclass(frozen=True)
class SourceReport:
    source: str
    points: dict[str, int]  # rows fitted, per role
    kinds: dict[str, str]  # the latency model's kind per role
    step_mape_pct: float  # in-sample: the full fit against every measured step
    heldout_step_mape_pct: float | None  # over every step, each predicted without its batch size's rows
    by_batch_size: tuple[BatchSizeError, ...]
    steps: tuple[StepError, ...]

    def to_json(self) -> dict:
        def clean(obj: dict) -> dict:
            return {key: rounded(value) if isinstance(value, float) else value for key, value in obj.items()}
        return {"source": self.source, "points": dict(self.points), "kinds": dict(self.kinds),
                "step_mape_pct": rounded(self.step_mape_pct),
                "heldout_step_mape_pct": None if self.heldout_step_mape_pct is None
                else rounded(self.heldout_step_mape_pct),
                "by_batch_size": [clean(asdict(e)) for e in self.by_batch_size],
                "steps": [clean(asdict(s)) for s in self.steps]}

    @classmethod
    def from_json(cls, obj: dict, where: str) -> "SourceReport":
        points, kinds = json_object(obj, "points", where), json_object(obj, "kinds", where)
        return cls(string(obj, "source", where),
                   {role: integer(points, role, at(where, "points"), 0) for role in points},
                   {role: string(kinds, role, at(where, "kinds")) for role in kinds},
                   number(obj, "step_mape_pct", where, 0.0), number(obj, "heldout_step_mape_pct", where, 0.0, True),
                   tuple(record(BatchSizeError, e, f"{at(where, 'by_batch_size')}[{i}]")
                         for i, e in enumerate(listed(obj, "by_batch_size", where))),
                   tuple(record(StepError, s, f"{at(where, 'steps')}[{i}]")
                         for i, s in enumerate(listed(obj, "steps", where))))


@dataclass(frozen=True)
class SourceChoice:
    chosen: str
    criterion: str  # "held-out step MAPE" | "in-sample step MAPE"
    reports: tuple[SourceReport, ...]

    def report(self, source: str) -> SourceReport:
        return next(r for r in self.reports if r.source == source)

    def to_json(self) -> dict:
        return {"chosen": self.chosen, "criterion": self.criterion, "sources": [r.to_json() for r in self.reports]}

    @classmethod
    def from_json(cls, obj: dict, where: str) -> "SourceChoice":
        reports = tuple(SourceReport.from_json(r, f"{at(where, 'sources')}[{i}]")
                        for i, r in enumerate(listed(obj, "sources", where)))
        chosen = string(obj, "chosen", where, tuple(r.source for r in reports))
        return cls(chosen, string(obj, "criterion", where), reports)



MIN_SWEEPS = 2  # per (b, k): a spread to shrink by
MIN_SWEEPS_TO_VALIDATE = MIN_SWEEPS + 1  # and a sweep to hold out


@dataclass(frozen=True)
class StepCorrection:
    """c(b, k) on the measured grid, and how well it predicted held-out sweeps."""

    log_factors: dict[tuple[int, int], float]  # (b, k) -> c(b, k)
    sweeps: int
    heldout_error_pct: float  # mean |d| on held-out sweeps with c fitted on the others, corrected
    heldout_uncorrected_pct: float  # mean |d| on the same rows: the model alone
    # (b, k) -> factor, filled as asked: an online policy asks about the same few at every step
    _factors: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def applied(self) -> bool:
        return self.heldout_error_pct < self.heldout_uncorrected_pct

    @property
    def batch_sizes(self) -> list[int]:
        return sorted({b for b, _ in self.log_factors})

    def _at_batch(self, b: int, k: int) -> float:
        ks = sorted(kk for bb, kk in self.log_factors if bb == b)
        if k >= ks[-1]:
            return self.log_factors[(b, ks[-1])]
        if k <= ks[0]:
            return self.log_factors[(b, ks[0])]
        return float(np.interp(k, ks, [self.log_factors[(b, kk)] for kk in ks]))

    def factor(self, batch_size: int, k: int) -> float:
        """exp(c(b, k)): the step time over the model's for a strategy verifying k draft tokens per row;
        1 where the correction does not apply."""
        key = (batch_size, k)
        if key not in self._factors:
            self._factors[key] = self._factor(batch_size, k)
        return self._factors[key]

    def _factor(self, batch_size: int, k: int) -> float:
        if not self.applied:
            return 1.0
        sizes = self.batch_sizes
        if batch_size >= sizes[-1] or batch_size <= sizes[0]:
            return math.exp(self._at_batch(sizes[-1] if batch_size >= sizes[-1] else sizes[0], k))
        if batch_size in sizes:
            return math.exp(self._at_batch(batch_size, k))
        above = next(i for i, b in enumerate(sizes) if b > batch_size)
        lo, hi = sizes[above - 1], sizes[above]
        weight = (math.log(batch_size) - math.log(lo)) / (math.log(hi) - math.log(lo))
        return math.exp((1 - weight) * self._at_batch(lo, k) + weight * self._at_batch(hi, k))

    def note(self) -> str:
        verdict = "applied" if self.applied else "not applied: it did not predict held-out sweeps better"
        largest = max(self.log_factors.items(), key=lambda item: abs(item[1]))
        return (f"in-situ step correction {verdict} (paired step-time error on held-out sweeps "
                f"{self.heldout_uncorrected_pct:.2f} % by the model alone, {self.heldout_error_pct:.2f} % corrected, "
                f"{self.sweeps} sweeps; largest: k={largest[0][1]} at b={largest[0][0]} "
                f"x{math.exp(largest[1]):.3f})")

    def to_json(self) -> dict[str, Any]:
        return {"method": "paired residuals of lockstep in-situ steps, shrunk; keyed by draft tokens verified per row",
                "sweeps": self.sweeps, "applied": self.applied,
                "heldout_error_pct": rounded(self.heldout_error_pct),
                "heldout_uncorrected_pct": rounded(self.heldout_uncorrected_pct),
                "factors": [{"batch_size": b, "k": k, "log_factor": rounded(c)}
                            for (b, k), c in sorted(self.log_factors.items())]}

    @classmethod
    def from_json(cls, obj: Any, where: str) -> "StepCorrection":
        factors = {}
        for index, row in enumerate(listed(obj, "factors", where)):
            at_row = f"{at(where, 'factors')}[{index}]"
            factors[(integer(row, "batch_size", at_row, 1), integer(row, "k", at_row, 0))] = \
                number(row, "log_factor", at_row)
        correction = cls(factors, integer(obj, "sweeps", where, 0), number(obj, "heldout_error_pct", where, 0.0),
                         number(obj, "heldout_uncorrected_pct", where, 0.0))
        if not factors or any(not math.isfinite(c) for c in factors.values()):
            raise PerfModelError(f"{where}: a step correction needs finite factors, found {len(factors)}")
        return correction


# (b, k, sweep) -> r = log(measured / predicted)
Residuals = dict[tuple[int, int, int], float]


def paired(residuals: Residuals) -> Residuals:
    """d(b, k, s): each residual less the mean of its (b, s) cell; cells with one k carry no ratio."""
    cells: dict[tuple[int, int], dict[int, float]] = defaultdict(dict)
    for (b, k, s), r in residuals.items():
        cells[(b, s)][k] = r
    out = {}
    for (b, s), by_k in cells.items():
        if len(by_k) < 2:
            continue
        mean = statistics.fmean(by_k.values())
        out.update({(b, k, s): r - mean for k, r in by_k.items()})
    return out


def shrunk_means(pairs: Residuals, skip_sweep: int | None = None) -> dict[tuple[int, int], float]:
    """c(b, k) from the sweeps other than `skip_sweep`: the mean, shrunk by its standard error; a (b, k)
    seen in fewer than MIN_SWEEPS sweeps gets 0 (no spread to judge it by)."""
    by_point: dict[tuple[int, int], list[float]] = defaultdict(list)
    for (b, k, s), d in pairs.items():
        if s != skip_sweep:
            by_point[(b, k)].append(d)
    out = {}
    for point, values in by_point.items():
        if len(values) < MIN_SWEEPS:
            out[point] = 0.0
            continue
        mean = statistics.fmean(values)
        se2 = statistics.variance(values) / len(values)
        out[point] = mean * max(0.0, 1.0 - se2 / mean ** 2) if mean else 0.0
    return out


def step_residuals(steps: Sequence, predicted_ms: Sequence[float]) -> Residuals:
    """r(b, k, s) of the lockstep rows (sweep known), one per (b, k, sweep): the first when a merged profile
    has more. `predicted_ms[i]` is the model's time of `steps[i]` (`fit.predict_steps`)."""
    residuals: Residuals = {}
    for row, predicted in zip(steps, predicted_ms, strict=True):
        if row.sweep is None:
            continue  # older profiles measured point by point: no lockstep sweep to pair within
        residuals.setdefault((row.batch_size, row.k, row.sweep), math.log(row.median_ms / predicted))
    return residuals


def paired_error_pct(steps: Sequence, predicted_ms: Sequence[float]) -> float | None:
    """Mean |d| in per cent: how far a model's ratios between the ks of a batch size are from the ratios
    measured side by side (None: nothing to pair). With another calibration's steps it is a held-out test of
    a model and its correction."""
    pairs = paired(step_residuals(steps, predicted_ms))
    return 100 * statistics.fmean(abs(d) for d in pairs.values()) if pairs else None


def fit_step_correction(steps: Sequence, predicted_ms: Sequence[float]) -> StepCorrection | None:
    """The correction from in-situ step rows (batch_size, k, sweep, median_ms) and the model's prediction
    of each; None when there is nothing to pair or hold out."""
    pairs = paired(step_residuals(steps, predicted_ms))
    sweeps = sorted({s for _, _, s in pairs})
    if len(sweeps) < MIN_SWEEPS_TO_VALIDATE:
        return None
    corrected, uncorrected = [], []
    for held in sweeps:
        learned = shrunk_means(pairs, skip_sweep=held)
        for (b, k, s), d in pairs.items():
            if s == held and (b, k) in learned:
                uncorrected.append(abs(d))
                corrected.append(abs(d - learned[(b, k)]))
    if not corrected:
        return None
    return StepCorrection(shrunk_means(pairs), len(sweeps), 100 * statistics.fmean(corrected),
                          100 * statistics.fmean(uncorrected))
