"""Strategies end to end: E and step time by hand, the ranking, the table's choice on a synthetic GPU
profile (a tree at batch 1, a chain or nothing at large batch), and files without the new fields."""
from __future__ import annotations

import copy
import dataclasses

import pytest

from specbatch.perfmodel.acceptance import acceptance_from_user
from specbatch.perfmodel.errors import PerfModelError
from specbatch.perfmodel.fit import fit_profile
from specbatch.perfmodel.model import (choose_acceptance, compute_table, evaluate_strategy, model_from_json,
                                       model_to_json, query_strategies, strategy_family)
from specbatch.perfmodel.overhead import OverheadModel
from specbatch.perfmodel.profile import Stage2Info, profile_from_json
from specbatch.perfmodel.strategy import StepModel, candidate_strategies
from specbatch.perfmodel.table import load_table, save_table, table_from_json, to_csv, to_vllm
from specbatch.perfmodel.tree import Strategy, chain, parse_tree
from perfmodel_fixtures import build_profile, roofline_latency, tree_profile

RANKS = ((0.5, 0.3), (0.4, 0.2))
FAN = parse_tree("0,1,0.0,0.1,1.0")  # nodes 0, 1, 0.0, 0.1, 1.0: inner 0 and 1 at depth 1
STAGE2 = Stage2Info("ngram.bin", "ab" * 32, (0.0,), query_overhead_ms=0.05, query_ms_per_context=0.001)


def by_hand_latency(role: str, b: int, n: int, L: int) -> float:
    return 1.0 + 0.5 * n if role == "draft" else 10.0 + 0.1 * n


def step_model(per_position=(0.5,), tokens_per_step=None, ranks=RANKS, stage2=STAGE2, overhead=OverheadModel(())):
    acceptance = dataclasses.replace(acceptance_from_user(per_position), tokens_per_step=tokens_per_step,
                                     rank_acceptance=ranks)
    return StepModel(by_hand_latency, overhead, acceptance, stage2)


def test_tree_tokens_per_step_by_hand():
    model = step_model()
    # 1 + P(0) + P(1) + P(0.0) = 1 + 0.5 + 0.3 + 0.5 * 0.4
    assert model.tokens_per_step(Strategy(parse_tree("0,1,0.0"))) == pytest.approx(2.0)
    assert model.tokens_per_step(Strategy(FAN, stage2=True)) == pytest.approx(1 + 0.5 + 0.3 + 0.2 + 0.1 + 0.12)
    assert model.tokens_per_step(Strategy(None)) == 1.0
    # chains use the chain acceptance even when rank data exists: measured E(k) first, else per position
    assert model.tokens_per_step(Strategy(chain(2))) == pytest.approx(1 + 0.5 + 0.25)
    measured = step_model(tokens_per_step=(1.0, 1.4, 1.6))
    assert measured.tokens_per_step(Strategy(chain(2), stage2=True)) == 1.6


def test_tree_step_time_and_goodput_by_hand():
    candidate = step_model().evaluate(Strategy(FAN), 2, 100)
    p2 = 1 - (1 - (0.2 + 0.1 + 0.12)) ** 2  # some row's path ended at one of the leaves 0.0, 0.1, 1.0
    draft = p2 * 2.0 + (1 - p2) * 1.5 + 2.0  # catch-up of 2 or 1 tokens; one pass over the 2 depth-1 inner nodes
    assert candidate.draft_ms == pytest.approx(draft)
    assert candidate.target_ms == pytest.approx(10.6)  # one pass over root + 5 nodes
    assert candidate.step_ms == pytest.approx(draft + 10.6) and candidate.ngram_ms == 0.0
    assert candidate.tokens_per_s == pytest.approx(2 * 2.22 / (draft + 10.6) * 1e3)
    assert candidate.draft_passes == pytest.approx(2.0)


