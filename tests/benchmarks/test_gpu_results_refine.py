"""benchmarks/gpu_results.py's refinement protocol on a constructed profile: the base grid, the passes calibrate's
refinement chooses, and every other row predicted with the chosen ones no longer held out."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np

from specbatch.perfmodel import latency as lat
from specbatch.perfmodel.profile import profile_from_json
from perfmodel_fixtures import build_profile, roofline_latency

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_results_refine", ROOT / "benchmarks" / "gpu_results.py")
gpu_results = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = gpu_results  # its dataclasses look their module up by name
_spec.loader.exec_module(gpu_results)

SMOOTH = roofline_latency()
STEP_AFTER = 200  # a GEMM step between the base grid's 32 x 6 and 32 x 7 tokens


def stepped(role: str, b: int, n: int, L: int) -> float:
    return SMOOTH(role, b, n, L) + (2.0 * (b * n > STEP_AFTER) if role == "target" else 0.0)


def test_the_refined_passes_are_fitted_not_held_out():
    profile = profile_from_json(build_profile(stepped, batch_sizes=tuple(range(1, 41)), context_lens=(256, 1024),
                                              max_k=8, noise=0.003, seed=5, acceptance=[0.8] * 8))
    run = gpu_results.refined(profile, budget=4)
    assert 0 < len(run.added) <= 4 and run.unavailable == 0
    # inside the base grid's batch sizes, none of them in it, every token pass inside the gap around the step
    assert all(1 < b < 32 and b not in gpu_results.TRAIN_BATCH_SIZES for b, _, _ in run.added)
    tokens = [b * n for b, n, _ in run.added if n > 1]
    assert tokens and all(192 < t < 224 for t in tokens)
    rows = {row.role: row for row in run.rows}
    per_role = {"target": 9 * 2, "draft": 2 * 2}  # rows per batch size: widths x contexts
    for role, row in rows.items():
        added = len(run.added) if role == "target" else 0
        assert row.test_points == (40 - len(gpu_results.TRAIN_BATCH_SIZES)) * per_role[role] - added
        assert row.label == "every b not fitted nor refined"
        assert np.isfinite(row.chosen).all()


def test_where_the_refinement_measured_and_its_table():
    added = ((22, 8, 256), (30, 8, 256), (12, 1, 256), (12, 1, 2048), (3, 1, 256))
    assert gpu_results.where_refined(added) == "b n = 176 (22 x 8, L = 256), 240 (30 x 8, L = 256); b = 3, 12 at n = 1"
    assert gpu_results.where_refined(()) == "none"

    def row(role: str, label: str, mape: float, worst: float, tested: int):
        point = lat.PointError(1, 1, 1, 1.0, 1.0 + worst / 100, worst)
        report = lat.HoldoutReport((), (), 0, tested, lat.STAIRCASE, mape, worst, {lat.STAIRCASE: mape}, (point,))
        return gpu_results.HeldOut(label, role, report)

    plain = [row("target", gpu_results.EVERY_OTHER_B, 1.94, 8.61, 100), row("draft", gpu_results.EVERY_OTHER_B,
                                                                           2.0, 10.04, 50)]
    run = gpu_results.Refined(gpu_results.DEFAULT_BUDGET, added, 1, (row("target", "x", 1.7, 7.94, 95),
                                                                      row("draft", "x", 1.8, 6.0, 50)))
    lines = gpu_results.refined_table(plain, [run]).splitlines()
    assert lines[2] == "| none (the base grid) | 0 | - | 1.9 / 8.6 | 2.0 / 10.0 | 150 |"
    assert lines[3] == (f"| {gpu_results.DEFAULT_BUDGET} (calibrate's) | 5 (1 more not in the data) | "
                        "b n = 176 (22 x 8, L = 256), 240 (30 x 8, L = 256); b = 3, 12 at n = 1 | 1.7 / 7.9 | "
                        "1.8 / 6.0 | 145 |")
