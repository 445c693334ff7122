"""`specbatch bench`: the harness on tiny random pairs (no wall-clock assertions) and the command's input errors.

What is checked: the bench.json / bench.csv contract, that every policy ran the configured rounds at
every batch size in rotated interleaved order, that synthetic acceptance delivers α within binomial
sampling error, the hindsight arithmetic (best k, regret, speedup) against hand-made timings, and
that missing optional packages (transformers, matplotlib) give a note instead of an error.
"""
from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from calibrate.bench import (BENCH_SCHEMA, CSV_COLUMNS, HF_ASSISTED, HF_GREEDY, TABLE_POLICY, BenchConfig,
                             BenchError, BenchModels, RunRecord, bench_policies, check_context, cycled_prompts,
                             parse_sampling, random_prompts, rotated, run_bench, summarize_batch, summarize_policy,
                             tree_policy_name, write_outputs)
from runtime.checkpoint import build_model
from runtime.sampling import Sampling

VOCAB = 64


@pytest.fixture(scope="module")
def tiny_pair(llama_config_factory):
    target = build_model(llama_config_factory(max_position_embeddings=256), seed=1)
    draft = build_model(llama_config_factory(num_layers=1, max_position_embeddings=256), seed=2)
    return BenchModels(target=target, draft=draft, target_source="tiny-target", draft_source="tiny-draft",
                       random_weights=True)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(5, 6, VOCAB, seed=3)


@pytest.fixture(scope="module")
def table_path(write_table):
    return write_table({1: 2, 2: 1, 3: 1})


@pytest.fixture(scope="module")
def small_run(tiny_pair, prompts, table_path, tmp_path_factory):
    """Batch sizes 1 and 3, k in {0, 1, 2} plus the table, 2 timed rounds after 1 warm-up round."""
    config = BenchConfig(batch_sizes=(1, 3), ks=(1, 2), max_new_tokens=6, rounds=2, warmup_rounds=1,
                         synthetic_acceptance=0.7, table_path=table_path)
    result = run_bench(config, tiny_pair, prompts)
    out = tmp_path_factory.mktemp("bench")
    written = write_outputs(result, out)
    return result, out, written


POLICIES = ["k=0", "k=1", "k=2", TABLE_POLICY]


# ---------------------------------------------------------------------------------------------- outputs
def test_bench_json_schema(small_run):
    result, out, written = small_run
    doc = json.loads((out / "bench.json").read_text())
    assert doc["schema"] == BENCH_SCHEMA
    assert "SYNTHETIC" in doc["synthetic"] and doc["config"]["synthetic_acceptance"] == 0.7
    assert doc["config"]["ks"] == [0, 1, 2] and doc["config"]["batch_sizes"] == [1, 3]
    assert {"kind", "name", "dtype", "torch_version", "cpu_threads"} <= set(doc["device"])
    assert doc["models"]["target"]["random_weights"] is True
    assert [entry["batch_size"] for entry in doc["batch_sizes"]] == [1, 3]
    for entry in doc["batch_sizes"]:
        assert [p["policy"] for p in entry["policies"]] == POLICIES
        assert {"best_k", "table_k", "table_regret", "table_speedup", "context_len"} <= set(entry)
        for policy in entry["policies"]:
            assert policy["rounds"] == 2 and len(policy["tokens_per_s"]) == 2
            assert policy["p10_tokens_per_s"] <= policy["median_tokens_per_s"] <= policy["p90_tokens_per_s"]
    assert len(doc["runs"]) == 2 * len(POLICIES) * (1 + 2)  # batch sizes x policies x (warm-up + timed)
    assert [run["order"] for run in doc["runs"]] == list(range(len(doc["runs"])))
    assert {path.name for path in written} == {"bench.json", "bench.csv", "goodput_vs_k.png", "speedup_vs_batch.png"}
    assert all((out / name).stat().st_size > 0 for name in ("goodput_vs_k.png", "speedup_vs_batch.png"))


