"""Refinement: more target passes where the fit cannot place a kernel step, until it can."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from specbatch.calibrate.refine import refinement_points, refinement_rounds, unresolved_steps
from specbatch.calibrate.run import CalibrationRequest, calibrate
from specbatch.calibrate.store import write_profile
from specbatch.perfmodel import latency as lat
from specbatch.perfmodel.profile import TimingRow, load_profile, profile_from_json
from specbatch.perfmodel.staircase import ROWS_CONTEXT, TOKENS
from perfmodel_fixtures import build_profile, roofline_latency

ROOFLINE = roofline_latency()
STEP_AFTER, WAVE_AFTER = 200, 6  # a GEMM tile step past 200 tokens; an attention wave past 6 rows


def stepped(role: str, b: int, n: int, L: int) -> float:
    value = ROOFLINE(role, b, n, L)
    if role == "target":
        value += 2.0 * (b * n > STEP_AFTER) + 0.6 * (L + n) / 1000 * (b > WAVE_AFTER)
    return value


def powers_of_two(latency) -> object:
    return profile_from_json(build_profile(latency, batch_sizes=(1, 2, 4, 8, 16, 32), context_lens=(256, 1024),
                                           max_k=8, noise=0.003, seed=3, acceptance=[0.8] * 8))


def measure(profile, point, latency):
    ms = latency(point.model, point.batch_size, point.new_tokens, point.context_len)
    row = TimingRow(point.model, point.batch_size, point.new_tokens, point.context_len, ms, ms, ms, 1, True)
    return replace(profile, timings=profile.timings + (row,))


def test_refinement_places_the_steps_a_power_of_two_grid_leaves_in_gaps():
    profile = powers_of_two(stepped)
    before = {(s.axis, s.after, s.until) for s in unresolved_steps(profile)}
    assert (TOKENS, 192.0, 224.0) in before  # 32 x 6 and 32 x 7 tokens: the step past 200 lies between
    assert (ROWS_CONTEXT, 4.0, 8.0) in before
    state = {"profile": profile}
    proposed = []
    for point in refinement_rounds(lambda: state["profile"]):
        proposed.append(point)
        state["profile"] = measure(state["profile"], point, stepped)
    assert 0 < len(proposed) <= 64
    assert unresolved_steps(state["profile"]) == []
    model = lat.fit_latency_model(lat.RoleShape.from_model_info(profile.target),
                                  lat.Points.from_rows(state["profile"].timings_of("target")), lat.STAIRCASE)
    big = [s for s in model.staircase.steps if s.axis == TOKENS and s.coefficient > 1.0]
    assert len(big) == 1 and big[0].sharp and big[0].after <= STEP_AFTER < big[0].until
    assert big[0].until - big[0].after <= 16  # placed to within the token resolution
    wave = [s for s in model.staircase.steps if s.axis == ROWS_CONTEXT and s.coefficient > 0.3]
    assert [(s.after, s.until, s.sharp) for s in wave] == [(6.0, 7.0, True)]
    # every token pass added lies inside a gap the fit had ramped, at the smallest context
    assert all(p.context_len == 256 for p in proposed if p.new_tokens > 1)


def test_a_smooth_device_gets_no_extra_passes():
    assert refinement_points(powers_of_two(ROOFLINE)) == []


def test_the_budget_bounds_the_passes():
    state = {"profile": powers_of_two(stepped)}
    proposed = []
    for point in refinement_rounds(lambda: state["profile"], budget=3):
        proposed.append(point)
        state["profile"] = measure(state["profile"], point, stepped)
    assert len(proposed) == 3


def rendered(summary, monkeypatch) -> str:
    """What `calibrate` prints for `summary` (console.calibration.render_calibration), on one line."""
    import rich.console

    from specbatch.console import output
    from specbatch.console.calibration import render_calibration

    console = rich.console.Console(record=True, width=400)
    with monkeypatch.context() as patch:
        patch.setattr(output, "report_console", lambda *args, **kwargs: console)
        render_calibration(summary)
    return " ".join(console.export_text().split())


def test_calibrate_refines_after_the_grid(tmp_path: Path, monkeypatch):
    """A real run resumed on a profile whose target rows jump between 32 and 64 tokens per pass (measured at
    32 and 64 tokens, none between; rewritten so): calibrate --refine times passes inside that gap on the
    real pair (forced on the CPU, where refinement is off by default); the progress total grows with the
    points refinement proposes, and --max-seconds guards them as any other point."""
    config = dict(model_type="llama", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128)
    (tmp_path / "target.json").write_text(json.dumps(config))
    (tmp_path / "draft.json").write_text(json.dumps(dict(config, num_hidden_layers=1)))
    out = tmp_path / "profile.json"
    ticks = iter(range(10**6))
    request = CalibrationRequest(target=str(tmp_path / "target.json"), draft=str(tmp_path / "draft.json"), out=out,
                                 device="cpu", batch_sizes=(1, 2, 32), context_lens=(16,), max_k=3, acceptance="0.8",
                                 quick=True)
    calibrate(request)  # CPU: no refinement by default
    profile = load_profile(out)
    assert {r.batch_size for r in profile.timings} == {1, 2, 32}
    rewritten = tuple(replace(r, median_ms=ms, p10_ms=ms, p90_ms=ms) if r.model == "target" else r
                      for r in profile.timings
                      for ms in [1.0 + 0.001 * r.batch_size * r.new_tokens + (1.0 if r.batch_size * r.new_tokens > 32
                                                                              else 0.0)])
    write_profile(out, replace(profile, timings=rewritten))
    stopped = calibrate(replace(request, resume=True, refine=True, max_seconds=0.5),
                        clock=lambda: float(next(ticks)))  # 1 s per tick: out of time at the first proposal
    assert stopped.stopped_by_max_seconds and stopped.points_left == 1 and stopped.points_measured == 0
    assert "stopped after --max-seconds 0.5: 1 points left" in rendered(stopped, monkeypatch)
    events = []
    summary = calibrate(replace(request, resume=True, refine=True), on_progress=events.append)
    assert events and all(e.done <= e.total for e in events)  # the total grows as refinement proposes points
    assert [e.total for e in events] == sorted(e.total for e in events) and events[-1].done == events[-1].total
    assert summary.points_measured == len(events) and summary.points_left == 0
    assert not summary.stopped_by_max_seconds  # and no stop line, though max_seconds is None (no :g of None)
    assert "stopped after" not in rendered(summary, monkeypatch)
    added = [r for r in load_profile(out).timings_of("target") if r.batch_size not in (1, 2, 32)]
    assert added, "refinement must time passes inside the 32-64 token gap"
    assert all(32 < r.batch_size * r.new_tokens < 64 or r.new_tokens == 1 for r in added)
    assert all(r.feasible and r.median_ms > 0 and r.reps > 0 for r in added)  # timed, not copied
    assert np.all([r.context_len == 16 for r in added])
