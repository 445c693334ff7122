"""The staircase kind: kernel steps found where the data have them, at the right place, and nowhere else; past
the grid, the steps its learnt tile and wave width put there."""
from __future__ import annotations

import numpy as np
import pytest

from specbatch.perfmodel import latency as lat
from specbatch.perfmodel.model import model_from_json, model_to_json
from specbatch.perfmodel.fit import fit_profile
from specbatch.perfmodel.profile import profile_from_json
from specbatch.perfmodel.staircase import ROWS_CONTEXT, TOKENS
from perfmodel_fixtures import GPU_MODELS, GPU_PARAMS, build_profile, shape_of

SHAPE = shape_of(GPU_MODELS["target"])
ROOF = GPU_PARAMS["target"]
# Known steps: +0.6 ms just past 64 tokens, +1.5 ms past 128 (GEMM tiles), and an attention wave past b = 6
# of 0.4 ms per 1000 cached tokens.
TOKEN_STEPS = {64: 0.6, 128: 1.5}
WAVE_AFTER, WAVE_MS_PER_1000 = 6, 0.4


def stepped_ms(b, n, L):
    b, n, L = (np.asarray(v, dtype=float) for v in (b, n, L))
    value = ROOF.latency_ms(SHAPE, b, n, L)
    for after, height in TOKEN_STEPS.items():
        value = value + height * (b * n > after)
    return value + WAVE_MS_PER_1000 * (L + n) / 1000 * (b > WAVE_AFTER)


def points(latency, batch_sizes, noise: float, seed: int, contexts=(256, 1024), widths=range(1, 10)) -> lat.Points:
    b, n, L = (g.reshape(-1).astype(float) for g in np.meshgrid(batch_sizes, list(widths), contexts, indexing="ij"))
    rng = np.random.default_rng(seed)
    return lat.Points(b, n, L, latency(b, n, L) * np.exp(noise * rng.standard_normal(len(b))))


def smooth_ms(b, n, L):
    return ROOF.latency_ms(SHAPE, np.asarray(b, float), np.asarray(n, float), np.asarray(L, float))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dense_grid_finds_every_known_step_at_its_place(seed):
    model = lat.fit_latency_model(SHAPE, points(stepped_ms, range(1, 41), 0.01, seed), lat.STAIRCASE)
    steps = model.staircase.steps
    big = {(s.axis, s.after): s.coefficient for s in steps if s.sharp and s.coefficient > 0.2}
    # the data fix each step's place to one token (one row): right after the last value below it
    assert set(big) == {(TOKENS, 64.0), (TOKENS, 128.0), (ROWS_CONTEXT, 6.0)}
    assert big[(TOKENS, 64.0)] == pytest.approx(0.6, rel=0.25)
    assert big[(TOKENS, 128.0)] == pytest.approx(1.5, rel=0.2)
    assert big[(ROWS_CONTEXT, 6.0)] == pytest.approx(WAVE_MS_PER_1000, rel=0.25)
    # nothing it adds beside them matters: every other step is below the noise's size
    level = float(np.median(stepped_ms(8, 4, 256)))
    assert all(abs(s.coefficient) < 0.03 * level for s in steps if (s.axis, s.after) not in big)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_a_smooth_roofline_has_no_steps(seed):
    data = points(smooth_ms, range(1, 41), 0.01, seed)
    model = lat.fit_latency_model(SHAPE, data, lat.STAIRCASE)
    assert model.staircase.steps == ()
    assert lat.select_kind(lat.cross_validate(SHAPE, data)) == lat.ROOFLINE


def test_cross_validation_prefers_the_staircase_where_steps_are_measured():
    data = points(stepped_ms, range(1, 41), 0.01, 5)
    cv = lat.cross_validate(SHAPE, data)
    assert cv[lat.STAIRCASE] < 0.5 * min(cv[lat.ROOFLINE], cv[lat.MONOTONE])
    assert lat.select_kind(cv) == lat.STAIRCASE


def test_dense_steps_are_kept_not_smoothed():
    """Every measured point on both sides of a step is predicted to within the noise: the step is not
    spread over its neighbours as a ramp would."""
    data = points(stepped_ms, range(1, 41), 0.005, 6)
    model = lat.fit_latency_model(SHAPE, data, lat.STAIRCASE)
    tokens = data.batch_size * data.new_tokens
    near = (np.abs(tokens - 64) <= 8) | (np.abs(tokens - 128) <= 8)
    predicted = model.latency_ms(data.batch_size[near], data.new_tokens[near], data.context_len[near])
    truth = stepped_ms(data.batch_size[near], data.new_tokens[near], data.context_len[near])
    assert np.max(np.abs(predicted / truth - 1)) < 0.02


