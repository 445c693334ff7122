"""Memory planning (calibrate.memory) on constructed shapes: the arithmetic for the reference pairs, the
lockstep groups that make in-situ timing fit an H200, and the points a run says it will skip.

Oracles: KV bytes per token from the published shapes (2 x layers x kv_heads x head_dim x 2 bytes in
bfloat16), the runtime's own buffer length (longest prompt + new tokens + k + 1), and the figures of the
first GPU review: the lockstep groups of the old reference script (llama-2-7b + llama-68m, k = 0..8, contexts
up to 1792) need about 142 / 271 / 530 GiB at b = 16 / 32 / 64, where the old check counted about 70."""
from __future__ import annotations

import json

import pytest
import torch

from specbatch.calibrate.errors import CalibrationError
from specbatch.calibrate.grid import TimingPoint, make_grid, overhead_points, timing_points
from specbatch.calibrate.insitu import insitu_points
from specbatch.calibrate.memory import (GIB, HEADROOM, MemoryBudget, generation_bytes, kv_bytes, lockstep_bytes,
                                        lockstep_split, memory_budget, plan_memory, reference_bytes)
from specbatch.calibrate.models import model_info
from specbatch.calibrate.run import CalibrationRequest, calibrate
from specbatch.perfmodel.profile import load_profile
from specbatch.runtime.loading import resolve_model

H200_FREE_BYTES = 139 * GIB  # an H200 ("141 GB": 143771 MiB) less a CUDA context: what mem_get_info reports free


def infos(target: str, draft: str):
    return (model_info(resolve_model(target, "target"), torch.bfloat16),
            model_info(resolve_model(draft, "draft"), torch.bfloat16))


def test_the_old_reference_groups_need_what_the_review_computed():
    target, draft = infos("llama-2-7b", "llama-68m")
    assert target.kv_bytes_per_token == 2 * 32 * 32 * 128 * 2 and draft.kv_bytes_per_token == 2 * 2 * 12 * 64 * 2
    weights = target.weight_bytes + draft.weight_bytes
    # what the old check counted: both caches at b = 64 and the largest context, once
    counted = weights + (target.kv_bytes_per_token + draft.kv_bytes_per_token) * 64 * (1792 + 9)
    assert counted / GIB == pytest.approx(70, rel=0.02)
    # what in situ ran: k = 0..8 in lockstep, each generation its own caches; prompts up to 1792 - 32 tokens
    longest_prompt, new_tokens = min(2048 - 8 - 2, 1792) - 32, 32
    for rows, review_gib in ((16, 142), (32, 271), (64, 530)):
        caches = sum(generation_bytes(target, draft, rows, k, longest_prompt, new_tokens) for k in range(9))
        by_hand = sum(rows * (longest_prompt + new_tokens + k + 1) * (target.kv_bytes_per_token + 8
                                                                      + (draft.kv_bytes_per_token if k else 0))
                      for k in range(9))
        assert caches == by_hand
        assert (weights + caches) / GIB == pytest.approx(review_gib, rel=0.02)


def test_the_old_reference_grid_now_fits_an_h200_in_smaller_lockstep_groups():
    """With a fused attention kernel (flash, memory-efficient or cuDNN: llama-2-7b has as many KV heads as
    heads, so a masked pass may use the memory-efficient one); with the math kernel the prefill of 64 rows
    of 1760 tokens alone materializes 51 GB of scores, and those points are skipped, not run out of memory."""
    target, draft = infos("llama-2-7b", "llama-68m")
    budget = memory_budget(target, draft, H200_FREE_BYTES, "cuda")
    assert lockstep_split(target, draft, 64, range(9), 1760, 32, True, budget) == ([], list(range(9)))
    for scores_materialized, sizes in ((False, (16, 32, 64)), (True, (16, 32))):
        for rows in sizes:
            groups, alone = lockstep_split(target, draft, rows, range(9), 1760, 32, scores_materialized, budget)
            assert alone == [] and [k for group in groups for k in group] == list(range(9))
            assert all(budget.fits(lockstep_bytes(target, draft, rows, g, 1760, 32, scores_materialized))
                       for g in groups)
            assert len(groups) > 1  # all nine at once never fit: 140 GiB and more
            for first, second in zip(groups, groups[1:]):  # each group is as large as fits
                assert not budget.fits(lockstep_bytes(target, draft, rows, first + second[:1], 1760, 32,
                                                      scores_materialized))


