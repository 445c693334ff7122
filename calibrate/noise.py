"""The noise monitor: a reference pass timed at the start of calibration, at intervals between points,
and at the end (perfmodel.profile.noise says what the figures mean); the full-load warm-up; and
`MachineWatch`, which keeps both references and the GPU's state (perfmodel.profile.device_state) over a run.
Pure Python over an injectable clock and sampler, so the schedule is tested with a fake clock;
`reference_sampler` builds the real one."""
from __future__ import annotations

import time
from typing import Callable

from specbatch.perfmodel.profile.device_state import DeviceState
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


WARMUP_MIN_S = 5.0  # a GPU's clocks and temperature settle over seconds of load
WARMUP_MAX_S = 30.0
WARMUP_WINDOW_S = 1.0
WARMUP_SETTLED = 0.01  # a window's median within 1 % of the one before: the clocks have settled


def warm_up(sample_ms: Callable[[], float], clock: Clock = time.perf_counter, min_s: float = WARMUP_MIN_S,
            max_s: float = WARMUP_MAX_S, window_s: float = WARMUP_WINDOW_S) -> float:
    """Run a heavy pass back to back, in windows of `window_s`, until its median over a window is within
    WARMUP_SETTLED of the window before (and `min_s` have passed), or `max_s` have; the seconds it took."""
    started_s, previous = clock(), None
    while True:
        window_started, samples = clock(), [sample_ms()]
        while clock() - window_started < window_s:
            samples.append(sample_ms())
        median, elapsed_s = percentile(sorted(samples), 50), clock() - started_s
        settled = previous is not None and abs(median - previous) <= WARMUP_SETTLED * previous
        if elapsed_s >= max_s or (settled and elapsed_s >= min_s):
            return elapsed_s
        previous = median


class MachineWatch:
    """The machine's state over a calibration: the reference pass at the smallest batch size (`small`) and,
    when the grid has a larger one that fits, at the largest (`large`: power capping slows large passes
    first); on CUDA a full-load warm-up on the largest reference before timing, and NVML's clocks, power and
    temperature at the start and end (`gpu`, None without NVML or on a CPU)."""

    def __init__(self, small: NoiseMonitor, large: NoiseMonitor | None, gpu=None, on_cuda: bool = False):
        self.small, self.large, self.gpu, self.on_cuda = small, large, gpu, on_cuda
        self.warmup_s, self.start_reading = 0.0, None

    def start(self, elapsed_s: Callable[[], float]) -> None:
        """Warm up (CUDA), read the GPU, time both references; `elapsed_s()`: seconds since calibration began."""
        if self.on_cuda:
            self.warmup_s = round(warm_up((self.large or self.small).sample_ms, self.small.clock), 3)
        if self.gpu is not None:
            self.start_reading = self.gpu.reading(elapsed_s())
        self.check(force=True)

    def check(self, force: bool = False) -> None:
        for monitor in (self.small, self.large):
            if monitor is not None:
                monitor.check(force)

    def finish(self, elapsed_s: Callable[[], float]) -> tuple[NoiseFigure | None, NoiseFigure | None,
                                                              DeviceState | None]:
        """The last checks; the profile's `noise`, `noise_large_batch` and `device_state`."""
        self.check(force=True)
        state = None
        if self.on_cuda:
            gpu = self.gpu
            state = DeviceState(self.warmup_s, None if gpu is None else gpu.max_sm_clock_mhz(),
                                None if gpu is None else gpu.power_limit_w(), self.start_reading,
                                None if gpu is None else gpu.reading(elapsed_s()))
            if gpu is not None:
                gpu.close()
        return self.small.figure(), None if self.large is None else self.large.figure(), state