def test_staged_chain_step_time_by_hand():
    """A chain of 3 whose guesses are always wrong, one row: round 1 feeds w + 2, round 2 both inner
    nodes again, round 3 the second; one query per round, guessing 2, 1 and 0 nodes."""
    candidate = step_model().evaluate(Strategy(chain(3), stage2=True), 1, 0)
    p2 = 0.5 ** 3  # all three accepted: the catch-up is 2 tokens
    assert candidate.draft_ms == pytest.approx(p2 * 3.0 + (1 - p2) * 2.5 + 2.0 + 1.5)
    assert candidate.ngram_ms == pytest.approx(3 * 0.05 + 3 * 0.001)
    assert candidate.draft_passes == pytest.approx(3.0)
    assert candidate.step_ms == pytest.approx(candidate.draft_ms + 10.4 + candidate.ngram_ms)


def test_ranking_speedup_margin_and_ties_to_the_simpler_strategy():
    model = step_model()
    family = candidate_strategies(3, RANKS, stage2=True, family="all", max_tree_nodes=8)
    choice = model.choose(family, 1, 0)
    goodputs = [c.tokens_per_s for c in choice.ranked]
    assert goodputs == sorted(goodputs, reverse=True) and len(choice.ranked) == len(family)
    none = next(c for c in choice.ranked if c.strategy.kind == "none")
    assert choice.speedup == pytest.approx(choice.best.tokens_per_s / none.tokens_per_s)
    assert choice.margin == pytest.approx((goodputs[0] - goodputs[1]) / goodputs[0])
    # a grown tree that is a chain equals that chain: listed once
    assert len(set(family)) == len(family)
    # free drafting, flat verification, nothing ever accepted: every strategy ties, the simplest wins
    flat = StepModel(lambda role, b, n, L: 0.0 if role == "draft" else 10.0, OverheadModel(()),
                     dataclasses.replace(acceptance_from_user([1.0]), per_position=(0.0,)))
    tie = flat.choose([Strategy(chain(2)), Strategy(chain(1))], 1, 0)
    assert [c.tokens_per_s for c in tie.ranked] == [100.0] * 3
    assert [c.strategy.describe() for c in tie.ranked] == ["none", "chain k=2", "chain k=1"]


def test_trees_need_rank_acceptance_and_the_second_stage_its_measurements():
    with pytest.raises(PerfModelError, match="rank_acceptance"):
        step_model(ranks=None).evaluate(Strategy(FAN), 1, 0)
    with pytest.raises(PerfModelError, match="stage2 measurements"):
        step_model(stage2=None).evaluate(Strategy(FAN, stage2=True), 1, 0)
    assert step_model(ranks=None, stage2=None).evaluate(Strategy(chain(2)), 1, 0).tokens_per_step == 1.75
    with pytest.raises(PerfModelError, match="strategies: 'trees' is not one of chain, tree, all"):
        candidate_strategies(3, RANKS, family="trees")


def test_candidate_family():
    assert candidate_strategies(2) == (Strategy(None), Strategy(chain(1)), Strategy(chain(2)))
    assert candidate_strategies(2, RANKS, stage2=True, family="chain") == candidate_strategies(2)
    trees = [s for s in candidate_strategies(2, RANKS, family="tree", max_tree_nodes=12) if s.kind == "tree"]
    assert [s.tree.num_nodes for s in trees] == [4, 6]  # two ranks, two depths: at most 6 nodes exist
    assert all(s.k <= len(RANKS) and not s.stage2 for s in trees)
    staged = candidate_strategies(2, RANKS, stage2=True, max_tree_nodes=4)
    # grown by probability: 0 (0.5), 1 (0.3), 0.0 (0.2), then 1.0 (0.3 * 0.4) before 0.1 (0.5 * 0.2)
    assert [s.describe() for s in staged][-2:] == ["tree 0,1,0.0,1.0 (4 nodes)", "tree 0,1,0.0,1.0 (4 nodes) +ngram"]


# ---------------------------------------------------------------- end to end on a fitted synthetic profile
@pytest.fixture(scope="module")
def fitted():
    return fit_profile(profile_from_json(tree_profile()))


