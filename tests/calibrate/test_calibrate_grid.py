"""Grid construction and the memory check (no model is built here)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from specbatch.calibrate.errors import CalibrationError
from specbatch.calibrate.grid import (
    TimingPoint, TreeOverheadPoint, check_grid_fits, fit_wide_passes, make_grid, merge_grids,
    new_tokens_at, overhead_points, timing_points, tree_overhead_points)
from specbatch.runtime.presets import preset_config


# ---------------------------------------------------------------- grid
def test_grid_is_sorted_deduplicated_and_mirrors_the_runtime_schedule():
    grid = make_grid([8, 1, 2, 8], [512, 128], max_k=3)
    assert grid.batch_sizes == (1, 2, 8) and grid.context_lens == (128, 512)
    # verify passes of k + 1 tokens, k = 0..3, then tree verify passes (N + 1 tokens)
    assert grid.target_new_tokens == (1, 2, 3, 4, 16, 32, 64)
    # the 1-token pass and the catch-up pass, then tree levels and staged rounds
    assert grid.draft_new_tokens == (1, 2, 4, 8, 16, 32, 64)
    assert make_grid([1], [8], max_k=20).target_new_tokens == tuple(range(1, 22)) + (32, 64)  # 16 is a chain's


def test_wide_passes_are_timed_at_small_batch_sizes_only():
    grid = make_grid([1, 4, 8, 32], [64], max_k=2)
    assert new_tokens_at(grid, "target", 4) == (1, 2, 3, 16, 32, 64)
    assert new_tokens_at(grid, "target", 8) == (1, 2, 3) and new_tokens_at(grid, "draft", 32) == (1, 2)
    assert new_tokens_at(grid, "draft", 1) == (1, 2, 4, 8, 16, 32, 64)
    # no batch size that small: the smallest one gets them
    large = make_grid([8, 16], [64], max_k=2)
    assert new_tokens_at(large, "target", 8)[-1] == 64 and new_tokens_at(large, "target", 16)[-1] == 3


def test_timing_points_cover_every_role_size_and_length_once():
    grid = make_grid([1, 8], [16, 64], max_k=2)
    points = timing_points(grid)
    assert len(points) == len(set(points)) == 2 * ((3 + 3) + 3 + (2 + 5) + 2)  # per L: wide ones at b = 1 only
    assert points[0] == TimingPoint("draft", 1, 1, 16) and points[-1] == TimingPoint("target", 8, 3, 64)
    assert TimingPoint("target", 1, 64, 16) in points and TimingPoint("target", 8, 16, 16) not in points
    # points sharing (model, b, L) are adjacent, so one KV cache serves them
    groups = [(p.model, p.batch_size, p.context_len) for p in points]
    assert len([i for i in range(1, len(groups)) if groups[i] != groups[i - 1]]) == 2 * 2 * 2 - 1


def test_wide_passes_beyond_the_models_positions_are_left_out():
    gpt2 = preset_config("gpt2")  # 1024 positions
    grid = fit_wide_passes(make_grid([1], [980], max_k=8), gpt2, gpt2)  # room for 44 more tokens
    assert grid.target_new_tokens == tuple(range(1, 10)) + (16, 32) and grid.draft_new_tokens == (1, 2, 4, 8, 16, 32)
    assert fit_wide_passes(make_grid([1], [1015], max_k=8), gpt2, gpt2).target_new_tokens == tuple(range(1, 10))


def test_tree_overhead_points():
    grid = make_grid([1, 4], [8], max_k=2)
    assert tree_overhead_points(grid, (12, 32), stage2=False) == [
        TreeOverheadPoint(1, 12, False), TreeOverheadPoint(1, 32, False), TreeOverheadPoint(4, 12, False),
        TreeOverheadPoint(4, 32, False)]
    assert len(tree_overhead_points(grid, (12, 32), stage2=True)) == 8


def test_overhead_points_are_every_batch_size_and_k():
    assert [(p.batch_size, p.k) for p in overhead_points(make_grid([1, 2], [8], max_k=1))] == \
        [(1, 0), (1, 1), (2, 0), (2, 1)]


@pytest.mark.parametrize("batch_sizes, context_lens, max_k, option", [
    ([0, 1], [8], 2, "--batch-sizes"), ([1], [-4], 2, "--context-lens"), ([], [8], 2, "--batch-sizes"),
    ([1.5], [8], 2, "--batch-sizes"), ([1], [8], 0, "--max-k"),
])
def test_bad_grid_values_name_their_option(batch_sizes, context_lens, max_k, option):
    with pytest.raises(CalibrationError, match=option):
        make_grid(batch_sizes, context_lens, max_k)


def test_context_plus_verify_pass_must_fit_the_models_positions():
    gpt2, llama = preset_config("gpt2"), preset_config("llama-68m")  # 1024 and 2048 positions
    check_grid_fits(make_grid([1], [1015], max_k=8), gpt2, llama)  # 1015 + 8 + 1 = 1024 fits
    with pytest.raises(CalibrationError, match=r"1016 \+ max_k 8 \+ 1 = 1025 positions exceeds the target's maximum"):
        check_grid_fits(make_grid([1], [1016], max_k=8), gpt2, llama)
    with pytest.raises(CalibrationError, match="draft's maximum of 1024"):
        check_grid_fits(make_grid([1], [1016], max_k=8), llama, gpt2)


def test_resumed_grid_is_the_union_and_keeps_max_k():
    merged = merge_grids(make_grid([1, 4], [64], 4), make_grid([2, 4], [128], 4))
    assert merged.batch_sizes == (1, 2, 4) and merged.context_lens == (64, 128)
    # a profile of before the wide passes gains them
    old = replace(make_grid([1], [64], 4), target_new_tokens=(1, 2, 3, 4, 5), draft_new_tokens=(1, 2))
    merged = merge_grids(old, make_grid([1], [64], 4))
    assert merged.target_new_tokens == (1, 2, 3, 4, 5, 16, 32, 64) and merged.draft_new_tokens[-1] == 64
    with pytest.raises(CalibrationError, match="--max-k 4, not 6"):
        merge_grids(make_grid([1], [64], 4), make_grid([1], [64], 6))
