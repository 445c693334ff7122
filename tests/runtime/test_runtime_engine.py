"""The continuous-batching engine: requests join and leave between steps, each gets its solo output.

Oracles: the target-only greedy output of each prompt generated alone (k = 0, no draft); for a seeded
sampled request, the same request run alone through the engine.
"""
from __future__ import annotations

import pytest

from specbatch.runtime.engine import Engine, EngineConfig, EngineError, QueueFull, Request
from specbatch.runtime.generator import SpeculativeGenerator
from specbatch.runtime.policy import FixedK, TableK
from specbatch.runtime.sampling import Sampling


class Recording:
    """Wraps a policy and records the k it gave at each (batch size) call."""

    def __init__(self, policy):
        self.policy, self.max_k, self.calls = policy, policy.max_k, []

    def __call__(self, batch_size, context_len):
        choice = self.policy(batch_size, context_len)
        self.calls.append((batch_size, choice))
        return choice


def solo_greedy(target, prompt, max_tokens, eos=()):
    return SpeculativeGenerator(target, None, eos).generate([prompt], max_tokens, FixedK(0)).token_ids[0]


def drive(engine, arrivals: dict[int, list[Request]], cancels: dict[int, list[str]] | None = None, check=None,
          max_iterations: int = 500):
    """Submit requests at given iterations, step until idle; returns request id -> its events."""
    events: dict[str, list] = {}
    for requests in arrivals.values():
        for r in requests:
            events[r.id] = []
    last = max(arrivals)
    for iteration in range(max_iterations):
        for r in arrivals.get(iteration, []):
            engine.submit(Request(r.id, r.prompt_ids, r.max_tokens, r.sampling, r.seed, r.stop, events[r.id].append))
        for request_id in (cancels or {}).get(iteration, []):
            engine.cancel(request_id)
        worked = engine.step()
        if check:
            check(engine)
        if not worked and iteration > last:
            return events
    raise AssertionError("the engine did not finish in time")


def tokens_of(events):
    return [t for e in events for t in e.token_ids]


@pytest.mark.filterwarnings("ignore:table. context length")
def test_staggered_arrivals_with_table_switching_k_equal_solo_greedy(greedy_target, greedy_draft_sometimes,
                                                                     prompts8, write_table):
    policy = Recording(TableK(write_table({1: 4, 2: 3, 3: 2, 4: 1, 5: 0})))
    engine = Engine(SpeculativeGenerator(greedy_target, greedy_draft_sometimes), policy, EngineConfig(max_batch_size=5))
    max_tokens = [12, 20, 6, 16, 24, 9, 14, 18]
    requests = [Request(f"r{i}", tuple(p), n) for i, (p, n) in enumerate(zip(prompts8, max_tokens))]
    arrivals = {0: requests[:1], 2: requests[1:3], 3: requests[3:5], 6: requests[5:6], 9: requests[6:8]}
    events = drive(engine, arrivals)
    for r, prompt, n in zip(requests, prompts8, max_tokens):
        assert tokens_of(events[r.id]) == solo_greedy(greedy_target, prompt, n), r.id
        assert events[r.id][-1].finish_reason == "length"
        assert events[r.id][-1].completion_tokens == n and events[r.id][-1].prompt_tokens == len(prompt)
        assert all(e.finish_reason is None for e in events[r.id][:-1])
    ks = {choice for _, choice in policy.calls}
    assert len(ks) >= 3, "the table never switched k"
    assert all(choice == {1: 4, 2: 3, 3: 2, 4: 1, 5: 0}[b] for b, choice in policy.calls)
    assert engine.running == 0 and engine.reserved_tokens == 0
    snapshot = engine.metrics.snapshot()
    assert snapshot["generated_tokens_total"] == sum(max_tokens)
    assert snapshot["finished_total"] == {"length": 8}


def test_eos_ends_a_request_early(greedy_target, greedy_draft_sometimes, prompts8):
    reference = solo_greedy(greedy_target, prompts8[2], 16)
    eos = reference[5]
    expected = reference[:reference.index(eos) + 1]
    engine = Engine(SpeculativeGenerator(greedy_target, greedy_draft_sometimes, (eos,)), FixedK(3))
    events = drive(engine, {0: [Request("a", tuple(prompts8[2]), 16)], 1: [Request("b", tuple(prompts8[0]), 8)]})
    assert tokens_of(events["a"]) == expected
    assert events["a"][-1].finish_reason == "stop"
    assert tokens_of(events["b"]) == solo_greedy(greedy_target, prompts8[0], 8, (eos,))


