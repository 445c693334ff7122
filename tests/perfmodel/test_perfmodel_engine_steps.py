"""An engine's profile (`calibrate --engine vllm`): its sections read strictly, its step model recovers known
costs and is judged on held-out K and batch sizes, its acceptance is what its counters say, and the tables made
from it (and from our runtime's model) say whose costs they carry. No torch, no vLLM: constructed rows."""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from perfmodel_fixtures import CPU_MODELS, build_profile, cpu_like_latency, write_profile
from specbatch.perfmodel.engine_steps import TERMS, engine_acceptance, engine_points, fit_engine_steps, held_out
from specbatch.perfmodel.errors import PerfModelError
from specbatch.perfmodel.fit import fit_profile
from specbatch.perfmodel.model import compute_table, load_model, query_strategies, save_model
from specbatch.perfmodel.profile import EngineStepRow, load_profile, profile_from_json
from specbatch.perfmodel.table import costs_note, load_table, save_table, to_vllm, write_table
from specbatch.perfmodel.tree import Strategy, chain

ENGINE = {"name": "vllm", "version": "0.32.0", "settings": {"threads": "1 OpenMP thread(s), unbound"}}
# a vLLM-like step on a CPU: ms per unit of what each term counts (perfmodel/engine_steps.py)
KNOWN = {"step_ms": 7.0, "speculative_step_ms": 2.5, "draft_pass_ms": 1.1, "row_ms": 0.3, "target_token_ms": 0.12,
         "draft_token_ms": 0.05, "target_kv_ms": 2.0, "draft_kv_ms": 0.3}
ALPHAS = (0.8, 0.75, 0.7, 0.7)


def known_step_ms(mode: str, b: int, k: int, L: float) -> float:
    """The module docstring's sum, written out term by term."""
    spec = 1.0 if mode == "schedule" else 0.0
    drafted = spec * b * (k + 1) + b * max(k - 1, 0)
    draft_passes = spec * max(k, 1)
    return (KNOWN["step_ms"] + KNOWN["speculative_step_ms"] * spec + KNOWN["draft_pass_ms"] * max(k - 1, 0)
            + KNOWN["row_ms"] * b + KNOWN["target_token_ms"] * b * (k + 1) + KNOWN["draft_token_ms"] * drafted
            + KNOWN["target_kv_ms"] * b * L / 1e3 + KNOWN["draft_kv_ms"] * draft_passes * b * L / 1e3)


def step_rows(step_ms=known_step_ms, batch_sizes=(1, 2, 4, 8, 16, 32), prompt_lens=(128, 512), max_k=4, sweeps=3,
              noise=0.0, seed=0) -> list[dict]:
    """Rows as calibrate writes them: drafts of b rows x 8 steps, each position accepted with ALPHAS."""
    rng = np.random.default_rng(seed)
    rows = []
    for sweep in range(1, sweeps + 1):
        for L in prompt_lens:
            for b in batch_sizes:
                for mode, k in [("none", 0)] + [("schedule", k) for k in range(max_k + 1)]:
                    drafts = 8 * b if k else 0
                    survive = np.cumprod(ALPHAS[:k])
                    per_position = [int(round(drafts * s)) for s in survive]
                    accepted = sum(per_position)
                    context = L + 10
                    median = step_ms(mode, b, k, context) * float(np.exp(noise * rng.standard_normal()))
                    rows.append({"mode": mode, "batch_size": b, "k": k, "prompt_len": L, "context_len": context,
                                 "tokens_per_step": 1 + accepted / drafts if drafts else 1.0, "drafts": drafts,
                                 "draft_tokens": drafts * k, "accepted_tokens": accepted,
                                 "accepted_per_position": per_position, "median_ms": median, "p10_ms": 0.9 * median,
                                 "p90_ms": 1.2 * median, "reps": 8, "sweep": sweep})
    return rows


def engine_profile(rows=None, **kwargs) -> dict:
    profile = build_profile(cpu_like_latency, models=CPU_MODELS, batch_sizes=(1, 2, 4, 8, 16, 32),
                            context_lens=(128, 512), max_k=4, device_kind="cpu")
    profile.update(timings=[], overheads=[], engine=copy.deepcopy(ENGINE),
                   engine_steps=step_rows(**kwargs) if rows is None else rows)
    parsed = profile_from_json(profile, "engine.json")
    acceptance = engine_acceptance(parsed.engine_steps, 4, "held-out.jsonl", None)
    profile["acceptance"] = [{**acceptance.__dict__, "per_position": list(acceptance.per_position),
                              "trials": list(acceptance.trials), "tokens_per_step": list(acceptance.tokens_per_step)}]
    return profile


