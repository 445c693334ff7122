"""`specbatch generate | query` with trees and the n-gram second stage, on the bundled demo pair and
n-gram: lossless end to end (the same greedy text as plain decoding), and every bad input is one line."""
from __future__ import annotations

import json
import shutil

import pytest

from cli_helpers import assert_one_line_error, invoke
from perfmodel_fixtures import build_profile, roofline_latency, write_profile
from specbatch.runtime.ngram import NGramModel

NGRAM = "data/models/demo-ngram.safetensors"
PROMPT = "def fibonacci(n):"


def _generated(*options: str) -> list[int]:
    result = invoke("generate", "--prompt", PROMPT, "--max-new-tokens", "40", "--device", "cpu", "--json", *options)
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)["outputs"][0]["token_ids"]


@pytest.fixture(scope="module")
def plain_output():
    return _generated("--k", "0")


@pytest.mark.parametrize("options", [
    ("--tree", "0,1,0.0,0.1,1.0,0.0.0"),
    ("--tree", "0,1,0.0,0.0.0,0.0.0.0", "--stage2", NGRAM),
    ("--tree", "chain:5", "--stage2", NGRAM),
    ("--draft", NGRAM, "--k", "4"),  # the n-gram alone as the draft
    ("--draft", NGRAM, "--tree", "0,1,0.0"),
], ids=["tree", "staged-tree", "staged-chain", "ngram-chain", "ngram-tree"])
def test_trees_and_stages_give_plain_greedy_text(options, plain_output):
    assert _generated(*options) == plain_output


def test_bad_tree_specs_name_the_first_bad_path():
    assert_one_line_error(invoke("generate", "--prompt", "x", "--tree", "0,0.1"), "--tree", "0.1", "0.0")
    assert_one_line_error(invoke("generate", "--prompt", "x", "--tree", "0,1.0.0"), "--tree", "1.0.0", "parent")
    assert_one_line_error(invoke("generate", "--prompt", "x", "--tree", "[[0], [0, -1]]"), "--tree", "rank")
    assert_one_line_error(invoke("generate", "--prompt", "x", "--tree", "auto"), "--tree auto needs --model")


def test_tree_larger_than_the_cache_margin():
    huge = ",".join(str(rank) for rank in range(200))
    assert_one_line_error(invoke("generate", "--prompt", "x", "--tree", huge, "--max-new-tokens", "900"),
                          "draft tokens per step", "200")


def test_ngram_for_another_tokenizer_is_refused(tmp_path):
    other_vocab = tmp_path / "vocab300.safetensors"
    NGramModel.fit([[1, 2, 3, 4, 5] * 4], vocab_size=300).save(other_vocab)
    assert_one_line_error(invoke("generate", "--prompt", "x", "--tree", "0,1", "--stage2", other_vocab),
                          str(other_vocab), "300")
    other_tokenizer = tmp_path / "hash.safetensors"
    NGramModel.fit([[1, 2, 3, 4, 5] * 4], vocab_size=259, tokenizer_sha256="0" * 64).save(other_tokenizer)
    assert_one_line_error(invoke("generate", "--prompt", "x", "--tree", "0,1", "--stage2", other_tokenizer),
                          str(other_tokenizer), "tokenizer")
    not_ngram = tmp_path / "config.safetensors"
    shutil.copy("data/models/demo-draft/model.safetensors", not_ngram)
    assert_one_line_error(invoke("generate", "--prompt", "x", "--tree", "0,1", "--stage2", not_ngram), str(not_ngram))


@pytest.fixture(scope="module")
def tree_model(tmp_path_factory):
    """A GPU-like synthetic profile with per-rank acceptance, fitted."""
    root = tmp_path_factory.mktemp("tree_cli")
    profile = build_profile(roofline_latency(), acceptance=[0.8, 0.75], batch_sizes=(1, 2, 4, 8, 16),
                            context_lens=(128, 512), max_k=4)
    profile["acceptance"][0]["rank_acceptance"] = [[0.7, 0.15, 0.05]] * 4
    model = root / "model.json"
    assert invoke("fit", write_profile(root / "profile.json", profile), "-o", model).exit_code == 0
    return model


def test_query_ranks_trees_and_evaluates_one(tree_model):
    ranked = json.loads(invoke("query", tree_model, "--batch-size", "1", "--tree", "auto", "--json").stdout)
    kinds = {c["strategy"].split()[0] for c in ranked["candidates"]}
    assert {"none", "chain", "tree"} <= kinds
    best = max(ranked["candidates"], key=lambda c: c["tokens_per_s"])
    assert ranked["best_strategy"]["k"] == best["k"]
    one = json.loads(invoke("query", tree_model, "--batch-size", "1", "--tree", "0,1,0.0", "--json").stdout)
    assert [c["strategy"] for c in one["candidates"]] == ["none", "tree 0,1,0.0 (3 nodes)"]
    assert_one_line_error(invoke("query", tree_model, "--batch-size", "1", "--tree", "0,1", "--stage2", NGRAM),
                          "--stage2", "second-stage")