def test_a_sparse_grid_interpolates_and_says_so():
    """Powers of two up to 32: n = 1..9 resolve the token steps at small counts, but b = 8 -> 16 leaves the
    wave step's place unknown: a ramp, and a pass inside it is reported as interpolated."""
    data = points(stepped_ms, (1, 2, 4, 8, 16, 32), 0.005, 7)
    staircase = lat.fit_latency_model(SHAPE, data, lat.STAIRCASE).staircase
    wave = [s for s in staircase.steps if s.axis == ROWS_CONTEXT and s.coefficient > 0.2]
    assert [(s.after, s.until, s.sharp) for s in wave] == [(4.0, 8.0, False)]
    assert staircase.interpolating_gap(tokens=6, rows=6) == wave[0]
    assert staircase.interpolating_gap(tokens=8, rows=8) is None  # measured


def test_a_learnt_tile_places_a_step_in_a_sparse_gap_at_the_tile():
    """Steps past 64, 128 and 192 tokens: the counts near 64 and 128 are dense enough to place those two
    (a 64-token tile); the one past 192 only b = 32 brackets (160, 192, 224 tokens), and the tile places it
    right after 192 instead of ramping over 192-224."""
    steps = {64: 1.2, 128: 0.6, 192: 2.0}

    def latency(b, n, L):
        return smooth_ms(b, n, L) + sum(h * (b * n > a) for a, h in steps.items())

    data = points(latency, (1, 2, 4, 8, 16, 32), 0.005, 8, widths=range(1, 10))
    staircase = lat.fit_latency_model(SHAPE, data, lat.STAIRCASE).staircase
    assert staircase.tile_tokens() == 64
    past_192 = [s for s in staircase.steps if s.axis == TOKENS and s.after == 192.0]
    assert len(past_192) == 1 and past_192[0].sharp and past_192[0].until == 224.0
    assert past_192[0].coefficient == pytest.approx(2.0, rel=0.2)
    assert staircase.interpolating_gap(tokens=200, rows=25) is None


def test_the_model_file_keeps_the_staircase():
    profile = profile_from_json(build_profile(lambda role, b, n, L: float(stepped_ms(b, n, L)) * (
        1.0 if role == "target" else 0.1), batch_sizes=tuple(range(1, 25)), context_lens=(256, 1024), max_k=8,
        noise=0.01, seed=9))
    fitted = fit_profile(profile)
    assert fitted.roles["target"].kind == lat.STAIRCASE
    written = model_to_json(fitted)
    again = model_from_json(written, "model.json")
    b, n, L = np.meshgrid(np.arange(1, 40), np.arange(1, 10), [256.0, 700.0], indexing="ij")
    for role in ("target", "draft"):
        assert np.allclose(again.roles[role].model.latency_ms(b, n, L), fitted.roles[role].model.latency_ms(b, n, L),
                           rtol=1e-6)
    assert written["roles"]["target"]["staircase"]["row_cost_from"] == 6  # the smallest b >= 24 / 4
    # a file written before the continuation knew its quantization still loads: the roofline continues its rows
    for key in ("wave_rows", "row_cost_from"):
        del written["roles"]["target"]["staircase"][key]
    older = model_from_json(written, "model.json").roles["target"].model
    assert older.staircase.row_cost_from is None
    assert older.latency_ms(40.0, 1.0, 256.0) == pytest.approx(
        float(older.fitted_ms(24.0, 40 / 24, 256.0) + older.roofline.latency_ms(older.shape, 40.0, 1.0, 256.0)
              - older.roofline.latency_ms(older.shape, 24.0, 40 / 24, 256.0)))


def _old_rule_ms(model: lat.LatencyModel, b, n, L):
    """How the staircase was continued before it knew its quantization: the time at the box's edge (the point
    clipped to it) plus what the smooth roofline adds."""
    edge = model.box.clip(b, n, L)
    return model.fitted_ms(*edge) + model.roofline.latency_ms(SHAPE, b, n, L) - model.roofline.latency_ms(SHAPE, *edge)


def test_past_the_grid_a_pass_keeps_the_token_steps_measured_at_its_token_count():
    """b = 33 rows of 4 tokens feed 132 tokens, past the 128-token step every b <= 32 measured (b = 32, n = 5 is
    160 tokens): the continuation keeps that step; clipping b at 32 with n = 4 left the pass at 128 tokens,
    before it."""
    model = lat.fit_latency_model(SHAPE, points(stepped_ms, range(1, 33), 0.005, 10), lat.STAIRCASE)
    for b, n in ((33, 4), (40, 3), (60, 2)):  # 132, 120 and 120 tokens: the first past the step, the others not
        truth = float(stepped_ms(b, n, 512.0))
        assert model.latency_ms(b, n, 512.0) == pytest.approx(truth, rel=0.03)
    assert float(_old_rule_ms(model, 33.0, 4.0, 512.0)) < 0.9 * float(stepped_ms(33, 4, 512.0))


# A GPU-like pass with a known quantization: the GEMMs' roofline over whole 128-token tiles, then the attention
# reading every row's cache and launching a wave of blocks per 6 rows, its time growing with the context.
TILE, WAVE_ROWS, WAVE_MS = 128, 6, 0.5


