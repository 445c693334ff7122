"""`SpeculativeGenerator.generation`: a generation advanced one turn at a time, several side by side.

Oracle: the same generation run alone (`generate`), token for token and step for step. Each
generation owns its caches, its random generator and its policy's state, so interleaving their turns
on the same models must change nothing they produce; and `stats.total_s` must count a generation's
own turns only (bench.timing's lockstep compares policies by it).
"""
from __future__ import annotations

import time

import pytest

from specbatch.calibrate.pass_clock import StepRecorder
from specbatch.runtime.generator import SpeculativeGenerator, run_to_end
from specbatch.runtime.policy import FixedK
from specbatch.runtime.sampling import Sampling
from test_runtime_adaptive import adaptive

N_NEW = 12


def _contenders():
    return {"k=0": FixedK(0), "k=2": FixedK(2), "k=5": FixedK(5), "adaptive": adaptive(0.5, max_k=5)}


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.9)], ids=["greedy", "sampling"])
def test_interleaved_turns_produce_exactly_what_each_generation_produces_alone(greedy_target, greedy_draft_sometimes,
                                                                                prompts8, sampling):
    generator = SpeculativeGenerator(greedy_target, greedy_draft_sometimes)
    prompts = prompts8[:5]
    recorders = {(name, together): StepRecorder("cpu") for name in _contenders() for together in (False, True)}
    alone = {name: generator.generate(prompts, N_NEW, policy, sampling, seed=3, observer=recorders[name, False])
             for name, policy in _contenders().items()}
    turns = {name: generator.generation(prompts, N_NEW, policy, sampling, seed=3, observer=recorders[name, True])
             for name, policy in _contenders().items()}
    together, order = {}, []
    while turns:  # round-robin: every contender one turn, in a fixed order
        for name in list(turns):
            try:
                next(turns[name])
                order.append(name)
            except StopIteration as done:
                together[name] = done.value
                del turns[name]
    assert len(set(order[:8])) == 4  # the turns really alternated
    for name, result in alone.items():
        assert together[name].token_ids == result.token_ids, name
        for field in ("k_per_step", "batch_size_per_step", "accepted_per_position", "trials_per_position",
                      "generated_tokens"):
            assert getattr(together[name].stats, field) == getattr(result.stats, field), (name, field)
        mine, solo = recorders[name, True], recorders[name, False]  # each saw its own steps and passes only
        assert mine.per_step("tokens") == solo.per_step("tokens") and len(mine.steps) == result.stats.steps
        assert all(mine.pass_shapes(role) == solo.pass_shapes(role) for role in ("draft", "target")), name


def test_turns_yield_the_fraction_of_tokens_generated(greedy_target, greedy_draft_sometimes, prompts8):
    generator = SpeculativeGenerator(greedy_target, greedy_draft_sometimes)
    recorder = StepRecorder("cpu")
    steps = generator.generation(prompts8[:3], N_NEW, FixedK(3), seed=0, observer=recorder)
    fractions = []
    while True:
        try:
            fractions.append(next(steps))
        except StopIteration as done:
            stats = done.value.stats
            break
    assert len(fractions) == stats.steps  # after the prefill, then after every step but the last
    assert fractions[0] == pytest.approx(1 / N_NEW)  # the prefill made one token per row
    assert fractions == sorted(fractions) and all(0 < f <= 1 for f in fractions)
    # what the rows hold before the last step: all but what that step added
    assert fractions[-1] * 3 * N_NEW == pytest.approx(3 * N_NEW - recorder.steps[-1].tokens)


def test_total_seconds_count_only_the_generations_own_turns(greedy_target, greedy_draft_sometimes, prompts8):
    generator = SpeculativeGenerator(greedy_target, greedy_draft_sometimes)
    pause_s, paused = 0.02, 0
    recorder = StepRecorder("cpu")
    steps = generator.generation(prompts8[:2], N_NEW, FixedK(2), seed=0, observer=recorder)
    started = time.perf_counter()
    while True:
        try:
            next(steps)
        except StopIteration as done:
            stats = done.value.stats
            break
        time.sleep(pause_s)  # another contender's turn
        paused += 1
    wall_s = time.perf_counter() - started
    assert paused == stats.steps
    # a sleep lasts at least what it asks for, and none of it is the generation's own time
    assert stats.total_s <= wall_s - paused * pause_s
    assert stats.total_s >= sum(recorder.step_s) + stats.prefill_s


def test_run_to_end_is_generate(greedy_target, greedy_draft_sometimes, prompts8):
    generator = SpeculativeGenerator(greedy_target, greedy_draft_sometimes)
    result = run_to_end(generator.generation(prompts8[:4], N_NEW, FixedK(3), seed=1))
    assert result.token_ids == generator.generate(prompts8[:4], N_NEW, FixedK(3), seed=1).token_ids
