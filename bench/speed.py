"""The machine's speed during a bench against its speed during calibration: the profile's reference pass
timed again.

A prediction is built from passes timed during calibration. On a machine whose speed moves (other
tenants of a shared host, throttling) the same pass takes longer or shorter minutes later, and every
prediction is off by that factor whatever the model. Measured on the 2-core VM this project is built on,
idle, one thread: the same target pass (b = 1, one new token, 128 cached) ran 4.2 ms and 7.3 ms in
40-pass series a few seconds apart, on either core.

Calibrate timed a reference pass throughout (perfmodel.noise; the model file keeps those checks). The
bench times the same pass (same target, batch size, context, one new token) before every timed round and
once after a batch size's last one, and reports per batch size

    slowdown(b) = median of the reference pass during b's rounds / its median during calibration,

so a prediction error that comes with a slowdown of 1.5x is visibly the machine's. The bench does not
rescale its predictions by it: measured side by side (docs/fidelity.md), dividing the predictions by
slowdown(b) raised the mean |error| from 7.1 % to 11.6 %. One narrow pass, timed 7 times per check, is
noisier than the bench's minutes of steps, and a host-level slowdown (cache and memory-bandwidth
contention) does not hit narrow and wide passes alike.
"""
from __future__ import annotations

import statistics
import time
from typing import Any

from specbatch.calibrate.noise import NoiseMonitor, reference_sampler
from specbatch.perfmodel.errors import PerfModelError
from specbatch.perfmodel.noise import NoiseFigure

from .config import BenchError


def machine_speed_for(target, calibration: NoiseFigure | None, device, model_path) -> "MachineSpeed | None":
    """The reference-pass check for a model file that kept calibration's (None for older ones); a reference
    it cannot read is refused in one line naming --model, before anything is measured."""
    if calibration is None:
        return None
    try:
        return MachineSpeed(target, calibration, str(device))
    except PerfModelError as error:
        raise BenchError(f"--model {model_path}: {error}") from None


def speed_note(speed: dict[str, Any] | None) -> list[str]:
    """`explain`'s line about the machine: the reference pass now against calibration."""
    if not speed:
        return []
    return [f"the machine ran the reference pass ({speed['reference']}) in {speed['bench_ms']:.3g} ms during "
            f"these rounds, {speed['calibration_ms']:.3g} ms during calibration: {speed['slowdown']:.2f}x; a "
            "prediction error of that order is the machine's, not the model's"]


class MachineSpeed:
    def __init__(self, target, calibration: NoiseFigure, device: str, monitor: NoiseMonitor | None = None):
        """`monitor`: injectable for tests; by default the reference pass on `target`."""
        if monitor is None:
            batch_size, context_len = calibration.reference_shape()
            monitor = NoiseMonitor(reference_sampler(target, batch_size, context_len, device, time.perf_counter),
                                   calibration.reference)
        self.monitor, self.calibration = monitor, calibration
        self.checks_by_batch: dict[int, list[float]] = {}

    def check(self, batch_size: int) -> None:
        """Time the reference pass now, counted for batch size `batch_size`."""
        self.monitor.check(force=True)
        self.checks_by_batch.setdefault(batch_size, []).append(self.monitor.checks[-1].median_ms)

    def slowdown(self, batch_size: int) -> float | None:
        checks = self.checks_by_batch.get(batch_size)
        return None if not checks else statistics.median(checks) / self.calibration.level_ms

    def at(self, batch_size: int) -> dict[str, Any] | None:
        """bench.json's `machine_speed` of one batch size; None when it was not checked."""
        checks = self.checks_by_batch.get(batch_size)
        if not checks:
            return None
        return {"reference": self.calibration.reference, "calibration_ms": self.calibration.level_ms,
                "bench_ms": statistics.median(checks), "checks": len(checks),
                "slowdown": self.slowdown(batch_size),
                "method": "median reference pass during this batch size's rounds / its median during calibration"}


def add_machine_speed(batches, speed: MachineSpeed) -> None:
    """Set each batch's `machine_speed` (None where it was not checked)."""
    for batch in batches:
        batch.machine_speed = speed.at(batch.batch_size)
