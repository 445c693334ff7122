"""Live fidelity: every served step's measured time beside the step model's prediction, and drift detection.

Per cell (strategy, batch-size bucket): the steps, their predicted and measured seconds (and the re-fitted
prediction with --refit), and the running ratio measured / predicted (geometric, over the cell's last
~`ratio_memory_steps` steps) with its spread (the standard deviation of log ratio). Drift: after its first
`warmup_steps` steps, a cell's next `settle_steps` set its baseline ratio (the model's own error there); afterwards
every step's log ratio less its cell's baseline feeds one pooled running mean (a machine that slows down slows
every cell), and when that mean stays outside the band for `persist_steps` steps in a row one warning is logged,
naming the cells and by how much. The band is the profile's noise figure (`noise_band`), at most `max_band`. A
baseline itself outside the band widened by the model's own step error at calibration (each at most `max_band`: a
2x error is always seen) is a profile that does not describe this machine: one warning, and the cell counts in
/metrics. docs/serving.md shows the metrics; the predictions come from the policy
(runtime.adaptive).
"""
from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field
from functools import lru_cache

from specbatch.perfmodel.profile.noise import NOISE_RULE, NoiseFigure

from .learning import LEARNING

log = logging.getLogger("specbatch.fidelity")

FIDELITY = LEARNING.fidelity  # every knob of this module (runtime.learning)
BATCH_BOUNDS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@lru_cache(maxsize=1024)  # asked every step
def batch_bucket(batch_size: int) -> str:
    """'1', '2', '3-4', '5-8', ..., '257+': the batch sizes a cell pools.

    >>> [batch_bucket(b) for b in (1, 2, 3, 8, 9, 300)]
    ['1', '2', '3-4', '5-8', '9-16', '257+']
    """
    low = 1
    for bound in BATCH_BOUNDS:
        if batch_size <= bound:
            return str(bound) if low == bound else f"{low}-{bound}"
        low = bound + 1
    return f"{low}+"


def noise_band(noise: NoiseFigure | None) -> float:
    """The relative band a running ratio may move within without drifting: the calibration's reference pass
    moved ± drift around its median and its samples spread ± jitter, so max(the ±3 % rule, drift + jitter),
    at most `max_band`."""
    if noise is None:
        return FIDELITY.default_band
    return min(FIDELITY.max_band, max(NOISE_RULE, noise.drift + noise.jitter))


def noise_band_source(noise: NoiseFigure | None) -> str:
    """Where `noise_band` took the band from, as the warnings say it."""
    if noise is None:
        return "no noise figure in the profile: the default"
    return "the profile's noise figure" + (", capped" if too_noisy_to_check(noise) else "")


def too_noisy_to_check(noise: NoiseFigure | None) -> str | None:
    """The line said at start when the profile's noise exceeds `max_band`, else None."""
    if noise is None or noise.drift + noise.jitter <= FIDELITY.max_band:
        return None
    return (f"the profile's noise figure (±{100 * (noise.drift + noise.jitter):.0f} %: drift ±{100 * noise.drift:.0f} "
            f"%, jitter ±{100 * noise.jitter:.0f} %) is too noisy to check the served steps closely: the self-check "
            f"uses ±{100 * FIDELITY.max_band:.0f} %, so steps may be called off the model where the profile itself "
            "was; recalibrate on a quiet machine")


def announce_noise(noise: NoiseFigure | None, source: str) -> None:
    """Log `too_noisy_to_check`'s line, naming the model file, when it has one."""
    if (line := too_noisy_to_check(noise)) is not None:
        log.warning("%s: %s", source, line)


@dataclass
class _Cell:
    steps: int = 0
    predicted_s: float = 0.0
    measured_s: float = 0.0
    refit_predicted_s: float = 0.0
    weight: float = 0.0  # running (fading) sums of 1, log ratio, log ratio squared
    log_sum: float = 0.0
    square_sum: float = 0.0
    settle_sum: float = 0.0  # log ratios of the `settle_steps` steps after the warm-up
    baseline: float | None = None  # their mean
    run: tuple[int, int, float] = (-1, 0, 0.0)  # (run id, steps, deviation sum) in the pooled mean's current run

    @property
    def log_ratio(self) -> float:
        return self.log_sum / self.weight if self.weight else 0.0

    @property
    def spread(self) -> float:
        mean = self.log_ratio
        return math.sqrt(max(0.0, self.square_sum / self.weight - mean * mean)) if self.weight else 0.0


