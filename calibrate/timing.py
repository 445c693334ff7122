"""The repetition rule: how many times to time one grid point, and what to record.

A point is warmed up (first calls allocate, pick kernels, fill caches), then sampled until the
median is known to ±3% with 95% confidence, or the point's time budget runs out. The confidence
interval is the distribution-free one for a median: between the order statistics x_(j) and
x_(n+1-j), where j is the largest rank with P(Binomial(n, 1/2) < j) <= 2.5%. It assumes only that
the samples are independent and identically distributed; it makes no normality assumption, so a
few slow outliers (a context switch, a page fault) widen it much less than they would a mean's.
With fewer than 6 samples no such interval exists and the rule keeps sampling.

Everything here is pure Python over an injectable clock, so the rule is tested with a fake clock. Device
work is timed between two marks of `runtime.clock.DeviceClock` (`device_timed_ms`: CUDA events on the
stream, nothing synchronized inside the region); budgets and host-only work read a plain clock.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from specbatch.runtime.clock import DeviceClock

Clock = Callable[[], float]  # seconds, monotonic host time (a runtime.clock.DeviceClock reads perf_counter)


@dataclass(frozen=True)
class RepetitionRule:
    warmup_reps: int = 2  # discarded: the first calls allocate the KV cache and pick kernels
    min_reps: int = 5  # never stop below this, whatever the interval says
    max_reps: int = 1000  # a cap on work for very fast points; the binomial tail stays representable
    ci_relative: float = 0.03  # stop once the median's 95% interval is within ±3% of it
    budget_s: float = 0.3  # wall time per point, warm-up included; min_reps still wins over it

    def __post_init__(self):
        if not 1 <= self.min_reps <= self.max_reps <= 1000:
            raise ValueError(f"need 1 <= min_reps <= max_reps <= 1000, got {self.min_reps}, {self.max_reps}")


@dataclass(frozen=True)
class Measurement:
    median_ms: float
    p10_ms: float
    p90_ms: float
    reps: int


def median_ci_ranks(n: int, confidence: float = 0.95) -> tuple[int, int] | None:
    """1-based ranks (j, n+1-j) of the order statistics bounding the median with `confidence`.

    >>> median_ci_ranks(9)
    (2, 8)
    >>> median_ci_ranks(5) is None  # even (min, max) covers the median only 93.75% of the time
    True
    """
    tail = (1.0 - confidence) / 2.0
    pmf = 0.5 ** n  # P(Binomial(n, 1/2) = 0)
    below = 0.0  # P(Binomial(n, 1/2) < j), for j = 1, 2, ...
    j = 0
    while j < n // 2:
        below += pmf
        if below > tail:
            break
        j += 1
        pmf *= (n - j + 1) / j
    return (j, n + 1 - j) if j >= 1 else None


def median_is_stable(samples_ms: list[float], ci_relative: float) -> bool:
    """Whether the 95% interval of the median of `samples_ms` lies within ±ci_relative of it."""
    ranks = median_ci_ranks(len(samples_ms))
    if ranks is None:
        return False
    ordered = sorted(samples_ms)
    median = statistics.median(ordered)
    low, high = ordered[ranks[0] - 1], ordered[ranks[1] - 1]
    return median - low <= ci_relative * median and high - median <= ci_relative * median


def should_stop(samples_ms: list[float], elapsed_s: float, rule: RepetitionRule) -> bool:
    """The stopping rule; `elapsed_s` counts from the start of the warm-up."""
    n = len(samples_ms)
    if n >= rule.max_reps:
        return True
    if n < rule.min_reps:
        return False
    return elapsed_s >= rule.budget_s or median_is_stable(samples_ms, rule.ci_relative)


def percentile(ordered: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default) of an already sorted list, q in [0, 100]."""
    position = (len(ordered) - 1) * q / 100.0
    below = int(position)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (position - below)


def summarize(samples_ms: list[float]) -> Measurement:
    ordered = sorted(samples_ms)
    return Measurement(median_ms=statistics.median(ordered), p10_ms=percentile(ordered, 10),
                       p90_ms=percentile(ordered, 90), reps=len(ordered))


def repeat(sample_ms: Callable[[], float], rule: RepetitionRule, clock: Clock = time.perf_counter) -> Measurement:
    """Warm up, then call `sample_ms` (which returns one sample in milliseconds) until `should_stop`."""
    started_s = clock()
    for _ in range(rule.warmup_reps):
        sample_ms()
    samples_ms: list[float] = []
    while not should_stop(samples_ms, clock() - started_s, rule):
        samples_ms.append(sample_ms())
    return summarize(samples_ms)


def timed_ms(call: Callable[[], object], clock: Clock = time.perf_counter) -> float:
    """Host wall time of `call()` in milliseconds, between two readings of `clock`: for work done on the host
    (device work is `device_timed_ms`'s: CUDA queues kernels, and the host clock would measure the launch)."""
    start_s = clock()
    call()
    return (clock() - start_s) * 1000.0


def device_timed_ms(call: Callable[[], object], clock: DeviceClock) -> float:
    """Time of the device work `call()` queues, in milliseconds, between two marks of `clock` (CUDA: events
    recorded on the stream around it, nothing synchronized inside; the figure is read back after the second
    mark, so the next sample starts on an idle stream as a step's first pass does). On the CPU: perf_counter."""
    start = clock.mark()
    call()
    end = clock.mark()
    return clock.elapsed_s(start, end) * 1000.0


def is_out_of_memory(error: BaseException) -> bool:
    """torch.cuda.OutOfMemoryError is a RuntimeError whose message says 'out of memory'; the CPU
    allocator raises a RuntimeError saying it "can't allocate memory"."""
    if not isinstance(error, (RuntimeError, MemoryError)):
        return False
    message = str(error).lower()
    return isinstance(error, MemoryError) or "out of memory" in message or "can't allocate memory" in message
