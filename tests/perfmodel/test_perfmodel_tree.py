"""perfmodel.tree.Strategy: what a step runs, as data; its JSON round-trips and bad JSON names the field."""
from __future__ import annotations

import json

import pytest

from specbatch.perfmodel.errors import PerfModelError
from specbatch.perfmodel.tree import Strategy, TreeSpecError, chain, parse_tree

TREE = parse_tree("0,1,0.0")


@pytest.mark.parametrize("strategy,kind,k,text", [
    (Strategy(None), "none", 0, "none"),
    (Strategy(chain(0)), "none", 0, "none"),  # a chain of 0 is no speculation
    (Strategy.from_k(0), "none", 0, "none"),
    (Strategy(chain(4)), "chain", 4, "chain k=4"),
    (Strategy.from_k(3, stage2=True), "chain", 3, "chain k=3 +ngram"),
    (Strategy(parse_tree("0,0.0,0.0.0")), "chain", 3, "chain k=3"),  # a tree that is a chain is a chain
    (Strategy(TREE), "tree", 2, "tree 0,1,0.0 (3 nodes)"),
    (Strategy(TREE, stage2=True), "tree", 2, "tree 0,1,0.0 (3 nodes) +ngram"),
])
def test_kind_k_and_description(strategy, kind, k, text):
    assert (strategy.kind, strategy.k, strategy.describe()) == (kind, k, text)


def test_json_round_trip_through_text():
    for strategy in (Strategy(None), Strategy(chain(2)), Strategy(chain(2), True), Strategy(TREE, True)):
        obj = json.loads(json.dumps(strategy.to_json()))
        assert Strategy.from_json(obj, "x") == strategy
    assert Strategy(TREE, True).to_json() == {"kind": "tree", "k": 2, "tree": [[0], [1], [0, 0]], "stage2": True}
    assert Strategy(None).to_json() == {"kind": "none", "k": 0, "tree": None, "stage2": False}
    assert Strategy(chain(2)) == Strategy(parse_tree("chain:2"))
    assert hash(Strategy(chain(2))) == hash(Strategy.from_k(2))


def test_long_descriptions_can_be_cut():
    big = Strategy(parse_tree(",".join(f"{a}.{b}" for a in range(3) for b in range(3)) + ",0,1,2"))
    assert big.describe().startswith("tree 0,1,2,0.0,0.1,0.2,1.0")
    assert big.describe(12) == "tree 0,1,2,0.0,... (12 nodes)"
    assert parse_tree(big.describe().split()[1]) == big.tree  # the full spec reads back


@pytest.mark.parametrize("obj,message", [
    ([1], r"^entry\.strategy: expected an object"),
    ({"kind": "chain", "k": 1, "tree": [[0]]}, r"entry\.strategy\.stage2: missing"),
    ({"kind": "fan", "k": 1, "tree": [[0]], "stage2": False},
     r"entry\.strategy\.kind: 'fan' is not one of none, chain, tree"),
    ({"kind": "chain", "k": -1, "tree": [[0]], "stage2": False}, r"entry\.strategy\.k: expected an integer >= 0"),
    ({"kind": "chain", "k": 1, "tree": [[0]], "stage2": "yes"}, r"entry\.strategy\.stage2: expected true or false"),
    ({"kind": "chain", "k": 2, "tree": [[0]], "stage2": False},
     r"entry\.strategy\.k: 2 does not match its tree's depth 1"),
    ({"kind": "chain", "k": 2, "tree": [[0], [1], [0, 0]], "stage2": False},
     r"entry\.strategy\.kind: 'chain' does not match its tree, which is a tree"),
    ({"kind": "none", "k": 0, "tree": None, "stage2": True}, r"entry\.strategy\.stage2: true needs a tree"),
    ({"kind": "tree", "k": 2, "tree": "0,1", "stage2": False},
     r"entry\.strategy\.tree: expected a list of rank lists or null"),
])
def test_bad_strategy_json_names_the_field(obj, message):
    with pytest.raises(PerfModelError, match=message):
        Strategy.from_json(obj, "entry.strategy")


def test_bad_tree_in_strategy_json_is_a_tree_spec_error_naming_where():
    obj = {"kind": "tree", "k": 2, "tree": [[0], [0, 1]], "stage2": False}
    with pytest.raises(TreeSpecError, match=r"^entry\.strategy\.tree: path 0\.1 has no lower-ranked sibling 0\.0"):
        Strategy.from_json(obj, "entry.strategy")


def test_second_stage_needs_draft_tokens():
    with pytest.raises(PerfModelError, match="second stage needs draft tokens"):
        Strategy(None, stage2=True)
    with pytest.raises(PerfModelError, match="k must be >= 0"):
        Strategy.from_k(-1)
