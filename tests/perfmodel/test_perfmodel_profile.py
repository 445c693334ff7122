"""The specbatch.profile/1 reader: a valid file round-trips; a bad one is named field by field."""
from __future__ import annotations

import copy
import json

import pytest

from specbatch.perfmodel.errors import PerfModelError
from specbatch.perfmodel.profile import load_profile, save_profile
from perfmodel_fixtures import build_profile, roofline_latency

VALID = build_profile(roofline_latency(), batch_sizes=(1, 4), context_lens=(128,), max_k=2,
                      acceptance=[0.8, 0.7], infeasible=lambda role, b, n, L: role == "target" and b == 4 and n == 3)


def write(tmp_path, obj) -> str:
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(obj))
    return str(path)


def test_round_trip(tmp_path):
    profile = load_profile(write(tmp_path, VALID))
    assert profile.grid.max_k == 2 and profile.target.layers == 32
    assert len(profile.timings_of("target")) == 5 and len(profile.timings_of("target", feasible_only=False)) == 6
    assert profile.acceptance[0].per_position == (0.8, 0.7)
    out = tmp_path / "again.json"
    save_profile(out, profile)
    assert load_profile(out) == profile
    assert json.loads(out.read_text())["schema"] == "specbatch.profile/1"


def test_measured_tokens_per_step_round_trip_and_drive_the_model(tmp_path):
    from specbatch.perfmodel.acceptance import acceptance_from_profile

    obj = copy.deepcopy(VALID)
    obj["acceptance"][0]["tokens_per_step"] = [1.0, 1.6, 2.0]
    profile = load_profile(write(tmp_path, obj))
    assert profile.acceptance[0].tokens_per_step == (1.0, 1.6, 2.0)
    save_profile(tmp_path / "again.json", profile)
    assert load_profile(tmp_path / "again.json") == profile
    model = acceptance_from_profile(profile.acceptance[0])
    # measured E(k) wins over the product formula (which would give 1.8 and 2.36 here)
    assert [model.expected_tokens(k) for k in range(3)] == [1.0, 1.6, 2.0]


SHA = "0123456789abcdef" * 4


def with_tree_fields(obj: dict) -> dict:
    """VALID plus every optional field of trees and the second stage."""
    obj = copy.deepcopy(obj)
    obj["acceptance"][0]["rank_acceptance"] = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.0]]
    obj["stage2"] = {"file": "ngram.bin", "sha256": SHA, "guess_accuracy": [0.7, 0.4],
                     "query_overhead_ms": 0.05, "query_ms_per_context": 0.001}
    obj["overheads"].append({"batch_size": 1, "k": 2, "median_ms": 0.3, "p10_ms": 0.2, "p90_ms": 0.4, "reps": 5,
                             "tree_nodes": 6, "stage2": False})
    obj["overheads"].append({"batch_size": 1, "k": 2, "median_ms": 0.35, "p10_ms": 0.2, "p90_ms": 0.4, "reps": 5,
                             "tree_nodes": 6, "stage2": True})
    return obj


def test_tree_and_second_stage_fields_round_trip(tmp_path):
    profile = load_profile(write(tmp_path, with_tree_fields(VALID)))
    assert profile.acceptance[0].rank_acceptance == ((0.6, 0.2, 0.1), (0.5, 0.2, 0.0))
    assert profile.stage2.guess_accuracy == (0.7, 0.4) and profile.stage2.sha256 == SHA
    assert profile.stage2.query_ms(10) == pytest.approx(0.06) and profile.stage2.query_ms(0) == 0.0
    assert profile.stage2.accuracy(1) == 0.4 and profile.stage2.accuracy(5) == 0.0  # unmeasured ranks: never right
    tree_rows = [(row.tree_nodes, row.stage2) for row in profile.overheads if row.tree_nodes is not None]
    assert tree_rows == [(6, False), (6, True)]
    save_profile(tmp_path / "again.json", profile)
    assert load_profile(tmp_path / "again.json") == profile


def test_profiles_without_the_new_fields_mean_chains_only(tmp_path):
    profile = load_profile(write(tmp_path, VALID))
    assert profile.stage2 is None and profile.acceptance[0].rank_acceptance is None
    assert all(row.tree_nodes is None and not row.stage2 for row in profile.overheads)
    obj = copy.deepcopy(VALID)  # explicit nulls read the same as missing keys
    obj["stage2"] = None
    obj["acceptance"][0]["rank_acceptance"] = None
    for row in obj["overheads"]:
        row.update(tree_nodes=None, stage2=False)
    assert load_profile(write(tmp_path, obj)) == profile