def test_the_device_scripts_calibration_fits_an_h200_without_skipping_a_point():
    """llama-3.1-8b + llama-3.2-1b, bfloat16, --batch-sizes 1,4,16,64 --context-lens 512,2048 --max-k 6 --quick."""
    target, draft = infos("llama-3.1-8b", "llama-3.2-1b")
    assert target.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 and draft.kv_bytes_per_token == 2 * 16 * 8 * 64 * 2
    grid = make_grid((1, 4, 16, 64), (512, 2048), 6)
    insitu = insitu_points(grid, (0, 2, 3, 4, 5, 6), every_other_batch_size=True, sweeps=2)
    assert sorted({p.batch_size for p in insitu}) == [1, 16, 64]
    longest_prompt = 2048 - 24  # the grid's largest context less the 24 new tokens of --quick
    for scores_materialized in (False, True):  # whichever attention kernel torch picks on the device
        references = sum(reference_bytes(target, b, 512, scores_materialized) for b in (1, 64))  # kept all run
        budget = memory_budget(target, draft, H200_FREE_BYTES, "cuda").reserve(references)
        plan = plan_memory(target, draft, grid, budget, scores_materialized, timing_points(grid),
                           overhead_points(grid), [], insitu, overhead_steps=2, tree_steps=2,
                           insitu_prompt_tokens=longest_prompt, insitu_new_tokens=24)
        assert plan.skipped == frozenset()
        assert plan.lockstep_ks[1] == [[0, 2, 3, 4, 5, 6]]  # small batches keep every k in one lockstep group
        assert len(plan.lockstep_ks[64]) > 1
        biggest = max(lockstep_bytes(target, draft, b, g, longest_prompt, 24, scores_materialized)
                      for b, groups in plan.lockstep_ks.items() for g in groups)
        assert budget.weight_bytes + references + biggest <= HEADROOM * H200_FREE_BYTES
        assert any(f"in situ at b=64 the ks run in {len(plan.lockstep_ks[64])} lockstep groups" in note
                   for note in plan.notes)


def test_points_that_cannot_fit_are_named_and_a_grid_with_no_pass_that_fits_is_refused():
    target, draft = infos("llama-3.1-8b", "llama-3.2-1b")
    grid = make_grid((1, 64), (2048,), 2)
    small = MemoryBudget("cuda", int((target.weight_bytes + draft.weight_bytes + 2 * GIB) / HEADROOM), 0)
    small = MemoryBudget("cuda", small.available_bytes, target.weight_bytes + draft.weight_bytes)
    assert small.room_bytes == pytest.approx(2 * GIB, abs=16)
    plan = plan_memory(target, draft, grid, small, False, timing_points(grid), overhead_points(grid), [],
                       insitu_points(grid, (0, 2), False), overhead_steps=2, tree_steps=2, insitu_prompt_tokens=2024,
                       insitu_new_tokens=24)
    skipped_passes = {p for p in plan.skipped if isinstance(p, TimingPoint)}
    # a b = 64 target cache of 2048 + 3 tokens is 64 x 2051 x 128 KiB = 16 GiB: none of them fits; b = 1 does
    assert skipped_passes == {p for p in timing_points(grid) if p.batch_size == 64 and p.model == "target"} | \
        {p for p in timing_points(grid) if p.batch_size == 64 and p.model == "draft"
         and kv_bytes(draft, 64, 2050) > 2 * GIB}
    assert {p.batch_size for p in plan.skipped} == {64}
    assert any(note.startswith("memory: skipping") and "isolated passes that cannot fit" in note
               and "GiB are free on cuda" in note for note in plan.notes)
    assert plan.lockstep_ks == {1: [[0, 2]]}
    only_large = make_grid((64,), (2048,), 2)
    with pytest.raises(CalibrationError, match="no target pass of the grid fits on cuda"):
        plan_memory(target, draft, only_large, small, False, timing_points(only_large), [], [], [], 2, 2, 2024, 24)
    with pytest.raises(CalibrationError, match="the weights need .* GiB at 2 bytes a parameter, and 1.0 GiB are free "
                                               "on cuda"):
        memory_budget(target, draft, GIB, "cuda")


def test_a_point_that_does_not_fit_alone_is_skipped_and_the_rest_keep_their_order():
    target, draft = infos("llama-2-7b", "llama-68m")
    one = lockstep_bytes(target, draft, 16, [0], 1760, 32, False)
    budget = MemoryBudget("cuda", int((target.weight_bytes + draft.weight_bytes + 2.5 * one) / HEADROOM) + 1,
                          target.weight_bytes + draft.weight_bytes)
    groups, alone = lockstep_split(target, draft, 16, [0, 1, 2, 3], 1760, 32, False, budget)
    assert groups == [[0, 1], [2, 3]] and alone == []
    tight = MemoryBudget("cuda", int((budget.weight_bytes + 0.5 * one) / HEADROOM), budget.weight_bytes)
    assert lockstep_split(target, draft, 16, [0, 1], 1760, 32, False, tight) == ([], [0, 1])


