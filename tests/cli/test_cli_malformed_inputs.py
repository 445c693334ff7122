"""Malformed inputs through the commands: profiles with times no machine measures, hand-edited model files,
a config.json with a negative size, seeds past 64 bits, contexts past the pair's positions, a table too
large to hold, an empty prompt, and temperatures or nucleus masses so small that computing them would
overflow float32 (they sample the argmax: greedy, their limit). Each is one `error:` line naming the file or
option, or (the tiny sampling settings) exactly the limit's output."""
from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch

from cli_helpers import assert_one_line_error, invoke
from perfmodel_fixtures import build_profile, roofline_latency, write_profile

SMALL = dict(batch_sizes=(1, 2, 4, 8), context_lens=(128, 512), max_k=3)


@pytest.fixture(scope="module")
def profile_json() -> dict:
    obj = build_profile(roofline_latency(), acceptance=[0.8, 0.75, 0.7], **SMALL)
    return json.loads(json.dumps(obj))


@pytest.fixture(scope="module")
def model_json(profile_json, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("malformed")
    profile = profile_json | {"acceptance": [profile_json["acceptance"][0] | {"rank_acceptance": [[0.7, 0.1]] * 3}]}
    write_profile(root / "profile.json", profile)
    assert invoke("fit", root / "profile.json", "-o", root / "model.json").exit_code == 0
    return json.loads((root / "model.json").read_text())


def written(tmp_path, obj: dict, name: str) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(obj))
    return str(path)


def edited(obj: dict, edit) -> dict:
    obj = copy.deepcopy(obj)
    edit(obj)
    return obj


# ---------------------------------------------------------------------------------------------- profiles
def every_time_huge(obj: dict) -> None:
    for row in obj["timings"]:
        if row["feasible"]:
            row.update(median_ms=row["median_ms"] * 1e200, p10_ms=row["p10_ms"] * 1e200, p90_ms=row["p90_ms"] * 1e200)


@pytest.mark.parametrize("edit, fragments", [
    (every_time_huge, ["timings[0].median_ms: expected a measured time in ms between 1e-06 and 1e+08"]),
    (lambda o: o["timings"][1].update(median_ms=0.0, p10_ms=0.0),
     ["timings[1].median_ms: a feasible row needs a positive time, found 0.0"]),
    (lambda o: o["acceptance"][0].update(step_counts_by_prompt=[[], [], []]),
     ["acceptance[0].step_counts_by_prompt: expected 3 non-empty lists"]),
    # a batch size whose KV cache alone is more than the device's memory, "measured" at 17 ms
    (lambda o: o["timings"][0].update(batch_size=10**9, median_ms=17.0, p10_ms=17.0, p90_ms=17.0),
     ["timings[0]: target b=1000000000 L=128 n=1 needs", "GiB of KV cache alone, more than the device's 80 GiB"]),
    (lambda o: o["overheads"][0].update(batch_size=10**9),
     ["overheads[0]: b=1000000000 k=0 needs more KV cache than the device's 80 GiB"]),
])
def test_a_profile_no_machine_measured_is_one_line_in_fit(profile_json, tmp_path, edit, fragments):
    path = written(tmp_path, edited(profile_json, edit), "profile.json")
    assert_one_line_error(invoke("fit", path, "-o", tmp_path / "m.json"), path, *fragments)
    assert not (tmp_path / "m.json").exists()


# ------------------------------------------------------------------------------------------- model files
@pytest.mark.parametrize("edit, fragment", [
    (lambda o: o["acceptance"][0].update(tokens_per_step=[1.0, 50.0, 2.5, 3.0]),
     "acceptance[0].tokens_per_step[1]: expected tokens per step in [1, 2], found 50"),
    (lambda o: o["overheads"][0].update(median_ms=-500.0), "overheads[0].median_ms: expected a measured time"),
    (lambda o: o["acceptance"][0].update(rank_acceptance=[[0.9, 0.9]] * 3), "rank_acceptance[0]: ranks sum to 1.8"),
    # hand edits that used to name a Python exception ("KeyError: 'roles'") or another field than the one at fault
    (lambda o: o.pop("roles"), ": roles: missing"),
    (lambda o: o["roles"].update(target=None), "roles.target: expected a JSON object, found null"),
    (lambda o: o["roles"]["target"]["roofline"].update(bandwidth_GBps=-2.0),
     "roles.target.roofline.bandwidth_GBps: must be > 0, found -2.0"),
    (lambda o: o["roles"]["draft"]["roofline"].update(flops_TFLOPs=0),
     "roles.draft.roofline.flops_TFLOPs: must be > 0"),
    (lambda o: o["roles"]["target"]["roofline"].update(overlap_exponent=0.5),
     "roles.target.roofline.overlap_exponent: must be >= 1, found 0.5"),
    (lambda o: o["roles"]["target"]["shape"].update(parameters=None),
     "roles.target.shape.parameters: expected an integer, found None"),
    (lambda o: o["roles"]["target"]["points"].update(rows=[[1, 1, 128]]),
     "roles.target.points.rows[0]: expected [batch_size, new_tokens, context_len, median_ms]"),
    (lambda o: o["roles"]["target"]["validation"]["worst"][0].pop("measured_ms"),
     "roles.target.validation.worst[0].measured_ms: missing"),
    (lambda o: o.update(acceptance=[None]), "acceptance[0]: expected a JSON object, found None"),
    (lambda o: o["acceptance"][0].update(constant_alpha="high"),
     "acceptance[0].constant_alpha: expected a number, found 'high'"),
    (lambda o: o.pop("created_utc"), ": created_utc: missing"),
])
def test_a_model_file_is_read_by_the_profiles_rules_in_table_and_query(model_json, tmp_path, edit, fragment):
    path = written(tmp_path, edited(model_json, edit), "model.json")
    assert_one_line_error(invoke("table", path, "-o", tmp_path / "t.json"), path, fragment)
    assert_one_line_error(invoke("query", path, "--batch-size", "1"), path, fragment)
    assert not (tmp_path / "t.json").exists()


