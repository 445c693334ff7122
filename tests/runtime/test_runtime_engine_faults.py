"""One request must not hurt another in the engine: a long prompt is prefilled in parts with the running
rows' steps between them, and a step or prefill that fails ends only the requests that fail alone.

Oracles: each prompt's target-only greedy output generated alone; the events each request received.
The failing request is made at the generator's boundary: a generator whose passes raise when a poison token
is among the rows they run (what a bug or a bad value in one row does)."""
from __future__ import annotations

import pytest

from specbatch.runtime.engine import Engine, EngineConfig, Request
from specbatch.runtime.generator import SpeculativeGenerator
from specbatch.runtime.policy import FixedK

from test_runtime_engine import drive, solo_greedy, tokens_of

POISON = 63


class Poisoned(SpeculativeGenerator):
    """Fails every step and prefill whose rows hold POISON among their committed tokens."""

    def _raise_if_poisoned(self, state):
        if bool((state.tokens[:, 0] == POISON).any()):
            raise RuntimeError("a row's value breaks the step")

    def step(self, state, choice, observer=None):
        self._raise_if_poisoned(state)
        return super().step(state, choice, observer)

    def prefill(self, state, prompts, continuing=False):
        self._raise_if_poisoned(state)
        return super().prefill(state, prompts, continuing)


def test_a_long_prompt_is_prefilled_in_parts_while_the_others_step(greedy_target, greedy_draft_sometimes, prompts8):
    engine = Engine(SpeculativeGenerator(greedy_target, greedy_draft_sometimes), FixedK(2),
                    EngineConfig(max_batch_size=4, prefill_chunk_tokens=8))
    long_prompt = (prompts8[4] * 3)[:45]  # 5 parts of 8 tokens and a last one of 5
    timeline = []  # every event of every request, in the order the engine emitted them
    requests = [Request("a", tuple(prompts8[0]), 30, on_event=timeline.append),
                Request("b", tuple(prompts8[2]), 30, on_event=timeline.append),
                Request("long", tuple(long_prompt), 10, on_event=timeline.append)]
    for request in requests[:2]:
        engine.submit(request)
    engine.step(), engine.step()
    engine.submit(requests[2])
    before = len(timeline)
    engine.step()  # admits the long prompt: its parts, a step of the running rows after each but the last
    first_of_long = next(i for i, e in enumerate(timeline) if e.request_id == "long")
    assert timeline[first_of_long].completion_tokens == 1
    # one step of the running rows per part before its last: "a" got 5 events meanwhile
    assert sum(e.request_id == "a" for e in timeline[before:first_of_long]) == 5
    while engine.step():
        pass
    for request in requests:
        got = [t for e in timeline if e.request_id == request.id for t in e.token_ids]
        assert got == solo_greedy(greedy_target, list(request.prompt_ids), request.max_tokens), request.id
    assert engine.metrics.snapshot()["finished_total"] == {"length": 3}


def test_a_request_that_breaks_the_step_ends_alone(greedy_target, greedy_draft_sometimes, prompts8):
    generator = Poisoned(greedy_target, greedy_draft_sometimes)
    engine = Engine(generator, FixedK(3), EngineConfig(max_batch_size=4, prefill_chunk_tokens=4))
    good = [Request(f"g{i}", tuple(prompts8[i]), 16) for i in range(3)]
    bad = Request("bad", (POISON,) + tuple(prompts8[5]), 16)
    events = drive(engine, {0: good[:2] + [bad], 3: good[2:]})
    assert events["bad"][-1].finish_reason == "error"
    for request in good:
        assert tokens_of(events[request.id]) == solo_greedy(greedy_target, list(request.prompt_ids), 16), request.id
        assert events[request.id][-1].finish_reason == "length"
    assert engine.running == 0 and engine.metrics.snapshot()["finished_total"] == {"length": 3, "error": 1}


def test_a_failing_prefill_ends_its_request_and_no_running_one(greedy_target, prompts8):
    class BreaksPrefill(Poisoned):
        def step(self, state, choice, observer=None):
            return SpeculativeGenerator.step(self, state, choice, observer)

    engine = Engine(BreaksPrefill(greedy_target, None), FixedK(0), EngineConfig(max_batch_size=4))
    running = Request("running", tuple(prompts8[1]), 12)
    bad = Request("bad", (POISON,) + tuple(prompts8[3]), 12)
    events = drive(engine, {0: [running], 2: [bad]})
    assert [e.finish_reason for e in events["bad"]] == ["error"] and tokens_of(events["bad"]) == []
    assert tokens_of(events["running"]) == solo_greedy(greedy_target, prompts8[1], 12)


@pytest.mark.parametrize(("target_positions", "draft_positions", "limiter"), [(128, 48, "draft"), (40, 128, "target")])
def test_a_context_error_names_the_model_that_limits_it(target_positions, draft_positions, limiter):
    from specbatch.runtime.checkpoint import build_model
    from specbatch.runtime.generator import GenerationError
    from torch_fixtures import tiny_llama_config

    target = build_model(tiny_llama_config(max_position_embeddings=target_positions), seed=1)
    draft = build_model(tiny_llama_config(max_position_embeddings=draft_positions, num_layers=1), seed=2)
    generator = SpeculativeGenerator(target, draft)
    limit = min(target_positions, draft_positions)
    with pytest.raises(GenerationError, match=f"the {limiter} model's context is {limit} positions"):
        generator.generate([[3] * limit], 4, FixedK(2))
    with pytest.raises(GenerationError, match=f"exceeds the {limiter} model's context of {limit} positions"):
        generator.generate([[3] * (limit - 4)], 8, FixedK(2))