def test_bench_csv_one_row_per_batch_size_and_policy(small_run):
    result, out, _ = small_run
    rows = list(csv.DictReader(io.StringIO((out / "bench.csv").read_text())))
    assert tuple(rows[0]) == CSV_COLUMNS
    assert [(int(r["batch_size"]), r["policy"]) for r in rows] == [(b, p) for b in (1, 3) for p in POLICIES]
    assert all(float(r["synthetic_acceptance"]) == 0.7 and int(r["rounds"]) == 2 for r in rows)
    assert all(r["acceptance"] == "" for r in rows if r["policy"] == "k=0")  # nothing proposed at k = 0
    assert all(float(r["median_tokens_per_s"]) > 0 for r in rows)


def test_every_policy_ran_every_round_at_every_batch_size(small_run):
    result, _, _ = small_run
    for b in (1, 3):
        for policy in POLICIES:
            rounds = [r.round for r in result.runs if r.batch_size == b and r.policy == policy]
            assert rounds == [-1, 0, 1]
            # EOS is ignored: every row produced exactly max_new_tokens
            assert all(r.generated_tokens == b * 6 for r in result.runs if r.batch_size == b)


def test_table_k_is_the_tables_k_at_full_batch(small_run):
    result, _, _ = small_run
    assert [batch.table_k for batch in result.batches] == [2, 1]  # the table maps 1 -> 2, 3 -> 1
    for batch in result.batches:
        table, best = batch.policy(TABLE_POLICY), batch.policy(f"k={batch.best_k}")
        # ranked on steady-state goodput (full-batch steps), which every run of ours reports
        assert table.median_steady_tokens_per_s is not None and best.median_steady_tokens_per_s is not None
        assert batch.table_regret == pytest.approx(
            1 - table.median_steady_tokens_per_s / best.median_steady_tokens_per_s)


# ---------------------------------------------------------------------------------------------- interleaving
def test_runs_are_interleaved_and_rotated(small_run):
    result, _, _ = small_run
    for b in (1, 3):
        orders = []
        for round_index in (-1, 0, 1):
            orders.append([r.policy for r in result.runs if r.batch_size == b and r.round == round_index])
        for order in orders:
            assert sorted(order) == sorted(POLICIES)  # every policy once per round: never twice in a row
        for previous, current in zip(orders, orders[1:]):
            assert current == rotated(previous, 1) and current != previous
    # rounds run one after another, not all rounds of one policy first
    sequence = [(r.batch_size, r.round) for r in result.runs]
    assert sequence == sorted(sequence)


def test_rotation_and_prompt_cycling_helpers():
    assert rotated(["a", "b", "c"], 0) == ["a", "b", "c"]
    assert rotated(["a", "b", "c"], 4) == ["b", "c", "a"]
    assert rotated(["a", "b", "c"], -1) == ["c", "a", "b"]
    assert cycled_prompts([[1], [2]], 5) == [[1], [2], [1], [2], [1]]
    assert cycled_prompts([[1], [2], [3]], 2, offset=2) == [[3], [1]]  # the next round takes the next prompts


# ---------------------------------------------------------------------------------------------- acceptance
def test_synthetic_acceptance_within_binomial_band(tiny_pair, prompts):
    alpha = 0.6
    config = BenchConfig(batch_sizes=(8,), ks=(4,), max_new_tokens=40, rounds=1, warmup_rounds=0,
                         synthetic_acceptance=alpha)
    policy = run_bench(config, tiny_pair, prompts).batches[0].policy("k=4")
    assert len(policy.trials_per_position) == 4
    assert policy.trials_per_position[0] >= 100  # enough draws for the band to mean something
    for rate, trials in zip(policy.acceptance_per_position, policy.trials_per_position):
        sigma = math.sqrt(alpha * (1 - alpha) / trials)
        assert abs(rate - alpha) <= 4 * sigma, (rate, trials)


def test_synthetic_acceptance_of_one_accepts_everything(tiny_pair, prompts):
    config = BenchConfig(batch_sizes=(2,), ks=(3,), max_new_tokens=12, rounds=1, warmup_rounds=0,
                         synthetic_acceptance=1.0)
    policy = run_bench(config, tiny_pair, prompts).batches[0].policy("k=3")
    assert policy.acceptance == 1.0 and policy.acceptance_per_position == [1.0, 1.0, 1.0]