def test_calibrate_says_before_measuring_which_points_it_skips_and_measures_the_rest(tmp_path):
    """A batch size no machine has the memory for: its points are named before the first one is measured,
    left out of the profile, and the others are measured."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(dict(model_type="llama", vocab_size=64, hidden_size=32, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                      max_position_embeddings=128)))
    said, events = [], []
    huge = 10 ** 8  # 10^8 rows x 18 tokens x 256 bytes of KV cache: 430 GiB
    summary = calibrate(CalibrationRequest(target=str(config), draft=str(config), out=tmp_path / "p.json",
                                           device="cpu", batch_sizes=(1, huge), context_lens=(16,), max_k=2,
                                           acceptance="0.8", quick=True),
                        on_progress=lambda event: events.append(event.done), on_notice=lambda line: said.append(
                            (len(events), line)))
    assert said and all(at == 0 for at, _ in said)  # every line before the first point
    assert any(f"target b={huge} n=1 L=16" in line for _, line in said)
    profile = load_profile(tmp_path / "p.json")
    assert {row.batch_size for row in profile.timings} == {1}
    assert {row.batch_size for row in profile.overheads} == {1} and {r.batch_size for r in profile.insitu_steps} == {1}
    # b = 10^8: 5 passes (target n = 1..3, draft n = 1, 2), 3 overheads (k = 0..2), 2 ks x 2 sweeps in situ
    assert summary.points_skipped == 5 + 3 + 4 and summary.points_left == 0


def test_graph_logits_buffers_of_a_server_by_hand():
    """The issue's figure: the 8B's serving buckets to 256 at n = 1..9, a logits buffer each in bfloat16:
    (1 + 2 + 4 + 8 + 16 + 24 + 32 + 48 + 64 + 96 + 128 + 160 + 192 + 224 + 256) = 1255 rows x 45 positions x
    128,256 x 2 bytes = 13.49 GiB. The draft keeps one position a row: widths 1 and 2 are 2 positions."""
    from specbatch.calibrate.memory import ladder, logits_buffer_bytes

    target, draft = infos("llama-3.1-8b", "llama-3.2-1b")
    buckets = ladder(256)
    assert sum(buckets) == 1255 and target.vocab_size == 128256
    logits = logits_buffer_bytes(target.vocab_size, 2, buckets, range(1, 10), last_only=False)
    assert logits == 1255 * 45 * 128256 * 2 and logits / GIB == pytest.approx(13.49, abs=0.01)
    assert logits_buffer_bytes(draft.vocab_size, 2, buckets, [1, 2], last_only=True) == 1255 * 2 * 128256 * 2


def test_graphs_are_counted_once_per_lockstep_group_and_the_caches_get_the_buckets_rows():
    """At b = 5 (bucket 8) with ks 0 and 3: the caches of 8 rows, the peak pass of 5, and the graphs both
    generations share: the target's pool (its widest pass at the bucket: 8 x 4 tokens) and logits buffers
    for buckets 1, 2, 4, 8 at widths 1 and 4 (5 positions), the draft's pool (8 x 2, last position) and its
    buffers at widths 1 and 2 (a position each)."""
    from specbatch.calibrate.memory import generation_peak_pass_bytes, pass_bytes

    target, draft = infos("llama-3.2-1b", "llama-68m")
    prompt, new = 16, 8
    key_len = prompt + new + 3 + 1
    eager = lockstep_bytes(target, draft, 5, [0, 3], prompt, new, False)
    graphed = lockstep_bytes(target, draft, 5, [0, 3], prompt, new, False, graphs=True)
    caches = (generation_bytes(target, draft, 8, 0, prompt, new, 128)
              + generation_bytes(target, draft, 8, 3, prompt, new, 128))
    # by hand: 8 rows x 128 slots (28 positions rounded up) of each model's cache, the token buffers unrounded
    assert caches == 2 * kv_bytes(target, 8, 128) + kv_bytes(draft, 8, 128) + 8 * (25 + 28) * 8
    peak = max(generation_peak_pass_bytes(target, draft, 5, k, prompt, new, False) for k in (0, 3))
    pools = (pass_bytes(target, 8, 4, key_len, 8 * 4, False) + pass_bytes(draft, 8, 2, key_len, 8, False))
    buffers = (15 * 5 * target.vocab_size * 2) + (15 * 2 * draft.vocab_size * 2)
    assert graphed == caches + peak + pools + buffers
    assert eager == generation_bytes(target, draft, 5, 0, prompt, new) + generation_bytes(target, draft, 5, 3, prompt,
                                                                                          new) + peak
    three = lockstep_bytes(target, draft, 5, [0, 3, 3], prompt, new, False, graphs=True)
    assert three - graphed == generation_bytes(target, draft, 8, 3, prompt, new, 128)  # a third generation's caches
