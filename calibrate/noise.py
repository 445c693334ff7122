"""The noise monitor: a reference pass timed at the start of calibration, at intervals between points,
and at the end (perfmodel.profile.noise says what the figures mean). Pure Python over an injectable clock and
sampler, so the schedule is tested with a fake clock; `reference_sampler` builds the real one."""
from __future__ import annotations

import time
from typing import Callable

from specbatch.perfmodel.profile.noise import NoiseCheck, NoiseFigure

from .timing import Clock, percentile

CHECK_INTERVAL_S = 3.0  # a quick calibration (15 s idle) gets about five checks; a full one hundreds
CHECK_SAMPLES = 7  # per check, after one warm-up: enough for a median and a p10-p90 spread


class NoiseMonitor:
    def __init__(self, sample_ms: Callable[[], float], reference: str, clock: Clock = time.perf_counter,
                 interval_s: float = CHECK_INTERVAL_S, samples: int = CHECK_SAMPLES):
        self.sample_ms, self.reference, self.clock = sample_ms, reference, clock
        self.interval_s, self.samples = interval_s, samples
        self.started_s = clock()
        self.last_s: float | None = None
        self.checks: list[NoiseCheck] = []

    def check(self, force: bool = False) -> None:
        """Time the reference if `force` or if `interval_s` has passed since the last check."""
        now = self.clock()
        if not force and self.last_s is not None and now - self.last_s < self.interval_s:
            return
        self.sample_ms()  # warm-up: the caches the points before it left behind
        ordered = sorted(self.sample_ms() for _ in range(self.samples))
        self.checks.append(NoiseCheck(round(now - self.started_s, 3), percentile(ordered, 50),
                                      percentile(ordered, 10), percentile(ordered, 90)))
        self.last_s = self.clock()

    def figure(self) -> NoiseFigure | None:
        return NoiseFigure(self.reference, tuple(self.checks)) if self.checks else None


def reference_sampler(model, batch_size: int, context_len: int, device: str, clock):
    """One pass of `model` over (batch_size, 1) new tokens on `context_len` cached ones, in ms, between two
    marks of `clock` (a runtime.clock.DeviceClock)."""
    from .benchmarks import forward_sampler, random_tokens

    cache = model.new_cache(batch_size, context_len + 1)
    tokens = random_tokens(model.config.vocab_size, batch_size, 1, device, seed=7)
    return forward_sampler(model, cache, tokens, context_len, clock)
