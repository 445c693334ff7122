"""The adaptive policy inside real generation: still lossless.

Oracles: target-only greedy output (k = 0, no draft) for greedy, token for token, in the offline
generator and in the serving engine under staggered arrivals; the exact distribution of the first three
tokens on a 6-token vocabulary for sampling (the chi-square test of test_runtime_sampling, whose power
against wrong acceptance rules that module shows at the same sample size).
"""
from __future__ import annotations

import pytest

from specbatch.calibrate.pass_clock import StepRecorder
from specbatch.perfmodel.acceptance import acceptance_from_user
from specbatch.perfmodel.overhead import OverheadModel
from specbatch.perfmodel.strategy import StepModel
from specbatch.runtime.adaptive import AdaptivePolicy
from specbatch.runtime.engine import Engine, EngineConfig, Request
from specbatch.runtime.generator import SpeculativeGenerator
from specbatch.runtime.policy import FixedK
from specbatch.runtime.sampling import Sampling
from test_runtime_engine import drive, solo_greedy, tokens_of
from test_runtime_sampling import ALPHA, PROMPT, ROWS, _chi2_pvalue, _counts, _exact, pair  # noqa: F401

N_NEW = 16
BATCHES = {1: [4], 3: [0, 1, 2], 8: list(range(8))}


def cheap_drafts(role, batch_size, new_tokens, context_len):
    """Draft passes cost 0.3 ms, a target pass 10 ms + 0.5 ms per extra token (whatever the batch size):
    long chains pay when the draft agrees, short ones when it does not."""
    return 0.3 if role == "draft" else 10.0 + 0.5 * (new_tokens - 1)


def adaptive(prior_alpha: float, max_k: int = 6) -> AdaptivePolicy:
    model = StepModel(cheap_drafts, OverheadModel(()), acceptance_from_user([prior_alpha]))
    return AdaptivePolicy(model, max_k=max_k)


@pytest.fixture(scope="module")
def reference(greedy_target, prompts8):
    return {size: SpeculativeGenerator(greedy_target, None).generate([prompts8[i] for i in index], N_NEW,
                                                                      FixedK(0)).token_ids
            for size, index in BATCHES.items()}


@pytest.mark.parametrize("size", [1, 3, 8])
@pytest.mark.parametrize("kind", ["always", "sometimes", "never"])
def test_adaptive_greedy_equals_target_only(kind, size, greedy_target, greedy_draft_sometimes,
                                            greedy_draft_never, prompts8, reference):
    draft = {"always": greedy_target, "sometimes": greedy_draft_sometimes, "never": greedy_draft_never}[kind]
    policy = adaptive(0.6)
    recorder = StepRecorder("cpu")
    result = SpeculativeGenerator(greedy_target, draft).generate([prompts8[i] for i in BATCHES[size]], N_NEW, policy,
                                                                 observer=recorder)
    assert result.token_ids == reference[size]
    assert len(recorder.steps) == result.stats.steps and all(s >= 0 for s in recorder.per_step("decision_s"))
    assert policy.acceptance.counts == {}  # every request was released at its end


def test_adaptive_sampling_matches_exact_target_distribution(pair):  # noqa: F811
    target, draft = pair
    sampling = Sampling(temperature=1.0)
    p1, p2, p3 = _exact(target, sampling)
    policy = adaptive(0.95, max_k=5)
    result = SpeculativeGenerator(target, draft).generate([PROMPT] * ROWS, 3, policy, sampling, seed=4321)
    assert max(result.stats.k_per_step) > 0  # it speculated
    counts3 = _counts(result.token_ids, 3)
    assert _chi2_pvalue(counts3, (p1[:, None, None] * p2[:, :, None] * p3).numpy()) > ALPHA
    assert _chi2_pvalue(counts3.sum(2), (p1[:, None] * p2).numpy()) > ALPHA


def test_engine_with_adaptive_under_staggered_arrivals_equals_solo_greedy(greedy_target, greedy_draft_sometimes,
                                                                          prompts8):
    policy = adaptive(0.6)
    engine = Engine(SpeculativeGenerator(greedy_target, greedy_draft_sometimes), policy, EngineConfig(max_batch_size=5))
    max_tokens = [12, 20, 6, 16, 24, 9, 14, 18]
    requests = [Request(f"r{i}", tuple(p), n) for i, (p, n) in enumerate(zip(prompts8, max_tokens))]
    seen = []
    events = drive(engine, {0: requests[:1], 2: requests[1:3], 3: requests[3:5], 6: requests[5:6], 9: requests[6:8]},
                   check=lambda e: seen.append(set(policy.acceptance.counts)))
    for r, prompt, n in zip(requests, prompts8, max_tokens):
        assert tokens_of(events[r.id]) == solo_greedy(greedy_target, prompt, n), r.id
    # per request, by id: requests that left are forgotten, and never more than the running ones are held
    assert policy.acceptance.counts == {}
    assert all(ids <= {r.id for r in requests} and len(ids) <= 5 for ids in seen)
    assert engine.metrics.snapshot()["decision_seconds_sum"] > 0


def test_each_step_reports_its_draft_passes(greedy_target, greedy_draft_sometimes, prompts8):
    """A plain chain of k drafts in k passes (the first one 1 or 2 wide); the counts per step add up to
    the passes recorded, and a learning policy is told them (what teaches it the second stage's rate;
    the engine goes through the same `learn`)."""
    told = []

    class Listening(FixedK):
        def observe_draft_passes(self, batch_size, passes):
            told.append(passes)

    recorder = StepRecorder("cpu")
    stats = SpeculativeGenerator(greedy_target, greedy_draft_sometimes).generate(
        prompts8[:3], N_NEW, Listening(3), observer=recorder).stats
    assert recorder.per_step("draft_passes") == [3] * stats.steps
    assert len(recorder.passes["draft"]) == 3 * stats.steps  # the prefill's are not step passes
    assert told == recorder.per_step("draft_passes")