def test_cancellation_frees_the_slot_for_a_waiting_request(greedy_target, greedy_draft_sometimes, prompts8):
    engine = Engine(SpeculativeGenerator(greedy_target, greedy_draft_sometimes), FixedK(2),
                    EngineConfig(max_batch_size=2))
    sizes = []
    arrivals = {0: [Request("a", tuple(prompts8[0]), 40), Request("b", tuple(prompts8[1]), 30),
                    Request("c", tuple(prompts8[2]), 10)]}
    events = drive(engine, arrivals, cancels={2: ["a"]}, check=lambda e: sizes.append((e.running, e.waiting)))
    assert sizes[0] == (2, 1) and sizes[1] == (2, 1)  # c waits while a and b hold both slots
    assert sizes[2] == (2, 0)  # a cancelled at iteration 2: c took its slot in the same iteration
    assert events["a"][-1].finish_reason == "cancelled"
    assert 0 < len(tokens_of(events["a"])) < 40
    assert tokens_of(events["b"]) == solo_greedy(greedy_target, prompts8[1], 30)
    assert tokens_of(events["c"]) == solo_greedy(greedy_target, prompts8[2], 10)
    assert engine.metrics.snapshot()["finished_total"] == {"cancelled": 1, "length": 2}


def test_cancelling_a_waiting_request(greedy_target, prompts8):
    engine = Engine(SpeculativeGenerator(greedy_target, None), FixedK(0), EngineConfig(max_batch_size=1))
    events = drive(engine, {0: [Request("a", tuple(prompts8[0]), 5), Request("b", tuple(prompts8[1]), 5)]},
                   cancels={1: ["b"]})
    assert [e.finish_reason for e in events["b"]] == ["cancelled"] and tokens_of(events["b"]) == []
    assert tokens_of(events["a"]) == solo_greedy(greedy_target, prompts8[0], 5)


def test_kv_budget_is_respected(greedy_target, greedy_draft_sometimes, prompts8):
    generator = SpeculativeGenerator(greedy_target, greedy_draft_sometimes)
    probe = Engine(generator, FixedK(2), EngineConfig(max_batch_size=1))
    needs = [probe.reservation(len(p), 12) for p in prompts8[:6]]
    budget = sorted(needs)[-1] + sorted(needs)[-2]  # room for any two of them, never for three
    engine = Engine(generator, FixedK(2), EngineConfig(max_batch_size=8, kv_budget_tokens=budget))
    seen = []

    def check(e):
        assert e.reserved_tokens <= budget
        seen.append(e.running)

    requests = [Request(f"r{i}", tuple(p), 12) for i, p in enumerate(prompts8[:6])]
    events = drive(engine, {0: requests}, check=check)
    assert max(seen) == 2 or (max(seen) >= 2 and budget >= sum(sorted(needs)[:3]))
    for r, p in zip(requests, prompts8):
        assert tokens_of(events[r.id]) == solo_greedy(greedy_target, p, 12)
    with pytest.raises(EngineError, match="KV tokens, above the budget"):
        engine.submit(Request("big", tuple(prompts8[4]), 100))


def test_seeded_sampled_request_is_reproducible_whoever_shares_the_batch(greedy_target, greedy_draft_sometimes,
                                                                          prompts8):
    generator = SpeculativeGenerator(greedy_target, greedy_draft_sometimes)
    hot = Sampling(temperature=1.5, top_p=0.95)  # peaked logits: a high temperature makes the draws matter
    alone = drive(Engine(generator, FixedK(3)), {0: [Request("s", tuple(prompts8[3]), 20, hot, seed=7)]})
    crowd = {0: [Request("g", tuple(prompts8[0]), 16), Request("x", tuple(prompts8[5]), 12, hot, seed=1)],
             1: [Request("s", tuple(prompts8[3]), 20, hot, seed=7)],
             3: [Request("y", tuple(prompts8[6]), 20, Sampling(temperature=0.7), seed=2)]}
    together = drive(Engine(generator, FixedK(3)), crowd)
    assert tokens_of(together["s"]) == tokens_of(alone["s"])
    # a greedy request in a batch that samples still gets its greedy tokens
    assert tokens_of(together["g"]) == solo_greedy(greedy_target, prompts8[0], 16)
    other_seed = drive(Engine(generator, FixedK(3)), {0: [Request("s", tuple(prompts8[3]), 20, hot, seed=8)]})
    assert tokens_of(other_seed["s"]) != tokens_of(alone["s"])


@pytest.mark.filterwarnings("ignore:table. context length")
def test_with_a_table_a_seeded_request_repeats_its_text_when_its_strategies_repeat(greedy_target,
                                                                                   greedy_draft_sometimes, prompts8,
                                                                                   write_table):
    """What docs/serving.md promises a seeded sampled request under the table policy: the same text when the
    same sequence of strategies verifies it (a table of one k at every batch size: whoever shares the batch;
    a table whose k follows the batch size: the same arrivals replayed), the target's distribution always."""
    generator = SpeculativeGenerator(greedy_target, greedy_draft_sometimes)
    hot = Sampling(temperature=1.5, top_p=0.95)
    crowd = {0: [Request("g", tuple(prompts8[0]), 16), Request("x", tuple(prompts8[5]), 12, hot, seed=1)],
             1: [Request("s", tuple(prompts8[3]), 20, hot, seed=7)]}
    one_k = write_table({b: 3 for b in range(1, 6)}, "one-k.json")
    alone = drive(Engine(generator, TableK(one_k)), {0: [Request("s", tuple(prompts8[3]), 20, hot, seed=7)]})
    assert tokens_of(drive(Engine(generator, TableK(one_k)), crowd)["s"]) == tokens_of(alone["s"])
    by_batch = write_table({1: 4, 2: 3, 3: 2, 4: 1, 5: 0}, "by-batch.json")
    first, again = (drive(Engine(generator, TableK(by_batch)), crowd) for _ in range(2))
    assert tokens_of(first["s"]) == tokens_of(again["s"])