# ---------------------------------------------------------------- the profile sections

def test_engine_sections_round_trip(tmp_path):
    path = write_profile(tmp_path / "engine.json", engine_profile())
    profile = load_profile(path)
    assert profile.engine.describe() == "vllm 0.32.0" and len(profile.engine_steps) == 3 * 2 * 6 * 6
    assert profile.engine_steps[0] == EngineStepRow(**{**step_rows()[0], "accepted_per_position": ()})
    again = write_profile(tmp_path / "again.json", profile.to_json())
    assert load_profile(again) == profile


@pytest.mark.parametrize("change, message", [
    (lambda p: p.pop("engine"), "engine_steps without an engine section"),
    (lambda p: p["timings"].append({"model": "target", "batch_size": 1, "new_tokens": 1, "context_len": 1,
                                    "median_ms": 1.0, "p10_ms": 1.0, "p90_ms": 1.0, "reps": 1, "feasible": True}),
     "holds its measured steps only"),
    (lambda p: p["engine_steps"].append(dict(p["engine_steps"][0])), "duplicate (mode, batch_size, k, prompt_len"),
    (lambda p: p["engine_steps"][0].update(k=2), "k must be 0"),
    (lambda p: p["engine_steps"][3].update(tokens_per_step=3.5), "at most k + 1 = 3"),
    (lambda p: p["engine_steps"][3].update(accepted_tokens=10 ** 6), "accepted of"),
    (lambda p: p["engine_steps"][3].update(accepted_per_position=[1, 2, 3]), "at most k = 2 counts"),
    (lambda p: p["engine_steps"][3].update(p10_ms=10 ** 4), "p10_ms <= median_ms"),
    (lambda p: p["engine"].update(settings=[]), "engine.settings: expected an object"),
])
def test_bad_engine_sections_are_one_line_errors(tmp_path, change, message):
    profile = engine_profile()
    change(profile)
    with pytest.raises(PerfModelError, match=message.replace("(", r"\(").replace("+", r"\+")) as error:
        load_profile(write_profile(tmp_path / "bad.json", profile))
    assert "\n" not in str(error.value) and "bad.json" in str(error.value)


# ---------------------------------------------------------------- the step model

def test_fit_recovers_the_costs_a_step_is_made_of():
    profile = profile_from_json(engine_profile(), "engine.json")
    fit = fit_engine_steps(profile.engine, profile.engine_steps)
    assert fit.terms == pytest.approx(KNOWN, rel=1e-6)
    assert fit.in_sample_mape_pct < 1e-6 and {h.by for h in fit.held_out} == {"k", "batch_size"}
    by_k, by_b = fit.held_out
    assert by_b.mape_pct < 1e-6 and all(by_k.per_group[k] < 1e-6 for k in range(1, 5))
    # without K = 0 the tokens the drafter reads (2 b K from K = 1 on) are a sum of the target's tokens and the
    # rows: the split between those terms is not determined, and K = 0's prediction is not exact
    assert by_k.per_group[0] > 0.1
    assert fit.step_ms("none", 8, 0, 300) == pytest.approx(known_step_ms("none", 8, 0, 300))
    assert sum(fit.term_ms("schedule", 8, 3, 300).values()) == pytest.approx(known_step_ms("schedule", 8, 3, 300))


def test_points_are_medians_over_sweeps_and_say_their_spread():
    rows = step_rows(sweeps=3)
    for row in rows:  # sweep 3 twice as slow: one slow spell of a shared machine
        row["median_ms"] *= 2.0 if row["sweep"] == 3 else (1.1 if row["sweep"] == 2 else 1.0)
        row["p10_ms"], row["p90_ms"] = 0.9 * row["median_ms"], 1.2 * row["median_ms"]
    points = engine_points(profile_from_json(engine_profile(rows), "engine.json").engine_steps)
    assert all(p.sweeps == 3 for p in points)
    point = next(p for p in points if (p.mode, p.batch_size, p.k, p.prompt_len) == ("schedule", 4, 2, 128))
    base = known_step_ms("schedule", 4, 2, 138)
    assert point.median_ms == pytest.approx(1.1 * base)  # the slow sweep does not move the median
    assert point.spread_pct == pytest.approx(100 * (2.0 - 1.0) / 1.1)