def test_sampling_mode_runs_with_synthetic_acceptance(tiny_pair, prompts):
    config = BenchConfig(batch_sizes=(2,), ks=(2,), max_new_tokens=5, rounds=1, warmup_rounds=0,
                         synthetic_acceptance=0.5, sampling=Sampling(temperature=0.8))
    batch = run_bench(config, tiny_pair, prompts).batches[0]
    assert [p.policy for p in batch.policies] == ["k=0", "k=2"]


# ---------------------------------------------------------------------------------------------- arithmetic
def _records(policy: str, tokens_per_s: list[float], k: int | None = None) -> list[RunRecord]:
    """Hand-made timings: 100 tokens in 100 / rate seconds per round."""
    return [RunRecord(batch_size=4, round=i, policy=policy, generated_tokens=100, seconds=100 / rate, steps=10,
                      full_batch_steps=10, k_counts_full_batch={k: 10} if k is not None else {})
            for i, rate in enumerate(tokens_per_s)]


def test_best_k_regret_and_speedup_from_medians():
    policies = [summarize_policy("k=0", 0, _records("k=0", [100, 110, 90])),
                summarize_policy("k=1", 1, _records("k=1", [150, 140, 160])),
                summarize_policy("k=2", 2, _records("k=2", [150, 120, 300])),  # median 150: ties k=1
                summarize_policy(TABLE_POLICY, 2, _records(TABLE_POLICY, [135, 135, 135], k=2))]
    batch = summarize_batch(4, 64, policies, (0, 1, 2), has_peers=False)
    assert batch.best_k == 1  # ties go to the smaller k
    assert batch.best_tokens_per_s == pytest.approx(150)
    assert batch.table_regret == pytest.approx(0.1)  # 1 - 135 / 150
    assert batch.table_speedup == pytest.approx(1.35)  # 135 / 100
    assert policies[2].p10_tokens_per_s == pytest.approx(126) and policies[2].max_tokens_per_s == pytest.approx(300)


def test_peer_ratios_compare_medians():
    policies = [summarize_policy("k=0", 0, _records("k=0", [100])),
                summarize_policy("k=1", 1, _records("k=1", [150])),
                summarize_policy(HF_GREEDY, None, _records(HF_GREEDY, [50]))]
    batch = summarize_batch(4, 64, policies, (0, 1), has_peers=True)
    assert [(r.ours, r.theirs, r.ratio) for r in batch.peer_ratios] == [("k=0", HF_GREEDY, 2.0), ("k=1", HF_GREEDY, 3.0)]


