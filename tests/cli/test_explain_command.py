"""`specbatch explain` on the bundled demo pair (a short generation): the decomposition's contract."""
from __future__ import annotations

import json

import pytest

from cli_helpers import assert_one_line_error, invoke
from perfmodel_fixtures import build_profile, roofline_latency, write_profile


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    root = tmp_path_factory.mktemp("explain")
    profile = write_profile(root / "profile.json", build_profile(roofline_latency(), batch_sizes=(1, 2, 4),
                                                                 context_lens=(64, 256), max_k=4, acceptance=[0.6]))
    assert invoke("fit", profile, "-o", root / "model.json").exit_code == 0
    return root / "model.json"


def test_explain_json_terms_sum_to_both_step_times(model_file):
    result = invoke("explain", model_file, "--batch-size", 2, "--k", 2, "--max-new-tokens", 6, "--rounds", 1,
                    "--device", "cpu", "--json")
    assert result.exit_code == 0, result.output
    explained = json.loads(result.stdout)
    assert explained["batch_size"] == 2 and explained["strategy"] == "chain k=2"
    terms = explained["terms"]
    assert [t["name"] for t in terms][-1] == "overhead" and "target n=3" in [t["name"] for t in terms]
    assert sum(t["predicted_ms"] for t in terms) == pytest.approx(explained["step_ms"]["predicted"])
    assert sum(t["measured_ms"] for t in terms) == pytest.approx(explained["step_ms"]["measured"])
    assert explained["notes"][0].startswith("predictions use")


def test_explain_times_the_reference_pass_when_the_model_file_kept_it(tmp_path):
    """A model file with calibration's reference pass (5 ms here): explain times it again on the real target,
    before the one timed round and after it, and reports it against calibration's, in JSON and in a note."""
    profile = build_profile(roofline_latency(), batch_sizes=(1, 2, 4), context_lens=(64, 256), max_k=4,
                            acceptance=[0.6])
    profile["noise"] = {"reference": "target b=1 n=1 L=64",
                        "checks": [{"elapsed_s": 0.0, "median_ms": 5.0, "p10_ms": 4.9, "p90_ms": 5.2}]}
    write_profile(tmp_path / "profile.json", profile)
    assert invoke("fit", tmp_path / "profile.json", "-o", tmp_path / "model.json").exit_code == 0
    result = invoke("explain", tmp_path / "model.json", "--batch-size", 2, "--k", 2, "--max-new-tokens", 6,
                    "--rounds", 1, "--device", "cpu", "--threads", 1, "--json")
    assert result.exit_code == 0, result.output
    speed = json.loads(result.stdout)["machine_speed"]
    assert speed["reference"] == "target b=1 n=1 L=64" and speed["calibration_ms"] == 5.0 and speed["checks"] == 2
    assert speed["bench_ms"] > 0 and speed["slowdown"] == pytest.approx(speed["bench_ms"] / 5.0)
    assert any(note.startswith("the machine ran the reference pass") for note in json.loads(result.stdout)["notes"])
    profile["noise"]["reference"] = "draft b=1 n=1 L=64"  # not a target pass of one token: refused, naming --model
    write_profile(tmp_path / "profile.json", profile)
    assert invoke("fit", tmp_path / "profile.json", "-o", tmp_path / "bad.json").exit_code == 0
    assert_one_line_error(invoke("explain", tmp_path / "bad.json", "--batch-size", 2, "--k", 2, "--device", "cpu"),
                          "--model")


def test_explain_refuses_two_strategies(model_file):
    assert_one_line_error(invoke("explain", model_file, "--batch-size", 2, "--k", 2, "--tree", "0,1"),
                          "one of --k, --table and --tree")


def test_explain_prints_the_terms_and_names_the_largest(model_file):
    result = invoke("explain", model_file, "--batch-size", 1, "--k", 1, "--max-new-tokens", 5, "--rounds", 1,
                    "--device", "cpu")
    assert result.exit_code == 0, result.output
    assert "draft n=1" in result.stdout and "overhead" in result.stdout
    assert "the largest term is" in result.stdout


