"""A prefill pays only for the logits it uses: one position per row for the target, none for the draft.

Oracles: the full pass's logits at those positions, the full pass's cache, and greedy decoding of each
prompt alone without a cache."""
from __future__ import annotations

import torch

from specbatch.runtime.generator import SpeculativeGenerator
from specbatch.runtime.policy import FixedK


def padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    lengths = torch.tensor([len(p) for p in prompts])
    tokens = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        tokens[row, :len(prompt)] = torch.tensor(prompt)
    return tokens, lengths


def test_logits_at_one_position_per_row_are_the_full_pass_at_those_positions(greedy_target, prompts8):
    tokens, lengths = padded(prompts8)
    full_cache, one_cache = greedy_target.new_cache(8, 32), greedy_target.new_cache(8, 32)
    with torch.no_grad():
        full = greedy_target(tokens, full_cache)  # (b, n, vocab)
        last = greedy_target(tokens, one_cache, logits_at=lengths - 1)  # (b, vocab)
    assert last.shape == (8, full.shape[-1])
    torch.testing.assert_close(last, full[torch.arange(8), lengths - 1], rtol=1e-5, atol=1e-5)
    assert torch.equal(full_cache.lengths, one_cache.lengths)
    assert torch.equal(full_cache.keys, one_cache.keys) and torch.equal(full_cache.values, one_cache.values)


def test_a_pass_without_logits_fills_the_cache_and_returns_none(greedy_target, prompts8):
    tokens, _ = padded(prompts8)
    with_logits, without = greedy_target.new_cache(8, 32), greedy_target.new_cache(8, 32)
    with torch.no_grad():
        greedy_target(tokens, with_logits)
        assert greedy_target(tokens, without, logits=False) is None
    assert torch.equal(with_logits.keys, without.keys) and torch.equal(with_logits.lengths, without.lengths)


def test_generation_matches_greedy_decoding_without_cache_or_padding(greedy_target, greedy_draft_sometimes, prompts8):
    """The oracle: each prompt alone, the whole sequence re-run every token with no cache, no padding and no
    position gathered; the batched generator (its prefill reading one position per row) must agree."""
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
