"""Trees, the n-gram second stage and --tree auto in `run_bench`, on a tiny random pair with real greedy
verification (trees refuse synthetic acceptance): stable names, what ran, predictions, refusals."""
from __future__ import annotations

import csv
import dataclasses
import io
import json
from pathlib import Path

import pytest

from specbatch.bench.config import BenchConfig, BenchError
from specbatch.bench.harness import run_bench
from specbatch.bench.outputs import CSV_COLUMNS, write_outputs
from specbatch.bench.policies import TABLE_POLICY, tree_policy_name

TREES = ("0,1,0.0", "chain:2")
STAGED_POLICIES = ["k=0", "k=1", "k=2", "tree:0,1,0.0", "tree:chain:2",
                   "k=1+ngram", "k=2+ngram", "tree:0,1,0.0+ngram", "tree:chain:2+ngram"]


@pytest.fixture(scope="module")
def staged_run(tiny_pair, prompts, ngram, tmp_path_factory):
    """Real greedy verification (trees refuse synthetic acceptance): chains, two trees, all staged too."""
    models = dataclasses.replace(tiny_pair, stage2=ngram)
    config = BenchConfig(batch_sizes=(1, 2), ks=(1, 2), max_new_tokens=6, rounds=2, warmup_rounds=0, trees=TREES)
    result = run_bench(config, models, prompts)
    out = tmp_path_factory.mktemp("staged")
    return result, out, write_outputs(result, out)


def test_tree_and_staged_policies_run_under_stable_names(staged_run, vocab_size):
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
    assert result.models["stage2"]["vocab_size"] == vocab_size
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
    assert tuple(rows[0]) == CSV_COLUMNS and CSV_COLUMNS[-2:] == ("strategy", "prediction_error")
    assert CSV_COLUMNS[:-2] == ("batch_size", "policy", "k", "median_wall_tokens_per_s", "p10_wall_tokens_per_s",
                                "p90_wall_tokens_per_s", "rounds", "acceptance", "median_steady_tokens_per_s",
                                "predicted_tokens_per_s", "synthetic_acceptance")  # the old columns, in order
    assert [(int(r["batch_size"]), r["policy"]) for r in rows] == [(b, p) for b in (1, 2) for p in STAGED_POLICIES]
    strategies = {r["policy"]: r["strategy"] for r in rows}
    assert strategies["k=2+ngram"] == "chain k=2 +ngram" and strategies["tree:chain:2"] == "chain k=2"


# -------------------------------------------------------------------------------- --tree auto and predictions
def _model_file(tmp_path, rank_acceptance):
    from specbatch.perfmodel.fit import fit_profile
    from specbatch.perfmodel.model import save_model
    from specbatch.perfmodel.profile import profile_from_json
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
    from specbatch.perfmodel.model import choose_acceptance, load_model, query_strategies

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
