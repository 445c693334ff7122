"""In-situ timing in the profile and the fit: the optional sections round-trip and fail field by field,
passes and steps are summarized as calibrate records them, and the fit keeps the timing source that
predicts the measured steps, with held-out MAPE per batch size checked against hand-computed values."""
from __future__ import annotations

import copy
import json

import pytest

from specbatch.perfmodel.errors import PerfModelError
from specbatch.perfmodel.profile.insitu import pass_rows, step_row
from specbatch.perfmodel.fit import fit_profile
from specbatch.perfmodel.model import load_model, model_to_json, save_model
from specbatch.perfmodel.profile import load_profile, save_profile
from specbatch.perfmodel.steps import COMBINED, INSITU, ISOLATED
from perfmodel_fixtures import build_profile, roofline_latency

TRUE_MS = roofline_latency()  # the isolated passes' times: exactly the roofline form
INSITU_BATCH_SIZES, INSITU_KS, INSITU_CONTEXTS, STEP_CONTEXT = (1, 4, 16), (0, 2, 4, 6), (100, 164), 130


def in_situ_rows(scale: float) -> list[dict]:
    """Passes of chains k = 0, 2, 4, 6 at b = 1, 4, 16 and two contexts, `scale` x the isolated time (a
    roofline too: every term scales). Acceptance is 0, so a chain step is k draft passes of 1 token."""
    rows = []
    for b in INSITU_BATCH_SIZES:
        for L in INSITU_CONTEXTS:
            for k in INSITU_KS:
                shapes = [("target", k + 1)] + ([("draft", 1)] if k else [])
                for role, n in shapes:
                    ms = scale * TRUE_MS(role, b, n, L)
                    rows.append({"model": role, "batch_size": b, "new_tokens": n, "context_len": L, "k": k,
                                 "median_ms": ms, "p10_ms": 0.9 * ms, "p90_ms": 1.1 * ms, "reps": 12, "in_situ": True})
    return rows


def step_ms_by_hand(b: int, k: int, L: int) -> float:
    """With acceptance 0 no row ever catches up: k draft passes of 1 token, one verify pass of k + 1."""
    return k * TRUE_MS("draft", b, 1, L) + TRUE_MS("target", b, k + 1, L)


def steps(scale: float) -> list[dict]:
    return [{"batch_size": b, "k": k, "context_len": STEP_CONTEXT, "tokens_per_step": 1.0,
             "median_ms": scale * step_ms_by_hand(b, k, STEP_CONTEXT), "p10_ms": 0.0,
             "p90_ms": 2 * scale * step_ms_by_hand(b, k, STEP_CONTEXT), "reps": 10}
            for b in INSITU_BATCH_SIZES for k in INSITU_KS]


def constructed(pass_scale: float, step_scale: float) -> dict:
    """Isolated passes at TRUE_MS (noise-free), in-situ passes at pass_scale x, steps at step_scale x the
    isolated sum; no overhead rows (overhead 0), acceptance 0."""
    obj = build_profile(TRUE_MS, batch_sizes=(1, 2, 4, 8, 16), context_lens=(128, 512), max_k=6, noise=0.0,
                        acceptance=[0.0] * 6, overheads_ms=None)
    obj["insitu_timings"], obj["insitu_steps"] = in_situ_rows(pass_scale), steps(step_scale)
    return obj


def write(tmp_path, obj) -> str:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(obj))
    return str(path)


# ---------------------------------------------------------------- the profile's sections
def test_sections_round_trip_and_older_profiles_load_unchanged(tmp_path):
    obj = constructed(1.25, 1.25)
    profile = load_profile(write(tmp_path, obj))
    assert len(profile.insitu_timings) == len(obj["insitu_timings"]) and len(profile.insitu_steps) == 12
    assert profile.insitu_timings[0].in_situ and profile.insitu_steps[-1].k == 6
    save_profile(tmp_path / "again.json", profile)
    again = json.loads((tmp_path / "again.json").read_text())
    assert again["insitu_timings"] == obj["insitu_timings"] and again["insitu_steps"] == obj["insitu_steps"]
    assert load_profile(tmp_path / "again.json") == profile
    older = build_profile(TRUE_MS, batch_sizes=(1, 4), context_lens=(128,), max_k=2, acceptance=[0.8, 0.7])
    loaded = load_profile(write(tmp_path, older))
    assert loaded.insitu_timings == () and loaded.insitu_steps == ()
    assert "insitu_timings" not in loaded.to_json() and "insitu_steps" not in loaded.to_json()


