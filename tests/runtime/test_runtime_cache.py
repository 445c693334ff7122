"""Rows retire in place: the last running row moves into each freed slot (its live entries only), the
caches keep their storage (nothing allocated, no whole-cache copy), and device and host lengths agree.
Oracles: the original rows' entries, and the storage pointers before the retirement."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from torch_fixtures import tiny_llama_config
from specbatch.runtime.batch import BatchState, apply_moves, fill_holes
from specbatch.runtime.kv_cache import KVCache


def filled_cache(lengths: list[int], seed: int = 3) -> KVCache:
    cache = KVCache(tiny_llama_config(), len(lengths), 16, "cpu", torch.float32)
    cache.lengths = torch.tensor(lengths)  # first: lengths set past what was written zero those slots
    generator = torch.Generator().manual_seed(seed)
    cache.keys.copy_(torch.randn(cache.keys.shape, generator=generator))
    cache.values.copy_(torch.randn(cache.values.shape, generator=generator))
    return cache


def filled_state(lengths: list[int]) -> BatchState:
    b = len(lengths)
    tokens = torch.arange(b * 20).view(b, 20)
    committed = torch.tensor(lengths) + 1
    return BatchState(tokens, committed, committed.numpy().copy(), filled_cache(lengths), filled_cache(lengths, 4), 2)


@pytest.mark.parametrize("holes", [[1, 3], [4], [0, 1, 2, 3], [2], [0, 4]])
def test_retired_rows_are_refilled_in_place_with_the_survivors_live_entries(holes):
    lengths = [5, 16, 0, 9, 12]
    state = filled_state(lengths)
    caches = (state.target_cache, state.draft_cache)
    before = [(c.keys.clone(), c.values.clone()) for c in caches]
    tokens_before = state.tokens.clone()
    pointers = [(c.keys.untyped_storage().data_ptr(), c.values.untyped_storage().data_ptr()) for c in caches]
    moves = fill_holes(state, holes, len(lengths))
    remaining = len(lengths) - len(holes)
    survivors = apply_moves(list(range(len(lengths))), moves, remaining)
    assert sorted(survivors) == [r for r in range(len(lengths)) if r not in holes]
    state = state.rows(0, remaining)
    for cache, (keys, values), (key_ptr, value_ptr) in zip((state.target_cache, state.draft_cache), before, pointers):
        assert cache.keys.untyped_storage().data_ptr() == key_ptr  # the same buffers: nothing was copied whole
        assert cache.values.untyped_storage().data_ptr() == value_ptr
        assert cache.lengths.tolist() == [lengths[r] for r in survivors]
        assert cache.host_lengths.tolist() == [lengths[r] for r in survivors]
        for slot, source in enumerate(survivors):
            live = lengths[source]
            assert torch.equal(cache.keys[:, slot, :live], keys[:, source, :live])
            assert torch.equal(cache.values[:, slot, :live], values[:, source, :live])
    assert state.committed.tolist() == [lengths[r] + 1 for r in survivors] == state.host_committed.tolist()
    assert torch.equal(state.tokens, tokens_before[survivors])
    # only the moved rows were written: a row that did not move still holds its own entries past its length
    for slot, source in enumerate(survivors):
        if slot == source:
            assert torch.equal(state.target_cache.keys[:, slot], before[0][0][:, source])


def test_a_move_copies_only_live_entries():
    state = filled_state([3, 7])
    stale = state.target_cache.keys[:, 0, 7:].clone()  # beyond row 1's live entries
    fill_holes(state, [0], 2)
    assert torch.equal(state.target_cache.keys[:, 0, 7:], stale)


def test_views_share_both_lengths_with_their_parent():
    cache = filled_cache([4, 6, 8, 10])
    view = cache.rows(1, 2)
    view.advance(3)
    assert cache.lengths.tolist() == [4, 9, 11, 10] and cache.host_lengths.tolist() == [4, 9, 11, 10]
    view.set_lengths(torch.tensor([1, 2]), [1, 2])
    assert cache.lengths.tolist() == [4, 1, 2, 10] and np.array_equal(cache.host_lengths, [4, 1, 2, 10])
    assert cache.longest() == 10 and view.longest() == 2


def test_a_generator_keeps_its_caches_for_the_next_generation_that_fits(greedy_target, greedy_draft_sometimes,
                                                                         prompts8):
    """The second generation runs in the first one's cache memory (no allocation, no page touched for the
    first time), a third one too large for it gets a new cache, and the tokens are those of a fresh generator."""
    from specbatch.runtime.generator import SpeculativeGenerator
    from specbatch.runtime.policy import FixedK

    def fresh(prompts, n):
        return SpeculativeGenerator(greedy_target, greedy_draft_sometimes).generate(prompts, n, FixedK(3)).token_ids

    expected = [fresh(prompts8, 10), fresh(prompts8[2:5], 6), fresh(prompts8, 20)]
    generator = SpeculativeGenerator(greedy_target, greedy_draft_sometimes)
    allocated = []
    new_cache = KVCache.__init__

    def counting(self, *args, **kwargs):
        new_cache(self, *args, **kwargs)
        allocated.append(self)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(KVCache, "__init__", counting)
        assert generator.generate(prompts8, 10, FixedK(3)).token_ids == expected[0]
        assert len(allocated) == 2  # target and draft
        assert generator.generate(prompts8[2:5], 6, FixedK(3)).token_ids == expected[1]
        assert len(allocated) == 2  # nothing new: both caches are the first generation's
        assert generator.generate(prompts8, 20, FixedK(3)).token_ids == expected[2]  # longer rows: new caches
        assert len(allocated) == 4
    generator.release_caches()
    assert not generator._spare_caches


def test_generations_in_turns_never_share_a_kept_cache(greedy_target, greedy_draft_sometimes, prompts8):
    from specbatch.runtime.generator import SpeculativeGenerator
    from specbatch.runtime.policy import FixedK

    generator = SpeculativeGenerator(greedy_target, greedy_draft_sometimes)
    alone = [generator.generate(prompts8[:4], 8, FixedK(2)).token_ids,
             generator.generate(prompts8[4:], 8, FixedK(2)).token_ids]  # leaves a cache to take
    turns = [generator.generation(prompts8[:4], 8, FixedK(2)), generator.generation(prompts8[4:], 8, FixedK(2))]
    results = [None, None]
    while None in results:
        for i, turn in enumerate(turns):
            if results[i] is None:
                try:
                    next(turn)
                except StopIteration as finished:
                    results[i] = finished.value.token_ids
    assert results == alone
