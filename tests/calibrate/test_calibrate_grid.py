"""Grid construction, shape presets, model resolution and the memory check (no model is built here)."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from specbatch.calibrate.errors import CalibrationError
from specbatch.calibrate.grid import (TimingPoint, TreeOverheadPoint, check_grid_fits, fit_wide_passes, make_grid, merge_grids,
                            new_tokens_at, overhead_points, timing_points, tree_overhead_points)
from specbatch.calibrate.models import MemoryNeed, check_memory, memory_need, model_info, resolve_model
from specbatch.calibrate.presets import PRESET_NAMES, PRESETS, preset_config


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


# ---------------------------------------------------------------- presets
# Parameter counts published on the model cards (millions): an oracle independent of our formula.
PUBLISHED_PARAMETERS_M = {
    "opt-125m": 125, "opt-350m": 331, "opt-1.3b": 1316, "opt-6.7b": 6658, "llama-68m": 68, "llama-160m": 162,
    "llama-2-7b": 6738, "llama-3.2-1b": 1236, "llama-3.1-8b": 8030, "qwen2.5-0.5b": 494, "qwen2.5-7b": 7616,
    "gpt2": 124, "gpt2-large": 774,
}


def test_every_required_preset_exists_with_its_published_size():
    assert set(PUBLISHED_PARAMETERS_M) <= set(PRESET_NAMES)
    for name, millions in PUBLISHED_PARAMETERS_M.items():
        assert preset_config(name).parameter_count() / 1e6 == pytest.approx(millions, rel=0.01), name


def test_preset_shapes_that_are_easy_to_get_wrong():
    opt350 = preset_config("opt-350m")
    assert (opt350.word_embed_proj_dim, opt350.do_layer_norm_before, opt350.final_layer_norm) == (512, False, False)
    small = preset_config("llama-3.2-1b")
    assert (small.num_kv_heads, small.head_dim, small.tie_word_embeddings) == (8, 64, True)
    assert small.rope_scaling["factor"] == 32.0 and small.rope_theta == 500000.0
    assert preset_config("llama-3.1-8b").rope_scaling["factor"] == 8.0
    qwen = preset_config("qwen2.5-0.5b")
    assert (qwen.num_heads, qwen.num_kv_heads, qwen.qkv_bias, qwen.tie_word_embeddings) == (14, 2, True, True)
    assert preset_config("llama-68m").num_layers == 2


def test_unknown_preset_lists_the_valid_names():
    with pytest.raises(CalibrationError) as error:
        preset_config("llama2-7b")
    assert all(name in str(error.value) for name in PRESETS)


# ---------------------------------------------------------------- resolving --target / --draft
def test_a_preset_and_a_config_file_mean_random_weights(tmp_path):
    spec = resolve_model("opt-125m", "target")
    assert spec.random_weights and spec.source == "opt-125m"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(PRESETS["llama-68m"]))
    spec = resolve_model(str(path), "draft")
    assert spec.random_weights and spec.config == preset_config("llama-68m")


def test_a_config_without_needed_fields_names_them(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "vocab_size": 100, "hidden_size": 64}))
    with pytest.raises(CalibrationError, match="--target: .*missing field.*num_hidden_layers, num_attention_heads"):
        resolve_model(str(path), "target")


def test_a_directory_needs_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["llama-68m"]))
    with pytest.raises(CalibrationError, match="no weights.*--acceptance"):
        resolve_model(str(tmp_path), "draft")
    (tmp_path / "model.safetensors").write_bytes(b"")  # existence is what resolve checks; loading comes later
    assert not resolve_model(str(tmp_path), "draft").random_weights


def test_a_missing_path_that_is_no_preset_says_both():
    with pytest.raises(CalibrationError, match="--draft 'nowhere/model': no such model directory.*presets: opt-125m"):
        resolve_model("nowhere/model", "draft")


# ---------------------------------------------------------------- memory
def test_memory_need_adds_weights_both_caches_and_logits():
    target = model_info(resolve_model("llama-2-7b", "target"), torch.bfloat16)
    draft = model_info(resolve_model("llama-68m", "draft"), torch.bfloat16)
    assert target.kv_bytes_per_token == 2 * 32 * 32 * 128 * 2  # K and V, 32 layers, 32 heads of 128, 2 bytes
    need = memory_need(target, draft, make_grid([1, 16], [256, 1024], max_k=7))
    cache_len = 1024 + 7 + 1
    assert need.kv_cache_bytes == (target.kv_bytes_per_token + draft.kv_bytes_per_token) * 16 * cache_len
    assert need.weight_bytes == 2 * (target.parameters + draft.parameters)
    assert need.logits_bytes == 16 * 8 * 32000 * 4  # the widest pass at b = 1 (64 tokens) is smaller
    assert need.total_bytes == need.weight_bytes + need.kv_cache_bytes + need.logits_bytes
    # tree steps verify N + 1 tokens per row at every batch size
    assert memory_need(target, draft, make_grid([1, 16], [256, 1024], max_k=7), tree_nodes=32).logits_bytes == \
        16 * 33 * 32000 * 4


def test_memory_check_refuses_with_the_numbers():
    need = MemoryNeed(weight_bytes=14 * 2**30, kv_cache_bytes=64 * 2**30, logits_bytes=0, batch_size=64,
                      context_len=2048)
    check_memory(need, available_bytes=80 * 2**30, device="cuda")
    with pytest.raises(CalibrationError, match=r"weights 14.00 GiB \+ KV cache 64.00 GiB \(batch 64, context 2048\)"
                                               r".* = 78.00 GiB > 70.00 GiB available"):
        check_memory(need, available_bytes=70 * 2**30, device="cuda")