def test_stop_strings_end_the_text_before_them(greedy_target, greedy_draft_sometimes, prompts8):
    decode = lambda ids: "".join(chr(97 + t % 26) for t in ids)  # noqa: E731 - one char per token
    reference = decode(solo_greedy(greedy_target, prompts8[4], 20))
    stop = reference[8:11]
    cut = reference.index(stop)
    engine = Engine(SpeculativeGenerator(greedy_target, greedy_draft_sometimes), FixedK(4), decode=decode)
    events = drive(engine, {0: [Request("a", tuple(prompts8[4]), 20, stop=(stop, "never-seen")),
                                Request("b", tuple(prompts8[1]), 20)]})
    assert "".join(e.text for e in events["a"]) == reference[:cut]
    assert events["a"][-1].finish_reason == "stop"
    # one character per token: the client gets the tokens of its text, and the count says so, nothing past it
    assert tokens_of(events["a"]) == solo_greedy(greedy_target, prompts8[4], 20)[:cut]
    assert events["a"][-1].completion_tokens == cut
    assert "".join(e.text for e in events["b"]) == decode(solo_greedy(greedy_target, prompts8[1], 20))


def test_bad_requests_and_a_full_queue(greedy_target, prompts8):
    engine = Engine(SpeculativeGenerator(greedy_target, None), FixedK(0), EngineConfig(max_waiting=1))
    limit = greedy_target.config.max_position_embeddings
    with pytest.raises(EngineError, match="exceeds the context"):
        engine.submit(Request("long", tuple([5] * limit), 4))
    with pytest.raises(EngineError, match="zero tokens"):
        engine.submit(Request("empty", (), 4))
    with pytest.raises(EngineError, match="stop strings need a tokenizer"):
        engine.submit(Request("stop", (5, 6), 4, stop=("x",)))
    engine.submit(Request("a", tuple(prompts8[0]), 4))
    with pytest.raises(QueueFull):
        engine.submit(Request("b", tuple(prompts8[1]), 4))


def test_tree_strategy_with_staggered_arrivals_equals_solo_greedy(greedy_target, greedy_draft_sometimes, prompts8):
    from specbatch.perfmodel.tree import Strategy, parse_tree
    from specbatch.runtime.policy import FixedStrategy

    policy = FixedStrategy(Strategy(parse_tree("0,1,0.0,0.1,1.0")))
    engine = Engine(SpeculativeGenerator(greedy_target, greedy_draft_sometimes), policy, EngineConfig(max_batch_size=3))
    requests = [Request(f"r{i}", tuple(p), 10 + i) for i, p in enumerate(prompts8[:5])]
    events = drive(engine, {0: requests[:2], 3: requests[2:4], 5: requests[4:]})
    for r, p in zip(requests, prompts8):
        assert tokens_of(events[r.id]) == solo_greedy(greedy_target, p, r.max_tokens), r.id


@pytest.mark.filterwarnings("ignore:table. context length")
@pytest.mark.parametrize("spec", ["chain:4", "0,1,0.0,0.1,1.0"])
def test_staged_strategy_with_staggered_arrivals_equals_solo_greedy(greedy_target, greedy_draft_sometimes, prompts8,
                                                                   spec):
    """The n-gram second stage (what a table's staged entries run) under joins and leaves."""
    import torch

    from specbatch.perfmodel.tree import Strategy, parse_tree
    from specbatch.runtime.ngram import NGramModel
    from specbatch.runtime.policy import FixedStrategy

    vocab = greedy_target.config.vocab_size
    corpus = torch.randint(0, vocab, (20, 30), generator=torch.Generator().manual_seed(9)).tolist()
    stage2 = NGramModel.fit(corpus, vocab)
    policy = FixedStrategy(Strategy(parse_tree(spec), stage2=True))
    generator = SpeculativeGenerator(greedy_target, greedy_draft_sometimes, stage2=stage2)
    engine = Engine(generator, policy, EngineConfig(max_batch_size=3))
    requests = [Request(f"r{i}", tuple(p), 10 + i) for i, p in enumerate(prompts8[:5])]
    events = drive(engine, {0: requests[:2], 3: requests[2:4], 5: requests[4:]})
    for r, p in zip(requests, prompts8):
        assert tokens_of(events[r.id]) == solo_greedy(greedy_target, p, r.max_tokens), r.id
