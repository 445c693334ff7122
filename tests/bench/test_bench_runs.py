"""`run_bench` on a tiny random pair (no wall-clock assertions): what it writes and how it runs.

What is checked: the bench.json / bench.csv contract, that every policy ran the configured rounds at
every batch size in a balanced interleaved order, that synthetic acceptance delivers α within binomial
sampling error, the KV-cache margin, and that missing optional packages (transformers, matplotlib)
give a note instead of an error.
"""
from __future__ import annotations

import csv
import io
import json
import math
import sys

import pytest

from specbatch.bench.config import BenchConfig, BenchError, BenchModels
from specbatch.bench.harness import run_bench
from specbatch.bench.plan import balanced_order, check_context
from specbatch.bench.outputs import BENCH_SCHEMA, CSV_COLUMNS, write_outputs
from specbatch.bench.policies import HF_ASSISTED, HF_GREEDY, TABLE_POLICY, bench_policies
from specbatch.runtime.sampling import Sampling


@pytest.fixture(scope="module")
def small_run(tiny_pair, prompts, table_path, tmp_path_factory):
    """Batch sizes 1 and 3, k in {0, 1, 2} plus the table, 2 timed rounds after 1 warm-up round."""
    # resolve_rounds=0: the schema checks count rounds (extra paired rounds: test_bench_explain)
    config = BenchConfig(batch_sizes=(1, 3), ks=(1, 2), max_new_tokens=6, rounds=2, warmup_rounds=1,
                         resolve_rounds=0, synthetic_acceptance=0.7, table_path=table_path)
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
            assert policy["rounds"] == 2 and len(policy["wall_tokens_per_s"]) == 2
            low, median, high = (policy[f"{q}_wall_tokens_per_s"] for q in ("p10", "median", "p90"))
            assert low <= median <= high
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
    assert all(float(r["median_wall_tokens_per_s"]) > 0 for r in rows)


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
def test_runs_are_interleaved_in_a_balanced_order(small_run):
    result, _, _ = small_run
    for b in (1, 3):
        orders = []
        for round_index in (-1, 0, 1):
            orders.append([r.policy for r in result.runs if r.batch_size == b and r.round == round_index])
        for round_index, order in zip((-1, 0, 1), orders):
            assert sorted(order) == sorted(POLICIES)  # every policy once per round: never twice in a row
            assert order == balanced_order(POLICIES, round_index)
        assert len({tuple(order) for order in orders}) == 3
    # rounds run one after another, not all rounds of one policy first
    sequence = [(r.batch_size, r.round) for r in result.runs]
    assert sequence == sorted(sequence)


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


# ---------------------------------------------------------------------------------------------- optional packages
def test_peers_skipped_cleanly_without_transformers(tiny_pair, prompts, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now raises ImportError
    models = BenchModels(tiny_pair.target, tiny_pair.draft, "t", "d", target_dir=tmp_path, draft_dir=tmp_path)
    config = BenchConfig(batch_sizes=(1,), ks=(1,), max_new_tokens=3, rounds=1, warmup_rounds=0,
                         peers=("transformers",))
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


def test_peers_generate_exactly_max_new_tokens(tmp_path, prompts, vocab_size):
    transformers = pytest.importorskip("transformers")
    import torch

    from specbatch.runtime.checkpoint import load_checkpoint

    directories = []
    for name, layers in (("target", 2), ("draft", 1)):
        torch.manual_seed(layers)
        config = transformers.LlamaConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=layers,
                                          num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                          max_position_embeddings=128, pad_token_id=0,
                                          eos_token_id=list(range(1, vocab_size)))  # any token ends a row...
        transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / name)
        directories.append(tmp_path / name)
    target, draft = (load_checkpoint(d) for d in directories)
    models = BenchModels(target.model, draft.model, "t", "d", target_dir=directories[0], draft_dir=directories[1])
    config = BenchConfig(batch_sizes=(1, 2), ks=(2,), max_new_tokens=5, rounds=1, warmup_rounds=0,
                         peers=("transformers",))
    result = run_bench(config, models, prompts)
    ran = {(r.batch_size, r.policy): r.generated_tokens for r in result.runs}
    # ...unless EOS is ignored (ours) or suppressed with min_new_tokens (theirs)
    assert ran[(1, "k=0")] == ran[(1, "k=2")] == 5 and ran[(2, "k=2")] == 10
    assert ran[(1, HF_GREEDY)] == 5 and ran[(2, HF_GREEDY)] == 10 and ran[(1, HF_ASSISTED)] == 5
    assert (2, HF_ASSISTED) not in ran  # transformers refuses assisted generation above batch size 1
    assert {(r.ours, r.theirs) for r in result.batches[0].peer_ratios} >= {("k=0", HF_GREEDY)}


def test_context_margin_includes_the_largest_k(tiny_pair):
    config = BenchConfig(batch_sizes=(1,), ks=(0,), max_new_tokens=240)
    check_context(tiny_pair, [[1] * 10], config, max_k=6)  # 10 + 240 + 6 = 256: fits exactly
    with pytest.raises(BenchError, match="KV-cache margin"):
        check_context(tiny_pair, [[1] * 10], config, max_k=7)


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