@pytest.mark.parametrize("section, index, change, message", [
    ("insitu_timings", 0, {"median_ms": "fast"}, r"insitu_timings\[0\]\.median_ms: expected a number, found 'fast'"),
    ("insitu_timings", 1, {"in_situ": False}, r"insitu_timings\[1\]\.in_situ: an in-situ row must say true"),
    ("insitu_timings", 2, {"model": "verifier"}, r"insitu_timings\[2\]\.model: 'verifier' is not one of target, draft"),
    ("insitu_timings", 0, {"p10_ms": 1e7}, r"insitu_timings\[0\]: expected p10_ms <= median_ms <= p90_ms"),
    ("insitu_steps", 0, {"median_ms": 1e300}, r"insitu_steps\[0\]\.median_ms: expected a measured time in ms between"),
    ("insitu_steps", 3, {"k": None}, r"insitu_steps\[3\]\.k: expected an integer, found None"),
    ("insitu_steps", 5, {"tokens_per_step": 4.0}, r"insitu_steps\[5\]\.tokens_per_step: at most k \+ 1 = 3"),
    ("insitu_steps", 0, {"batch_size": 0}, r"insitu_steps\[0\]\.batch_size: must be >= 1, found 0"),
])
def test_a_bad_row_is_one_line_naming_the_file_and_the_field(tmp_path, section, index, change, message):
    obj = constructed(1.0, 1.0)
    obj[section][index].update(change)
    with pytest.raises(PerfModelError, match=r"profile\.json: " + message) as error:
        load_profile(write(tmp_path, obj))
    assert "\n" not in str(error.value)


def test_missing_fields_and_duplicates_are_named(tmp_path):
    obj = constructed(1.0, 1.0)
    del obj["insitu_steps"][0]["reps"]
    with pytest.raises(PerfModelError, match=r"profile\.json: insitu_steps\[0\]\.reps: missing"):
        load_profile(write(tmp_path, obj))
    obj = constructed(1.0, 1.0)
    obj["insitu_steps"].append(copy.deepcopy(obj["insitu_steps"][0]))
    duplicate = r"insitu_steps\[12\]: duplicate \(batch_size, k, context_len, sweep\) row \(1, 0, 130, None\)"
    with pytest.raises(PerfModelError, match=duplicate):
        load_profile(write(tmp_path, obj))
    obj["insitu_steps"][12]["sweep"] = 2  # the same point and context timed again in another sweep: a row of its own
    obj["insitu_timings"].append(dict(obj["insitu_timings"][0], sweep=2))
    swept = load_profile(write(tmp_path, obj))
    assert [r.sweep for r in swept.insitu_steps] == [None] * 12 + [2] and swept.insitu_timings[-1].sweep == 2
    assert swept.to_json()["insitu_steps"][12]["sweep"] == 2 and "sweep" not in swept.to_json()["insitu_steps"][0]
    obj["insitu_steps"][12]["sweep"] = 0
    with pytest.raises(PerfModelError, match=r"insitu_steps\[12\]\.sweep: must be >= 1, found 0"):
        load_profile(write(tmp_path, obj))
    obj = constructed(1.0, 1.0)
    obj["insitu_timings"] = {"not": "a list"}
    with pytest.raises(PerfModelError, match=r"profile\.json: insitu_timings: expected a list, found an object"):
        load_profile(write(tmp_path, obj))


# ---------------------------------------------------------------- what calibrate records
def test_passes_are_grouped_by_width_and_context_over_the_full_batch_only():
    records = [("target", 4, 3, 70, 0.010), ("target", 4, 3, 90, 0.020), ("target", 4, 3, 100, 0.030),
               ("target", 4, 3, 130, 0.050), ("draft", 4, 1, 64, 0.001), ("draft", 3, 1, 64, 0.9)]
    rows = pass_rows(records, batch_size=4, k=2)
    assert [(r.model, r.new_tokens, r.context_len, r.reps, r.k) for r in rows] == \
        [("draft", 1, 64, 1, 2), ("target", 3, 87, 3, 2), ("target", 3, 130, 1, 2)]  # bins [64, 128), [128, 192)
    target = rows[1]
    assert (target.median_ms, target.p10_ms, target.p90_ms) == (20.0, 12.0, 28.0)  # 10, 20, 30 ms: linear p10/p90


