"""Every forward pass of a generation, timed one by one, without touching the generator.

The generator records each pass's shape (`GenerationStats.draft_passes` / `target_passes`: batch, new
tokens) and only the summed times. `PassClock` wraps the models' `forward` for the duration of one
`generate()` call and records (batch, new tokens, context, seconds) per call, the context being the
longest row's cached length before the pass (what the pass's attention spans: shorter rows are masked);
the first calls of each model are the prefill, so the step passes are the last
`len(stats.<role>_passes)` records, which must have the same shapes (checked). The clock synchronizes
CUDA around each pass, as the generator's own timer does, so it adds no synchronization the run did not
already have. `records` may be swapped between passes: bench.timing's lockstep runs several
generations on the same models and keeps one set of records per generation.

Shared by `bench` (the decomposition of a prediction's error) and `calibrate` (in-situ timing: passes
timed inside real speculative steps, calibrate/insitu.py).
"""
from __future__ import annotations

from typing import Any

import torch

from specbatch.perfmodel.explain import MeasuredSteps, measured_from_stats
from specbatch.runtime.clock import DeviceClock


class PassClock:
    """`with PassClock({"draft": draft, "target": target}, device) as clock: generator.generate(...)`."""

    def __init__(self, models: dict[str, Any], device: torch.device):
        distinct: dict[int, str] = {}  # a model passed twice (draft = target) is wrapped once, under its first role
        for role, model in models.items():
            if isinstance(model, torch.nn.Module):
                distinct.setdefault(id(model), role)
        self.models = {role: models[role] for role in distinct.values()}
        self.clock = DeviceClock(device)
        # per role, per call: (batch, new tokens, cached context of the longest row, seconds)
        self.records: dict[str, list[tuple[int, int, int, float]]] = {role: [] for role in self.models}

    def _timed(self, role: str, forward):
        def timed_forward(tokens, *args, **kwargs):
            cache = args[0] if args else kwargs.get("cache")
            context = int(cache.lengths.max()) if cache is not None else 0  # before the clock starts
            started = self.clock.now()
            out = forward(tokens, *args, **kwargs)
            self.records[role].append((int(tokens.shape[0]), int(tokens.shape[1]), context,
                                       self.clock.now() - started))
            return out
        return timed_forward

    def __enter__(self) -> "PassClock":
        for role, model in self.models.items():
            model.forward = self._timed(role, model.forward)  # an instance attribute shadows the method
        return self

    def __exit__(self, *exc) -> None:
        for model in self.models.values():
            del model.forward  # the class's forward again

    def step_records(self, stats) -> dict[str, list[tuple[int, int, int, float]]] | None:
        """The step passes' records (batch, new tokens, context, seconds), aligned with
        `stats.<role>_passes`; None when the records do not line up with the generator's (then no
        per-pass figures are claimed)."""
        out = {"draft": [], "target": []}
        for role in out:
            shapes = [tuple(s) for s in getattr(stats, f"{role}_passes")]
            records = self.records.get(role, [])
            if not shapes:
                continue
            if len(records) < len(shapes) or [r[:2] for r in records[-len(shapes):]] != shapes:
                return None
            out[role] = records[-len(shapes):]
        return out

    def step_pass_seconds(self, stats) -> dict[str, list[float]] | None:
        """Seconds of each step pass, aligned with `stats.<role>_passes`, or None (see `step_records`)."""
        records = self.step_records(stats)
        return None if records is None else {role: [r[3] for r in rows] for role, rows in records.items()}


def measured_steps(stats, clock: PassClock, batch_size: int) -> MeasuredSteps | None:
    """The run's full-batch steps with each pass's time (perfmodel.explain), or None."""
    seconds = clock.step_pass_seconds(stats)
    if seconds is None:
        return None
    record = {"batch_size_per_step": stats.batch_size_per_step, "step_s": stats.step_s,
              "step_tokens": stats.step_tokens, "step_tokens_drawn": stats.step_tokens_drawn,
              "draft_passes": stats.draft_passes,
              "target_passes": stats.target_passes, "draft_pass_s": seconds["draft"],
              "target_pass_s": seconds["target"]}
    return measured_from_stats(record, batch_size)
