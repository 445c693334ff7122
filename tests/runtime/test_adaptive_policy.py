"""The adaptive policy's arithmetic, on constructed step models with known costs (no torch models).

Oracles: hand-computed goodputs and choices from the closed forms E(k) = 1 + sum_{i<=k} alpha^i and the
constructed pass times; the Beta posterior's mean written out; a Bernoulli acceptance of known alpha for
the estimator's convergence; a seeded noisy acceptance sequence for the hysteresis.
"""
from __future__ import annotations

import numpy as np
import pytest

from perfmodel.acceptance import acceptance_from_user
from perfmodel.overhead import OverheadModel
from perfmodel.strategy import StepModel
from runtime.adaptive import AdaptivePolicy, RequestAcceptance, matching_alpha
from runtime.draft_stop import DraftStop, SignalCalibration

DRAFT_MS, TARGET_MS, PER_TOKEN_MS = 1.0, 10.0, 1.5


def constructed_latency(role, batch_size, new_tokens, context_len):
    """A draft pass costs 1 ms whatever its width; a target pass 10 ms + 1.5 ms per extra token per row."""
    return DRAFT_MS if role == "draft" else TARGET_MS + PER_TOKEN_MS * batch_size * (new_tokens - 1)


def constructed_model(alpha=0.5):
    return StepModel(constructed_latency, OverheadModel(()), acceptance_from_user([alpha]))


def hand_goodput(alphas, k, b=1):
    """b * mean_r E_r(k) / S(k): S = k draft passes of 1 ms (the catch-up pass is 1 ms at any width)
    + the target's pass over k + 1 tokens; E_r(k) = 1 + sum_{i<=k} alpha_r^i."""
    tokens = np.mean([1 + sum(a ** i for i in range(1, k + 1)) for a in alphas])
    step_ms = k * DRAFT_MS + TARGET_MS + PER_TOKEN_MS * b * k
    return b * tokens / step_ms * 1e3


def test_matching_alpha_recovers_a_constant_alpha():
    assert matching_alpha([1.0] + [(1 - 0.7 ** (k + 1)) / 0.3 for k in range(1, 9)]) == pytest.approx(0.7, abs=1e-3)


def test_posterior_mean_by_hand_and_release():
    estimator = RequestAcceptance(prior_alpha=0.8, prior_trials=8, memory_tokens=1e9)  # no forgetting
    assert estimator.means(["new"]) == pytest.approx([0.8])
    estimator.observe(["a", "b"], 4, [1, 4])  # a: 1 hit, 1 miss; b: 4 hits, no miss (all accepted)
    assert estimator.means(["a", "b"]) == pytest.approx([(6.4 + 1) / (8 + 2), (6.4 + 4) / (8 + 4)])
    estimator.release(["a"])
    assert estimator.means(["a"]) == pytest.approx([0.8]) and list(estimator.counts) == ["b"]


@pytest.mark.parametrize("true_alpha", [0.35, 0.9])
def test_estimator_converges_to_a_constructed_acceptance_within_its_interval(true_alpha):
    """Rows that accept each draft token with probability true_alpha (prior 0.8): after 200 steps of k = 4
    the 95 % interval contains the truth, and its width is the stated floor (about 2 x 0.12)."""
    rng = np.random.default_rng(7)
    estimator = RequestAcceptance(prior_alpha=0.8)
    for request in range(20):
        for _ in range(200):
            accepted = 0
            while accepted < 4 and rng.random() < true_alpha:
                accepted += 1
            estimator.observe([request], 4, [accepted])
    inside = 0
    for request in range(20):
        low, high = estimator.interval(request)
        inside += low <= true_alpha <= high
        assert high - low < 0.26
    assert inside >= 17  # 95 % intervals: at most 3 of 20 may miss (binomial tail 1.6 %)
    assert np.mean(estimator.means(list(range(20)))) == pytest.approx(true_alpha, abs=0.04)


