"""benchmarks/serving_fidelity.py's mis-calibrated profile, on a constructed one: every target pass row scaled, the
draft's untouched, each in-situ step longer by its own target pass's difference; fitted, the target's predicted
pass times move by the factor and the draft's do not. (The measurements themselves run for tens of minutes:
docs/results.md shows them with the command.)"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from perfmodel_fixtures import build_profile, roofline_latency

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import serving_fidelity  # noqa: E402

TRUE_MS = roofline_latency()


def constructed() -> dict:
    profile = build_profile(TRUE_MS, batch_sizes=(1, 2, 4, 8), context_lens=(128, 512), max_k=4, noise=0.0,
                            acceptance=[0.0] * 4, overheads_ms=None)
    profile["insitu_timings"] = [
        {"model": role, "batch_size": b, "new_tokens": n, "context_len": 130, "k": k, "median_ms": ms,
         "p10_ms": ms, "p90_ms": ms, "reps": 5, "in_situ": True, "sweep": 1}
        for b in (1, 4) for k in (0, 2) for role, n in (("target", k + 1), ("draft", 1))
        if role == "target" or k for ms in [TRUE_MS(role, b, n, 130)]]
    profile["insitu_steps"] = [
        {"batch_size": b, "k": k, "context_len": 130, "tokens_per_step": 1.0, "median_ms": ms, "p10_ms": ms,
         "p90_ms": ms, "reps": 5, "sweep": 1}
        for b in (1, 4) for k in (0, 2) for ms in [TRUE_MS("target", b, k + 1, 130) + k * TRUE_MS("draft", b, 1, 130)]]
    return profile


def test_the_target_passes_are_scaled_and_nothing_else():
    profile = constructed()
    scaled = serving_fidelity.scaled_profile(profile, 1.5)
    for key in ("timings", "insitu_timings"):
        for before, after in zip(profile[key], scaled[key]):
            factor = 1.5 if before["model"] == "target" else 1.0
            assert after["median_ms"] == pytest.approx(factor * before["median_ms"])
            assert after["p90_ms"] == pytest.approx(factor * before["p90_ms"])
    for before, after in zip(profile["insitu_steps"], scaled["insitu_steps"]):
        target_ms = TRUE_MS("target", before["batch_size"], before["k"] + 1, 130)
        assert after["median_ms"] == pytest.approx(before["median_ms"] + 0.5 * target_ms)
    assert profile["insitu_steps"][0]["median_ms"] != scaled["insitu_steps"][0]["median_ms"]  # a copy, scaled


def test_the_fit_of_the_scaled_profile_predicts_the_target_slower(tmp_path):
    import json

    from specbatch.perfmodel.fit import fit_profile
    from specbatch.perfmodel.profile import load_profile

    fitted = {}
    for factor in (1.0, 1.5):
        path = tmp_path / f"profile-{factor}.json"
        path.write_text(json.dumps(serving_fidelity.scaled_profile(constructed(), factor)))
        fitted[factor] = fit_profile(load_profile(path))
    for b, n in ((1, 1), (4, 3), (8, 5)):
        assert fitted[1.5].latency_ms("target", b, n, 256) == pytest.approx(
            1.5 * fitted[1.0].latency_ms("target", b, n, 256), rel=0.05)
        assert fitted[1.5].latency_ms("draft", b, 1, 256) == pytest.approx(
            fitted[1.0].latency_ms("draft", b, 1, 256), rel=0.05)


def test_the_section_renders_the_committed_figures_as_docs_results_md_shows_them():
    """Oracle: the serving-fidelity section of docs/results.md, rendered again from its own figures: everything
    after the conditions line (the command, the tables, the cost and drift lines) comes out the same."""
    import argparse
    import re

    page = (Path(__file__).resolve().parents[2] / "docs" / "results.md").read_text()
    committed = page.split("<!-- serving-fidelity:begin -->\n", 1)[1].split("\n<!-- serving-fidelity:end -->")[0]
    args = argparse.Namespace(rates=(3.0, 8.0), requests=32, max_tokens=(32, 64), max_batch_size=8, rounds=8,
                              warmup_rounds=1, factor=1.5, quiet_minutes=10.0)
    table = {}
    for name, rate, plain, measured, refit, refitted in re.findall(
            r"^\| (correct|slower|faster) \| (\d+) \| ([\d.]+ \[[\d.]+, [\d.]+\]) \| ([\d.]+) \| "
            r"([\d.]+ \[[\d.]+, [\d.]+\]) \| ([\d.]+) \|$", committed, re.MULTILINE):
        def entry(cell: str) -> dict:
            ratio, low, high = map(float, re.findall(r"[\d.]+", cell))
            return {"ratio": ratio, "low": low, "high": high}
        table[(name, float(rate))] = dict(entry(plain), measured_over_predicted=float(measured))
        table[(f"{name} --refit", float(rate))] = dict(entry(refit), measured_over_refit=float(refitted))
    assert len(table) == 12
    bands = {"profile": {"band": 0.34, "steps_to_warning": 122, "drifting_at_the_change": False, "change": 2.0,
                         "quiet_warnings": 0, "quiet_mismatch_warnings": 0},
             "0.1": {"band": 0.10, "steps_to_warning": None, "drifting_at_the_change": True, "change": None,
                     "quiet_warnings": 11, "quiet_mismatch_warnings": 1},
             "0.25": {"band": 0.25, "steps_to_warning": 109, "drifting_at_the_change": False, "change": 1.95,
                      "quiet_warnings": 4, "quiet_mismatch_warnings": 0}}
    figures = {"load_test": table,
               "refit_cost": {"plain_us": 21.6, "refit_us": 42.9, "steps": 1684, "served_step_ms": 15.7},
               "drift": {"slowed_from_step": 400, "quiet_steps": 17880, "quiet_ratio": 0.96, "bands": bands}}
    rendered = serving_fidelity.render(figures, args)
    after_conditions = [part for part in rendered.split("\n\n") if not part.startswith("Demo pair, greedy")]
    assert after_conditions == [part for part in committed.split("\n\n") if not part.startswith("Demo pair, greedy")]
    assert rendered.split("\n\n")[2].startswith("```bash\nOMP_NUM_THREADS=1 python benchmarks/serving_fidelity.py")