# ---------------------------------------------------------------------------------------------- optional packages
def test_peers_skipped_cleanly_without_transformers(tiny_pair, prompts, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError
    models = BenchModels(tiny_pair.target, tiny_pair.draft, "t", "d", target_dir=tmp_path, draft_dir=tmp_path)
    config = BenchConfig(batch_sizes=(1,), ks=(1,), max_new_tokens=3, rounds=1, warmup_rounds=0, peers=True)
    result = run_bench(config, models, prompts)
    assert any("transformers is not installed" in note for note in result.notes)
    assert {r.policy for r in result.runs} == {"k=0", "k=1"}
    assert result.batches[0].peer_ratios == []


def test_plots_skipped_cleanly_without_matplotlib(small_run, tmp_path, monkeypatch):
    result, _, _ = small_run
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(result, "notes", list(result.notes))  # do not leak the note into other tests
    written = write_outputs(result, tmp_path)
    assert [path.name for path in written] == ["bench.json", "bench.csv"]
    assert "matplotlib is not installed" in json.loads((tmp_path / "bench.json").read_text())["notes"][-1]


def test_peers_generate_exactly_max_new_tokens(tmp_path, prompts):
    transformers = pytest.importorskip("transformers")
    import torch

    from runtime.checkpoint import load_checkpoint

    directories = []
    for name, layers in (("target", 2), ("draft", 1)):
        torch.manual_seed(layers)
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers,
                                          num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                          max_position_embeddings=128, pad_token_id=0,
                                          eos_token_id=list(range(1, VOCAB)))  # any token ends a row...
        transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / name)
        directories.append(tmp_path / name)
    target, draft = (load_checkpoint(d) for d in directories)
    models = BenchModels(target.model, draft.model, "t", "d", target_dir=directories[0], draft_dir=directories[1])
    config = BenchConfig(batch_sizes=(1, 2), ks=(2,), max_new_tokens=5, rounds=1, warmup_rounds=0, peers=True)
    result = run_bench(config, models, prompts)
    ran = {(r.batch_size, r.policy): r.generated_tokens for r in result.runs}
    # ...unless EOS is ignored (ours) or suppressed with min_new_tokens (theirs)
    assert ran[(1, "k=0")] == ran[(1, "k=2")] == 5 and ran[(2, "k=2")] == 10
    assert ran[(1, HF_GREEDY)] == 5 and ran[(2, HF_GREEDY)] == 10 and ran[(1, HF_ASSISTED)] == 5
    assert (2, HF_ASSISTED) not in ran  # transformers refuses assisted generation above batch size 1
    assert {(r.ours, r.theirs) for r in result.batches[0].peer_ratios} >= {("k=0", HF_GREEDY)}


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("changes, message", [
    (dict(synthetic_acceptance=0.0), "--synthetic-acceptance"),
    (dict(synthetic_acceptance=1.5), "--synthetic-acceptance"),
    (dict(ks=()), "--ks"),
    (dict(ks=(-1,)), "--ks"),
    (dict(rounds=0), "--rounds"),
    (dict(synthetic_acceptance=0.5, peers=True), "--peers"),
])
def test_config_refuses_bad_values(changes, message):
    with pytest.raises(BenchError, match=message):
        BenchConfig(**changes)


def test_context_margin_includes_the_largest_k(tiny_pair):
    config = BenchConfig(batch_sizes=(1,), ks=(0,), max_new_tokens=240)
    check_context(tiny_pair, [[1] * 10], config, max_k=6)  # 10 + 240 + 6 = 256: fits exactly
    with pytest.raises(BenchError, match="KV-cache margin"):
        check_context(tiny_pair, [[1] * 10], config, max_k=7)


@pytest.mark.parametrize("text, expected", [
    ("greedy", Sampling()), ("T=0.8", Sampling(temperature=0.8)),
    ("T=1,top_k=5,top_p=0.9", Sampling(temperature=1.0, top_k=5, top_p=0.9)),
])
def test_parse_sampling(text, expected):
    assert parse_sampling(text) == expected


@pytest.mark.parametrize("text", ["hot", "T=0", "T=x", "top_k=5", "T=0.8,top_p=2"])
def test_parse_sampling_refuses(text):
    with pytest.raises(BenchError, match="--sampling"):
        parse_sampling(text)


@pytest.fixture(scope="module")
def cli_pair(tmp_path_factory):
    """Two tiny Hugging Face directories without tokenizer (the bench then uses 64-token random prompts)."""
    transformers = pytest.importorskip("transformers")
    root = tmp_path_factory.mktemp("cli_pair")
    for name, layers in (("target", 2), ("draft", 1)):
        config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=layers,
                                          num_attention_heads=2, num_key_value_heads=1, intermediate_size=32,
                                          max_position_embeddings=96, eos_token_id=2, pad_token_id=0)
        transformers.LlamaForCausalLM(config).save_pretrained(root / name)
    return str(root / "target"), str(root / "draft")


def _invoke(args):
    from cli import app

    return CliRunner().invoke(app, ["bench", *args])


@pytest.mark.parametrize("args, message", [
    (["--synthetic-acceptance", "0"], "--synthetic-acceptance"),
    (["--synthetic-acceptance", "1.01"], "--synthetic-acceptance"),
    (["--ks", ""], "--ks"),
    (["--ks", "0,x"], "--ks"),
    (["--batch-sizes", "0"], "--batch-sizes"),
    (["--rounds", "0"], "--rounds"),
    (["--sampling", "warm"], "--sampling"),
    (["--table", "/no/such/table.json"], "--table"),
    (["--target", "no-such-preset", "--synthetic-acceptance", "0.8"], "--target"),
    (["--target", "gpt2", "--draft", "gpt2"], "--synthetic-acceptance"),  # random weights need α
])
def test_cli_bad_input_is_one_line_exit_2(args, message):
    result = _invoke(args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0]


