"""The adaptive policy's arithmetic, on constructed step models with known costs (no torch models).

Oracles: hand-computed goodputs and choices from the closed forms E(k) = 1 + sum_{i<=k} alpha^i and the
constructed pass times; the Beta posterior's mean written out; a Bernoulli acceptance of known alpha for
the estimator's convergence; a seeded noisy acceptance sequence for the hysteresis.
"""
from __future__ import annotations

import numpy as np
import pytest

from specbatch.perfmodel.acceptance import acceptance_from_user
from specbatch.perfmodel.overhead import OverheadModel
from specbatch.perfmodel.strategy import StepModel
from specbatch.perfmodel.tree import Strategy, chain
from specbatch.runtime.adaptive import AdaptivePolicy, RequestAcceptance

DRAFT_MS, TARGET_MS, PER_TOKEN_MS = 1.0, 10.0, 1.5


def constructed_latency(role, batch_size, new_tokens, context_len):
    """A draft pass costs 1 ms whatever its width; a target pass 10 ms + 1.5 ms per extra token per row."""
    return DRAFT_MS if role == "draft" else TARGET_MS + PER_TOKEN_MS * batch_size * (new_tokens - 1)


def constructed_model(alpha=0.5):
    return StepModel(constructed_latency, OverheadModel(()), acceptance_from_user([alpha]))


def hand_goodput(ratios, k, b=1):
    """b * mean_r E_r(k) / S(k): S = k draft passes of 1 ms (the catch-up pass is 1 ms at any width)
    + the target's pass over k + 1 tokens; E_r(k) = min(k + 1, 1 + rho_r (E_cal(k) - 1)), E_cal(k) - 1 =
    sum_{i<=k} 0.5^i = 1 - 0.5^k."""
    tokens = np.mean([min(k + 1, 1 + rho * (1 - 0.5 ** k)) for rho in ratios])
    step_ms = k * DRAFT_MS + TARGET_MS + PER_TOKEN_MS * b * k
    return b * tokens / step_ms * 1e3


def test_posterior_mean_by_hand_and_release():
    """E_cal(4) - 1 = 0.5 + 0.25 + 0.125 + 0.0625 = 0.9375 expected tokens per k = 4 step, prior 8 tokens."""
    estimator = RequestAcceptance([0.0, 0.5, 0.75, 0.875, 0.9375], prior_tokens=8, memory_tokens=1e12)
    assert estimator.means(["new"]) == pytest.approx([1.0])
    estimator.observe(["a", "b"], 4, [1, 4])
    assert estimator.means(["a", "b"]) == pytest.approx([(8 + 1) / (8 + 0.9375), (8 + 4) / (8 + 0.9375)])
    estimator.observe(["a"], 2, [0])
    assert estimator.means(["a"]) == pytest.approx([(8 + 1) / (8 + 0.9375 + 0.75)])
    estimator.release(["a"])
    assert estimator.means(["a"]) == pytest.approx([1.0]) and list(estimator.counts) == ["b"]


@pytest.mark.parametrize("true_alpha", [0.2, 0.5, 0.9])
def test_estimator_converges_to_a_constructed_acceptance_within_its_interval(true_alpha):
    """Rows that accept each draft token with probability true_alpha, calibrated at alpha = 0.5: at k = 4
    the true ratio is sum_{i<=4} true_alpha^i / 0.9375. After 200 steps the 95 % interval contains it in
    at least 17 of 20 rows, and is no wider than the stated floor (1.96 sqrt(rho / X) each side, X >= 24)."""
    truth = sum(true_alpha ** i for i in range(1, 5)) / 0.9375
    rng = np.random.default_rng(7)
    estimator = RequestAcceptance([0.0, 0.5, 0.75, 0.875, 0.9375])
    for request in range(20):
        for _ in range(200):
            accepted = 0
            while accepted < 4 and rng.random() < true_alpha:
                accepted += 1
            estimator.observe([request], 4, [accepted])
    inside = 0
    for request in range(20):
        low, high = estimator.interval(request)
        inside += low <= truth <= high
        assert high - low < 2 * 1.96 * np.sqrt(max(truth, 0.1) / 24) * 1.3
    assert inside >= 17  # 95 % intervals: at most 3 of 20 may miss (binomial tail 1.6 %)
    assert np.mean(estimator.means(list(range(20)))) == pytest.approx(truth, rel=0.1)


