"""Calibration on CUDA: synchronized timing end to end, a real out-of-memory point recorded as
infeasible without stopping the run, and trees with the second stage. Skipped where there is no GPU."""
from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from specbatch.calibrate.benchmarks import ForwardTimer, time_point
from specbatch.calibrate.grid import TimingPoint, make_grid
from specbatch.calibrate.run import CalibrationRequest, calibrate
from specbatch.calibrate.timing import RepetitionRule
from specbatch.perfmodel.profile import load_profile
from specbatch.runtime.checkpoint import build_model
from specbatch.runtime.config import ModelConfig
from specbatch.runtime.ngram import NGramModel, tokenizer_fingerprint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["def add(a, b):\n", "class Stack:\n", "import os\n", "x = [i * i for i in", "for key in items:\n"]


def _export_function():
    """The demo pair's own exporter (Hugging Face layout + byte-level tokenizer.json)."""
    spec = importlib.util.spec_from_file_location("train_demo_pair", ROOT / "data" / "train_demo_pair.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.export, module.TARGET


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
    # b = 1: target n = 1..3 and 16, 32, 64, draft n = 1, 2 and 4..64; b = 8: the chain's only
    assert len(profile.timings) == (6 + 7) + (3 + 2) and all(row.feasible for row in profile.timings)
    assert summary.points_infeasible == 0


def test_trees_and_the_second_stage_on_cuda(tmp_path):
    """A tiny real pair on CUDA: rank acceptance (greedy and the sampling Monte Carlo on the device),
    the n-gram's guesses and query cost, and tree step overheads with synchronized query timing."""
    export, demo = _export_function()
    target = replace(demo, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
                     intermediate_size=64, max_position_embeddings=160)
    draft = replace(target, hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=2, intermediate_size=32)
    export(build_model(target, seed=1), target, tmp_path / "target")
    export(build_model(draft, seed=2), draft, tmp_path / "draft")
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    sequences = np.random.default_rng(0).integers(0, target.vocab_size, size=(20, 200))
    NGramModel.fit(sequences, target.vocab_size, tokenizer_fingerprint(tmp_path / "target" / "tokenizer.json")).save(
        tmp_path / "ngram.safetensors")
    out = tmp_path / "profile.json"
    summary = calibrate(CalibrationRequest(target=str(tmp_path / "target"), draft=str(tmp_path / "draft"), out=out,
                                           device="cuda", batch_sizes=(1, 4), context_lens=(16,), max_k=2,
                                           prompts=tmp_path / "prompts.jsonl", samplings=("T=1.0",), quick=True,
                                           stage2=tmp_path / "ngram.safetensors"))
    profile = load_profile(out)
    assert all(len(e.rank_acceptance) == 2 and all(sum(r) <= 1 + 1e-9 for r in e.rank_acceptance)
               for e in profile.acceptance)
    assert len(profile.stage2.guess_accuracy) == 4 and profile.stage2.query_ms_per_context >= 0
    trees = [r for r in profile.overheads if r.tree_nodes is not None]
    assert len(trees) == summary.tree_overheads == 2 * 2 * 2 and all(r.median_ms > 0 for r in trees)


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
