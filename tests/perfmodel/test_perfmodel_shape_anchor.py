"""Shape anchoring (perfmodel.shape_anchor): the fit held to the grid's timings where in-situ steps confirm.

Oracles: a constructed grid whose measured times are a smooth "fit" times known factors, so every
residual, its interpolation and its mean are known by hand; lockstep steps built from the quirky or the
smooth times decide whether the anchor is applied.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest

from perfmodel.errors import PerfModelError
from perfmodel.shape_anchor import ShapeAnchor, fit_shape_anchor, role_anchor

BATCH_SIZES = (1, 2, 4, 8)
CONTEXTS = (64, 128)
WIDTHS = (1, 2, 3, 4, 5)
QUIRK = {(4, 4): 0.7, (4, 3): 1.2}  # (b, n) of the target: measured / smooth, at every context


@dataclass(frozen=True)
class Row:  # the fields of perfmodel.profile.TimingRow the anchor reads
    model: str
    batch_size: int
    new_tokens: int
    context_len: int
    median_ms: float
    feasible: bool = True


@dataclass(frozen=True)
class Step:  # ... of perfmodel.insitu.InSituStepRow
    batch_size: int
    k: int
    sweep: int
    median_ms: float
    context_len: int = 96


def smooth_ms(role, b, n, L):
    return (10.0 if role == "target" else 1.0) * (1 + 0.1 * np.asarray(b) * np.asarray(n)) * (1 + np.asarray(L) / 1000)


def quirky_ms(role, b, n, L):
    return smooth_ms(role, b, n, L) * (QUIRK.get((b, n), 1.0) if role == "target" else 1.0)


def grid(times=quirky_ms):
    rows = [Row(role, b, n, L, float(times(role, b, n, L))) for role in ("target", "draft")
            for b in BATCH_SIZES for n in (WIDTHS if role == "target" else (1, 2)) for L in CONTEXTS]
    return rows + [Row("target", 1, 16, 64, 99.0)]  # a wide pass at one shape only: never anchored


def test_the_residuals_are_the_measured_factors_less_their_mean():
    anchor = role_anchor(grid(), "target", smooth_ms)
    assert anchor.new_tokens == WIDTHS and anchor.batch_sizes == BATCH_SIZES and anchor.context_lens == CONTEXTS
    mean = (math.log(0.7) + math.log(1.2)) / (len(BATCH_SIZES) * len(WIDTHS))  # per context, so overall too
    assert anchor.log_residual[2, 3, 0] == pytest.approx(math.log(0.7) - mean)
    assert anchor.log_residual[2, 2, 1] == pytest.approx(math.log(1.2) - mean)
    assert anchor.log_residual[0, 0, 0] == pytest.approx(-mean)
    assert anchor.log_residual.mean() == pytest.approx(0.0, abs=1e-12)


def applied(roles) -> ShapeAnchor:
    return ShapeAnchor(roles, paired_error_pct=1.0, unanchored_paired_error_pct=2.0)


def test_the_factor_reproduces_measured_ratios_interpolates_and_holds_the_edge():
    anchor = applied({"target": role_anchor(grid(), "target", smooth_ms)})
    assert anchor.factor("target", 4, 4, 64) / anchor.factor("target", 4, 5, 64) == pytest.approx(0.7)
    assert anchor.factor("target", 4, 3, 100) / anchor.factor("target", 4, 5, 100) == pytest.approx(1.2)
    # b = 2 sqrt(2) lies halfway between 2 and 4 in log b: half the log residual of b = 4
    assert math.log(anchor.factor("target", 2 * math.sqrt(2), 4, 64) / anchor.factor("target", 2, 5, 64)) == \
        pytest.approx(0.5 * math.log(0.7))
    assert anchor.factor("target", 32, 4, 64) == pytest.approx(anchor.factor("target", 8, 4, 64))  # held beyond
    assert anchor.factor("target", 4, 4, 4096) == pytest.approx(anchor.factor("target", 4, 4, 128))
    assert anchor.factor("target", 1, 16, 64) == 1.0 and anchor.factor("target", 4, 9, 64) == 1.0  # not anchored
    assert anchor.factor("draft", 4, 1, 64) == 1.0  # a role without an anchor


def test_arrays_give_the_scalars_values():
    anchor = applied({"target": role_anchor(grid(), "target", smooth_ms)})
    b = np.array([1, 3, 4, 4, 16, 4])
    n = np.array([1, 4, 4, 3, 2, 9])
    L = np.array([64, 90, 128, 70, 200, 64])
    vectorized = anchor.factor("target", b, n, L)
    assert vectorized == pytest.approx([anchor.factor("target", int(x), int(y), int(z)) for x, y, z in zip(b, n, L)])


def lockstep(times, batch_sizes=(1, 4), ks=(0, 2, 3, 4), speeds=(1.0, 1.7)):
    """Steps of a chain k: one target pass of k + 1 tokens and k draft passes of 1, at machine speed s."""
    return [Step(b, k, sweep, speed * float(times("target", b, k + 1, 96) + k * times("draft", b, 1, 96)))
            for sweep, speed in enumerate(speeds, start=1) for b in batch_sizes for k in ks]


def predict(steps):
    return lambda latency_ms: [float(latency_ms("target", s.batch_size, s.k + 1, s.context_len)
                                     + s.k * latency_ms("draft", s.batch_size, 1, s.context_len)) for s in steps]


def test_applied_when_the_steps_run_as_the_grid_measured_and_not_when_they_run_as_the_fit():
    quirky_steps = lockstep(quirky_ms)
    anchor = fit_shape_anchor(grid(), smooth_ms, quirky_steps, predict(quirky_steps))
    # not 0: the target's mean residual is removed (the fit keeps its level), which moves the target's share
    # of a step against the draft's a little
    assert anchor.applied and anchor.paired_error_pct < 0.1 < 5 < anchor.unanchored_paired_error_pct
    smooth_steps = lockstep(smooth_ms)  # the grid's quirk was the grid's alone (noise): the steps say so
    anchor = fit_shape_anchor(grid(), smooth_ms, smooth_steps, predict(smooth_steps))
    assert not anchor.applied and anchor.unanchored_paired_error_pct == pytest.approx(0.0, abs=1e-9)
    assert anchor.factor("target", 4, 4, 96) == 1.0
    assert "not applied" in anchor.note()
    assert fit_shape_anchor(grid(), smooth_ms, [], predict([])) is None  # nothing to judge by


def test_json_round_trip_and_malformed_input():
    anchor = fit_shape_anchor(grid(), smooth_ms, lockstep(quirky_ms), predict(lockstep(quirky_ms)))
    again = ShapeAnchor.from_json(anchor.to_json(), "m.json")
    assert again.applied and again.factor("target", 4, 4, 100) == pytest.approx(anchor.factor("target", 4, 4, 100))
    broken = anchor.to_json()
    broken["roles"]["target"]["log_residual"] = [[0.0]]
    with pytest.raises(PerfModelError, match=r"^m.json: shape_anchor is malformed \(log_residual of target"):
        ShapeAnchor.from_json(broken, "m.json")