def test_table_picks_a_tree_at_batch_one_and_a_chain_or_nothing_at_large_batch(fitted, tmp_path):
    acceptance = choose_acceptance(fitted, None)
    table = compute_table(fitted, acceptance, 64, [128])
    entries = table.buckets[0].entries
    assert entries[0].strategy.kind == "tree" and entries[0].k == entries[0].strategy.k
    assert entries[-1].strategy.kind in ("chain", "none")
    assert entries[0].strategy.tree.num_nodes > entries[12].strategy.tree.num_nodes  # trees shrink with b
    assert table.max_k >= max(e.k for e in entries)
    save_table(tmp_path / "t.json", table)
    loaded = load_table(tmp_path / "t.json")
    assert [loaded.strategy(b, 128) for b in range(1, 65)] == [e.strategy for e in entries]
    assert [loaded.lookup(b, 128) for b in range(1, 65)] == [e.strategy.k for e in entries]
    (tmp_path / "config.json").write_text("{}")  # the draft directory vLLM would load
    with pytest.raises(PerfModelError, match="--format vllm: the table has strategies vllm cannot run .b = 1: tree"):
        to_vllm(loaded, draft=tmp_path)  # vLLM would run a chain of the tree's depth, which nobody predicted
    assert "tree 0,1" in to_csv(loaded).splitlines()[1]


def test_table_names_the_ngram_file_when_an_entry_uses_it(fitted):
    acceptance = choose_acceptance(fitted, None)
    slow_trees = dataclasses.replace(fitted, stage2=dataclasses.replace(fitted.stage2, guess_accuracy=(1.0,) * 3,
                                                                        query_overhead_ms=0.0))
    table = compute_table(slow_trees, acceptance, 4, [128])
    assert any(e.strategy.stage2 for e in table.buckets[0].entries)  # perfect free guesses: staging wins
    assert table.stage2 == {"file": "ngram.bin", "sha256": "ab" * 32}
    obj = table.to_json()
    del obj["stage2"]
    with pytest.raises(PerfModelError, match="t.json: stage2: missing, but entries use the n-gram second stage"):
        table_from_json(obj, "t.json")
    assert compute_table(fitted, acceptance, 4, [128], strategies="tree").stage2 is None


def test_chain_family_on_a_tree_profile_is_the_chain_table(fitted):
    acceptance = choose_acceptance(fitted, None)
    table = compute_table(fitted, acceptance, 16, [128], strategies="chain")
    assert all(e.strategy.kind in ("chain", "none") and not e.strategy.stage2 for e in table.buckets[0].entries)
    assert table.stage2 is None


def test_query_and_what_if_agree(fitted):
    acceptance = choose_acceptance(fitted, None)
    choice = query_strategies(fitted, acceptance, 1, 128)
    assert choice.best.strategy.kind == "tree"
    assert {c.strategy for c in choice.ranked} == set(strategy_family(fitted, acceptance))
    for candidate in choice.ranked[:5]:
        again = evaluate_strategy(fitted, candidate.strategy, 1, 128)
        assert again.tokens_per_s == pytest.approx(candidate.tokens_per_s, rel=1e-12)
    what_if = evaluate_strategy(fitted, Strategy(parse_tree("0,1,0.0"), stage2=True), 1, 128,
                                stage2=dataclasses.replace(fitted.stage2, guess_accuracy=(1.0,)))
    assert what_if.draft_passes == pytest.approx(1.0)  # perfect guesses: one draft round
    notes = fitted.strategy_notes([c.strategy for c in choice.ranked])
    assert any("verify up to 65 tokens per row" in note for note in notes)
    assert any("chain overhead at k = depth" in note for note in notes)