def test_held_out_k_finds_a_k_the_form_does_not_follow():
    def bumped(mode, b, k, L):  # K = 3 costs 40 % more than any sum of the terms says
        return known_step_ms(mode, b, k, L) * (1.4 if (mode, k) == ("schedule", 3) else 1.0)

    points = engine_points(profile_from_json(engine_profile(step_rows(bumped)), "engine.json").engine_steps)
    by_k = held_out(points, "k")
    # without K = 3 the others fit exactly, so K = 3 is predicted at the form's cost: 0.4 / 1.4 below it
    assert by_k.per_group[3] == pytest.approx(100 * 0.4 / 1.4)
    few = [p for p in points if p.batch_size <= 2 and p.prompt_len == 128]  # 12 configurations
    assert held_out(few, "k") is None  # too few points left to refit: no figure, rather than a wrong one


def test_too_few_configurations_or_no_later_draft_pass_are_refused():
    profile = profile_from_json(engine_profile(), "engine.json")
    few = [r for r in profile.engine_steps if r.batch_size == 1 and r.prompt_len == 128]
    with pytest.raises(PerfModelError, match="at least 16 configurations"):
        fit_engine_steps(profile.engine, few)
    short = [r for r in profile.engine_steps if r.k <= 1]
    with pytest.raises(PerfModelError, match="K >= 2"):
        fit_engine_steps(profile.engine, short)


# ---------------------------------------------------------------- acceptance from the engine's counters

def test_acceptance_is_what_the_counters_say():
    rows = profile_from_json(engine_profile(), "engine.json").engine_steps
    entry = engine_acceptance(rows, 4, "held-out.jsonl", None)
    # by hand: position i is reached by the rows with k >= i whose first i - 1 were accepted
    reached = [sum(r.drafts if i == 0 else r.accepted_per_position[i - 1] for r in rows if r.k > i)
               for i in range(4)]
    accepted = [sum(r.accepted_per_position[i] for r in rows if r.k > i) for i in range(4)]
    assert entry.per_position == pytest.approx([a / r for a, r in zip(accepted, reached)], rel=1e-6)
    assert entry.per_position == pytest.approx(ALPHAS, abs=0.01)
    assert entry.trials == tuple(reached)
    at_2 = [r for r in rows if r.mode == "schedule" and r.k == 2]
    assert entry.tokens_per_step[2] == pytest.approx(1 + sum(r.accepted_tokens for r in at_2)
                                                     / sum(r.drafts for r in at_2), rel=1e-6)
    assert entry.tokens_per_step[0] == 1.0 and entry.mode == "greedy"
    assert engine_acceptance([r for r in rows if r.k == 0], 4, None, None) is None


# ---------------------------------------------------------------- tables under the engine's costs

@pytest.fixture
def engine_model(tmp_path):
    fitted = fit_profile(load_profile(write_profile(tmp_path / "engine.json", engine_profile())))
    save_model(tmp_path / "engine.model.json", fitted)
    return load_model(tmp_path / "engine.model.json")


def test_the_model_file_keeps_the_step_model(engine_model, tmp_path):
    fitted = fit_profile(load_profile(write_profile(tmp_path / "e.json", engine_profile())))
    assert engine_model.engine.terms == pytest.approx(fitted.engine.terms, rel=1e-6)
    assert engine_model.roles == {} and engine_model.engine.engine.describe() == "vllm 0.32.0"
    with pytest.raises(PerfModelError, match="whole steps, not pass latencies"):
        engine_model.latency_ms("target", 1, 1, 128)


def test_strategies_are_priced_at_the_engine_s_steps(engine_model):
    acceptance = engine_model.acceptance[0]
    choice = query_strategies(engine_model, acceptance, 8, 200, strategies="all")
    assert all(c.strategy.kind in ("none", "chain") and not c.strategy.stage2 for c in choice.ranked)
    by_k = {c.k: c for c in choice.ranked}
    for k, candidate in by_k.items():  # no speculation is the schedule saying 0: the drafter's first pass is paid
        assert candidate.step_ms == pytest.approx(known_step_ms("schedule", 8, k, 200), rel=1e-5)
        assert candidate.tokens_per_s == pytest.approx(8 * acceptance.expected_tokens(k) / candidate.step_ms * 1e3)
    # the speedup's baseline is the engine without a speculative configuration
    assert choice.baseline_tokens_per_s == pytest.approx(8 / known_step_ms("none", 8, 0, 200) * 1e3, rel=1e-5)
    from specbatch.perfmodel.model import step_model

    with pytest.raises(PerfModelError, match="runs chains only"):
        step_model(engine_model, acceptance).evaluate(Strategy(chain(2), stage2=True), 8, 200)


