"""A chain's step time relative to the other chains at the same batch size, corrected by the steps that
calibrate measured side by side.

The fitted step model (pass latency x the passes a step runs, plus the overhead) is smooth in the tokens
a pass verifies; the runtime's steps are not quite. On the demo pair on a 2-core CPU the calibration's
in-situ steps at b = 32 ran chain k = 4 about 9 % faster than k = 2 in each of three sweeps, while the
model called them equal and the table chose k = 2 (the bench then measured k = 4 15 % ahead). The
absolute level of those steps moved by 2x between sweeps with the machine's speed, so it cannot be
learned from them; their ratios can. calibrate generates the ks of one batch size and sweep in lockstep
(calibrate.lockstep): the same prompts, step by step, at the same moments, so the machine's speed is
common to them and cancels in

    r(b, k, s) = log(measured step ms / predicted step ms), for each in-situ step row,
    d(b, k, s) = r(b, k, s) - mean over the ks of (b, s) of r,     the paired residual,
    c(b, k)    = mean over sweeps of d(b, k, s),                   shrunk towards 0 by its own spread:
                 c * max(0, 1 - se^2 / c^2), se^2 = var over sweeps / sweeps  (positive-part James-Stein).

A chain of k at batch size b (k = 0 included: plain decoding is the table's baseline) is then predicted
to take exp(c(b, k)) times the model's step time. The corrections average to 0 over the measured ks at
each b, so they move the model's ratios between ks, never its level (which `fit --holdout` and the bench
judge). Between measured batch sizes c is interpolated linearly in log b, between measured ks linearly
in k, and beyond the largest measured k or b it is held, as perfmodel.extrapolation carries the fitted
time at the grid's edge and grows it by the roofline alone (dropping it there made the chain table jump
from k = 4 at b = 32 to k = 2 at b = 33 on the demo pair). Trees and second-stage steps were not measured
in situ and are not corrected.

It is applied only when it predicts a sweep it did not see better than the model alone: leave one sweep
out, fit c on the others, and compare mean |d| with mean |d - c| on the sweep left out. Both figures are
kept in the model file. Fewer than three sweeps (calibrate --quick runs two), or one k per batch size,
leave nothing to validate or to pair: no correction.
"""
from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .errors import PerfModelError
from .jsonio import rounded

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
        """exp(c(b, k)): the chain's step time over the model's; 1 where it does not apply."""
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
        return (f"in-situ step correction between chains {verdict} (paired step-time error on held-out sweeps "
                f"{self.heldout_uncorrected_pct:.2f} % by the model alone, {self.heldout_error_pct:.2f} % corrected, "
                f"{self.sweeps} sweeps; largest: chain k={largest[0][1]} at b={largest[0][0]} "
                f"x{math.exp(largest[1]):.3f})")

    def to_json(self) -> dict[str, Any]:
        return {"method": "paired residuals of lockstep in-situ steps, shrunk (perfmodel.step_correction)",
                "sweeps": self.sweeps, "applied": self.applied,
                "heldout_error_pct": rounded(self.heldout_error_pct),
                "heldout_uncorrected_pct": rounded(self.heldout_uncorrected_pct),
                "factors": [{"batch_size": b, "k": k, "log_factor": rounded(c)}
                            for (b, k), c in sorted(self.log_factors.items())]}

    @classmethod
    def from_json(cls, obj: Any, where: str) -> "StepCorrection":
        try:
            factors = {(int(row["batch_size"]), int(row["k"])): float(row["log_factor"]) for row in obj["factors"]}
            correction = cls(factors, int(obj["sweeps"]), float(obj["heldout_error_pct"]),
                             float(obj["heldout_uncorrected_pct"]))
        except (KeyError, TypeError, ValueError) as error:
            raise PerfModelError(f"{where}: malformed step correction ({type(error).__name__}: {error})") from None
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
    has more. `predicted_ms[i]` is the model's time of `steps[i]` (e.g. perfmodel.sources.predict_steps)."""
    residuals: Residuals = {}
    for row, predicted in zip(steps, predicted_ms, strict=True):
        if row.sweep is None:
            continue  # older profiles measured point by point: no lockstep sweep to pair within
        residuals.setdefault((row.batch_size, row.k, row.sweep), math.log(row.median_ms / predicted))
    return residuals


def paired_error_pct(steps: Sequence, predicted_ms: Sequence[float]) -> float | None:
    """Mean |d| in per cent: how far a model's ratios between the ks of a batch size are from the ratios
    measured side by side (None: nothing to pair). With another calibration's steps it is a held-out test of
    a model and its correction (`python -m bench.step_ratios`)."""
    pairs = paired(step_residuals(steps, predicted_ms))
    return 100 * statistics.fmean(abs(d) for d in pairs.values()) if pairs else None


def fit_step_correction(steps: Sequence, predicted_ms: Sequence[float]) -> StepCorrection | None:
    """The correction from in-situ step rows (`perfmodel.insitu.InSituStepRow`: batch_size, k, sweep,
    median_ms) and the model's prediction of each; None when there is nothing to pair or hold out."""
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