def test_model_file_carries_rank_acceptance_stage2_and_tree_overheads(fitted):
    obj = model_to_json(fitted)
    obj["tree_overheads"] = [{"batch_size": 1, "tree_nodes": 8, "stage2": True, "median_ms": 0.5}]
    again = model_from_json(obj, "m.json")
    assert again.stage2 == fitted.stage2
    assert again.acceptance[0].rank_acceptance == ((0.7, 0.15, 0.05),) * 4
    assert again.overhead.tree_rows == ((1, 8, True, 0.5),)
    assert again.overhead.step_overhead_ms(3, Strategy(parse_tree("0,1"), True)) == pytest.approx(0.5)
    obj["stage2"]["sha256"] = "nope"
    with pytest.raises(PerfModelError, match=r"m.json: stage2.sha256: expected 64 hexadecimal digits"):
        model_from_json(obj, "m.json")


# ---------------------------------------------------------------- files without the new fields

@pytest.fixture(scope="module")
def chain_model():
    obj = build_profile(roofline_latency(), batch_sizes=(1, 2, 4, 8, 16, 32), context_lens=(128, 512), max_k=4,
                        acceptance=[0.8, 0.75, 0.7, 0.7])
    obj["acceptance"][0]["tokens_per_step"] = [1.0, 1.7, 2.2, 2.5, 2.7]
    old = model_to_json(fit_profile(profile_from_json(obj)))
    # a model file from before trees: no tree overheads, no stage2, no rank acceptance
    del old["tree_overheads"], old["stage2"], old["acceptance"][0]["rank_acceptance"]
    return model_from_json(old, "old.json")


def test_old_model_gives_the_chain_table_of_before(chain_model):
    acceptance = choose_acceptance(chain_model, None)
    assert acceptance.rank_acceptance is None and chain_model.stage2 is None
    table = compute_table(chain_model, acceptance, 40, [128, 512])  # default family "all": chains here
    assert table.to_json()["buckets"] == compute_table(chain_model, acceptance, 40, [128, 512],
                                                       strategies="chain").to_json()["buckets"]
    assert "stage2" not in table.to_json()


def test_old_table_json_means_chains(chain_model):
    table = compute_table(chain_model, choose_acceptance(chain_model, None), 8, [128], strategies="chain")
    obj = copy.deepcopy(table.to_json())
    for entry in obj["buckets"][0]["entries"]:  # a table written before strategies existed
        del entry["strategy"], entry["runner_up_strategy"]
    old = table_from_json(obj, "old.json")
    assert [old.strategy(b) for b in range(1, 9)] == [Strategy.from_k(e.k) for e in table.buckets[0].entries]
    assert [old.lookup(b) for b in range(1, 9)] == [table.lookup(b) for b in range(1, 9)]


def test_bad_strategy_in_a_table_names_the_entry(chain_model):
    obj = compute_table(chain_model, choose_acceptance(chain_model, None), 2, [128]).to_json()
    obj["buckets"][0]["entries"][1].update(k=1, strategy=Strategy(parse_tree("0,1,0.0")).to_json())
    with pytest.raises(PerfModelError, match=r"t.json: buckets\[0\].entries\[1\].k: 1 is not its strategy's k 2"):
        table_from_json(obj, "t.json")
    obj["buckets"][0]["entries"][1]["strategy"] = {"kind": "tree", "k": 2, "tree": [[1]], "stage2": False}
    with pytest.raises(PerfModelError, match=r"entries\[1\].strategy.tree: path 1 has no lower-ranked sibling 0"):
        table_from_json(obj, "t.json")


@pytest.mark.parametrize("max_k", [0, 2])
def test_max_k_bounds_trees_too(fitted, max_k):
    """`table --max-k 2` with the default family: no tree deeper than 2 (the --max-k bound holds for trees too)."""
    table = compute_table(fitted, choose_acceptance(fitted, None), 16, [128], max_k=max_k)
    entries = table.buckets[0].entries
    assert max(e.k for e in entries) <= max_k and table.max_k == max_k
    assert all(e.strategy.tree is None or e.strategy.tree.depth <= max_k for e in entries)
