"""A prefill pays only for the logits it uses: one position per row for the target, none for the draft.

Oracles: the full pass's logits at those positions, the full pass's cache, and greedy decoding of each
prompt alone without a cache."""
from __future__ import annotations

import pytest
import torch

from specbatch.runtime.generator import SpeculativeGenerator
from specbatch.runtime.policy import FixedK
from torch_fixtures import tune_cpu


def packed(prompts: list[list[int]]) -> torch.Tensor:
    return torch.tensor([token for prompt in prompts for token in prompt])


def assert_each_row_as_alone(model, prompts: list[list[int]], last: torch.Tensor, cache) -> None:
    """Each row's last-position logits and cache entries equal those of its prompt run alone."""
    with torch.no_grad():
        for row, prompt in enumerate(prompts):
            alone = model.new_cache(1, cache.max_len)
            full = model(torch.tensor([prompt]), alone)
            torch.testing.assert_close(last[row, 0], full[0, -1], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(cache.keys[:, row, :len(prompt)], alone.keys[:, 0, :len(prompt)],
                                       rtol=1e-5, atol=1e-5)


def test_a_packed_prefill_gives_each_rows_last_logits_and_cache_as_the_row_alone(greedy_target, prompts8):
    """Prompts of different lengths packed with no padding: each row's last-position logits and its cache
    entries equal those of the row's prompt run alone."""
    counts = [len(p) for p in prompts8]
    assert len(set(counts)) > 1  # ragged
    cache = greedy_target.new_cache(8, 32)
    with torch.no_grad():
        last = greedy_target(packed(prompts8), cache, last=1, new_tokens=counts)  # (b, 1, vocab)
    assert last.shape == (8, 1, greedy_target.config.vocab_size)
    assert_each_row_as_alone(greedy_target, prompts8, last, cache)
    assert cache.lengths.tolist() == counts == cache.host_lengths.tolist()


def test_a_pass_without_logits_fills_the_cache_and_returns_none(greedy_target, prompts8):
    counts = [len(p) for p in prompts8]
    with_logits, without = greedy_target.new_cache(8, 32), greedy_target.new_cache(8, 32)
    with torch.no_grad():
        greedy_target(packed(prompts8), with_logits, last=1, new_tokens=counts)
        assert greedy_target(packed(prompts8), without, last=0, new_tokens=counts) is None
    assert torch.equal(with_logits.lengths, without.lengths)
    for r, count in enumerate(counts):  # the written slots (the rest of a CPU cache is uninitialised)
        assert torch.equal(with_logits.keys[:, r, :count], without.keys[:, r, :count])
        assert torch.equal(with_logits.values[:, r, :count], without.values[:, r, :count])


def test_a_ragged_pass_continues_rows_that_already_hold_tokens(greedy_target, prompts8):
    """Chunked prefill: rows that hold part of their prompt (and rows that hold none) feed the rest in one
    ragged pass; the logits equal the prompt run alone."""
    held = [3, 0, 5, 1, 0, 2, 4, 0]
    cache = greedy_target.new_cache(8, 32)
    with torch.no_grad():
        for row, h in enumerate(held):
            if h:
                greedy_target(torch.tensor(prompts8[row][:h]), cache.rows(row, 1), last=0, new_tokens=[h])
        rest = [p[h:] for p, h in zip(prompts8, held)]
        last = greedy_target(packed(rest), cache, last=1, new_tokens=[len(r) for r in rest])
        for row, prompt in enumerate(prompts8):
            full = greedy_target(torch.tensor([prompt]))
            torch.testing.assert_close(last[row, 0], full[0, -1], rtol=1e-5, atol=1e-5)
    assert cache.host_lengths.tolist() == [len(p) for p in prompts8]


@pytest.mark.parametrize("pass_tokens", [1024, 20], ids=["one pass", "passes of 20 tokens"])
def test_generation_matches_greedy_decoding_without_cache_or_padding(pass_tokens, greedy_target,
                                                                     greedy_draft_sometimes, prompts8, monkeypatch):
    """The oracle: each prompt alone, the whole sequence re-run every token with no cache, no padding and no
    position gathered; the batched generator (its prefill reading one position per row, in one pass or in
    passes of a few rows each, as a CPU prefill of many tokens runs) must agree."""
    from specbatch.runtime import generator as generator_module

    tune_cpu(monkeypatch, prefill_pass_tokens=pass_tokens)
    planned = []
    plan = generator_module.prefill_passes
    monkeypatch.setattr(generator_module, "prefill_passes", lambda *a: planned.append(plan(*a)) or planned[-1])
    new_tokens = 10
    expected = []
    with torch.no_grad():
        for prompt in prompts8:
            sequence = list(prompt)
            for _ in range(new_tokens):
                sequence.append(int(greedy_target(torch.tensor([sequence]))[0, -1].argmax()))
            expected.append(sequence[len(prompt):])
    for draft, k in ((None, 0), (greedy_draft_sometimes, 3)):
        got = SpeculativeGenerator(greedy_target, draft).generate(prompts8, new_tokens, FixedK(k)).token_ids
        assert [list(row) for row in got] == expected, k
    assert len(planned[-1]) == (1 if pass_tokens == 1024 else 4)  # 17 | 12 | 9, 7 | 6, 5, 4, 3 tokens



@pytest.mark.parametrize("shape", ["uniform and one long", "padded together", "long rows one by one"])
def test_rows_of_one_length_attend_through_a_view_and_match_the_row_alone(shape, greedy_target, prompts8):
    """A block of the packing whose rows have one length needs no gathered copies: its group is a span of
    the packing (the long row alone is one too); short rows of different lengths padded together keep the
    gathered path; long rows of different lengths attend one by one, each a span of the packing. Either way
    each row's logits and cache are the row's alone."""
    from specbatch.runtime.attention import RaggedPass
    from specbatch.runtime.devices.cpu import CPU

    alone_tokens = CPU.alone_prefill_tokens

    width = min(len(p) for p in prompts8)
    if shape == "uniform and one long":
        prompts = [p[:width] for p in prompts8[:6]] + [prompts8[0] + prompts8[1]]
    elif shape == "padded together":
        prompts = [p[:width - (row % 2)] for row, p in enumerate(prompts8[:6])]
    else:  # lengths 33 + 2 r (decreasing in the packing, as the generator's slot order gives them)
        joined = [token for prompt in prompts8 for token in prompt]
        prompts = [joined[r:r + alone_tokens + 1 + 2 * r] for r in range(4)][::-1]
    counts = [len(p) for p in prompts]
    cache = greedy_target.new_cache(len(prompts), 64)
    plan = RaggedPass(cache, counts, None, "sdpa")
    if shape == "uniform and one long":
        assert [group[2] for group in plan.groups] == [slice(6 * width, sum(counts)), slice(0, 6 * width)]
    elif shape == "padded together":
        assert len(plan.groups) == 1 and plan.groups[0][0] is not None
    else:
        starts = [sum(counts[:r]) for r in range(5)]
        assert [group[2] for group in plan.groups] == [slice(a, b) for a, b in zip(starts, starts[1:])]
    with torch.no_grad():
        last = greedy_target(packed(prompts), cache, last=1, new_tokens=counts)
    assert_each_row_as_alone(greedy_target, prompts, last, cache)
