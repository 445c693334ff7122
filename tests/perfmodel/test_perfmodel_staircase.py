"""The staircase kind: kernel steps found where the data have them, at the right place, and nowhere else."""
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
    again = model_from_json(model_to_json(fitted), "model.json")
    b, n, L = np.meshgrid(np.arange(1, 40), np.arange(1, 10), [256.0, 700.0], indexing="ij")
    for role in ("target", "draft"):
        assert np.allclose(again.roles[role].model.latency_ms(b, n, L), fitted.roles[role].model.latency_ms(b, n, L),
                           rtol=1e-6)


def test_beyond_the_grid_the_time_grows_as_the_roofline_grows_from_the_edge():
    """No step is known past the grid: the edge's time plus what the roofline adds, continuous at the edge
    and never below it (a ratio to the roofline taken at one point of the sawtooth would carry that point's
    phase, and fading it could make a pass cheaper past the edge)."""
    model = lat.fit_latency_model(SHAPE, points(stepped_ms, range(1, 33), 0.005, 10), lat.STAIRCASE)
    n, L = np.arange(1, 10.0), 512.0
    at_edge = model.latency_ms(32.0, n, L)
    assert np.allclose(model.latency_ms(32.0 + 1e-6, n, L), at_edge, rtol=1e-5)
    roofline = model.roofline.latency_ms
    for b in (33.0, 64.0, 100.0):
        assert np.allclose(model.latency_ms(b, n, L), at_edge + roofline(SHAPE, b, n, L) - roofline(SHAPE, 32.0, n, L))
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
