"""A head (EAGLE-3) in the serving engine and under the adaptive policy: lossless, and the head's state follows
its rows.

Oracles: target-only greedy output of each prompt alone (k = 0, no draft); each step's draft tokens against the
head recomputed from scratch on the row's committed tokens (test_runtime_heads._fresh_drafts), which a head whose
cache rows or carried hidden state (`HeadCache.hidden`) were moved wrongly, or a long prompt prefilled in parts into
the wrong positions, would not match (greedy output alone cannot see a wrong draft: verification makes it lossless);
the head's step schedule (`perfmodel.schedule.head_step_passes`) for what the adaptive policy and its re-fit learn.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specbatch.perfmodel.acceptance import acceptance_from_user
from specbatch.perfmodel.overhead import OverheadModel
from specbatch.perfmodel.strategy import StepModel
from specbatch.perfmodel.tree import Strategy, chain
from specbatch.runtime.adaptive import AdaptivePolicy
from specbatch.runtime.drafters.head import HeadDrafter
from specbatch.runtime.engine import Engine, EngineConfig, Request
from specbatch.runtime.generator import SpeculativeGenerator
from specbatch.runtime.policy import TableK
from specbatch.runtime.refit import StepCostRefit, part_index, step_parts
from test_runtime_engine import Recording, drive, solo_greedy, tokens_of
from test_runtime_heads import _fresh_drafts
from test_runtime_heads import eagle_head as head, target  # noqa: F401 - the same target and head, shared


class RecordedDrafts:
    """Every chain the head drafts, with each row's committed tokens at that moment."""

    def __init__(self, monkeypatch):
        self.seen: list[tuple[list[list[int]], list[list[int]]]] = []
        original = HeadDrafter.chain

        def recording(drafter, state, k, passes):
            tokens, probs = original(drafter, state, k, passes)
            committed = [state.tokens[r, :int(state.host_committed[r])].tolist() for r in range(state.batch_size)]
            self.seen.append((committed, tokens.tolist()))
            return tokens, probs

        monkeypatch.setattr(HeadDrafter, "chain", recording)

    def check(self, target, head) -> int:
        """Each drafted row against the head from scratch; returns the rows checked."""
        rows = 0
        with torch.no_grad():
            for committed, drafted in self.seen:
                for row, tokens in zip(committed, drafted):
                    assert tokens == _fresh_drafts(target, head, row, len(tokens)), (row, tokens)
                    rows += 1
        return rows


@pytest.mark.filterwarnings("ignore:table. context length")
def test_serving_with_a_head_gives_each_request_its_solo_greedy_output(target, head, write_table, monkeypatch):
    """Requests of different lengths join and leave a running batch (their rows move, HeadCache.hidden with
    them); a table switches k with the batch size, k = 0 included (the head still reads the verified position);
    one long prompt is prefilled in parts with decode steps between them."""
    gen = np.random.default_rng(7)
    lengths = [5, 3, 9, 4, 40, 7, 12, 6]  # the 40-token prompt is prefilled in parts of 8
    prompts = [gen.integers(3, 64, size=n).tolist() for n in lengths]
    max_tokens = [12, 18, 6, 14, 10, 9, 16, 8]
    policy = Recording(TableK(write_table({1: 3, 2: 2, 3: 0, 4: 4}, "head-table.json")))
    drafts = RecordedDrafts(monkeypatch)
    engine = Engine(SpeculativeGenerator(target, head), policy, EngineConfig(max_batch_size=4, prefill_chunk_tokens=8))
    requests = [Request(f"r{i}", tuple(p), n) for i, (p, n) in enumerate(zip(prompts, max_tokens))]
    events = drive(engine, {0: requests[:2], 2: requests[2:4], 3: requests[4:5], 5: requests[5:7], 9: requests[7:]})
    for r, prompt, n in zip(requests, prompts, max_tokens):
        assert tokens_of(events[r.id]) == solo_greedy(target, prompt, n), r.id
        assert events[r.id][-1].finish_reason == "length"
    assert {choice for _, choice in policy.calls} >= {0, 2, 3}, "the table never switched k"
    assert drafts.check(target, head) >= 40
    assert engine.running == 0 and engine.reserved_tokens == 0


def head_latency(role, batch_size, new_tokens, context_len):
    """Head passes cost 0.2 ms + 0.05 ms per token, a target pass 10 ms + 0.5 ms per extra token."""
    return 0.2 + 0.05 * new_tokens if role == "draft" else 10.0 + 0.5 * (new_tokens - 1)


def head_model(alpha: float = 0.6) -> StepModel:
    return StepModel(head_latency, OverheadModel(()), acceptance_from_user([alpha]), drafter="eagle3")


def test_the_adaptive_policy_and_its_refit_learn_from_a_heads_passes():
    """The policy's step times are the head's schedule (k - 1 passes of 1, the verify, a pass of k + 1; one at
    k = 0 too); the re-fit takes the head's parts by width and its corrected step time meets the served one."""
    model = head_model()
    policy = AdaptivePolicy(model, max_k=4, refit=StepCostRefit())
    assert model.head
    parts = step_parts(model, Strategy(chain(3)), 2, 64)
    assert parts[part_index("draft", 1)] == pytest.approx(2 * head_latency("draft", 2, 1, 64))
    assert parts[part_index("draft", 4)] == pytest.approx(head_latency("draft", 2, 4, 64))
    plain = step_parts(model, Strategy(None), 2, 64)  # k = 0: the head's pass of one token still runs
    assert plain[part_index("draft", 1)] == pytest.approx(head_latency("draft", 2, 1, 64))
    ids = ["a", "b"]
    for _ in range(40):  # served steps whose head passes over the verified positions run 4x slower
        k = policy.choose(ids, 64)
        assert policy._lag_steps == 0  # a head never lags behind the target, even after k = 0
        calibrated = step_parts(model, Strategy(chain(k)) if k else Strategy(None), 2, 64)
        served = calibrated.copy()
        served[part_index("draft", k + 1)] *= 4.0
        policy.refit.observe(calibrated, float(served.sum()))
        policy.acceptance.observe(ids, k, [min(k, 1)] * 2)
    assert policy.refit.corrected_ms(calibrated) == pytest.approx(float(served.sum()), rel=0.02)
    assert policy.refit.corrected_ms(calibrated) > 1.05 * float(calibrated.sum())


def test_adaptive_with_a_head_in_the_engine_is_lossless_and_decides(target, head, monkeypatch):
    policy = AdaptivePolicy(head_model(0.5), max_k=4, refit=StepCostRefit(solve_every=1))
    drafts = RecordedDrafts(monkeypatch)
    engine = Engine(SpeculativeGenerator(target, head), policy, EngineConfig(max_batch_size=3))
    gen = np.random.default_rng(3)
    prompts = [gen.integers(3, 64, size=n).tolist() for n in (6, 11, 4, 8)]
    max_tokens = [14, 10, 12, 9]
    requests = [Request(f"a{i}", tuple(p), n) for i, (p, n) in enumerate(zip(prompts, max_tokens))]
    events = drive(engine, {0: requests[:2], 2: requests[2:]})
    for r, prompt, n in zip(requests, prompts, max_tokens):
        assert tokens_of(events[r.id]) == solo_greedy(target, prompt, n), r.id
    assert policy.refit.steps > 0 and policy.fidelity is not None
    assert drafts.seen and drafts.check(target, head) > 0  # it drafted, and every draft was the head's own
    assert policy.acceptance.counts == {}  # every request was released at its end