def test_contexts_past_the_pairs_positions_are_refused(profile_json, model_json, tmp_path):
    path = written(tmp_path, model_json, "model.json")
    limit = min(model["max_position_embeddings"] for model in profile_json["models"].values())
    for args in (["table", path, "-o", tmp_path / "t.json", "--context-lens", "10000000"],
                 ["query", path, "--batch-size", "2", "--context-len", "100000000"]):
        assert_one_line_error(invoke(*args), "outside what the pair can hold", f"0..{limit} cached tokens")
    assert invoke("query", path, "--batch-size", "2", "--context-len", str(limit)).exit_code == 0


def test_a_table_too_large_to_hold_is_refused_before_any_work(model_json, tmp_path):
    path = written(tmp_path, model_json, "model.json")
    for args in (["table", path, "-o", tmp_path / "t.json", "--max-batch", "100000"],
                 ["plot", path, "-o", tmp_path / "p.png", "--max-batch", "100000"],
                 ["demo", "--out", tmp_path / "demo", "--max-batch", "100000"]):
        assert_one_line_error(invoke(*args), "--max-batch must be in [1, 4096], found 100000")
    assert list(tmp_path.iterdir()) == [tmp_path / "model.json"]


def test_the_largest_table_is_computed(model_json, tmp_path):
    from specbatch.perfmodel.table import MAX_TABLE_BATCH, load_table

    path = written(tmp_path, model_json, "model.json")
    result = invoke("table", path, "-o", tmp_path / "t.json", "--max-batch", MAX_TABLE_BATCH, "--context-lens", "256",
                    "--strategies", "chain")
    assert result.exit_code == 0, result.output
    entries = load_table(tmp_path / "t.json").buckets[0].entries
    assert [e.batch_size for e in entries] == list(range(1, MAX_TABLE_BATCH + 1))


# ------------------------------------------------------------------------------------------ model configs
@pytest.mark.parametrize("field, value, fragment", [
    ("hidden_size", -256, "hidden_size must be a positive integer, found -256"),
    ("num_hidden_layers", 0, "num_hidden_layers must be a positive integer, found 0"),
    ("vocab_size", 259.5, "vocab_size must be a positive integer, found 259.5"),
    ("num_key_value_heads", -4, "num_key_value_heads must be a positive integer, found -4"),
    ("num_key_value_heads", 3, "4 attention heads cannot be shared by 3 key-value heads"),
    # a dense family's name with an expert count: the field that made it mixture-of-experts is named
    ("num_local_experts", 8, "num_local_experts = 8 routes tokens among experts: the runtime's mixture-of-experts "
                             "families are qwen3_moe, mixtral, glm4_moe only"),
    ("n_routed_experts", 64, "n_routed_experts = 64 routes tokens among experts"),
])
def test_a_config_json_with_an_impossible_size_is_one_line(tmp_path, field, value, fragment):
    from specbatch.runtime.assembly import DEMO_TARGET

    target = tmp_path / "target"
    shutil.copytree(DEMO_TARGET, target)
    config = json.loads((target / "config.json").read_text()) | {field: value}
    (target / "config.json").write_text(json.dumps(config))
    result = invoke("generate", "--target", target, "--prompt", "x", "--max-new-tokens", "2", "--k", "0")
    assert_one_line_error(result, f"{target}/config.json", fragment)


def test_a_tokenizer_token_past_the_models_vocabulary_is_one_line(tmp_path):
    from specbatch.runtime.assembly import DEMO_TARGET

    target = tmp_path / "target"
    shutil.copytree(DEMO_TARGET, target)
    tokenizer = json.loads((target / "tokenizer.json").read_text())
    tokenizer["added_tokens"].append({"id": 300, "content": "<extra>", "single_word": False, "lstrip": False,
                                      "rstrip": False, "normalized": False, "special": False})
    (target / "tokenizer.json").write_text(json.dumps(tokenizer))
    result = invoke("generate", "--target", target, "--prompt", "a <extra> b", "--max-new-tokens", "2", "--k", "0")
    assert_one_line_error(result, f"--target {target}", "its tokenizer gives token id", "vocabulary has 259 tokens")


