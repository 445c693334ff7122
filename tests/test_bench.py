"""`specbatch bench`: the harness on tiny random pairs (no wall-clock assertions) and the command's input errors.

What is checked: the bench.json / bench.csv contract, that every policy ran the configured rounds at
every batch size in rotated interleaved order, that synthetic acceptance delivers α within binomial
sampling error, the hindsight arithmetic (best k, regret, speedup) against hand-made timings, and
that missing optional packages (transformers, matplotlib) give a note instead of an error.
"""
from __future__ import annotations

import csv
import io
import json
import math
import sys

import pytest
from typer.testing import CliRunner

from calibrate.bench import (BENCH_SCHEMA, CSV_COLUMNS, HF_ASSISTED, HF_GREEDY, TABLE_POLICY, BenchConfig,
                           BenchError, BenchModels, RunRecord, check_context, cycled_prompts,
                           parse_sampling, random_prompts, rotated, run_bench, summarize_batch, summarize_policy,
                           write_outputs)
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