def test_bench_prints_the_paired_regret_and_the_decomposition():
    from types import SimpleNamespace

    from rich.console import Console

    from specbatch.console.explain import render_bench_fidelity

    explained = {"batch_size": 4, "context_len": 96, "strategy": "chain k=2", "steps": 10,
                 "tokens_per_step": {"predicted": 1.75, "measured": 1.625},
                 "step_ms": {"predicted": 20.0, "measured": 22.0},
                 "tokens_per_s": {"predicted": 350.0, "measured": 295.5}, "error": 0.184,
                 "terms": [{"name": "draft n=1", "role": "draft", "new_tokens": 1, "predicted_ms": 4.0,
                            "measured_ms": 5.0, "predicted_count": 2.0, "measured_count": 2.0,
                            "predicted_pass_ms": 2.0, "measured_pass_ms": 2.5, "mix_ms": 0.0, "time_ms": -1.0},
                           {"name": "overhead", "role": None, "new_tokens": None, "predicted_ms": 16.0,
                            "measured_ms": 17.0, "predicted_count": None, "measured_count": None,
                            "predicted_pass_ms": None, "measured_pass_ms": None, "mix_ms": 0.0, "time_ms": -1.0}],
                 "culprit": {"term": "tokens per step", "effect": 0.077}}
    regret = {"against": "k=2", "rounds": 5, "regret": 0.021, "ci95": [-0.01, 0.05], "goal": 0.03,
              "verdict": "not resolved"}
    console = Console(record=True, width=200)
    render_bench_fidelity(console, [SimpleNamespace(batch_size=4, explanation=explained, paired_regret=regret)])
    text = console.export_text()
    assert "not resolved" in text and "[-1.0%, 5.0%]" in text
    wide = {**regret, "regret": 0.11, "ci95": [0.04, 0.18], "verdict": "missed", "settled": False}
    console = Console(record=True, width=200)
    render_bench_fidelity(console, [SimpleNamespace(batch_size=4, explanation=None, paired_regret=wide)])
    assert "missed (interval wider than ±3 %)" in console.export_text()
    assert "the largest term is tokens per step (+7.7% on the predicted goodput)" in text
    assert "+4.5%" in text  # the draft pass time: -(-1.0) / 22 ms


def test_a_tokens_term_inside_its_sampling_interval_is_called_noise():
    import pytest

    from specbatch.perfmodel.explain import MeasuredSteps, explain
    from specbatch.perfmodel.acceptance import acceptance_from_user
    from specbatch.perfmodel.overhead import OverheadModel
    from specbatch.perfmodel.strategy import StepModel
    from specbatch.perfmodel.tree import Strategy

    from specbatch.console.explain import culprit_line, explanation_table

    # passes of no time and a 30 ms overhead: the measured steps below (30 ms, no passes timed) match it exactly
    model = StepModel(lambda role, b, n, L: 0.0, OverheadModel(((1, 2, 30.0),)), acceptance_from_user([0.8]))
    # 16 steps at b = 1, k = 2 (E = 2.44 exactly, Var 0.6464: a 95 % half-width of 1.96 x sqrt(0.6464 / 16) =
    # 0.394 over 16 steps, above what the samples below spread by)
    def measured(drawn, kept, square_sum):
        return MeasuredSteps(1, 16, 16 * 0.030, kept, (), drawn_tokens=drawn, drawn_square_sum=square_sum)
    # 46 drawn (14 steps of 3, 2 of 2): 2.875, 2.2 half-widths above 2.44 (the gpt2-large synthetic run's figure)
    far = explain(model, Strategy.from_k(2), measured(46, 44, 14 * 9 + 2 * 4), 96).to_json()
    assert far["tokens_per_step"]["drawn_halfwidth95"] == pytest.approx(1.959964 * (0.6464 / 16) ** 0.5)
    assert far["tokens_per_step"]["within_noise"] is False
    line = culprit_line(far)
    assert "the largest term is tokens per step" in line and "noise" not in line
    # 44 drawn (12 of 3, 4 of 2): 2.75, within 0.394 of 2.44
    near = explain(model, Strategy.from_k(2), measured(44, 42, 12 * 9 + 4 * 4), 96).to_json()
    assert near["tokens_per_step"]["within_noise"] is True
    assert "inside its 95 % sampling interval" in culprit_line(near) and "over 16 steps" in culprit_line(near)
    assert "cut at max new tokens" in explanation_table(near).columns[0].cells


def test_explain_has_the_force_its_refusal_suggests(tmp_path):
    """A model file made for another pair is refused with 'pass --force'; explain takes --force and runs."""
    profile = build_profile(roofline_latency(), batch_sizes=(1, 2, 4), context_lens=(64, 256), max_k=4,
                            acceptance=[0.6])
    profile["models"]["target"]["fingerprint"] = "ab" * 32  # not the demo target's
    write_profile(tmp_path / "profile.json", profile)
    assert invoke("fit", tmp_path / "profile.json", "-o", tmp_path / "model.json").exit_code == 0
    args = ("explain", tmp_path / "model.json", "--batch-size", 1, "--k", 1, "--max-new-tokens", 4, "--rounds", 1,
            "--device", "cpu", "--json")
    assert_one_line_error(invoke(*args), "was made for another pair", "--force")
    result = invoke(*args, "--force")
    assert result.exit_code == 0, result.output