def test_cli_refuses_table_beyond_the_cache_margin(cli_pair, write_table, tmp_path):
    target, draft = cli_pair
    table = write_table({1: 12})  # 64 prompt + 24 new + 12 > 96 positions
    result = _invoke(["--target", target, "--draft", draft, "--table", table, "--ks", "0,1", "--batch-sizes", "1",
                      "--max-new-tokens", "24", "--out", str(tmp_path)])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "KV-cache margin" in lines[0]


def test_cli_json_is_one_object(cli_pair, tmp_path):
    target, draft = cli_pair
    result = _invoke(["--target", target, "--draft", draft, "--ks", "0,1", "--batch-sizes", "1,2", "--rounds", "1",
                      "--max-new-tokens", "3", "--synthetic-acceptance", "0.5", "--out", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["schema"] == BENCH_SCHEMA and "SYNTHETIC" in doc["synthetic"]
    assert sorted(doc["outputs"]) == sorted(str(tmp_path / name) for name in
                                            ("bench.json", "bench.csv", "goodput_vs_k.png", "speedup_vs_batch.png"))


# ---------------------------------------------------------------------------------------------- trees and the second stage
TREES = ("0,1,0.0", "chain:2")
STAGED_POLICIES = ["k=0", "k=1", "k=2", "tree:0,1,0.0", "tree:chain:2",
                   "k=1+ngram", "k=2+ngram", "tree:0,1,0.0+ngram", "tree:chain:2+ngram"]


@pytest.fixture(scope="module")
def ngram():
    """A tiny second stage over the test vocabulary: a trigram model of random sequences."""
    from runtime.ngram import NGramModel

    return NGramModel.fit(random_prompts(20, 30, VOCAB, seed=9), VOCAB)


@pytest.fixture(scope="module")
def staged_run(tiny_pair, prompts, ngram, tmp_path_factory):
    """Real greedy verification (trees refuse synthetic acceptance): chains, two trees, all staged too."""
    models = dataclasses.replace(tiny_pair, stage2=ngram)
    config = BenchConfig(batch_sizes=(1, 2), ks=(1, 2), max_new_tokens=6, rounds=2, warmup_rounds=0, trees=TREES)
    result = run_bench(config, models, prompts)
    out = tmp_path_factory.mktemp("staged")
    return result, out, write_outputs(result, out)


def test_tree_and_staged_policies_run_under_stable_names(staged_run):
    result, _, written = staged_run
    for batch in result.batches:
        assert [p.policy for p in batch.policies] == STAGED_POLICIES
        assert all(r.generated_tokens == batch.batch_size * 6 for r in result.runs if r.batch_size == batch.batch_size)
        shown = {p.policy: (p.k, p.nodes, p.strategy) for p in batch.policies}
        assert shown["k=0"] == (0, 0, "none") and shown["k=2"] == (2, 2, "chain k=2")
        assert shown["tree:0,1,0.0"] == (2, 3, "tree 0,1,0.0 (3 nodes)")  # k is the depth, nodes the tree's size
        assert shown["tree:chain:2"] == (2, 2, "chain k=2")
        assert shown["k=1+ngram"] == (1, 1, "chain k=1 +ngram")
        assert shown["tree:0,1,0.0+ngram"] == (2, 3, "tree 0,1,0.0 (3 nodes) +ngram")
        tree = batch.policy("tree:0,1,0.0")
        assert tree.acceptance is not None and len(tree.trials_per_position) == 2  # per depth
        assert set(batch.strategy_comparison) == {"best_chain", "best_tree", "best_staged"}
        assert batch.strategy_comparison["best_chain"]["policy"] == f"k={batch.best_k}"
        assert batch.strategy_comparison["best_tree"]["policy"].startswith("tree:")
        assert batch.strategy_comparison["best_staged"]["policy"].endswith("+ngram")
    assert result.models["stage2"]["vocab_size"] == VOCAB
    assert {path.name for path in written} >= {"goodput_vs_k.png", "speedup_vs_batch.png"}  # the plots cope


def test_bench_json_and_csv_carry_the_strategy(staged_run):
    result, out, _ = staged_run
    doc = json.loads((out / "bench.json").read_text())
    assert doc["config"]["trees"] == list(TREES) and doc["config"]["stage2"] is None
    for entry in doc["batch_sizes"]:
        by_name = {p["policy"]: p for p in entry["policies"]}
        assert by_name["tree:0,1,0.0+ngram"]["strategy"] == "tree 0,1,0.0 (3 nodes) +ngram"
        assert by_name["tree:0,1,0.0+ngram"]["nodes"] == 3 and by_name["tree:0,1,0.0+ngram"]["k"] == 2
        comparison = entry["strategy_comparison"]
        assert comparison["best_chain"]["vs_best_chain"] == pytest.approx(1.0)
        for value in comparison.values():
            assert {"policy", "strategy", "steady_tokens_per_s", "vs_plain", "vs_best_chain"} <= set(value)
            assert value["steady_tokens_per_s"] > 0
    rows = list(csv.DictReader(io.StringIO((out / "bench.csv").read_text())))
    assert tuple(rows[0]) == CSV_COLUMNS and CSV_COLUMNS[-1] == "strategy"
    assert CSV_COLUMNS[:-1] == ("batch_size", "policy", "k", "median_tokens_per_s", "p10_tokens_per_s",
                                "p90_tokens_per_s", "rounds", "acceptance", "median_steady_tokens_per_s",
                                "predicted_tokens_per_s", "synthetic_acceptance")  # the old columns, in order
    assert [(int(r["batch_size"]), r["policy"]) for r in rows] == [(b, p) for b in (1, 2) for p in STAGED_POLICIES]
    strategies = {r["policy"]: r["strategy"] for r in rows}
    assert strategies["k=2+ngram"] == "chain k=2 +ngram" and strategies["tree:chain:2"] == "chain k=2"


def test_old_configs_give_exactly_the_old_policies(small_run):
    result, out, _ = small_run
    assert list(bench_policies((0, 1, 2))) == ["k=0", "k=1", "k=2"]
    for batch in result.batches:
        assert [p.policy for p in batch.policies] == POLICIES
        assert batch.strategy_comparison["best_tree"] is None and batch.strategy_comparison["best_staged"] is None
        assert batch.strategy_comparison["best_chain"]["policy"] == f"k={batch.best_k}"
    rows = list(csv.DictReader(io.StringIO((out / "bench.csv").read_text())))
    assert {r["policy"]: r["strategy"] for r in rows if r["batch_size"] == "1"} == {
        "k=0": "none", "k=1": "chain k=1", "k=2": "chain k=2", TABLE_POLICY: "chain k=2"}


def test_comparison_picks_the_best_of_each_family():
    def summary(name, rates, k):
        return summarize_policy(name, k, _records(name, rates))

    policies = [summary("k=0", [100, 100, 100], 0), summary("k=1", [150, 160, 140], 1),
                summary("k=2", [170, 170, 170], 2), summary("tree:0,1,0.0", [180, 180, 180], 2),
                summary("tree:0,1,2,0.0", [220, 230, 210], 2), summary("k=2+ngram", [190, 190, 190], 2),
                summary("tree:0,1,0.0+ngram", [255, 255, 255], 2), summary("tree:0,1,2,0.0+ngram", [240, 250, 260], 2),
                summary(TABLE_POLICY, [400, 400, 400], 2)]  # the table has its own regret: never compared here
    comparison = summarize_batch(1, 64, policies, (0, 1, 2), has_peers=False).strategy_comparison
    assert comparison["best_chain"]["policy"] == "k=2"
    assert comparison["best_chain"]["vs_plain"] == pytest.approx(1.7) and comparison["best_chain"]["vs_best_chain"] == 1.0
    assert comparison["best_tree"]["policy"] == "tree:0,1,2,0.0"
    assert comparison["best_tree"]["steady_tokens_per_s"] == pytest.approx(220)
    assert comparison["best_tree"]["vs_best_chain"] == pytest.approx(220 / 170)
    # ranked by median: 255 beats the other staged tree's 250 (despite its p90 of 260) and the staged chain's 190
    assert comparison["best_staged"]["policy"] == "tree:0,1,0.0+ngram"
    assert comparison["best_staged"]["vs_plain"] == pytest.approx(2.55)
    assert comparison["best_staged"]["vs_best_chain"] == pytest.approx(255 / 170)


def test_comparison_ties_go_to_the_policy_run_first():
    policies = [summarize_policy(name, k, _records(name, [rate])) for name, k, rate in
                [("k=0", 0, 100), ("k=1", 1, 120), ("tree:0,1", 1, 130), ("tree:0,1,2", 1, 130)]]
    comparison = summarize_batch(1, 64, policies, (0, 1), has_peers=False).strategy_comparison
    assert comparison["best_tree"]["policy"] == "tree:0,1" and comparison["best_staged"] is None


def test_long_tree_specs_give_short_unique_names():
    from perfmodel.tree import parse_tree

    wide = ",".join(str(r) for r in range(16))  # 37 characters: one more path passes the 40 of a name
    first, second = parse_tree(wide + ",0.0"), parse_tree(wide + ",1.0")
    names = list(bench_policies((0,), trees=[first, second, first], stage2=True))
    assert names == ["k=0", f"tree:{wide},...(17 nodes)", f"tree:{wide},...(17 nodes) #2",
                     f"tree:{wide},...(17 nodes)+ngram", f"tree:{wide},...(17 nodes) #2+ngram"]


# ---------------------------------------------------------------------------------------------- --tree auto and predictions
def _model_file(tmp_path, rank_acceptance):
    from perfmodel.model import fit_profile, save_model
    from perfmodel.profile import profile_from_json
    from perfmodel_fixtures import build_profile, roofline_latency

    obj = build_profile(roofline_latency(), batch_sizes=(1, 2, 4, 8), context_lens=(128, 512), max_k=4,
                        acceptance=[0.7] * 4)
    obj["acceptance"][0]["rank_acceptance"] = rank_acceptance
    path = tmp_path / "model.json"
    save_model(path, fit_profile(profile_from_json(obj)))
    return path


def test_tree_auto_without_a_model_is_one_line():
    with pytest.raises(BenchError, match="--tree auto needs --model") as error:
        BenchConfig(trees=("auto",))
    assert "\n" not in str(error.value)


def test_tree_auto_without_rank_acceptance_is_one_line(tiny_pair, prompts, tmp_path):
    config = BenchConfig(batch_sizes=(1,), ks=(1,), max_new_tokens=3, rounds=1, warmup_rounds=0, trees=("auto",),
                         model_path=_model_file(tmp_path, None))
    with pytest.raises(BenchError, match="--tree auto: .* has no rank acceptance") as error:
        run_bench(config, tiny_pair, prompts)
    assert "\n" not in str(error.value)


def test_tree_auto_becomes_the_models_best_tree_and_trees_are_predicted(tiny_pair, prompts, ngram, tmp_path):
    from perfmodel.model import choose_acceptance, load_model, query_strategies

    model_path = _model_file(tmp_path, [[0.7, 0.15, 0.05]] * 4)
    models = dataclasses.replace(tiny_pair, stage2=ngram)
    config = BenchConfig(batch_sizes=(1,), ks=(1,), max_new_tokens=4, rounds=1, warmup_rounds=0,
                         trees=("auto", "0,1"), model_path=model_path)
    result = run_bench(config, models, prompts)
    fitted = load_model(model_path)
    context = result.batches[0].context_len  # batch size 1's context: where auto was resolved
    ranked = query_strategies(fitted, choose_acceptance(fitted, None), 1, context, strategies="tree").ranked
    expected = next(c.strategy.tree for c in ranked if c.strategy.kind == "tree")  # no stage2 data in the model
    auto = tree_policy_name(expected)
    batch = result.batches[0]
    assert [p.policy for p in batch.policies] == ["k=0", "k=1", auto, "tree:0,1", "k=1+ngram", auto + "+ngram",
                                                  "tree:0,1+ngram"]
    assert any(note.startswith(f"--tree auto became {auto}") for note in result.notes)
    assert batch.policy(auto).nodes == expected.num_nodes
    # trees predicted from the rank acceptance; the model has no second-stage data: no prediction, one note
    assert all(batch.policy(name).predicted_tokens_per_s > 0 for name in ("k=0", "k=1", auto, "tree:0,1"))
    assert all(p.predicted_tokens_per_s is None for p in batch.policies if p.policy.endswith("+ngram"))
    staged_notes = [note for note in result.notes if note.startswith("no prediction for")]
    assert len(staged_notes) == 1 and "k=1+ngram" in staged_notes[0] and "second stage" in staged_notes[0]


# ---------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize("changes, message", [
    (dict(synthetic_acceptance=0.5, trees=("0,1",)), "--tree cannot be combined with --synthetic-acceptance"),
    (dict(synthetic_acceptance=0.5, stage2_path=Path("n.bin")), "--stage2 cannot be combined"),
    (dict(trees=("0,1.0",)), "--tree: path 1.0 has no parent 1"),
    (dict(trees=("chain:0",)), "--tree"),
])
def test_config_refuses_trees_it_cannot_run(changes, message):
    with pytest.raises(BenchError, match=message):
        BenchConfig(**changes)


