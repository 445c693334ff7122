"""The step model of a head's chains and trees (perfmodel.schedule.head_step_passes, head_tree_step), by hand.

A head's step of k draft tokens: k - 1 head passes of one token, the target's verify of k + 1, and the head's
pass of k + 1 over the verified positions; at k = 0 that pass has one token. Its speedup is over decoding
without the head, which k = 0 with a head is not.
"""
from __future__ import annotations

import pytest

from specbatch.perfmodel.acceptance import acceptance_from_user
from specbatch.perfmodel.errors import PerfModelError
from specbatch.perfmodel.overhead import OverheadModel
from specbatch.perfmodel.schedule import head_step_passes
from specbatch.perfmodel.strategy import StepModel
from specbatch.perfmodel.tree import Strategy, chain, parse_tree


def latency(role: str, b: int, n: int, L: int) -> float:
    """Target: 10 ms + 0.1 ms a token (b n); head: 1 ms + 0.05 ms a token."""
    return (10.0 + 0.1 * b * n) if role == "target" else (1.0 + 0.05 * b * n)


def head_model(alpha: float = 0.6) -> StepModel:
    overhead = OverheadModel(tuple((b, k, 0.5) for b in (1, 8) for k in range(6)), ())
    return StepModel(latency, overhead, acceptance_from_user([alpha]), drafter="eagle3")


def test_head_step_passes_by_hand():
    assert [(p.role, p.new_tokens, p.weight) for p in head_step_passes(2, 0)] == [("target", 1, 1.0), ("draft", 1, 1.0)]
    assert [(p.role, p.new_tokens, p.weight) for p in head_step_passes(2, 1)] == [("target", 2, 1.0), ("draft", 2, 1.0)]
    assert [(p.role, p.new_tokens, p.weight) for p in head_step_passes(2, 5)] == [
        ("draft", 1, 4.0), ("target", 6, 1.0), ("draft", 6, 1.0)]


def test_head_chain_step_time_and_goodput_by_hand():
    candidate = head_model().evaluate(Strategy(chain(3)), 4, 100)
    draft = 2 * (1.0 + 0.05 * 4) + (1.0 + 0.05 * 4 * 4)  # two one-token passes, one pass of k + 1 = 4
    target = 10.0 + 0.1 * 4 * 4
    assert candidate.draft_ms == pytest.approx(draft)
    assert candidate.target_ms == pytest.approx(target)
    assert candidate.step_ms == pytest.approx(draft + target + 0.5)
    tokens = 1 + 0.6 + 0.36 + 0.216
    assert candidate.tokens_per_s == pytest.approx(4 * tokens / (draft + target + 0.5) * 1e3)
    assert candidate.draft_passes == pytest.approx(3.0)


def test_a_heads_speedup_is_over_decoding_without_it():
    """k = 0 with a head still runs the head's pass: it is slower than plain decoding, which is the baseline."""
    choice = head_model(alpha=0.001).choose([Strategy(chain(k)) for k in range(1, 4)], 8, 100)
    plain = 8 / (10.0 + 0.1 * 8 + 0.5) * 1e3
    assert choice.baseline_tokens_per_s == pytest.approx(plain)
    k0 = next(c for c in choice.ranked if c.k == 0)
    assert k0.tokens_per_s == pytest.approx(8 / (10.0 + 0.8 + 1.0 + 0.05 * 8 + 0.5) * 1e3)
    assert choice.best.k == 0 and choice.speedup < 1.0  # a head that is almost never right only costs


def test_a_heads_tree_step_time_and_goodput_by_hand():
    """A tree 0,1,0.0: one head pass over the one inner node (0), the target's pass over 4 tokens, the head's pass
    over the accepted path's depth + 1 = 3 positions; its yield from the rank table (node 0: 0.6, node 1: 0.2,
    node 0.0: 0.6 x 0.5)."""
    from dataclasses import replace

    model = head_model()
    model = replace(model, acceptance=replace(model.acceptance, rank_acceptance=((0.6, 0.2), (0.5, 0.1))))
    candidate = model.evaluate(Strategy(parse_tree("0,1,0.0")), 4, 100)
    draft = (1.0 + 0.05 * 4 * 1) + (1.0 + 0.05 * 4 * 3)
    target = 10.0 + 0.1 * 4 * 4
    assert candidate.draft_ms == pytest.approx(draft) and candidate.target_ms == pytest.approx(target)
    assert candidate.step_ms == pytest.approx(draft + target + 0.5)  # no tree rows: the chain rows at its depth
    assert candidate.tokens_per_step == pytest.approx(1 + 0.6 + 0.2 + 0.6 * 0.5)
    chain_of_two = model.evaluate(Strategy(chain(2)), 4, 100)  # a chain is the tree of one node a level
    assert chain_of_two.step_ms == pytest.approx(model.evaluate(Strategy(parse_tree("0,0.0")), 4, 100).step_ms)


def test_a_heads_tree_needs_rank_acceptance_and_no_second_stage():
    with pytest.raises(PerfModelError, match="a tree needs per-depth, per-rank acceptance"):
        head_model().evaluate(Strategy(parse_tree("0,1,0.0")), 1, 100)
    with pytest.raises(PerfModelError, match="drafts without the second stage"):
        head_model().evaluate(Strategy(chain(2), True), 1, 100)
