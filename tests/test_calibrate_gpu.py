"""Calibration on CUDA: synchronized timing end to end, and a real out-of-memory point recorded as
infeasible without stopping the run. Skipped where there is no GPU."""
from __future__ import annotations

import json

import pytest
import torch

from calibrate.benchmarks import ForwardTimer, time_point
from calibrate.grid import TimingPoint, make_grid
from calibrate.run import CalibrationRequest, calibrate
from calibrate.timing import RepetitionRule
from perfmodel.profile import load_profile
from runtime.checkpoint import build_model
from runtime.config import ModelConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

TINY = dict(model_type="llama", vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512)


def test_calibrate_a_tiny_shape_on_cuda(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    out = tmp_path / "profile.json"
    summary = calibrate(CalibrationRequest(target=str(config), draft=str(config), out=out, device="cuda",
                                           dtype="bfloat16", batch_sizes=(1, 8), context_lens=(64,), max_k=2,
                                           acceptance="0.8", quick=True))
    profile = load_profile(out)
    assert profile.device.kind == "cuda" and profile.device.dtype == "bfloat16"
    assert profile.device.memory_bytes == torch.cuda.get_device_properties(0).total_memory
    assert len(profile.timings) == 2 * (3 + 2) and all(row.feasible for row in profile.timings)
    assert summary.points_infeasible == 0


def test_an_out_of_memory_point_is_infeasible_and_the_next_one_runs():
    config = ModelConfig(model_type="llama", vocab_size=512, hidden_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=2048)
    model = build_model(config, "cuda", torch.bfloat16)
    grid = make_grid([1], [1024], max_k=1)
    timer = ForwardTimer({"target": model, "draft": model}, grid, "cuda", RepetitionRule(min_reps=3, budget_s=0.05))
    free_bytes, _ = torch.cuda.mem_get_info()
    kv_bytes_per_row = config.kv_bytes_per_token(2) * (1024 + 2)
    too_many_rows = 2 * free_bytes // kv_bytes_per_row  # a KV cache twice the free memory
    row = time_point(timer, TimingPoint("target", int(too_many_rows), 1, 1024))
    assert not row.feasible and row.median_ms is None and row.reps == 0
    row = time_point(timer, TimingPoint("target", 4, 1, 1024))
    assert row.feasible and row.median_ms > 0
