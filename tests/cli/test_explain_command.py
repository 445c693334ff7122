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


def test_explain_refuses_two_strategies(model_file):
    assert_one_line_error(invoke("explain", model_file, "--batch-size", 2, "--k", 2, "--tree", "0,1"),
                          "one of --k, --table and --tree")
