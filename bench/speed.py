"""The machine's speed during a bench against its speed during calibration: the profile's reference pass
timed again.

The bench times calibration's reference pass (perfmodel.profile.noise) before every timed round and after a
batch size's last, and reports slowdown(b) = its median during b's rounds / its median during calibration,
so a prediction error that comes with a slowdown is visibly the machine's. Predictions are not rescaled by it:
one narrow pass is noisier than minutes of steps, and a slow spell does not hit narrow and wide passes alike
(docs/calibration.md).
"""
from __future__ import annotations

import statistics
from typing import Any

from specbatch.calibrate.noise import NoiseMonitor, reference_sampler
from specbatch.perfmodel.errors import PerfModelError
from specbatch.perfmodel.profile.noise import NoiseFigure
from specbatch.runtime.clock import DeviceClock

from .config import BenchError


def machine_speed_for(target, calibration: NoiseFigure | None, device, model_path,
                      graphs: bool = False) -> "MachineSpeed | None":
    """The reference-pass check for a model file that kept calibration's (None for older ones); a reference
    it cannot read is refused in one line naming --model, before anything is measured. `graphs`: the pass
    replays its CUDA graph, as calibration timed it when it ran graphed (the first check's warm-up captures)."""
    if calibration is None:
        return None
    if graphs:
        from specbatch.runtime.cuda_graphs import GraphedModel

        target = GraphedModel(target)
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
            monitor = NoiseMonitor(reference_sampler(target, batch_size, context_len, device, DeviceClock(device)),
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
