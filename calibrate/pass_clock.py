"""Every step of a generation and every forward pass in it, timed: the recorder bench and calibrate attach.

`StepRecorder` is a `runtime.generator.StepObserver`: `generator.generate(..., observer=StepRecorder(device))`.
The generator hands it each pass of a step to run; it puts two marks of the device clock (runtime.clock:
CUDA events on the stream, perf_counter on the CPU) around the pass and notes its shape and the longest
row's cached context before it (what the pass's attention spans: shorter rows are masked). Nothing inside
a step is synchronized or read back for the recorder: when the step is over (`step_finished`, which the
generator calls after it has read the step's accept counts back, so every pass of the step has run) it
reads the step's pass times and the step's wall time (host time from `step_started`). The prefill is not
a step: its passes are not recorded. Plain generation attaches no recorder and pays for none of this.

Shared by `bench` (the decomposition of a prediction's error, perfmodel.explain) and `calibrate` (passes
timed inside real speculative steps, calibrate/insitu.py; step overheads, calibrate/benchmarks.py).
"""
from __future__ import annotations

from typing import Any

import torch

from specbatch.perfmodel.explain import MeasuredSteps, measured_from_stats
from specbatch.runtime.clock import DeviceClock, Mark
from specbatch.runtime.generator import StepRecord


class StepRecorder:
    """What each step of one generation ran, produced and took."""

    def __init__(self, device: torch.device | str, pass_contexts: bool = True):
        """`pass_contexts=False`: no context per pass."""
        self.clock, self.pass_contexts = DeviceClock(device), pass_contexts
        self.steps: list[StepRecord] = []
        self.step_s: list[float] = []  # wall time of each step: passes, the policy's decisions, bookkeeping
        # per role, per step pass: (batch, new tokens, cached context of the longest row or None, seconds)
        self.passes: dict[str, list[tuple[int, int, int | None, float]]] = {"draft": [], "target": []}
        self._queued: list[tuple[str, int, int, int | None, Mark, Mark]] = []  # this step's passes, not read yet
        self._started_s = 0.0

    # ------------------------------------------------------------------ the observer protocol
    def run_pass(self, role: str, model, tokens: torch.Tensor, cache, attention=None, last=None) -> torch.Tensor:
        context = cache.longest() if self.pass_contexts else None  # the host's lengths: no device read
        start = self.clock.mark()
        out = model(tokens, cache, attention, last)
        self._queued.append((role, int(tokens.shape[0]), int(tokens.shape[1]), context, start, self.clock.mark()))
        return out

    def step_started(self) -> None:
        self._started_s = self.clock.host_s()

    def step_finished(self, record: StepRecord) -> None:
        """The generator has read the step's counts back: its passes have run, their marks can be read."""
        self.step_s.append(self.clock.host_s() - self._started_s)
        for role, batch, new_tokens, context, start, end in self._queued:
            self.passes[role].append((batch, new_tokens, context, self.clock.elapsed_s(start, end)))
        self._queued.clear()
        self.steps.append(record)

    # ------------------------------------------------------------------ readings
    def per_step(self, name: str) -> list[Any]:
        """One field of every step's record (`batch_size`, `context_len`, `nodes`, `tokens`, ...)."""
        return [getattr(record, name) for record in self.steps]

    def pass_shapes(self, role: str) -> list[tuple[int, int]]:
        """(batch, new tokens) of every step pass of `role`, in order."""
        return [(batch, new_tokens) for batch, new_tokens, _, _ in self.passes[role]]

    def overhead_s(self) -> float:
        """The steps' time outside their forward passes (sampling, acceptance, bookkeeping, the policy)."""
        return sum(self.step_s) - sum(seconds for rows in self.passes.values() for *_, seconds in rows)

    def decision_s(self) -> float:
        """The policy's own time over all steps."""
        return sum(self.per_step("decision_s"))

    def steady_tokens_per_s(self, batch_size: int) -> float | None:
        """Goodput over the steps that ran with the full batch: what G(b, k) models (no prefill, no tail)."""
        full = [i for i, record in enumerate(self.steps) if record.batch_size == batch_size]
        seconds = sum(self.step_s[i] for i in full)
        return sum(self.steps[i].tokens for i in full) / seconds if full and seconds > 0 else None

    def measured_steps(self, batch_size: int) -> MeasuredSteps | None:
        """The full-batch steps with each pass's time (perfmodel.explain); None without full-batch steps."""
        record = {"batch_size_per_step": self.per_step("batch_size"), "step_s": self.step_s,
                  "step_tokens": self.per_step("tokens"), "step_tokens_drawn": self.per_step("tokens_drawn"),
                  "draft_passes": self.pass_shapes("draft"), "target_passes": self.pass_shapes("target"),
                  "draft_pass_s": [row[3] for row in self.passes["draft"]],
                  "target_pass_s": [row[3] for row in self.passes["target"]]}
        return measured_from_stats(record, batch_size)
