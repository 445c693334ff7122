"""The repetition rule, driven by a fake clock: which samples are kept, when it stops, what it records;
and the device clock every timing reads (runtime.clock)."""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from specbatch.calibrate.timing import (
    RepetitionRule, is_out_of_memory, median_ci_ranks, median_is_stable, percentile, repeat,
    should_stop, summarize, timed_ms)
from specbatch.runtime.clock import DeviceClock


class FakeClock:
    """Seconds that advance only when a fake pass 'runs'."""

    def __init__(self):
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def fake_passes(clock: FakeClock, durations_ms: list[float]):
    """A sampler that takes the next duration from the list, advancing the clock by it."""
    queue = iter(durations_ms)

    def sample_ms() -> float:
        duration = next(queue)
        clock.now_s += duration / 1000.0
        return duration

    return sample_ms


def test_median_ci_ranks_match_the_binomial_tables():
    # exact binomial ranks: n=6 -> (1, 6) with 96.9% coverage; n=9 -> (2, 8); n=100 -> (40, 61)
    assert median_ci_ranks(5) is None  # 1 - 2/32 = 93.75% < 95%: no interval exists
    assert median_ci_ranks(6) == (1, 6)
    assert median_ci_ranks(9) == (2, 8)
    assert median_ci_ranks(100) == (40, 61)
    for n in range(6, 400):
        low, high = median_ci_ranks(n)
        assert 1 <= low < high <= n and low + high == n + 1


def test_stability_needs_the_interval_within_tolerance():
    assert median_is_stable([10.0] * 6, 0.03)
    assert not median_is_stable([10.0] * 5, 0.03)  # too few samples for any 95% interval
    # n = 9: the interval is [x(2), x(8)]; one outlier on each side does not matter, two do
    assert median_is_stable([1.0, 9.9, 10, 10, 10, 10, 10, 10.2, 99.0], 0.03)
    assert not median_is_stable([1.0, 9.0, 10, 10, 10, 10, 10, 10.2, 99.0], 0.03)


def test_constant_samples_stop_as_soon_as_an_interval_exists():
    clock = FakeClock()
    rule = RepetitionRule(warmup_reps=2, min_reps=5, budget_s=100.0)
    measurement = repeat(fake_passes(clock, [10.0] * 100), rule, clock)
    assert measurement.reps == 6
    assert measurement.median_ms == measurement.p10_ms == measurement.p90_ms == 10.0


def test_warmup_samples_are_discarded():
    clock = FakeClock()
    rule = RepetitionRule(warmup_reps=2, min_reps=5, budget_s=100.0)
    measurement = repeat(fake_passes(clock, [500.0, 300.0] + [10.0] * 100), rule, clock)
    assert (measurement.median_ms, measurement.p90_ms, measurement.reps) == (10.0, 10.0, 6)


def test_noisy_samples_stop_when_the_budget_runs_out():
    # alternating 10 and 20 ms never gives a ±3% interval; the budget (warm-up included) ends it:
    # 2 warm-up passes (30 ms) + 24 samples (360 ms) = 390 ms < 395 ms; the 25th sample crosses it
    clock = FakeClock()
    rule = RepetitionRule(warmup_reps=2, min_reps=5, budget_s=0.395)
    measurement = repeat(fake_passes(clock, [10.0, 20.0] * 100), rule, clock)
    assert measurement.reps == 25
    assert measurement.median_ms == 10.0  # 13 of the 25 samples are 10 ms


def test_min_reps_wins_over_the_budget():
    clock = FakeClock()
    rule = RepetitionRule(warmup_reps=1, min_reps=5, budget_s=0.1)
    measurement = repeat(fake_passes(clock, [1000.0, 900.0, 1100.0] * 10), rule, clock)
    assert measurement.reps == 5


def test_max_reps_caps_the_work():
    clock = FakeClock()
    rule = RepetitionRule(warmup_reps=0, min_reps=3, max_reps=40, budget_s=1e9)
    measurement = repeat(fake_passes(clock, [10.0, 20.0] * 100), rule, clock)
    assert measurement.reps == 40


def test_should_stop_is_the_documented_rule():
    rule = RepetitionRule(min_reps=5, max_reps=50, budget_s=1.0)
    assert not should_stop([10.0] * 4, elapsed_s=5.0, rule=rule)  # below min_reps, whatever the time
    assert should_stop([10.0, 20.0] * 3, elapsed_s=1.0, rule=rule)  # budget spent
    assert not should_stop([10.0, 20.0] * 3, elapsed_s=0.5, rule=rule)  # unstable, budget left
    assert should_stop([10.0] * 6, elapsed_s=0.0, rule=rule)  # stable
    assert should_stop([10.0, 20.0] * 25, elapsed_s=0.0, rule=rule)  # max_reps


def test_summary_percentiles_agree_with_numpy():
    samples = [3.0, 1.0, 4.0, 1.5, 5.0, 9.0, 2.0, 6.0, 5.5, 3.5, 8.0]
    measurement = summarize(samples)
    assert measurement.median_ms == pytest.approx(np.median(samples))
    assert measurement.p10_ms == pytest.approx(np.percentile(samples, 10))
    assert measurement.p90_ms == pytest.approx(np.percentile(samples, 90))
    assert percentile(sorted(samples), 0) == 1.0 and percentile(sorted(samples), 100) == 9.0


def test_timed_region_lies_between_two_clock_readings():
    events = []
    clock = FakeClock()

    def read():
        events.append("clock")
        return clock()

    def call():
        events.append("call")
        clock.now_s += 0.0025

    assert timed_ms(call, read) == pytest.approx(2.5)
    assert events == ["clock", "call", "clock"]


def test_device_clock_on_the_cpu_is_perf_counter():
    clock = DeviceClock("cpu")
    before = time.perf_counter()
    read = clock.now()
    assert before <= read <= time.perf_counter() and clock.device is None
    assert before <= clock() <= time.perf_counter()  # callable: a calibrate.timing.Clock


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_device_clock_reads_the_time_only_after_the_queued_kernels_ran():
    clock = DeviceClock("cuda")
    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(20):
        x = x @ x / 64.0  # queued, asynchronously
    clock.now()
    assert torch.cuda.current_stream().query()  # nothing left on the stream when the time was read


def test_out_of_memory_errors_are_recognised():
    assert is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 GB"))
    assert is_out_of_memory(MemoryError())
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("out of memory"))  # not an allocator error
