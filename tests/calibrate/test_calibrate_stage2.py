"""The second stage's measurements: guess accuracy against hand-made positions, the query-cost fit on a
fake clock that only the n-gram's look-ups advance, and the query time kept out of tree step overheads."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specbatch.calibrate import benchmarks
from specbatch.calibrate.acceptance import ScoredRow
from specbatch.calibrate.stage2 import QUERY_CALLS_PER_SAMPLE, QUERY_CONTEXTS, fit_line, guess_accuracy, measure_stage2
from specbatch.calibrate.timing import RepetitionRule
from specbatch.perfmodel.profile import stage2_from_json


class FakeClock:
    """Host time that only the fake look-ups advance; its marks read the same time (a CPU DeviceClock's do)."""

    def __init__(self):
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s

    host_s = mark = __call__

    @staticmethod
    def elapsed_s(start: float, end: float) -> float:
        return end - start


class FakeNGram:
    """Guesses (u + v + r) mod 10 as its rank-r token; each look-up costs `lookup_s` on `clock`."""

    vocab_size = 10

    def __init__(self, clock: FakeClock | None = None, lookup_s: float = 0.0):
        self.clock, self.lookup_s, self.lookups = clock, lookup_s, 0

    def top_tokens_host(self, u: int, v: int) -> tuple[int, ...]:
        self.lookups += 1
        if self.clock is not None:
            self.clock.now_s += self.lookup_s
        return tuple((u + v + r) % 10 for r in range(4))

    def top_tokens(self, contexts: torch.Tensor, count: int) -> torch.Tensor:
        return torch.tensor([self.top_tokens_host(int(u), int(v))[:count] for u, v in contexts.tolist()])


def row(contexts, draft_top) -> ScoredRow:
    n = len(contexts)
    return ScoredRow(agreement=np.ones(n), ranks=np.zeros((n, 4)), draft_top=np.array(draft_top),
                     contexts=np.array(contexts))


def test_guess_accuracy_counts_each_rank_over_every_position():
    # the fake guesses (u + v + r) % 10: contexts (1, 2) -> 3 4 5 6, (-1, 4) -> 3 4 5 6, (5, 5) -> 0 1 2 3
    rows = [row([(1, 2), (-1, 4)], [[3, 4, 9, 9], [3, 9, 5, 9]]), row([(5, 5)], [[0, 1, 2, 9]])]
    assert guess_accuracy(FakeNGram(), rows) == pytest.approx((1.0, 2 / 3, 2 / 3, 0.0))


def test_query_cost_is_a_line_through_the_lookups():
    """Each look-up costs 2 microseconds on the fake clock and nothing else advances it: a query over n
    contexts takes n * 0.002 ms exactly, so the fit is (0, 0.002) whatever the repetitions."""
    clock = FakeClock()
    ngram = FakeNGram(clock, lookup_s=2e-6)
    rows = [row([(1, 2), (3, 4), (5, 6)], [[3, 4, 5, 6]] * 3)]
    info = measure_stage2(ngram, "n.safetensors", "ab" * 32, rows, RepetitionRule(warmup_reps=1, min_reps=6),
                          clock)
    assert (info.query_overhead_ms, info.query_ms_per_context) == pytest.approx((0.0, 0.002), abs=1e-9)
    assert info.guess_accuracy == (1 / 3, 1 / 3, 1 / 3, 1 / 3) and info.file == "n.safetensors"
    assert ngram.lookups >= len(QUERY_CONTEXTS) * 7 * QUERY_CALLS_PER_SAMPLE  # warm-up + 6 samples per size


def test_line_fit_clips_at_zero():
    assert fit_line([1, 4, 16], [1.1, 1.4, 2.6]) == pytest.approx((1.0, 0.1))
    assert fit_line([1, 4, 16], [2.0, 1.5, 1.0]) == (1.5, 0.0)  # falling with n: noise, a flat median
    overhead, slope = fit_line([1, 10, 100], [0.0, 0.5, 10.0])  # the intercept would be negative
    assert overhead == 0.0 and slope == pytest.approx(1005.0 / 10101.0)


def test_query_time_is_kept_out_of_tree_step_overheads():
    """TimedNGram adds up the time spent inside look-ups (and device queries), which the tree overhead
    sampler subtracts from the generator's other_s; other attributes pass through."""
    clock = FakeClock()
    timed = benchmarks.TimedNGram(FakeNGram(clock, lookup_s=0.5), clock)
    assert timed.top_tokens_host(1, 2) == (3, 4, 5, 6) and timed.vocab_size == 10
    timed.top_tokens(torch.tensor([[1, 2], [3, 4]]), 2)  # two look-ups inside one device query
    assert timed.seconds == pytest.approx(1.5)


def test_line_fit_records_a_sub_nanosecond_term_as_zero():
    """A least-squares intercept of 0.3 ns is noise no clock resolves, and a profile refuses a nonzero time
    under 1 ns (perfmodel.fields): the fit must write 0, or `specbatch fit` refuses the profile calibrate wrote."""
    overhead_ms, per_context_ms = fit_line([1, 4, 16, 64], [n * 0.001 + 3.02e-7 for n in (1, 4, 16, 64)])
    assert (overhead_ms, per_context_ms) == (0.0, pytest.approx(0.001))
    stage2 = {"file": "n.safetensors", "sha256": "ab" * 32, "guess_accuracy": [0.5],
              "query_overhead_ms": overhead_ms, "query_ms_per_context": per_context_ms}
    assert stage2_from_json(stage2, "stage2").query_overhead_ms == 0.0


class BatchedNGram(FakeNGram):
    """The fake whose batched query is one call (as the device tables answer it) that costs `query_s` plus
    `per_context_s` a context on the clock; its host look-ups are counted apart, to see which path ran."""

    def __init__(self, clock, query_s: float, per_context_s: float):
        super().__init__(clock)
        self.query_s, self.per_context_s, self.batched_calls = query_s, per_context_s, 0

    def top_tokens(self, contexts: torch.Tensor, count: int) -> torch.Tensor:
        self.batched_calls += 1
        self.clock.now_s += self.query_s + self.per_context_s * len(contexts)
        return torch.tensor([[(u + v + r) % 10 for r in range(count)] for u, v in contexts.tolist()])


def test_where_guesses_run_on_the_device_the_batched_query_is_timed_not_host_lookups():
    """On a device whose trees keep no host bookkeeping (CUDA), runtime.tree_decoding guesses with one
    top_tokens call per level over every context: calibration times that call (0.05 ms + 0.001 ms a context
    on the fake clock), and makes no host look-up."""
    clock = FakeClock()
    ngram = BatchedNGram(clock, query_s=5e-5, per_context_s=1e-6)
    rows = [row([(1, 2), (3, 4), (5, 6)], [[3, 4, 5, 6]] * 3)]
    info = measure_stage2(ngram, "n.safetensors", "ab" * 32, rows, RepetitionRule(warmup_reps=1, min_reps=6),
                          clock, device=torch.device("cpu"))
    assert (info.query_overhead_ms, info.query_ms_per_context) == pytest.approx((0.05, 0.001), abs=1e-9)
    assert ngram.lookups == 0 and ngram.batched_calls > len(QUERY_CONTEXTS) * 7 * QUERY_CALLS_PER_SAMPLE

