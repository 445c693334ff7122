"""The step-time formula counts the passes the runtime really makes.

This is the one perfmodel test that runs the torch runtime (tiny models from conftest, milliseconds):
it records the forward passes of each step and compares them with `schedule.step_passes`. At
acceptance 0 and 1 the schedule is deterministic, so the comparison is exact.
"""
from __future__ import annotations

from collections import Counter

import pytest

from specbatch.perfmodel.schedule import step_passes

pytest.importorskip("torch")


def run(target, draft, prompts, k: int, acceptance: float, max_new_tokens: int = 20):
    from specbatch.calibrate.pass_clock import StepRecorder
    from specbatch.runtime.generator import SpeculativeGenerator
    from specbatch.runtime.policy import FixedK

    recorder = StepRecorder("cpu")  # sees every pass of every step
    result = SpeculativeGenerator(target, draft).generate(prompts, max_new_tokens, FixedK(k),
                                                          synthetic_acceptance=acceptance, observer=recorder)
    stats = result.stats
    draft_passes, target_passes = recorder.pass_shapes("draft"), recorder.pass_shapes("target")
    assert stats.k_per_step == [k] * stats.steps
    assert len(draft_passes) == k * stats.steps and len(target_passes) == stats.steps
    steps = []
    for s, batch in enumerate(stats.batch_size_per_step):
        passes = [("draft", n, b) for b, n in draft_passes[k * s:k * (s + 1)]]
        passes.append(("target", target_passes[s][1], target_passes[s][0]))
        assert all(b == batch for _, _, b in passes)  # every pass of a step runs the whole batch
        steps.append((batch, [(role, n) for role, n, _ in passes]))
    return steps


def predicted(batch: int, k: int, acceptance: float) -> Counter:
    counts = Counter()
    for p in step_passes(batch, k, [acceptance]):
        counts[(p.role, p.new_tokens)] += p.weight
    return counts


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("acceptance", [0.0, 1.0])
def test_deterministic_schedules_match_exactly(greedy_target, greedy_draft_sometimes, prompts8, k, acceptance):
    steps = run(greedy_target, greedy_draft_sometimes, prompts8, k, acceptance)
    assert len(steps) >= 3
    # step 0 follows the prefill, after which the draft lags by one token: as if nothing was accepted
    batch, first = steps[0]
    assert Counter(first) == predicted(batch, k, 0.0)
    for batch, passes in steps[1:]:
        assert Counter(passes) == predicted(batch, k, acceptance)


def test_random_acceptance_keeps_the_shape(greedy_target, greedy_draft_sometimes, prompts8):
    k = 4
    for batch, passes in run(greedy_target, greedy_draft_sometimes, prompts8, k, 0.5, max_new_tokens=24):
        first, *rest, verify = passes
        assert first in (("draft", 1), ("draft", 2))
        assert rest == [("draft", 1)] * (k - 1)
        assert verify == ("target", k + 1)
        shapes = {(p.role, p.new_tokens) for p in step_passes(batch, k, [0.5])}
        assert set(passes) <= shapes


def test_no_speculation_is_one_target_pass(greedy_target, greedy_draft_sometimes, prompts8):
    for batch, passes in run(greedy_target, greedy_draft_sometimes, prompts8, 0, 0.5):
        assert Counter(passes) == predicted(batch, 0, 0.5)


def test_synthetic_draws_of_e_cover_the_exact_e_and_the_cut_lowers_what_is_kept(greedy_target, greedy_draft_sometimes,
                                                                                 prompts8):
    """Synthetic acceptance 0.8 at k = 2 has E = 1 + 0.8 + 0.64 exactly: the drawn tokens per step of 30
    generations (fixed seeds) lie within their 95 % sampling interval of it, and the kept ones (a row's
    last step cut at max_new_tokens) lie below the drawn ones."""
    from specbatch.calibrate.pass_clock import StepRecorder
    from specbatch.runtime.generator import SpeculativeGenerator
    from specbatch.runtime.policy import FixedK

    generator = SpeculativeGenerator(greedy_target, greedy_draft_sometimes)
    pooled = None
    for seed in range(30):
        recorder = StepRecorder("cpu")
        generator.generate(prompts8[:1], 12, FixedK(2), seed=seed, synthetic_acceptance=0.8, observer=recorder)
        assert recorder.per_step("tokens_drawn")[:-1] == recorder.per_step("tokens")[:-1]  # only the last is cut
        steps = recorder.measured_steps(1)
        pooled = steps if pooled is None else pooled.merged(steps)
    exact = 1 + 0.8 + 0.64
    assert abs(pooled.drawn_tokens_per_step - exact) <= pooled.drawn_halfwidth()
    assert 0.05 < pooled.drawn_halfwidth() < 0.5
    assert pooled.tokens_per_step < pooled.drawn_tokens_per_step
