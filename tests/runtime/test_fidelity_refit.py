"""The online re-fit of step costs (runtime.refit) on a constructed step model with known pass times.

Oracles: the model's own step times (the parts must add up to them), and served steps drawn from the same
constructed model with a known slowdown per role and width and log-normal noise: the correction must
converge to that slowdown within its stated interval, and stay at 1 without one.
"""
from __future__ import annotations

import numpy as np
import pytest

from specbatch.perfmodel.acceptance import acceptance_from_user
from specbatch.perfmodel.overhead import OverheadModel
from specbatch.perfmodel.strategy import StepModel
from specbatch.perfmodel.tree import Strategy, chain
from specbatch.runtime.refit import HOST_PART, PARTS, StepCostRefit, part_index, step_parts

OVERHEAD_MS = 2.0
CONTEXT = 128


def constructed_latency(role, batch_size, new_tokens, context_len):
    """A draft pass: 1 ms + 0.2 ms per extra token; a target pass: 10 ms + 1.5 ms per extra token per row."""
    if role == "draft":
        return 1.0 + 0.2 * (new_tokens - 1)
    return 10.0 + 1.5 * batch_size * (new_tokens - 1)


def constructed_model(alpha=0.6, latency=constructed_latency):
    overhead = OverheadModel(tuple((b, k, OVERHEAD_MS) for b in (1, 8) for k in (1, 8)))
    return StepModel(latency, overhead, acceptance_from_user([alpha]))


def strategy_of(k):
    return Strategy(chain(k)) if k else Strategy(None)


@pytest.mark.parametrize("k", [0, 1, 3, 8])
@pytest.mark.parametrize("b", [1, 5])
def test_parts_add_up_to_the_models_step_time(k, b):
    model = constructed_model()
    parts = step_parts(model, strategy_of(k), b, CONTEXT)
    assert parts.sum() == pytest.approx(model.evaluate(strategy_of(k), b, CONTEXT).step_ms, rel=1e-12)
    assert parts[HOST_PART] == pytest.approx(OVERHEAD_MS)
    # by hand: the target's pass over k + 1 tokens lands in its width bucket, whole
    assert parts[part_index("target", k + 1)] == pytest.approx(10.0 + 1.5 * b * k)
    if k:  # k draft passes: the first 1 or 2 wide, the rest 1 wide; k = 1's weights split between the two
        draft = parts[part_index("draft", 1)] + parts[part_index("draft", 2)]
        p2 = parts[part_index("draft", 2)] / 1.2
        assert draft == pytest.approx(k * 1.0 + 0.2 * p2)


def served_steps(refit, model, slowdown, steps, seed=3, noise=0.05):
    """`steps` steps of random k in 0..8 at b in 1, 2, 4, 8: measured = sum_j slowdown_j x_j, times
    log-normal noise of `noise`; the refit sees the calibrated parts and the measurement."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        k, b = int(rng.integers(0, 9)), int(rng.choice([1, 2, 4, 8]))
        parts = step_parts(model, strategy_of(k), b, CONTEXT)
        refit.observe(parts, float(parts @ slowdown) * float(np.exp(rng.normal(0.0, noise))))


def observed_parts(model):
    """The parts some served step has time in (at k = 0..8: draft widths 1-2, target 1..9, the host)."""
    seen = sum(step_parts(model, strategy_of(k), b, CONTEXT) for k in range(9) for b in (1, 2, 4, 8))
    return [j for j in range(len(PARTS)) if seen[j] > 0]


def test_the_correction_converges_to_a_constructed_slowdown_within_its_interval():
    """Target passes 1.5x slower than calibrated, every width; draft and host as calibrated."""
    model = constructed_model()
    slowdown = np.array([1.5 if role == "target" else 1.0 for role, _ in PARTS])
    refit = StepCostRefit()
    served_steps(refit, model, slowdown, 1500)
    for j in observed_parts(model):
        low, high = refit.interval(j)
        assert low <= slowdown[j] <= high, (PARTS[j], low, high)
        # the target's passes take most of a step's time: a narrow interval; the draft's and the host's about a
        # tenth each, confounded with each other (both in almost every step): ten times wider
        assert high - low < (0.2 if PARTS[j][0] == "target" else 1.0), PARTS[j]
        if PARTS[j][0] == "target":
            assert refit.factors[j] == pytest.approx(slowdown[j], abs=0.05), PARTS[j]
    # a width never served takes its role's factor: most of the way to 1.5
    assert 1.35 < refit.factors[part_index("target", 20)] <= 1.5
    assert refit.factors[part_index("draft", 20)] == pytest.approx(1.0, abs=0.05)
    # and the corrected model predicts the slowed steps, every candidate within its interval (a few %)
    for k in range(9):
        parts = step_parts(model, strategy_of(k), 4, CONTEXT)
        truth, (low, high) = float(parts @ slowdown), refit.step_interval(parts)
        assert low <= truth <= high and high - low < 0.05 * truth, k
        assert refit.corrected_ms(parts) == pytest.approx(truth, rel=0.03)


def test_the_correction_stays_at_one_without_a_slowdown():
    model = constructed_model()
    refit = StepCostRefit()
    served_steps(refit, model, np.ones(len(PARTS)), 1500, seed=11)
    for j in observed_parts(model):
        low, high = refit.interval(j)
        assert low <= 1.0 <= high, (PARTS[j], low, high)
    target = [j for j in observed_parts(model) if PARTS[j][0] == "target"]
    assert all(refit.factors[j] == pytest.approx(1.0, abs=0.02) for j in target)
    for k in range(9):  # the corrected model predicts what the calibrated one did, within its interval
        parts = step_parts(model, strategy_of(k), 4, CONTEXT)
        low, high = refit.step_interval(parts)
        assert low <= parts.sum() <= high and high - low < 0.05 * parts.sum(), k


def test_the_prior_holds_the_first_steps_and_fades():
    """One step measured 2x: the factors barely move (the calibration is worth more than a step); 300 more
    steps of it and they stand near 2 (the evidence outweighs the faded prior)."""
    model = constructed_model()
    refit = StepCostRefit(solve_every=1)
    parts = step_parts(model, strategy_of(3), 2, CONTEXT)
    refit.observe(parts, 2.0 * parts.sum())
    assert refit.corrected_ms(parts) < 1.2 * parts.sum()
    for _ in range(300):
        refit.observe(parts, 2.0 * parts.sum())
    assert refit.corrected_ms(parts) == pytest.approx(2.0 * parts.sum(), rel=0.03)