def test_policy_picks_what_the_model_says_on_a_constructed_profile():
    model = constructed_model(alpha=0.5)
    policy = AdaptivePolicy(model, max_k=8)
    # a new request sits at the calibrated pair: G(0..2) = 1/10, 1.5/12.5, 1.75/15 tokens per ms -> k = 1
    expected = [hand_goodput([1.0], k) for k in range(9)]
    assert policy.predicted_goodput(["new"], 100) == pytest.approx(expected)
    assert expected[:3] == pytest.approx([100.0, 120.0, 116.667], abs=1e-3) and int(np.argmax(expected)) == 1
    assert policy.choose(["new"], 100) == 1
    # a request that accepted 40 tokens where the pair predicted 20: rho = (4 + 40) / (4 + 20)
    high = AdaptivePolicy(model, max_k=8)
    high.acceptance.counts["hot"] = [40.0, 20.0, 1.0]
    rho = 44 / 24
    expected = [hand_goodput([rho], k) for k in range(9)]
    assert high.predicted_goodput(["hot"], 100) == pytest.approx(expected)
    assert high.choose(["hot"], 100) == int(np.argmax(expected)) == 2
    # two rows, one hot and one cold (0 accepted where 20 were expected): the batch's E is the rows' mean
    high.acceptance.counts["cold"] = [0.0, 20.0, 1.0]
    expected = [hand_goodput([rho, 4 / 24], k, b=2) for k in range(9)]
    assert high.predicted_goodput(["hot", "cold"], 100) == pytest.approx(expected)


def test_hysteresis_holds_on_noise_and_follows_a_real_change():
    """Rows at alpha = 0.66 sit where k = 1 and k = 2 predict nearly the same goodput (rho ~ 1.33): with a
    short memory (16 tokens) the estimate is noisy and, without hysteresis, the choice flips on it; with
    it (3 % for 2 steps) it holds. A real change (alpha = 0.15: no speculation pays) is followed."""
    def run(policy, seed=1):
        rng, choices = np.random.default_rng(seed), []
        for true_alpha in [0.66] * 80 + [0.15] * 40:
            k = policy.choose(["r"], 64)
            choices.append(k)
            accepted = 0
            while accepted < k and rng.random() < true_alpha:
                accepted += 1
            policy.observe(["r"], k, [accepted])
        return choices

    def flips(choices):
        return sum(a != b for a, b in zip(choices, choices[1:]))

    plain = run(AdaptivePolicy(constructed_model(), memory_tokens=16, switch_margin=0.0, persist_steps=1))
    held = run(AdaptivePolicy(constructed_model(), memory_tokens=16))
    assert flips(plain[:80]) >= 6
    assert flips(held[:80]) <= 1
    assert plain[-1] == held[-1] == 0
    assert held.index(0, 80) - plain.index(0, 80) <= 10  # the hysteresis delays a real switch a few steps


def test_catch_up_after_k0_steps_is_charged_to_chains():
    """After n steps at k = 0 every chain candidate pays (T_d(b, n + 1) - T_d(b, 1)) / horizon more."""
    widths = []

    def latency(role, batch_size, new_tokens, context_len):
        if role == "draft":
            widths.append(new_tokens)
            return 1.0 + 0.5 * (new_tokens - 1)
        return constructed_latency(role, batch_size, new_tokens, context_len)

    model = StepModel(latency, OverheadModel(()), acceptance_from_user([0.05]))
    policy = AdaptivePolicy(model, max_k=2, horizon_steps=4)
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


