"""Tree steps as the runtime schedules them: passes, widths and weights by hand; the second stage's
rounds exactly (closed form) against hand-computed expectations and against a Monte Carlo of the rounds."""
from __future__ import annotations

import numpy as np
import pytest

from specbatch.perfmodel.schedule import (
    catch_up_probability, inner_per_depth, leaf_end_probability, simulate_staged_rounds,
    staged_rounds, staged_step, step_passes, tree_step, valid_within)
from specbatch.perfmodel.tree import chain, node_probabilities, parse_tree

# nodes: 1 = 0, 2 = 1, 3 = 0.0, 4 = 0.1, 5 = 1.0; inner: the root, 1 and 2 (both at depth 1); leaves 3, 4, 5
FAN = parse_tree("0,1,0.0,0.1,1.0")
RANKS = [[0.5, 0.3], [0.4, 0.2]]


def shapes(step):
    return [(p.role, p.new_tokens, pytest.approx(p.weight)) for p in step.passes]


def test_leaf_end_probability_by_hand():
    probabilities = node_probabilities(FAN, RANKS)
    assert list(probabilities) == pytest.approx([0.5, 0.3, 0.2, 0.1, 0.12])  # 0.3 * 0.4 for node 1.0
    assert leaf_end_probability(FAN, probabilities) == pytest.approx(0.2 + 0.1 + 0.12)
    assert catch_up_probability(0.42, 2) == pytest.approx(1 - 0.58 ** 2)


def test_tree_step_passes_by_hand():
    # catch-up of 2 tokens when some row's path ended at a leaf (P = 1 - 0.58^2), else 1; one pass for
    # the two depth-1 inner nodes; the target verifies root + 5 nodes
    p2 = 1 - 0.58 ** 2
    step = tree_step(FAN, 2, 0.42)
    assert shapes(step) == [("draft", 2, p2), ("draft", 1, 1 - p2), ("draft", 2, 1.0), ("target", 6, 1.0)]
    assert (step.ngram_queries, step.ngram_contexts) == (0.0, 0.0) and step.draft_passes == pytest.approx(2.0)
    deep = parse_tree("0,1,0.0,0.1,0.0.0,0.0.1,0.0.0.0")  # inner nodes per depth: 1 (0), 1 (0.0), 1 (0.0.0)
    assert inner_per_depth(deep) == (1, 1, 1)
    assert [(p.role, p.new_tokens) for p in tree_step(deep, 3, 0.0).passes] == [
        ("draft", 1), ("draft", 1), ("draft", 1), ("draft", 1), ("target", 8)]
    flat = parse_tree("0,1,2")  # only the root is inner: the catch-up pass is all the drafting
    assert [(p.role, p.new_tokens) for p in tree_step(flat, 1, 1.0).passes] == [("draft", 2), ("target", 4)]


def totals(passes) -> dict:
    """Expected passes per (role, tokens fed), however the schedule lists them."""
    out: dict = {}
    for p in passes:
        out[(p.role, p.new_tokens)] = out.get((p.role, p.new_tokens), 0.0) + p.weight
    return out


def test_a_chain_as_a_tree_has_the_chain_schedule():
    alpha = 0.6
    for k in (1, 2, 4):
        as_tree = totals(tree_step(chain(k), 3, alpha ** k).passes)  # its path ends at the leaf iff all k accepted
        as_chain = totals(step_passes(3, k, [alpha]))
        assert as_tree.keys() == as_chain.keys()
        assert all(as_tree[key] == pytest.approx(as_chain[key]) for key in as_chain)


# ---------------------------------------------------------------- the second stage

CHAIN3 = chain(3)  # inner non-root nodes: 1 (depth 1) and 2 (depth 2); node 3 is the leaf


def test_perfect_guesses_take_exactly_one_round():
    rounds = staged_rounds(CHAIN3, 4, [1.0])
    assert rounds.expected_rounds == 1.0 and sum(rounds.width_weight) == 0.0
    step = staged_step(CHAIN3, 4, 0.0, [1.0])
    assert shapes(step) == [("draft", 3, 1.0), ("target", 4, 1.0)]  # w = 1, plus the 2 inner nodes
    assert (step.ngram_queries, step.ngram_contexts) == (1.0, 8.0)  # one query guessing 2 nodes in 4 rows