def test_staged_and_tree_runs_refuse_what_they_lack(tiny_pair, prompts, ngram):
    config = BenchConfig(batch_sizes=(1,), ks=(1,), max_new_tokens=3, rounds=1, warmup_rounds=0,
                         stage2_path=Path("ngram.bin"))
    with pytest.raises(BenchError, match="--stage2 ngram.bin: the n-gram model was not loaded"):
        run_bench(config, tiny_pair, prompts)
    no_draft = dataclasses.replace(tiny_pair, draft=None)
    with pytest.raises(BenchError, match="--tree needs a draft model"):
        run_bench(BenchConfig(batch_sizes=(1,), ks=(0,), trees=("0,1",)), no_draft, prompts)
    big = BenchConfig(batch_sizes=(1,), ks=(1,), max_new_tokens=240, trees=(",".join(str(r) for r in range(20)),))
    with pytest.raises(BenchError, match="KV-cache margin"):  # 6 + 240 + 20 nodes > 256 positions
        run_bench(big, tiny_pair, prompts)
    synthetic = BenchConfig(batch_sizes=(1,), ks=(1,), max_new_tokens=3, synthetic_acceptance=0.5)
    with pytest.raises(BenchError, match="--stage2 cannot be combined with --synthetic-acceptance"):
        run_bench(synthetic, dataclasses.replace(tiny_pair, stage2=ngram), prompts)