def test_predicted_goodput_is_the_step_models_at_the_rows_scaled_acceptance():
    """Oracle: perfmodel's StepModel.evaluate at the policy's context bucket (L rounded up to 64 tokens), whose
    tokens_per_s = b E_cal(s) / S_s, with E_cal(s) replaced by the rows' mean of E_r(s) = min(k + 1, 1 + rho_r
    (E_cal(s) - 1)), rho_r = (4 + A_r) / (4 + X_r) the posterior mean at the default prior of 4 tokens.
    Batches with rows past a candidate's k + 1 cap and batches with every row below it both occur."""
    model = constructed_model(alpha=0.5)
    policy = AdaptivePolicy(model, max_k=8)
    rng = np.random.default_rng(5)
    kinds = set()
    for trial in range(100):
        rows = [("row", trial, i) for i in range(int(rng.integers(1, 33)))]
        accepted = rng.uniform(0.2, rng.choice([40.0, 120.0]), size=len(rows))
        for row, a in zip(rows, accepted):
            policy.acceptance.counts[row] = [float(a), 20.0, 1.0]  # A accepted where 20 were expected
        ratios = (4 + accepted) / (4 + 20)  # 0.18 to 1.8 or to 5.2: above 1 / (E_cal(1) - 1) = 2, k = 1 is capped
        context = int(rng.integers(10, 600))
        bucket = -(-context // 64) * 64
        expected = []
        for k in range(9):
            candidate = model.evaluate(Strategy(chain(k)) if k else Strategy(None), len(rows), bucket)
            extra = candidate.tokens_per_step - 1
            tokens = np.mean([min(k + 1, 1 + rho * extra) for rho in ratios])
            expected.append(candidate.tokens_per_s * tokens / candidate.tokens_per_step)
        kinds.add(bool(max(ratios) > 2))
        assert policy.predicted_goodput(rows, context) == pytest.approx(expected, rel=1e-9)
        policy.acceptance.release(rows)
    assert kinds == {True, False}

def test_steps_without_speculation_age_the_evidence_but_not_the_prior():
    """A request judged poor (k = 0 chosen) gets no new evidence; its estimate must drift back toward the
    calibrated pair, (n0 w + A keep^t) / (n0 w + X keep^t) after t plain steps, so it is tried again."""
    acceptance = RequestAcceptance([0.0, 1.0, 1.8], prior_tokens=4.0, memory_tokens=64.0)
    acceptance.observe(["r"], 2, [0])
    acceptance.observe(["r"], 2, [0])
    accepted, expected, weight = acceptance.counts["r"]
    before = acceptance.means(["r"])[0]
    keep = 1 - 1 / 64
    for t in range(1, 129):
        acceptance.observe(["r"], 0, [0])
        assert acceptance.counts["r"][2] == weight  # the prior's weight does not fade without evidence
        mean = acceptance.means(["r"])[0]
        assert mean == pytest.approx((4 * weight + accepted * keep ** t) / (4 * weight + expected * keep ** t))
    assert before < 0.6 < mean < 1.0
    acceptance.observe(["unseen"], 0, [0])  # a request never observed stays unseen (at the prior)
    assert "unseen" not in acceptance.counts


# ---------------------------------------------------------------- the second stage's guess rate

def test_guess_rate_follows_a_constructed_guess_accuracy():
    """Rounds drawn by `simulate_staged_rounds` (the schedule's independent Monte Carlo) at a known
    rank-0 accuracy: the estimate settles near it, follows a change within a few steps, and resets."""
    from specbatch.perfmodel.schedule import simulate_staged_rounds
    from specbatch.perfmodel.tree import Strategy, chain
    from specbatch.runtime.adaptive import GuessRate

    staged = Strategy(chain(5), stage2=True)
    for true, b, tolerance in ((0.1, 1, 0.05), (0.5, 1, 0.05), (0.9, 1, 0.05), (0.5, 4, 0.1), (0.9, 4, 0.05)):
        guess = GuessRate([0.7])
        assert guess.rank0 == 0.7 and guess.accuracy(guess.level()) == (0.7,)  # the calibrated rate, exactly
        estimates = []
        for rounds in simulate_staged_rounds(staged.tree, b, [true], draws=200, seed=3).rounds:
            guess.observe(staged, b, int(rounds))
            estimates.append(guess.rank0)
        assert abs(np.mean(estimates[20:]) - true) < tolerance, (true, b)
    guess = GuessRate([0.9])
    for _ in range(10):
        guess.observe(staged, 1, 5)  # every guess wrong: five rounds for five draft tokens
    assert guess.rank0 < 0.3 and guess.accuracy(guess.level())[0] < 0.3
    guess.observe(Strategy(chain(1), stage2=True), 1, 1)  # one draft token: nothing was guessed, no evidence
    assert guess.rank0 < 0.3
    guess.reset()
    assert guess.rank0 == 0.9


def test_the_policy_leaves_a_staged_chain_whose_guesses_fail():
    """Draft passes cost 1 ms whatever their width (constructed_latency), so a staged chain that guesses
    90 % right drafts in fewer passes and wins; one whose every guess fails drafts k passes plus the
    n-gram's queries and loses to the plain chain of the same k. The policy learns that from the rounds."""
    from specbatch.perfmodel.profile import Stage2Info

    stage2 = Stage2Info("ngram", "0" * 64, (0.9,), query_overhead_ms=0.2, query_ms_per_context=0.01)
    model = StepModel(constructed_latency, OverheadModel(()), acceptance_from_user([0.8]), stage2)
    policy = AdaptivePolicy(model, max_k=6, staged=True)
    rows = [("r", 0)]
    first = policy.choose(rows, 100)
    assert not isinstance(first, int) and first.stage2  # fewer draft passes: the staged chain wins
    goodput = policy.predicted_goodput(rows, 100)
    plain_best = max(range(7), key=lambda k: goodput[k])
    for _ in range(24):
        k = first.k
        policy.observe(rows, k, [k])  # the target accepts everything: rho stays high, k stays long
        policy.observe_draft_passes(1, k)  # but every guess failed: k rounds
        choice = policy.choose(rows, 100)
        if isinstance(choice, int):
            break
        first = choice
    assert isinstance(choice, int) and choice > 0  # a plain chain now
    staged_ms = policy._step_times(1, 128)
    assert all(staged_ms[policy.max_k + k] > staged_ms[k] for k in range(2, 7))  # staged k now above plain k
    assert choice == plain_best or goodput[choice] >= goodput[plain_best] / (1 + policy.switch_margin)