def test_wrong_guesses_take_one_round_per_inner_node_more():
    for tree in (CHAIN3, chain(6), FAN, parse_tree("0,1,0.0,0.1,0.0.0,0.0.1,0.0.0.0")):
        inner = len(tree.inner_nodes) - 1
        assert staged_rounds(tree, 3, [0.0]).expected_rounds == pytest.approx(1 + max(
            tree.depths[n] for n in tree.inner_nodes))  # the deepest inner node's path: all wrong
        if tree.is_chain:
            assert staged_rounds(tree, 3, [0.0]).expected_rounds == inner + 1
    # a chain of 3, all wrong: round 2 re-feeds both inner nodes, round 3 the second one
    step = staged_step(CHAIN3, 2, 1.0, [0.0])
    assert shapes(step) == [("draft", 4, 1.0), ("draft", 2, 1.0), ("draft", 1, 1.0), ("target", 4, 1.0)]
    # one query per round; guesses per row: both nodes in round 1, node 2 again in round 2 (its parent,
    # node 1, was invalid), none in round 3 (node 2's token is known once node 1 is valid)
    assert (step.ngram_queries, step.ngram_contexts) == (3.0, 2 * 3.0)


def test_chain_rounds_by_hand():
    """One row: rounds = 1 + Binomial(2, 1 - p). Round 2 starts at node 1 when it was wrong (1 - p),
    else at node 2 when that was wrong (p (1 - p)); round 3 re-feeds node 2 after both were wrong."""
    p = 0.6
    rounds = staged_rounds(CHAIN3, 1, [p])
    assert rounds.expected_rounds == pytest.approx(1 + 2 * (1 - p))
    assert rounds.width_weight == pytest.approx((0.0, p * (1 - p) + (1 - p) ** 2, 1 - p))
    # b rows: rounds = 1 + the largest of b independent Binomial(2, 0.4)
    b, q = 3, 1 - p
    at_most = [p ** 2, p ** 2 + 2 * p * q]  # P(Binomial <= 0), P(<= 1)
    expected = 1 + sum(1 - c ** b for c in at_most)
    assert staged_rounds(CHAIN3, b, [p]).expected_rounds == pytest.approx(expected, rel=1e-12)


def test_monte_carlo_matches_the_hand_computed_chain():
    p = 0.6
    simulated = simulate_staged_rounds(CHAIN3, 1, [p], draws=20000, seed=3)
    # rounds - 1 ~ Binomial(2, 0.4): mean 0.8, standard deviation sqrt(0.48) = 0.69, so the standard
    # error of 20000 draws is 0.0049: 0.02 is four of them
    assert simulated.rounds.mean() == pytest.approx(1.8, abs=0.02)
    counts = np.bincount(simulated.rounds - 1, minlength=3) / 20000
    assert counts == pytest.approx([p * p, 2 * p * (1 - p), (1 - p) ** 2], abs=0.015)
    assert set(simulate_staged_rounds(CHAIN3, 2, [1.0], draws=50).rounds) == {1}
    assert set(simulate_staged_rounds(CHAIN3, 2, [0.0], draws=50).rounds) == {3}


def test_guesses_by_hand():
    """Node v is guessed again in every round its non-root parent u is still invalid: E[W(u)] times."""
    p = 0.6
    # chain of 3: node 1 in round 1; node 2 in round 1 and again E[W(node 1)] = 0.4 times
    assert staged_step(CHAIN3, 5, 0.0, [p]).ngram_contexts == pytest.approx(5 * (2 + (1 - p)))
    # FAN: both inner nodes have the root as parent: guessed once each
    assert staged_step(FAN, 3, 0.0, [0.1, 0.1]).ngram_contexts == pytest.approx(3 * 2)


@pytest.mark.parametrize("tree,accuracy,b", [
    (FAN, [0.7, 0.4], 1),
    (parse_tree("0,1,2,0.0,0.1,1.0,0.0.0,0.0.1,0.1.0,0.0.0.0"), [0.7, 0.4], 3),
    (chain(5), [0.5], 8),
])
def test_closed_form_matches_the_simulated_rounds(tree, accuracy, b):
    exact = staged_rounds(tree, b, accuracy)
    simulated = simulate_staged_rounds(tree, b, accuracy, draws=20000, seed=7)
    assert simulated.rounds.mean() == pytest.approx(exact.expected_rounds, abs=0.03)
    inner = len(tree.inner_nodes) - 1
    per_width = [(simulated.widths == s).sum() / 20000 for s in range(inner + 1)]
    assert per_width[1:] == pytest.approx(exact.width_weight[1:], abs=0.015)
    step = staged_step(tree, b, 0.0, accuracy)
    assert simulated.guesses.mean() == pytest.approx(step.ngram_contexts, rel=0.02)
    assert step.ngram_queries == exact.expected_rounds


def test_valid_within_is_a_probability_table():
    table = valid_within(FAN, (0.7, 0.4))
    # one row, inner nodes 1 (rank 0) and 2 (rank 1), both at depth 1: W is 0 or 1 for each
    assert table[:, 0] == pytest.approx([1.0, 0.7, 0.7 * 0.4])
    assert table[:, 1] == pytest.approx([1.0, 1.0, 1.0])


def test_no_inner_nodes_means_no_guessing():
    flat = parse_tree("0,1,2")
    assert staged_step(flat, 2, 0.5, [0.3]) == tree_step(flat, 2, 0.5)
