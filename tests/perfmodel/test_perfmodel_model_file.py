"""A hand-edited model.json is read by the profile's rules: values a profile may not hold (more tokens per
step than a step can make, negative overheads, rank acceptance summing past 1) are one-line errors naming
the file and the field, never a silently wrong table."""
from __future__ import annotations

import copy
import json

import pytest

from specbatch.perfmodel.errors import PerfModelError
from specbatch.perfmodel.fit import fit_profile
from specbatch.perfmodel.model import model_from_json, model_to_json
from specbatch.perfmodel.profile import profile_from_json
from perfmodel_fixtures import build_profile, roofline_latency


@pytest.fixture(scope="module")
def model_json() -> dict:
    obj = build_profile(roofline_latency(), batch_sizes=(1, 2, 4, 8), context_lens=(128, 512), max_k=3,
                        acceptance=[0.7] * 3)
    obj["acceptance"][0]["rank_acceptance"] = [[0.7, 0.1]] * 3
    return json.loads(json.dumps(model_to_json(fit_profile(profile_from_json(obj)))))


def edited(obj: dict, edit) -> dict:
    obj = copy.deepcopy(obj)
    edit(obj)
    return obj


def set_tokens_per_step(obj: dict) -> None:
    obj["acceptance"][0]["tokens_per_step"] = [1.0, 50.0, 2.5, 3.0]


@pytest.mark.parametrize("edit, message", [
    (set_tokens_per_step, r"acceptance\[0\]\.tokens_per_step\[1\]: expected tokens per step in \[1, 2\], found 50"),
    (lambda o: o["overheads"][0].update(median_ms=-500.0), r"overheads\[0\]\.median_ms: expected a measured time"),
    (lambda o: o["overheads"][0].update(batch_size=0), r"overheads\[0\]\.batch_size: must be >= 1"),
    (lambda o: o["acceptance"][0].update(rank_acceptance=[[0.9, 0.9]] * 3), r"rank_acceptance\[0\]: ranks sum to 1.8"),
    (lambda o: o["acceptance"][0].update(per_position=[0.7, 1.5, 0.7]), r"per_position\[1\]: expected a probability"),
])
def test_a_value_the_profile_refuses_is_refused_in_the_model_file(model_json, edit, message):
    with pytest.raises(PerfModelError, match=message) as error:
        model_from_json(edited(model_json, edit), "m.json")
    assert str(error.value).startswith("m.json: ") and "\n" not in str(error.value)


def test_the_unedited_model_file_reads_back(model_json):
    fitted = model_from_json(model_json, "m.json")
    assert fitted.overhead.rows and fitted.acceptance[0].rank_acceptance == ((0.7, 0.1),) * 3


def test_contexts_past_the_pairs_positions_are_refused(model_json):
    from specbatch.perfmodel.model import choose_acceptance, compute_table, evaluate_strategy, query_strategies
    from specbatch.perfmodel.tree import Strategy

    fitted = model_from_json(model_json, "m.json")
    limit = fitted.max_context_len()
    acceptance = choose_acceptance(fitted, None)
    assert query_strategies(fitted, acceptance, 4, limit).best is not None  # the last position still answers
    for call in (lambda: compute_table(fitted, acceptance, 4, [10_000_000]),
                 lambda: query_strategies(fitted, acceptance, 4, limit + 1),
                 lambda: evaluate_strategy(fitted, Strategy.from_k(2), 4, 100_000_000)):
        with pytest.raises(PerfModelError, match=rf"outside what the pair can hold: 0..{limit} cached tokens"):
            call()