def test_a_step_row_is_per_row_tokens_and_the_median_step():
    row = step_row([0.010, 0.030, 0.020, 0.040], [100, 101, 102, 105], tokens=24, batch_size=2, k=4)
    assert (row.tokens_per_step, row.median_ms, row.context_len, row.reps) == (3.0, 25.0, 102, 4)


# ---------------------------------------------------------------- the fit chooses its source
def test_in_situ_is_chosen_when_its_passes_are_the_steps_passes(tmp_path):
    """Steps measured at 1.25 x the isolated passes' sum, in-situ passes at 1.25 x: the isolated fit recovers
    TRUE_MS, so it predicts every step 1 - 1 / 1.25 = 20 % low, at every batch size, held out or not; the
    in-situ fit recovers 1.25 x TRUE_MS and predicts the steps exactly."""
    fitted = fit_profile(load_profile(write(tmp_path, constructed(1.25, 1.25))))  # held out per b: always
    choice = fitted.timing_source
    assert choice.chosen == INSITU and choice.criterion == "held-out step MAPE"
    isolated, in_situ = choice.report(ISOLATED), choice.report(INSITU)
    assert isolated.step_mape_pct == pytest.approx(20.0, abs=0.05)
    assert in_situ.step_mape_pct == pytest.approx(0.0, abs=0.05)
    for error in isolated.by_batch_size:  # per batch size, held out: the same 20 % (the fit is exact)
        assert error.steps == 4 and error.step_mape_pct == pytest.approx(20.0, abs=0.1)
        assert error.insitu_pass_mape_pct == pytest.approx(20.0, abs=0.1)  # |1 - 1.25| / 1.25
        assert error.pass_mape_pct == pytest.approx(0.0, abs=0.1)  # its own isolated rows at b
    for error in in_situ.by_batch_size:
        assert error.step_mape_pct == pytest.approx(0.0, abs=0.2) and error.pass_mape_pct == pytest.approx(0, abs=0.2)
    assert {r.source for r in choice.reports} == {ISOLATED, INSITU, COMBINED}
    assert fitted.roles["target"].points.latency_ms.size == in_situ.points["target"]  # the chosen rows
    assert fitted.latency_ms("target", 4, 3, 130) == pytest.approx(1.25 * TRUE_MS("target", 4, 3, 130), rel=1e-3)
    assert fitted.timing_source_notes() == [f"pass latency fitted to the in-situ timings (chosen by held-out step "
                                            f"MAPE: {in_situ.step_mape_pct:.1f} % on the profile's measured steps, "
                                            f"{in_situ.heldout_step_mape_pct:.1f} % held out)"]


def test_isolated_is_kept_when_it_predicts_the_steps_and_the_choice_survives_the_file(tmp_path):
    """In-situ passes 25 % slow but steps at exactly the isolated sum: the in-situ fit is 25 % high."""
    fitted = fit_profile(load_profile(write(tmp_path, constructed(1.25, 1.0))))
    choice = fitted.timing_source
    assert choice.chosen == ISOLATED
    assert choice.report(ISOLATED).heldout_step_mape_pct == pytest.approx(0.0, abs=0.1)
    assert choice.report(INSITU).heldout_step_mape_pct == pytest.approx(25.0, abs=0.2)
    assert fitted.latency_ms("draft", 8, 1, 300) == pytest.approx(TRUE_MS("draft", 8, 1, 300), rel=1e-3)
    save_model(tmp_path / "model.json", fitted)
    again = load_model(tmp_path / "model.json")
    assert again.timing_source.chosen == ISOLATED
    assert [r.by_batch_size for r in again.timing_source.reports] == \
        [r.by_batch_size for r in json_round(choice).reports]


def json_round(choice):
    from specbatch.perfmodel.steps import SourceChoice

    return SourceChoice.from_json(json.loads(json.dumps(choice.to_json())), "model.json: timing_source")


def test_without_in_situ_rows_the_fit_is_todays(tmp_path):
    obj = constructed(1.0, 1.0)
    del obj["insitu_timings"], obj["insitu_steps"]
    fitted = fit_profile(load_profile(write(tmp_path, obj)))
    assert fitted.timing_source is None and "timing_source" not in model_to_json(fitted)
    assert len(fitted.roles["target"].points) == len([r for r in obj["timings"] if r["model"] == "target"])