def test_policy_picks_what_the_model_says_on_a_constructed_profile():
    model = constructed_model(alpha=0.5)
    policy = AdaptivePolicy(model, max_k=8, early_stop=False)
    # a new request sits at the prior 0.5: G(0..2) = 1/10, 1.5/12.5, 1.75/15 tokens per ms -> k = 1
    expected = [hand_goodput([0.5], k) for k in range(9)]
    assert policy.predicted_goodput(["new"], 100) == pytest.approx(expected)
    assert expected[:3] == pytest.approx([100.0, 120.0, 116.667], abs=1e-3) and int(np.argmax(expected)) == 1
    assert policy.choose(["new"], 100) == 1
    # a request that accepted 40 of 40 tokens: alpha = (4 + 40) / 48, and the best k is the hand argmax (6)
    high = AdaptivePolicy(model, max_k=8, early_stop=False)
    high.acceptance.counts["hot"] = [40.0, 0.0, 1.0]
    alpha = 44 / 48
    expected = [hand_goodput([alpha], k) for k in range(9)]
    assert high.predicted_goodput(["hot"], 100) == pytest.approx(expected)
    assert high.choose(["hot"], 100) == int(np.argmax(expected)) == 6
    # two rows, one hot and one cold (0 of 40): the batch's E is the mean of the rows' E, at b = 2
    high.acceptance.counts["cold"] = [0.0, 40.0, 1.0]
    cold = 4 / 48
    expected = [hand_goodput([alpha, cold], k, b=2) for k in range(9)]
    assert high.predicted_goodput(["hot", "cold"], 100) == pytest.approx(expected)


def test_hysteresis_holds_on_noise_and_follows_a_real_change():
    """alpha = 0.56 sits where k = 1 and k = 2 predict nearly the same goodput: without hysteresis the
    choice flips on the estimator's noise; with it (3 % for 2 steps) it holds. A move to alpha = 0.9 is
    followed."""
    def run(policy, seed=2):
        rng, choices = np.random.default_rng(seed), []
        for true_alpha in [0.56] * 80 + [0.9] * 60:
            k = policy.choose(["r"], 64)
            choices.append(k)
            accepted = 0
            while accepted < k and rng.random() < true_alpha:
                accepted += 1
            policy.observe(["r"], k, [accepted])
        return choices

    def flips(choices):
        return sum(a != b for a, b in zip(choices, choices[1:]))

    plain = run(AdaptivePolicy(constructed_model(), switch_margin=0.0, persist_steps=1, early_stop=False))
    held = run(AdaptivePolicy(constructed_model(), early_stop=False))
    assert flips(plain[:80]) >= 8
    assert flips(held[:80]) <= 1
    assert held[-1] > 1 and held[-1] == plain[-1] or held[-1] >= 2


def test_catch_up_after_k0_steps_is_charged_to_chains():
    """After n steps at k = 0 every chain candidate pays (T_d(b, n + 1) - T_d(b, 1)) / horizon more."""
    widths = []

    def latency(role, batch_size, new_tokens, context_len):
        if role == "draft":
            widths.append(new_tokens)
            return 1.0 + 0.5 * (new_tokens - 1)
        return constructed_latency(role, batch_size, new_tokens, context_len)

    model = StepModel(latency, OverheadModel(()), acceptance_from_user([0.05]))
    policy = AdaptivePolicy(model, max_k=2, horizon_steps=4, early_stop=False)
    fresh = policy.predicted_goodput(["r"], 64)
    assert policy.choose(["r"], 64) == 0
    for _ in range(3):
        policy.choose(["r"], 64)
    charged = policy.predicted_goodput(["r"], 64)
    assert charged[0] == pytest.approx(fresh[0])
    # 4 steps ran at k = 0, the draft lags 4 tokens: a first pass of 5 tokens instead of 1, 2 ms more, over 4 steps
    step_ms = lambda g, k: 1e3 * (1 + sum(0.05 ** i for i in range(1, k + 1))) / g  # noqa: E731
    for k in (1, 2):
        assert step_ms(charged[k], k) - step_ms(fresh[k], k) == pytest.approx(2.0 / 4)


def test_draft_stop_proposes_while_the_next_token_pays_by_hand():
    """One row, a chain step so far of j - 1 tokens: propose token j iff dE * S_{j-1} >= E_{j-1} * dS."""
    model = constructed_model()
    step_ms = {k: k * DRAFT_MS + TARGET_MS + PER_TOKEN_MS * k for k in range(9)}
    stop = DraftStop(model, lambda b, L, k: step_ms[k], SignalCalibration(bins=10, prior_trials=4))
    stop.plan(1, 64, 8)
    # token 1 at top probability 0.95 (bin 9, prior 0.95): 0.95 * 10 >= 1 * (1 + 1.5)
    assert stop.propose(1, np.array([0.95]))
    # token 2 at 0.25 (bin 2, prior 0.25): dE = 0.95 * 0.25, E_1 = 1.95, S_1 = 12.5, dS = 2.5 -> no
    assert not stop.propose(2, np.array([0.25]))
    assert 0.95 * 0.25 * 12.5 < 1.95 * 2.5
    # the outcome teaches the calibration: the target accepted token 1, bin 9 moves to (3.8 + 1) / 5
    stop.observe(np.array([1]))
    assert stop.calibration.rate[9] == pytest.approx(4.8 / 5)