@pytest.mark.parametrize("edit,message", [
    (lambda o: o["acceptance"][0].update(rank_acceptance=[]),
     r"acceptance\[0\].rank_acceptance: expected a non-empty list of rows"),
    (lambda o: o["acceptance"][0].update(rank_acceptance=[[0.5], []]),
     r"rank_acceptance\[1\]: expected a non-empty list of probabilities"),
    (lambda o: o["acceptance"][0].update(rank_acceptance=[[0.5, 0.1], [0.5]]),
     r"rank_acceptance\[1\]: has 1 ranks but row 0 has 2"),
    (lambda o: o["acceptance"][0].update(rank_acceptance=[[0.5, 1.2]]),
     r"rank_acceptance\[0\]\[1\]: expected a probability in \[0, 1\]"),
    (lambda o: o["acceptance"][0].update(rank_acceptance=[[0.5, 0.2], [0.7, 0.4]]),
     r"rank_acceptance\[1\]: ranks sum to 1.1 > 1"),
    (lambda o: o["stage2"].pop("file"), r"stage2.file: missing"),
    (lambda o: o["stage2"].update(sha256="abc"), r"stage2.sha256: expected 64 hexadecimal digits"),
    (lambda o: o["stage2"].update(guess_accuracy=[]), r"stage2.guess_accuracy: needs at least one value"),
    (lambda o: o["stage2"].update(guess_accuracy=[0.5, -0.1]), r"stage2.guess_accuracy\[1\]: expected a probability"),
    (lambda o: o["stage2"].update(query_ms_per_context=-1),
     r"stage2.query_ms_per_context: expected a measured time in ms between 1e-06 and 1e\+08, found -1"),
    (lambda o: o["overheads"][-1].update(tree_nodes=0), r"overheads\[\d+\].tree_nodes: must be >= 1"),
    (lambda o: o["overheads"][-1].update(tree_nodes=1), r"overheads\[\d+\].k: a tree of 1 nodes cannot be 2 deep"),
    (lambda o: o["overheads"][-1].update(stage2=1), r"overheads\[\d+\].stage2: expected true or false"),
    (lambda o: o["overheads"].append(dict(o["overheads"][-1])),
     r"duplicate \(batch_size, k, tree_nodes, stage2\) rows"),
])
def test_bad_tree_fields_name_the_file_and_field(tmp_path, edit, message):
    obj = with_tree_fields(VALID)
    edit(obj)
    path = write(tmp_path, obj)
    with pytest.raises(PerfModelError, match=message) as error:
        load_profile(path)
    assert str(error.value).startswith(path) and "\n" not in str(error.value)


def broken(edit) -> dict:
    obj = copy.deepcopy(VALID)
    edit(obj)
    return obj


@pytest.mark.parametrize("edit,message", [
    (lambda o: o.update(schema="specbatch.profile/2"), "schema 'specbatch.profile/2', expected 'specbatch.profile/1'"),
    (lambda o: o.pop("schema"), "no schema field, expected 'specbatch.profile/1'"),
    (lambda o: o["device"].pop("dtype"), r"device.dtype: missing"),
    (lambda o: o["device"].update(kind="tpu"), r"device.kind: 'tpu' is not one of cpu, cuda"),
    (lambda o: o["models"]["draft"].update(layers="12"), r"models.draft.layers: expected an integer, found '12'"),
    (lambda o: o["grid"].update(batch_sizes=[]), r"grid.batch_sizes: must not be empty"),
    (lambda o: o["timings"][1].update(median_ms=None), r"timings\[1\].median_ms: a feasible row needs a positive time"),
    (lambda o: o["timings"][1].update(model="verifier"), r"timings\[1\].model: 'verifier' is not one of target, draft"),
    (lambda o: o["timings"].append(dict(o["timings"][0])), r"duplicate row for target b=1 n=1 L=128"),
    (lambda o: o["acceptance"][0].update(per_position=[0.8, 1.5]),
     r"per_position\[1\]: expected a probability in \[0, 1\]"),
    (lambda o: o["acceptance"][0].update(trials=[10]), r"trials: has 1 values but per_position has 2"),
    (lambda o: o["overheads"][0].update(median_ms=-1), r"overheads\[0\].median_ms: expected a measured time in ms"),
    # times no machine measures: the fit's weights (1 / T^2) would overflow or vanish
    (lambda o: o["timings"][1].update(median_ms=1e300), r"timings\[1\].median_ms: expected a measured time in ms "
     r"between 1e-06 and 1e\+08, found 1e\+300"),
    (lambda o: o["timings"][1].update(p10_ms=1e-320), r"timings\[1\].p10_ms: expected a measured time in ms"),
    (lambda o: o["acceptance"][0].update(tokens_per_step=[1.0, 1.8]), r"tokens_per_step: expected a list of 3 values"),
    (lambda o: o["acceptance"][0].update(tokens_per_step=[1.0, 2.5, 2.0]),
     r"tokens_per_step\[1\]: expected tokens per step in \[1, 2\]"),
    (lambda o: o["acceptance"][0].update(step_counts_by_prompt=[[], []]),
     r"step_counts_by_prompt: expected 2 non-empty lists \(k = 1..2\) of equal length"),
])
def test_bad_profiles_name_the_file_and_field(tmp_path, edit, message):
    path = write(tmp_path, broken(edit))
    with pytest.raises(PerfModelError, match=message) as error:
        load_profile(path)
    assert str(error.value).startswith(path) and "\n" not in str(error.value)


def test_infeasible_rows_must_have_null_times(tmp_path):
    def edit(obj):
        row = next(r for r in obj["timings"] if not r["feasible"])
        row["median_ms"] = 3.0
    with pytest.raises(PerfModelError, match="an infeasible .* row must have null times"):
        load_profile(write(tmp_path, broken(edit)))


def test_not_json_and_missing_file(tmp_path):
    path = tmp_path / "profile.json"
    path.write_text("{not json")
    with pytest.raises(PerfModelError, match="profile.json: not valid JSON"):
        load_profile(path)
    with pytest.raises(PerfModelError, match="nothere.json: no such file"):
        load_profile(tmp_path / "nothere.json")


def test_the_committed_profiles_pass_the_noise_rule_or_their_readme_says_why_they_are_kept():
    from pathlib import Path

    from specbatch.perfmodel.profile import load_profile

    folder = Path(__file__).parents[2] / "data" / "profiles"
    readme = (folder / "README.md").read_text()
    paragraphs = {p.split("`")[1]: p for p in readme.split("\n- ") if p.startswith("`")}
    for path in sorted(folder.glob("*.json")):
        noise = load_profile(path).noise
        if noise is not None and noise.too_noisy:
            assert "noise rule" in paragraphs[path.name] and "kept because" in paragraphs[path.name], path.name
