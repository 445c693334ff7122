"""Step time, goodput and the best k of chains (StepModel, the one prediction path), on latency
functions whose answer is known."""
from __future__ import annotations

import dataclasses

import pytest

from specbatch.perfmodel.acceptance import acceptance_from_user, expected_tokens
from specbatch.perfmodel.errors import PerfModelError
from specbatch.perfmodel.overhead import OverheadModel
from specbatch.perfmodel.schedule import step_passes
from specbatch.perfmodel.strategy import StepModel, StrategyChoice, candidate_strategies
from specbatch.perfmodel.tree import Strategy, chain
from perfmodel_fixtures import roofline_latency

NO_OVERHEAD = OverheadModel(())


def chains(latency, overhead: OverheadModel, alphas, batch_size: int, context_len: int, max_k: int,
           tokens_per_step=None) -> StrategyChoice:
    """No speculation and chains k = 1..max_k at one batch size, ranked."""
    acceptance = dataclasses.replace(acceptance_from_user(alphas), tokens_per_step=tokens_per_step)
    model = StepModel(latency, overhead, acceptance)
    return model.choose(candidate_strategies(max_k, family="chain"), batch_size, context_len)


def by_k(choice: StrategyChoice):
    return sorted(choice.ranked, key=lambda c: c.k)


def memory_bound(role: str, b: int, n: int, L: int) -> float:
    """Pass time independent of the tokens fed: verifying k+1 tokens costs what 1 does."""
    return 10.0 if role == "target" else 0.5


def compute_bound(role: str, b: int, n: int, L: int) -> float:
    """Pass time proportional to tokens fed: every verified token costs full price."""
    return (1.0 if role == "target" else 0.1) * b * n


def test_memory_bound_prefers_a_large_k():
    # G(k) = E(k) / (10 + 0.5 k) with alpha 0.8 peaks at k = 8 (E(8)/14 = 0.3092 > E(9)/14.5 = 0.3078)
    choice = chains(memory_bound, NO_OVERHEAD, [0.8], batch_size=4, context_len=512, max_k=10)
    assert choice.best.k == 8
    assert choice.speedup == pytest.approx(expected_tokens([0.8], 8) / 14.0 * 10.0)


def test_compute_bound_prefers_no_speculation():
    for b in (1, 8, 64):
        choice = chains(compute_bound, NO_OVERHEAD, [0.9], batch_size=b, context_len=512, max_k=8)
        assert choice.best.k == 0
        assert choice.speedup == 1.0
        assert choice.runner_up.k == 1


def test_step_time_mirrors_the_schedule_by_hand():
    def latency(role, b, n, L):
        return {("draft", 1): 1.0, ("draft", 2): 1.5, ("target", 3): 7.0}[(role, n)] * b

    overhead = OverheadModel(((2, 2, 0.25),))
    # alpha 0.5, k = 2: a row accepts both with 0.25; some row of 2 did with 1 - 0.75^2 = 0.4375
    p2 = 0.4375
    expected = p2 * 3.0 + (1 - p2) * 2.0 + 1 * 2.0 + 14.0 + 0.25
    model = StepModel(latency, overhead, acceptance_from_user([0.5]))
    assert model.evaluate(Strategy(chain(2)), 2, 100).step_ms == pytest.approx(expected)


def test_step_passes_follow_the_runtime_schedule():
    assert step_passes(8, 0, [0.7]) == step_passes(8, 0, [])  # k = 0 needs no acceptance
    [only] = step_passes(8, 0, [0.7])
    assert (only.role, only.new_tokens, only.weight) == ("target", 1, 1.0)
    passes = step_passes(3, 4, [0.5])
    draft = [p for p in passes if p.role == "draft"]
    target = [p for p in passes if p.role == "target"]
    assert sum(p.weight for p in draft) == pytest.approx(4)  # k draft passes per step
    assert [(p.new_tokens, p.weight) for p in target] == [(5, 1.0)]  # one verify pass of k+1 tokens
    p2 = 1 - (1 - 0.5 ** 4) ** 3
    assert [(p.new_tokens, p.weight) for p in draft] == [(2, pytest.approx(p2)), (1, pytest.approx(1 - p2)), (1, 3.0)]
    # all accepted -> the first draft pass always catches up 2 tokens; never -> always 1
    def passes(alphas):
        return [(p.role, p.new_tokens, p.weight) for p in step_passes(2, 1, alphas)]

    assert passes([1.0]) == [("draft", 2, 1.0), ("target", 2, 1.0)]
    assert passes([0.0]) == [("draft", 1, 1.0), ("target", 2, 1.0)]


def test_goodput_is_batch_tokens_over_step_time():
    choice = chains(memory_bound, OverheadModel(((1, 0, 1.0), (1, 3, 1.0))), [0.6], 3, 0, 3)
    assert [c.k for c in by_k(choice)] == [0, 1, 2, 3]
    for c in choice.ranked:
        assert c.tokens_per_step == pytest.approx(expected_tokens([0.6], c.k))
        assert c.tokens_per_s == pytest.approx(3 * c.tokens_per_step / c.step_ms * 1e3)
    assert by_k(choice)[0].step_ms == pytest.approx(11.0)  # one target pass + 1 ms overhead


