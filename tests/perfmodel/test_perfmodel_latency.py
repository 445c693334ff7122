"""The latency fitter: parameter recovery, monotonicity, held-out error on realistic synthetic data."""
from __future__ import annotations

import numpy as np
import pytest

from specbatch.perfmodel import latency as lat
from specbatch.perfmodel.errors import PerfModelError
from specbatch.perfmodel.profile import profile_from_json
from perfmodel_fixtures import (CPU_MODELS, GPU_MODELS, GPU_PARAMS, build_profile, cpu_like_latency,
                                gpu_like_latency, roofline_latency, shape_of)

CPU_GRID = dict(models=CPU_MODELS, batch_sizes=(1, 2, 4, 8, 16, 32), context_lens=(64, 256, 768), max_k=8,
                device_kind="cpu")


def points_of(profile: dict, role: str) -> tuple[lat.RoleShape, lat.Points]:
    parsed = profile_from_json(profile)
    return lat.RoleShape.from_model_info(parsed.model(role)), lat.Points.from_rows(parsed.timings_of(role))


# The target's true parameters: the overhead is large enough relative to a 3.5 ms weight read for 3%
# noise to leave it identifiable, and the grid spans both sides of the ridge (~140 tokens per pass).
TRUE = lat.RooflineParams(overhead_ms=1.0, bandwidth_GBps=3800.0, flops_TFLOPs=520.0, overlap_exponent=4.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fitter_recovers_roofline_parameters_from_noisy_rows(seed):
    params = {"target": TRUE, "draft": GPU_PARAMS["draft"]}
    shape, points = points_of(build_profile(roofline_latency(GPU_MODELS, params), noise=0.03, seed=seed), "target")
    fit = lat.fit_roofline(shape, points)
    assert fit.overhead_ms == pytest.approx(TRUE.overhead_ms, rel=0.10)
    assert fit.bandwidth_GBps == pytest.approx(TRUE.bandwidth_GBps, rel=0.10)
    assert fit.flops_TFLOPs == pytest.approx(TRUE.flops_TFLOPs, rel=0.10)
    assert fit.ridge_tokens(shape) == pytest.approx(TRUE.ridge_tokens(shape), rel=0.10)
    # the overlap exponent is a shape parameter pinned only by the points near the ridge
    assert fit.overlap_exponent == pytest.approx(TRUE.overlap_exponent, rel=0.25)


def test_ridge_point_is_where_memory_and_compute_times_meet():
    shape = shape_of(GPU_MODELS["target"])
    ridge = TRUE.ridge_tokens(shape)
    # at L = 0 with n = 1 the KV and attention terms are negligible next to the weights
    memory = TRUE.memory_ms(shape, ridge, 1, 0) - shape.kv_bytes_per_token * ridge / (TRUE.bandwidth_GBps * 1e6)
    compute = 2.0 * shape.parameters * ridge / (TRUE.flops_TFLOPs * 1e12) * 1e3
    assert memory == pytest.approx(compute, rel=1e-9)
    assert ridge == pytest.approx(shape.weight_bytes * 520e12 / (2 * shape.parameters * 3800e9))


def test_smooth_max_limits():
    assert lat.smooth_max(3.0, 4.0, 1.0) == pytest.approx(7.0)
    assert lat.smooth_max(3.0, 4.0, 2.0) == pytest.approx(5.0)
    assert lat.smooth_max(3.0, 4.0, 60.0) == pytest.approx(4.0, rel=1e-3)


@pytest.mark.parametrize("name,latency,grid", [
    ("cpu", cpu_like_latency, CPU_GRID),
    ("gpu", gpu_like_latency, dict(models=GPU_MODELS)),
])
def test_held_out_error_within_five_percent_on_realistic_data(name, latency, grid):
    """Whole batch sizes and context lengths left out; data NOT of the roofline's form (steps, a
    per-row cost, attention at its own efficiency) plus 3% noise."""
    profile = build_profile(latency, noise=0.03, seed=7, **grid)
    for role in ("target", "draft"):
        shape, points = points_of(profile, role)
        report = lat.evaluate_holdout(shape, points, role)
        assert report.held_out_batch_sizes and report.test_points > 0
        assert report.mape_pct <= 5.0, (name, role, report)


def test_held_out_report_scores_any_split_and_the_model_fit_would_use():
    """Oracle: noiseless roofline data, so every kind fitted on the small batch sizes predicts the large ones
    almost exactly; a model `adapt`ed to run 1.5x slow is then off by 50 % on every held-out row."""
    shape, points = points_of(build_profile(roofline_latency(), noise=0.0, seed=4), "target")
    train = np.isin(points.batch_size, (1, 2, 4, 8))
    report = lat.held_out_report(shape, points.subset(train), points.subset(~train), (lat.ROOFLINE, lat.MONOTONE))
    assert report.kind in (lat.ROOFLINE, lat.MONOTONE) and report.test_points == int((~train).sum())
    assert set(report.mape_pct_by_kind) == {lat.ROOFLINE, lat.MONOTONE} and report.mape_pct < 1.0
    assert min(point.batch_size for point in report.worst) > 8  # the worst points are held-out rows

    class Slow:
        def __init__(self, model):
            self.model = model

        def latency_ms(self, b, n, L):
            return 1.5 * self.model.latency_ms(b, n, L)

    slow = lat.held_out_report(shape, points.subset(train), points.subset(~train), (lat.ROOFLINE,), adapt=Slow)
    assert slow.mape_pct == pytest.approx(50.0 + 1.5 * report.mape_pct_by_kind[lat.ROOFLINE], abs=1.5)


def test_cpu_steps_need_the_monotone_model():
    """On CPU-like data the roofline alone misses; cross-validation must pick the monotone kind."""
    shape, points = points_of(build_profile(cpu_like_latency, noise=0.03, seed=3, **CPU_GRID), "target")
    cv = lat.cross_validate(shape, points)
    assert cv[lat.MONOTONE] < 0.6 * cv[lat.ROOFLINE]
    assert lat.select_kind(cv) == lat.MONOTONE


def test_roofline_data_keeps_the_roofline():
    shape, points = points_of(build_profile(roofline_latency(), noise=0.03, seed=4), "target")
    assert lat.select_kind(lat.cross_validate(shape, points)) == lat.ROOFLINE


def test_monotone_model_is_monotone_in_b_n_and_L_even_beyond_the_grid():
    shape, points = points_of(build_profile(cpu_like_latency, noise=0.05, seed=5, **CPU_GRID), "target")
    model = lat.fit_latency_model(shape, points, lat.MONOTONE)
    b, n, L = np.meshgrid(np.arange(1, 97), np.arange(1, 13), np.array([0, 64, 300, 768, 2000]), indexing="ij")
    t = model.latency_ms(b.astype(float), n.astype(float), L.astype(float))  # (b, n, L)
    assert np.all(np.diff(t, axis=0) >= -1e-9)
    assert np.all(np.diff(t, axis=1) >= -1e-9)
    assert np.all(np.diff(t, axis=2) >= -1e-9)
    assert np.all(np.asarray(model.correction.coefficients) >= 0)


def test_holdout_leaves_out_every_other_interior_value():
    assert lat.every_other_interior([1, 2, 4, 8, 16, 32]) == (2, 8)
    assert lat.every_other_interior([64, 256, 768]) == (256,)
    assert lat.every_other_interior([128, 512]) == ()


def test_too_few_points_says_how_many_are_needed():
    shape, points = points_of(build_profile(roofline_latency(), batch_sizes=(1, 2), context_lens=(128,)), "draft")
    assert len(points) == 4
    with pytest.raises(PerfModelError, match="needs at least 8 feasible timing rows, found 4"):
        lat.fit_roofline(shape, points)


def test_infeasible_rows_are_not_fitted():
    profile = build_profile(roofline_latency(), infeasible=lambda role, b, n, L: b == 64 and L == 2048)
    parsed = profile_from_json(profile)
    rows = parsed.timings_of("target", feasible_only=False)
    assert len(lat.Points.from_rows(rows)) == len(rows) - 7  # n = 1..7 at (64, 2048)
