"""In-situ timing on the bundled demo pair: one point (b = 2, k = 4) generated for real on held-out prompts,
every pass and step timed; the rows account for every pass of every full-batch step."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest

from specbatch.calibrate.acceptance import encode_prompts, read_prompts
from specbatch.calibrate.grid import make_grid
from specbatch.calibrate.insitu import InSituPoint, insitu_groups, insitu_points, measure_insitu
from specbatch.calibrate.store import measured_insitu_points
from specbatch.perfmodel.profile.insitu import InSituStepRow
from specbatch.runtime.checkpoint import load_checkpoint
from specbatch.runtime.generator import SpeculativeGenerator

ROOT = Path(__file__).resolve().parents[2]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def generator_and_prompts():
    target = load_checkpoint(ROOT / "data" / "models" / "demo-target")
    draft = load_checkpoint(ROOT / "data" / "models" / "demo-draft")
    prompts = encode_prompts(target.tokenizer, read_prompts(ROOT / "data" / "prompts" / "heldout.jsonl")[64:70], 200)
    return SpeculativeGenerator(target.model, draft.model, eos_token_ids=()), prompts


def test_a_point_accounts_for_every_pass_of_its_full_batch_steps(generator_and_prompts):
    generator, prompts = generator_and_prompts
    results = [measure_insitu(generator, [InSituPoint(2, 4, sweep)], prompts, NEW_TOKENS, sweeps=2)[0]
               for sweep in (1, 2)]
    steps = tuple(row for result in results for row in result.steps)
    passes = tuple(row for result in results for row in result.passes)
    assert all((r.batch_size, r.k) == (2, 4) for r in steps + passes)
    assert [len(result.steps) for result in results] == [1, 1]  # one step row per generation
    for sweep, result in enumerate(results, start=1):
        assert {r.sweep for r in result.steps + result.passes} == {sweep}
    assert all(1.5 < r.tokens_per_step <= 5 for r in steps)  # the demo pair agrees often (E(4) about 3)
    step_count = sum(r.reps for r in steps)
    assert all(r.reps * r.tokens_per_step <= NEW_TOKENS for r in steps)  # full-batch steps only, one round each
    target = [r for r in passes if r.model == "target"]
    draft = [r for r in passes if r.model == "draft"]
    assert {r.new_tokens for r in target} == {5} and sum(r.reps for r in target) == step_count
    assert {r.new_tokens for r in draft} <= {1, 2} and sum(r.reps for r in draft) == 4 * step_count
    # the two sweeps ran the two shortest and the two longest prompts: the longest row sets the context
    ordered = sorted(len(p) for p in prompts)
    short, long = ordered[1], ordered[-1]
    assert short <= steps[0].context_len <= short + NEW_TOKENS and long <= steps[1].context_len <= long + NEW_TOKENS
    assert all(short - 1 <= r.context_len <= long + NEW_TOKENS for r in passes)
    assert all(r.in_situ and 0 < r.p10_ms <= r.median_ms <= r.p90_ms for r in passes)


def test_the_sweeps_visit_every_point_once_each_in_the_same_order():
    grid = make_grid((1, 2, 4), (256,), 4)
    points = insitu_points(grid, (0, 2), every_other_batch_size=False, sweeps=3)
    cells = [(b, k) for b in (1, 2, 4) for k in (0, 2)]
    assert [(p.batch_size, p.k, p.sweep) for p in points] == [(b, k, s) for s in (1, 2, 3) for b, k in cells]
    with pytest.raises(ValueError, match="sweeps must be >= 1"):
        insitu_points(grid, (0, 2), False, sweeps=0)


def test_quick_points_are_every_other_batch_size_and_the_ks_up_to_max_k():
    grid = make_grid((1, 2, 4, 8, 16), (256,), 8)
    points = insitu_points(grid, (0, 2, 4, 6), every_other_batch_size=True)
    assert [(p.batch_size, p.k) for p in points] == [(b, k) for b in (1, 4, 16) for k in (0, 2, 4, 6)]
    assert [(p.batch_size, p.k) for p in insitu_points(make_grid((1, 2), (16,), 3), (0, 2, 4), True)] == \
        [(1, 0), (1, 2), (2, 0), (2, 2)]


def test_rows_without_a_sweep_stand_for_every_sweep_of_their_point_on_resume():
    """A profile measured point by point (before sweeps) is not measured again; a swept one resumes per sweep."""
    older = InSituStepRow(1, 2, 60, 2.5, 8.0, 7.5, 9.0, 10)
    swept = replace(older, batch_size=2, sweep=1)
    profile = SimpleNamespace(insitu_steps=(older, swept))
    assert measured_insitu_points(profile, sweeps=3) == \
        {InSituPoint(1, 2, 1), InSituPoint(1, 2, 2), InSituPoint(1, 2, 3), InSituPoint(2, 2, 1)}


def test_the_ks_of_one_batch_size_and_sweep_are_generated_together_each_with_its_own_passes(generator_and_prompts):
    generator, prompts = generator_and_prompts
    points = [InSituPoint(2, 0, 1), InSituPoint(2, 3, 1)]
    plain, chain = measure_insitu(generator, points, prompts, NEW_TOKENS, sweeps=2)
    assert {r.k for r in plain.steps + plain.passes} == {0} and {r.k for r in chain.steps + chain.passes} == {3}
    assert {r.new_tokens for r in plain.passes} == {1} and all(r.model == "target" for r in plain.passes)
    assert {r.new_tokens for r in chain.passes if r.model == "target"} == {4}
    assert plain.steps[0].tokens_per_step == 1.0
    # the same prompts: both start from the same contexts
    assert abs(plain.steps[0].context_len - chain.steps[0].context_len) <= NEW_TOKENS
    with pytest.raises(ValueError, match="share a batch size and a sweep"):
        measure_insitu(generator, [InSituPoint(2, 0, 1), InSituPoint(4, 0, 1)], prompts, NEW_TOKENS, sweeps=2)
    assert [[p.k for p in group] for group in insitu_groups(insitu_points(make_grid((1, 2), (64,), 2), (0, 2), False,
                                                                                   sweeps=2))] == [[0, 2]] * 4