def test_measured_tokens_per_step_replace_the_formula():
    formula = chains(memory_bound, NO_OVERHEAD, [0.8], 1, 0, 4)
    measured = chains(memory_bound, NO_OVERHEAD, [0.8], 1, 0, 4, tokens_per_step=(1.0, 1.5, 1.7, 1.8, 1.85))
    assert [c.tokens_per_step for c in by_k(measured)] == [1.0, 1.5, 1.7, 1.8, 1.85]
    assert [c.step_ms for c in by_k(measured)] == [c.step_ms for c in by_k(formula)]
    assert measured.best.k < formula.best.k  # flatter E(k): a shorter k is best


def test_runner_up_and_margin():
    choice = chains(memory_bound, NO_OVERHEAD, [0.8], 1, 0, 10)
    # G(k) = E(k) / (10 + 0.5 k): G(8) = 0.30921 > G(7) = 0.30822 > G(9) = 0.30778
    assert (choice.best.k, choice.runner_up.k) == (8, 7)
    g8, g7 = (expected_tokens([0.8], k) / (10 + 0.5 * k) for k in (8, 7))
    assert choice.margin == pytest.approx((g8 - g7) / g8)
    only_none = chains(memory_bound, NO_OVERHEAD, [0.8], 1, 0, 0)
    assert only_none.runner_up is None and only_none.margin is None


def test_overhead_interpolates_and_extrapolates_linearly_never_below_zero():
    overhead = OverheadModel(((1, 0, 1.0), (9, 0, 3.0), (1, 4, 2.0), (9, 4, 6.0)))
    assert overhead.overhead_ms(5, 0) == pytest.approx(2.0)
    assert overhead.overhead_ms(5, 2) == pytest.approx(3.0)  # midway between 2.0 (k=0) and 4.0 (k=4)
    assert overhead.overhead_ms(17, 0) == pytest.approx(5.0)  # extrapolated along b
    assert overhead.overhead_ms(9, 8) == pytest.approx(9.0)  # extrapolated along k
    falling = OverheadModel(((1, 0, 1.0), (2, 0, 0.5)))
    assert falling.overhead_ms(10, 0) == 0.0
    assert OverheadModel(()).overhead_ms(4, 2) == 0.0 and not OverheadModel(()).measured


def test_best_k_on_a_roofline_falls_with_batch_size_at_short_context():
    """The seed paper's shape: large k at batch 1, less as verification stops being free."""
    ks = [chains(roofline_latency(), NO_OVERHEAD, [0.8], b, 128, 8).best.k for b in range(1, 129)]
    assert all(a >= b for a, b in zip(ks, ks[1:]))
    assert ks[0] >= 3 and ks[-1] <= 1


def test_long_context_keeps_speculation_alive():
    """KV reads grow with b*L, so the pass stays memory-bound and speculation keeps paying."""
    short = chains(roofline_latency(), NO_OVERHEAD, [0.8], 64, 128, 8)
    long = chains(roofline_latency(), NO_OVERHEAD, [0.8], 64, 4096, 8)
    assert long.best.k > short.best.k


def test_bad_batch_sizes():
    with pytest.raises(PerfModelError, match="batch size must be >= 1"):
        chains(memory_bound, NO_OVERHEAD, [0.8], 0, 0, 4)
    with pytest.raises(PerfModelError, match="batch size must be >= 1"):
        StepModel(memory_bound, NO_OVERHEAD, acceptance_from_user([0.8])).evaluate(Strategy(chain(2)), 0, 0)


def test_tree_step_overhead_falls_back_from_same_flag_to_other_flag_to_chain_to_zero():
    from specbatch.perfmodel.tree import parse_tree

    tree = parse_tree("0,1,0.0,0.1")  # 4 nodes, depth 2
    chain_rows = ((1, 0, 1.0), (9, 0, 3.0), (1, 4, 2.0), (9, 4, 6.0))
    plain = ((1, 2, False, 10.0), (1, 6, False, 14.0), (9, 2, False, 18.0), (9, 6, False, 22.0))
    staged = ((1, 4, True, 30.0),)
    both = OverheadModel(chain_rows, plain + staged)
    assert both.step_overhead_ms(5, Strategy(tree)) == pytest.approx(16.0)  # mid of b (10..18 / 14..22), mid of nodes
    assert both.step_overhead_ms(5, Strategy(tree, True)) == pytest.approx(30.0)  # one staged row: constant
    assert both.step_overhead_ms(5, Strategy(chain(2))) == pytest.approx(3.0)  # plain chains keep the (b, k) rows
    assert both.step_overhead_ms(5, Strategy(None)) == pytest.approx(2.0)
    assert both.step_overhead_ms(5, Strategy(chain(4), True)) == pytest.approx(30.0)  # staged chains: tree rows
    only_plain = OverheadModel(chain_rows, plain)
    assert only_plain.step_overhead_ms(5, Strategy(tree, True)) == pytest.approx(16.0)  # the other flag's rows
    assert only_plain.tree_source(True) == "tree, other stage-2 flag"
    chain_only = OverheadModel(chain_rows)
    assert chain_only.step_overhead_ms(5, Strategy(tree)) == pytest.approx(3.0)  # chain rows at k = depth 2
    assert chain_only.tree_source(False) == "chain"
    assert OverheadModel(()).step_overhead_ms(5, Strategy(tree, True)) == 0.0
    assert OverheadModel(()).tree_source(True) == "none"