@dataclass
class LiveFidelity:
    """Predicted vs measured per (strategy, batch bucket), drift and mismatch warnings. `observe` runs on the
    engine's thread; `snapshot` (the HTTP thread) takes the same lock."""

    band: float = FIDELITY.default_band  # relative: see noise_band
    model_error: float = 0.0  # the model's own relative step error at calibration (a baseline may be off by it)
    band_source: str = noise_band_source(None)  # where the band came from, for the warnings
    refit: object | None = None  # runtime.refit.StepCostRefit whose factors the snapshot shows
    steps: int = 0
    drifting: bool = False
    drift_warnings: int = 0
    mismatch_warnings: int = 0
    _cells: dict = field(default_factory=dict, repr=False)  # (strategy, bucket) -> _Cell
    _pooled: list = field(default_factory=lambda: [0.0, 0.0], repr=False)  # fading [weight, deviation sum]
    _run: int = 0  # steps in a row on the other side of the band from the current state
    _run_sum: float = 0.0  # their deviations from the baselines, summed
    _run_id: int = 0  # which run the cells' own sums belong to
    _drift: dict | None = field(default=None, repr=False)  # the episode /health reports
    _mismatched: list = field(default_factory=list, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def observe(self, strategy: str, batch_size: int, predicted_s: float, measured_s: float,
                refit_predicted_s: float | None = None) -> None:
        """One step of `strategy` over `batch_size` rows: the model predicted `predicted_s`, it took `measured_s`."""
        if not predicted_s > 0 or not measured_s > 0:
            return
        x = min(max(math.log(measured_s / predicted_s), -FIDELITY.log_ratio_clip), FIDELITY.log_ratio_clip)
        key = (strategy, batch_bucket(batch_size))
        with self._lock:
            cell = self._cells.get(key)
            if cell is None:
                cell = self._cells[key] = _Cell()
            keep = 1.0 - 1.0 / FIDELITY.ratio_memory_steps
            cell.steps += 1
            cell.predicted_s += predicted_s
            cell.measured_s += measured_s
            cell.refit_predicted_s += refit_predicted_s or 0.0
            cell.weight = cell.weight * keep + 1.0
            cell.log_sum = cell.log_sum * keep + x
            cell.square_sum = cell.square_sum * keep + x * x
            self.steps += 1
            if cell.baseline is None:
                if cell.steps > FIDELITY.warmup_steps:
                    cell.settle_sum += x
                if cell.steps == FIDELITY.warmup_steps + FIDELITY.settle_steps:
                    cell.baseline = cell.settle_sum / FIDELITY.settle_steps
                    self._check_mismatch(key, cell)
                return
            self._track_drift(cell, x - cell.baseline)

    # ------------------------------------------------------------------ drift (under the lock)
    def _limit(self) -> float:
        return math.log1p(self.band)

    def _track_drift(self, cell: _Cell, deviation: float) -> None:
        keep = 1.0 - 1.0 / FIDELITY.drift_memory_steps
        pooled = self._pooled
        pooled[0] = pooled[0] * keep + 1.0
        pooled[1] = pooled[1] * keep + deviation
        change = pooled[1] / pooled[0]
        # into drift: outside the band; out of it: back within half of it (no flapping on the edge)
        crossing = abs(change) > self._limit() if not self.drifting else abs(change) < self._limit() / 2
        if not crossing:
            self._run, self._run_sum, self._run_id = 0, 0.0, self._run_id + 1
            if self.drifting:
                self._drift["change"] = math.exp(change)
            return
        self._run, self._run_sum = self._run + 1, self._run_sum + deviation
        run_id, steps, total = cell.run
        cell.run = (self._run_id, 1, deviation) if run_id != self._run_id else (run_id, steps + 1, total + deviation)
        if self._run < FIDELITY.persist_steps:
            return
        # the state changes: the change is the mean deviation over the run (steps all past the crossing)
        level = math.exp(self._run_sum / self._run)
        self._run, self._run_sum, self.drifting = 0, 0.0, not self.drifting
        if self.drifting:
            self.drift_warnings += 1
            cells = self._drifted_cells()
            self._drift = {"since_step": self.steps, "change": level, "cells": cells}
            where = ", ".join(f"{c['strategy']} at batch sizes {c['batch_sizes']} x{c['change']:.2f}" for c in cells)
            remedy = ("--refit is re-fitting the step costs" if self.refit is not None else
                      "the policy chooses from costs that no longer hold: recalibrate, or serve with --refit")
            log.warning("step times drifted: over the last %d steps they ran x%.2f their first-served level, "
                        "outside the band of ±%.0f %% (%s): %s; %s",
                        FIDELITY.persist_steps, level, 100 * self.band, self.band_source, where, remedy)
        else:
            log.info("step times back within ±%.0f %% of their first-served level (x%.2f)", 100 * self.band / 2, level)
            self._drift = None
        self._run_id += 1

    def _drifted_cells(self) -> list[dict]:
        """The cells of the run that moved their steps beyond the band, by their mean deviation in it, largest first."""
        out = []
        for (strategy, bucket), cell in self._cells.items():
            run_id, steps, total = cell.run
            if run_id == self._run_id and steps and abs(total / steps) > self._limit():
                out.append({"strategy": strategy, "batch_sizes": bucket, "steps": steps,
                            "change": math.exp(total / steps), "ratio": math.exp(cell.log_ratio)})
        return sorted(out, key=lambda c: -abs(math.log(c["change"])))

    def _check_mismatch(self, key: tuple[str, str], cell: _Cell) -> None:
        """A baseline outside band + the model's own error (each at most `max_band`): the profile does not
        describe this machine."""
        tolerance = min(self.band, FIDELITY.max_band) + min(self.model_error, FIDELITY.max_band)
        if abs(cell.baseline) <= math.log1p(tolerance):
            return
        found = {"strategy": key[0], "batch_sizes": key[1], "ratio": math.exp(cell.baseline)}
        self._mismatched.append(found)
        if len(self._mismatched) == 1:
            self.mismatch_warnings += 1
            log.warning("served steps do not match the profile: %s at batch sizes %s ran x%.2f the model's "
                        "prediction over its first %d steps, beyond ±%.0f %% (the band ±%.0f %% and the "
                        "model's own step error %.0f %%); was the profile measured with other threads, another "
                        "device or another load? Recalibrate, or serve with --refit", key[0], key[1],
                        found["ratio"], FIDELITY.settle_steps, 100 * tolerance, 100 * self.band, 100 * self.model_error)

    # ------------------------------------------------------------------ reading (any thread)
    def snapshot(self) -> dict:
        with self._lock:
            cells = [{"strategy": strategy, "batch_sizes": bucket, "steps": c.steps, "predicted_s": c.predicted_s,
                      "measured_s": c.measured_s,
                      "refit_predicted_s": c.refit_predicted_s if self.refit is not None else None,
                      "ratio": math.exp(c.log_ratio), "spread": c.spread,
                      "baseline_ratio": None if c.baseline is None else math.exp(c.baseline)}
                     for (strategy, bucket), c in self._cells.items()]
            body = {"steps": self.steps, "band": self.band, "model_error": self.model_error, "cells": cells,
                    "drift": None if self._drift is None else dict(self._drift),
                    "drift_warnings": self.drift_warnings, "mismatched": list(self._mismatched)}
        body["refit"] = None if self.refit is None else self.refit.snapshot()
        return body

    def health(self) -> dict:
        """What /health shows: the overall ratio, the drift episode and the mismatched cells (or None)."""
        snapshot = self.snapshot()
        predicted = sum(c["predicted_s"] for c in snapshot["cells"])
        measured = sum(c["measured_s"] for c in snapshot["cells"])
        return {"steps": snapshot["steps"], "measured_over_predicted": measured / predicted if predicted else None,
                "band": snapshot["band"], "drift": snapshot["drift"], "mismatched": snapshot["mismatched"] or None,
                "refit": snapshot["refit"] is not None}