def test_a_table_from_the_engine_s_costs_says_so(engine_model, tmp_path):
    table = compute_table(engine_model, engine_model.acceptance[0], 32, [128])
    assert table.costs == ENGINE and table.costs_name() == "vllm"
    best = [max(range(5), key=lambda k: b * engine_model.acceptance[0].expected_tokens(k)
                / known_step_ms("schedule", b, k, 128)) for b in range(1, 33)]
    assert [e.k for e in table.buckets[0].entries] == best
    save_table(tmp_path / "t.json", table)
    assert load_table(tmp_path / "t.json").costs == ENGINE
    (tmp_path / "config.json").write_text("{}")  # the draft an export names must be a model directory
    notes = write_table(tmp_path / "t.vllm.json", table, "vllm", draft=tmp_path)
    assert notes == [costs_note(table, "vllm")] and "vLLM 0.32.0's own steps" in notes[0]
    assert json.loads((tmp_path / "t.vllm.json").read_text()) == to_vllm(table, draft=tmp_path)


def test_the_kernel_step_notes_of_table_and_query_pass_over_an_engine_s_model(engine_model):
    """An engine's model holds whole steps, no target pass latencies: no kernel-step notes, and no error."""
    from specbatch.perfmodel.kernel_notes import row_gap_notes, table_step_notes
    from specbatch.perfmodel.model import step_model
    from specbatch.perfmodel.query import chain_answer

    acceptance = engine_model.acceptance[0]
    table = compute_table(engine_model, acceptance, 32, [128])
    assert table_step_notes(engine_model, table, step_model(engine_model, acceptance)) == []
    assert row_gap_notes(engine_model) == [] and row_gap_notes(engine_model, 8) == []
    answer = chain_answer(engine_model, acceptance, 8, 128)
    assert answer.best_strategy.k == table.lookup(8) and not any("kernel step" in n for n in answer.notes)


def test_a_table_from_our_runtime_s_costs_exported_to_vllm_says_whose_costs_it_carries(tmp_path):
    profile = build_profile(cpu_like_latency, models=CPU_MODELS, context_lens=(128,), max_k=4, device_kind="cpu",
                            acceptance=list(ALPHAS))
    fitted = fit_profile(load_profile(write_profile(tmp_path / "ours.json", profile)))
    table = compute_table(fitted, fitted.acceptance[0], 16, [128], strategies="chain")
    assert table.costs["name"] == "specbatch" and table.costs["settings"]["device"] == "synthetic device"
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "config.json").write_text("{}")
    notes = write_table(tmp_path / "t.vllm.json", table, "vllm", draft=tmp_path / "draft")
    assert notes[0].startswith("costs: our runtime's (specbatch) passes, not vLLM's")
    assert "calibrate --engine vllm" in notes[0]
    older = table.to_json()
    del older["costs"]
    path = tmp_path / "older.json"
    path.write_text(json.dumps(older))
    assert load_table(path).costs is None and "our runtime's" in costs_note(load_table(path), "trtllm")


def test_terms_cover_the_docstring():
    assert TERMS == tuple(KNOWN)


def test_plot_shows_the_engine_s_steps_measured_against_predicted(engine_model, tmp_path):
    from specbatch.perfmodel.plot import fit_panels, plot_model

    ((measured, predicted, batch_sizes, title),) = fit_panels(engine_model)
    assert len(measured) == len(engine_model.engine.points) == 2 * 6 * 6 and "vllm 0.32.0 steps" in title
    assert predicted == pytest.approx(measured, rel=1e-5)  # the known form, fitted exactly
    pytest.importorskip("matplotlib")  # the torch-free CI environment has no plotting
    plot_model(engine_model, engine_model.acceptance[0], tmp_path / "engine.png", max_batch=8)
    assert (tmp_path / "engine.png").read_bytes()[:4] == b"\x89PNG"


def test_the_committed_vllm_cpu_profile_fits_within_the_goal_held_out():
    """data/profiles/vllm-cpu-demo.json: vLLM's CPU build's own steps (`calibrate --engine vllm`). Its step
    model predicts each left-out K and each left-out batch size within the 10 % goal."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "data" / "profiles" / "vllm-cpu-demo.json"
    profile = load_profile(path)
    fit = fit_engine_steps(profile.engine, profile.engine_steps)
    assert {report.by for report in fit.held_out} == {"k", "batch_size"}
    assert all(report.mape_pct <= 10.0 for report in fit.held_out)
    assert fit.in_sample_mape_pct <= min(report.mape_pct for report in fit.held_out)