def test_a_tree_table_runs_and_says_what_it_ran(tiny_pair, prompts, write_table):
    path = Path(write_table({1: 2, 2: 1}, name="tree_table.json"))
    obj = json.loads(path.read_text())
    tree = {"kind": "tree", "k": 2, "tree": [[0], [1], [0, 0]], "stage2": False}
    obj["buckets"][0]["entries"][0]["strategy"] = tree  # batch size 1: a tree of depth 2
    obj["max_k"] = 3
    path.write_text(json.dumps(obj))
    config = BenchConfig(batch_sizes=(1, 2), ks=(1,), max_new_tokens=4, rounds=1, warmup_rounds=0, table_path=path)
    one, two = run_bench(config, tiny_pair, prompts).batches
    assert (one.policy(TABLE_POLICY).strategy, one.policy(TABLE_POLICY).nodes) == ("tree 0,1,0.0 (3 nodes)", 3)
    assert (two.policy(TABLE_POLICY).strategy, two.policy(TABLE_POLICY).nodes) == ("chain k=1", 1)
    with pytest.raises(BenchError, match="--synthetic-acceptance fakes acceptance for plain chains only"):
        run_bench(dataclasses.replace(config, synthetic_acceptance=0.5), tiny_pair, prompts)
    obj["buckets"][0]["entries"][0]["strategy"]["stage2"] = True
    obj["stage2"] = {"file": "ngram.bin", "sha256": "ab" * 32}
    path.write_text(json.dumps(obj))
    with pytest.raises(BenchError, match="second stage; pass --stage2 FILE"):
        run_bench(config, tiny_pair, prompts)
