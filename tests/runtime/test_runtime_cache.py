"""KVCache.keep_rows compacts in place: each kept row's live entries are the original row's (the oracle:
index_select of the same rows), nothing is allocated, and indices must be increasing."""
from __future__ import annotations

import pytest
import torch

from torch_fixtures import tiny_llama_config
from specbatch.runtime.model import KVCache


def filled_cache(lengths: list[int]) -> KVCache:
    cache = KVCache(tiny_llama_config(), len(lengths), 16, "cpu", torch.float32)
    generator = torch.Generator().manual_seed(3)
    cache.keys.copy_(torch.randn(cache.keys.shape, generator=generator))
    cache.values.copy_(torch.randn(cache.values.shape, generator=generator))
    cache.lengths = torch.tensor(lengths)
    return cache


@pytest.mark.parametrize("keep", [[0, 2, 3], [1, 4], [4], [0, 1, 2, 3, 4]])
def test_kept_rows_hold_their_live_entries_and_nothing_is_allocated(keep):
    lengths = [5, 16, 0, 9, 12]
    cache = filled_cache(lengths)
    keys, values = cache.keys.clone(), cache.values.clone()
    storage = cache.keys.untyped_storage().data_ptr()
    cache.keep_rows(torch.tensor(keep))
    assert cache.batch_size == len(keep) and cache.lengths.tolist() == [lengths[r] for r in keep]
    assert cache.keys.untyped_storage().data_ptr() == storage  # compacted where it was
    for row, source in enumerate(keep):
        live = lengths[source]
        assert torch.equal(cache.keys[:, row, :, :live], keys[:, source, :, :live])
        assert torch.equal(cache.values[:, row, :, :live], values[:, source, :, :live])


def test_indices_must_be_increasing():
    cache = filled_cache([3, 3, 3])
    with pytest.raises(ValueError, match=r"keep_rows: row indices must be increasing, found \[2, 0\]"):
        cache.keep_rows(torch.tensor([2, 0]))