# ---------------------------------------------------------------------------------------------- seeds
@pytest.mark.parametrize("args", [
    ["generate", "--prompt", "x", "--seed", "99999999999999999999999"],
    ["generate", "--prompt", "x", "--seed", "-1"],
    ["bench", "--seed", str(2**63)],
])
def test_a_seed_past_64_bits_is_one_line(args):
    assert_one_line_error(invoke(*args), "--seed must be an integer in [0, 9223372036854775807]")


# ----------------------------------------------------------------------------------------- empty prompts
def test_an_empty_prompt_is_refused(tmp_path):
    assert_one_line_error(invoke("generate", "--prompt", ""), "prompt 1 of 1 is empty")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('"def f(x):"\n""\n')
    assert_one_line_error(invoke("generate", "--prompts-file", prompts), "prompt 2 of 2 is empty")


# ------------------------------------------------------------------------ temperatures and nucleus limits
def _generated(*sampling: str) -> dict:
    result = invoke("generate", "--prompt", "def fibonacci(n):", "--prompt", "import os\n", "--max-new-tokens", "12",
                    "--k", "3", "--seed", "7", "--json", *sampling)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_tiny_temperatures_and_nucleus_masses_give_the_greedy_output():
    greedy = _generated("--temperature", "0")
    for sampling in (["--temperature", "1e-320"], ["--temperature", "9.99e-6"],
                     ["--temperature", "0.8", "--top-p", "1e-300"], ["--temperature", "1.5", "--top-p", "5e-6"]):
        generated = _generated(*sampling)
        assert generated["sampling"] == "greedy"
        assert [o["token_ids"] for o in generated["outputs"]] == [o["token_ids"] for o in greedy["outputs"]]


def test_at_the_greedy_floor_sampling_is_computed_and_is_the_argmax():
    from specbatch.runtime.sampling import GREEDY_BELOW, Sampling, probabilities

    assert Sampling(temperature=1e-320) == Sampling() and Sampling(temperature=0.7, top_p=1e-300) == Sampling()
    at_floor = Sampling(temperature=GREEDY_BELOW)
    assert not at_floor.greedy and at_floor.temperature == GREEDY_BELOW
    logits = torch.tensor([[3.0, 2.99, -1.0, 40.0], [0.5, 0.49, 0.0, -7.0]])  # gaps >= 0.01: exp(-1000) is 0
    probs = probabilities(logits, at_floor)
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 4).float())
    nucleus = probabilities(logits, Sampling(temperature=1.0, top_p=GREEDY_BELOW))
    assert torch.equal(nucleus, torch.nn.functional.one_hot(logits.argmax(-1), 4).float())


@pytest.mark.parametrize("text", ["T=1e-9", "T=0.8,top_p=1e-300"])
def test_a_sampling_option_below_the_floor_asks_for_greedy(text):
    assert_one_line_error(invoke("bench", "--sampling", text), f"--sampling {text!r}", "below 1e-05",
                          "write 'greedy'")


@pytest.mark.parametrize(("option", "value"), [("--slo-ttft-ms", "-5"), ("--slo-tpot-ms", "0"),
                                               ("--slo-e2e-ms", "nan"), ("--max-duration-s", "0"),
                                               ("--requests", "0"), ("--rates", "-1"), ("--cvs", "0")])
def test_loadtest_numbers_that_describe_no_run_are_one_line_before_any_server_starts(tmp_path, option, value):
    result = invoke("loadtest", "--requests", "2", option, value, "--out", tmp_path / "out")
    assert_one_line_error(result, option)
    assert not (tmp_path / "out").exists()


def test_a_draft_with_another_tokenizer_of_the_same_size_is_one_line(tmp_path):
    """Same vocabulary size, two byte ids swapped: every draft token would mean another text."""
    from specbatch.runtime.assembly import DEMO_DRAFT, DEMO_TARGET

    draft = tmp_path / "draft"
    shutil.copytree(DEMO_DRAFT, draft)
    tokenizer = json.loads((draft / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = sorted(vocab, key=vocab.get)[97:99]
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (draft / "tokenizer.json").write_text(json.dumps(tokenizer))
    result = invoke("generate", "--target", DEMO_TARGET, "--draft", draft, "--prompt", "x", "--max-new-tokens", "2")
    assert_one_line_error(result, f"--draft {draft}", f"{draft}/tokenizer.json", "every draft token would be rejected")


def test_a_draft_without_tokenizer_files_is_said_to_be_unchecked(tmp_path):
    from specbatch.runtime.assembly import DEMO_DRAFT, DEMO_TARGET

    draft = tmp_path / "draft"
    shutil.copytree(DEMO_DRAFT, draft)
    (draft / "tokenizer.json").unlink()
    result = invoke("generate", "--target", DEMO_TARGET, "--draft", draft, "--prompt", "x", "--max-new-tokens", "2")
    assert result.exit_code == 0, result.output
    assert f"note: --draft {draft} has no tokenizer.json" in " ".join(result.stderr.split())
