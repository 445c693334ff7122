"""The adaptive policy with --refit inside real generation: still lossless, while the re-fit moves its choices.

Oracle: target-only greedy output (k = 0, no draft), token for token, in the offline generator and in the serving
engine under staggered arrivals. The policy's clock reports each step at constructed "true" costs far from its
model's (drafting 30x dearer), so the re-fitted step costs change which k it runs mid-generation.
"""
from __future__ import annotations

import pytest

from specbatch.bench.config import BenchConfig, BenchError
from specbatch.perfmodel.acceptance import acceptance_from_user
from specbatch.perfmodel.overhead import OverheadModel
from specbatch.perfmodel.errors import UsageError
from specbatch.perfmodel.strategy import StepModel
from specbatch.runtime.adaptive import AdaptivePolicy
from specbatch.runtime.assembly import GenerationRequest
from specbatch.runtime.engine import Engine, EngineConfig, Request
from specbatch.runtime.generator import SpeculativeGenerator
from specbatch.runtime.policy import FixedK
from specbatch.runtime.refit import StepCostRefit
from test_runtime_engine import drive, solo_greedy, tokens_of

N_NEW = 24


def calibrated(role, batch_size, new_tokens, context_len):
    """What the model was told: draft passes 0.3 ms, a target pass 10 ms + 0.5 ms per extra token."""
    return 0.3 if role == "draft" else 10.0 + 0.5 * (new_tokens - 1)


def true_step_ms(k: int) -> float:
    """What the steps 'take' on the policy's clock: draft passes 30x dearer (9 ms)."""
    return 9.0 * k + 10.0 + 0.5 * k


class TrueCostClock:
    """Advances by the true time of the step in flight when the policy reads the step's end."""

    def __init__(self):
        self.now_s, self.policy = 0.0, None

    def __call__(self) -> float:
        flight = self.policy._in_flight
        if flight is not None:  # read in `observe`: the step ends
            self.now_s += true_step_ms(self.policy._depths[flight[0]]) / 1e3
        return self.now_s


def refitting_policy() -> AdaptivePolicy:
    clock = TrueCostClock()
    model = StepModel(calibrated, OverheadModel(()), acceptance_from_user([0.9]))
    policy = AdaptivePolicy(model, max_k=6, clock=clock, refit=StepCostRefit(solve_every=1))
    clock.policy = policy
    return policy


def test_refit_generation_equals_target_only_greedy(greedy_target, greedy_draft_sometimes, prompts8):
    policy = refitting_policy()
    prompts = prompts8[:3]
    result = SpeculativeGenerator(greedy_target, greedy_draft_sometimes).generate(prompts, N_NEW, policy)
    assert result.token_ids == SpeculativeGenerator(greedy_target, None).generate(prompts, N_NEW, FixedK(0)).token_ids
    assert policy.refit.version > 0 and len(set(result.stats.k_per_step)) > 1  # the re-fit moved the choice


def test_engine_with_refit_under_staggered_arrivals_equals_solo_greedy(greedy_target, greedy_draft_sometimes,
                                                                       prompts8):
    policy = refitting_policy()
    engine = Engine(SpeculativeGenerator(greedy_target, greedy_draft_sometimes), policy, EngineConfig(max_batch_size=5))
    max_tokens = [12, 20, 6, 16, 24, 9, 14, 18]
    requests = [Request(f"r{i}", tuple(p), n) for i, (p, n) in enumerate(zip(prompts8, max_tokens))]
    events = drive(engine, {0: requests[:1], 2: requests[1:3], 3: requests[3:5], 6: requests[5:6], 9: requests[6:8]})
    for r, prompt, n in zip(requests, prompts8, max_tokens):
        assert tokens_of(events[r.id]) == solo_greedy(greedy_target, prompt, n), r.id
    snapshot = engine.metrics.snapshot()
    fidelity = snapshot["fidelity"]
    assert fidelity["steps"] == snapshot["steps_total"] and policy.refit.version > 0
    assert len({c["strategy"] for c in fidelity["cells"]}) > 1


def test_refit_needs_the_adaptive_policy_in_generate_and_bench():
    with pytest.raises(UsageError, match="--refit .* needs --adaptive"):
        GenerationRequest(prompts=("def f(x):",), refit=True)
    with pytest.raises(BenchError, match="--refit .* needs --adaptive"):
        BenchConfig(adaptive_refit=True)
