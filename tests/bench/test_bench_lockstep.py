"""Lockstep timing (bench.timing): our contenders advance a step of each in turn, the one furthest
behind first, each with its own pass records; what they generate is what they generate alone.

No wall-clock thresholds: the checks are on the order of turns, on where each pass's record went, and
on the counts the runs produce (identical to back-to-back runs with the same seeds).
"""
from __future__ import annotations

import pytest

from specbatch.bench.config import BenchConfig, BenchError
from specbatch.bench.harness import run_bench
from specbatch.bench.timing import time_lockstep
from specbatch.calibrate.lockstep import next_turn
from specbatch.runtime.generator import SpeculativeGenerator
from specbatch.runtime.policy import FixedK


def test_next_turn_is_the_one_furthest_behind_and_ties_go_by_priority():
    assert next_turn({"a": 0.50, "b": 0.25, "c": 0.75}, ["a", "b", "c"]) == "b"
    assert next_turn({"a": 0.25, "b": 0.25}, ["b", "a"]) == "b"
    assert next_turn({"a": 0.25, "b": 0.25}, ["a", "b"]) == "a"
    assert next_turn({"b": 0.9}, ["a", "b", "c"]) == "b"  # finished contenders are gone from `progress`


class LoggedGenerator(SpeculativeGenerator):
    """Records, before every turn, which generation ran and every unfinished generation's progress."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.turns: list[tuple[int, dict[int, float]]] = []
        self.progress: dict[int, float] = {}

    def generation(self, *args, **kwargs):
        key = len(self.progress)
        self.progress[key] = 0.0
        inner = super().generation(*args, **kwargs)
        while True:
            self.turns.append((key, dict(self.progress)))
            try:
                self.progress[key] = next(inner)
            except StopIteration as done:
                del self.progress[key]
                return done.value
            yield self.progress[key]


def test_lockstep_always_advances_the_generation_furthest_behind(tiny_pair, prompts):
    generator = LoggedGenerator(tiny_pair.target, tiny_pair.draft)
    config = BenchConfig(batch_sizes=(3,), max_new_tokens=10, synthetic_acceptance=0.6)
    measured = time_lockstep(generator, prompts[:3], [("k=0", FixedK(0)), ("k=3", FixedK(3))], config, seed=0)
    # generations are registered lazily, on their first turn: the first two turns start them
    assert [key for key, _ in generator.turns[:2]] == [0, 1]
    for key, progress in generator.turns[2:]:
        assert progress[key] == min(progress.values())
    keys = [key for key, _ in generator.turns]
    assert keys.count(0) > keys.count(1)  # plain decoding needs more turns for the same tokens
    switches = sum(a != b for a, b in zip(keys, keys[1:]))
    assert switches >= keys.count(1) - 1  # k = 3 never ran two turns in a row while k = 0 lagged
    for name in ("k=0", "k=3"):
        assert measured[name]["generated_tokens"] == 3 * 10
        assert measured[name]["measured_steps"] is not None  # its own passes, none of the other's


def test_lockstep_and_back_to_back_runs_generate_the_same(tiny_pair, prompts, table_path):
    def bench(interleave):
        config = BenchConfig(batch_sizes=(1, 3), ks=(1, 2), max_new_tokens=8, rounds=2, warmup_rounds=1,
                             resolve_rounds=0, synthetic_acceptance=0.7, table_path=table_path,
                             interleave=interleave)
        return run_bench(config, tiny_pair, prompts)

    steps, runs = bench("steps"), bench("runs")
    key = lambda r: (r.batch_size, r.round, r.policy)  # noqa: E731
    assert sorted(map(key, steps.runs)) == sorted(map(key, runs.runs))
    by_key = {key(r): r for r in runs.runs}
    for record in steps.runs:
        other = by_key[key(record)]
        assert (record.generated_tokens, record.steps, record.accepted_per_position, record.k_counts_full_batch) == \
            (other.generated_tokens, other.steps, other.accepted_per_position, other.k_counts_full_batch)
        assert record.measured_steps is not None
        # a lockstep run's seconds are its own turns: at most the steps' time plus prefill and bookkeeping
        assert record.seconds >= record.step_seconds


def test_interleave_mode_is_checked():
    with pytest.raises(BenchError, match="--interleave 'rounds'"):
        BenchConfig(interleave="rounds")