def quantized_ms(b, n, L):
    b, n, L = np.broadcast_arrays(*(np.asarray(v, dtype=float) for v in (b, n, L)))
    gemm = ROOF.overhead_ms + ROOF.gemm_ms(SHAPE, b * n, TILE)
    kv_read = SHAPE.kv_bytes_per_token * b * (L + n) / (ROOF.bandwidth_GBps * 1e9) * 1e3
    return gemm + kv_read + WAVE_MS * (L + n) / 1000 * np.ceil(b / WAVE_ROWS)


@pytest.mark.parametrize("seed", [0, 1])
def test_past_the_grid_the_learnt_tile_and_wave_width_give_the_steps(seed):
    """Fitted on b = 1..32 (at most 288 tokens), the staircase learns the 128-token tile and the 6-row wave and,
    for b = 33..128, puts a step where the data have one: past every multiple of 128 tokens (up to 1152) and
    every 6th row, of about the measured height, and nothing between them. The old continuation, smooth past
    the edge, has none of them."""
    model = lat.fit_latency_model(SHAPE, points(quantized_ms, range(1, 33), 0.005, seed), lat.STAIRCASE)
    assert model.staircase.tile_tokens() == TILE and model.staircase.wave_rows == WAVE_ROWS
    b = np.arange(32.0, 129.0)
    for n in (1, 5, 9):
        for L in (256.0, 1024.0):
            true, predicted = np.diff(quantized_ms(b, n, L)), np.diff(model.latency_ms(b, n, L))
            old = np.diff(_old_rule_ms(model, b, n, L))
            # where one more row crosses a tile or a wave boundary: the increments that stand out
            crossed = (np.ceil(b[1:] * n / TILE) > np.ceil(b[:-1] * n / TILE)) | (b[:-1] % WAVE_ROWS == 0)
            for increments, has_steps in ((true, True), (predicted, True), (old, False)):
                stands_out = increments > 2.5 * np.median(increments)
                assert np.array_equal(stands_out, crossed) == has_steps and (has_steps or not stands_out.any())
            ratio = predicted[crossed] / true[crossed]
            assert np.all((ratio > 0.6) & (ratio < 1.6)), (n, L, ratio)


def test_a_geometric_grid_shows_no_wave_width():
    """b = 1, 2, 4, ..., 32 measures no two neighbouring batch sizes past 2: no wave boundary can be seen, and the
    cost of a row past the grid is read from b = 8 (two octaves below 32) up."""
    staircase = lat.fit_latency_model(SHAPE, points(quantized_ms, (1, 2, 4, 8, 16, 32), 0.005, 3),
                                      lat.STAIRCASE).staircase
    assert staircase.wave_rows is None and staircase.row_cost_from == 8.0


def test_past_the_largest_context_the_fits_own_context_terms_continue():
    """Fitted at 256, 512 and 1024 cached tokens, the pass at 2048 follows the attention's cost per cached token
    the fit learnt (within 3 %), and is never cheaper than at 1024."""
    model = lat.fit_latency_model(SHAPE, points(stepped_ms, range(1, 33), 0.005, 12, contexts=(256, 512, 1024)),
                                  lat.STAIRCASE)
    b, n = np.meshgrid(np.arange(1.0, 41.0), np.arange(1.0, 10.0), indexing="ij")
    predicted = model.latency_ms(b, n, 2048.0)
    assert np.max(np.abs(predicted / stepped_ms(b, n, 2048.0) - 1)) < 0.03
    assert np.all(predicted >= model.latency_ms(b, n, 1024.0))


def test_past_the_grid_the_time_never_falls_with_more_rows():
    model = lat.fit_latency_model(SHAPE, points(stepped_ms, range(1, 33), 0.005, 10), lat.STAIRCASE)
    n, L = np.arange(1, 10.0), 512.0
    assert np.allclose(model.latency_ms(32.0, n, L), model.fitted_ms(32.0, n, L))  # the edge is the fit
    beyond = model.latency_ms(np.arange(32.0, 129.0)[:, None], n[None, :], L)  # (b, n)
    assert np.all(np.diff(beyond, axis=0) > 0)


def test_fit_offers_the_staircase_on_gpu_profiles_only():
    """The same stepped data: a CUDA profile gets the staircase, a CPU one chooses among the smooth kinds (a
    shared CPU's slow spells look like steps)."""
    def latency(role, b, n, L):
        return float(stepped_ms(b, n, L)) * (1.0 if role == "target" else 0.1)

    kinds = {}
    for device in ("cuda", "cpu"):
        profile = profile_from_json(build_profile(latency, batch_sizes=tuple(range(1, 25)), context_lens=(256, 1024),
                                                  max_k=8, noise=0.01, seed=11, device_kind=device))
        kinds[device] = fit_profile(profile).roles["target"]
    assert kinds["cuda"].kind == lat.STAIRCASE
    assert kinds["cpu"].kind in (lat.ROOFLINE, lat.MONOTONE) and lat.STAIRCASE not in kinds["cpu"].cv_mape_pct
