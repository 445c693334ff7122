"""A CPU KV cache is allocated uninitialised (runtime.kv_cache): the slots a pass reads beyond a row's own
keys, masked, must be zeroed first, as a masked key still meets its zero weight (0 x NaN is NaN). Here every
fresh cache is filled with NaN, the worst memory it can be given; oracles: target-only greedy output from
zeroed caches, and finite logits."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specbatch.perfmodel.tree import Strategy, parse_tree
from specbatch.runtime import kv_cache
from specbatch.runtime.generator import SpeculativeGenerator
from specbatch.runtime.policy import FixedK, FixedStrategy

N_NEW = 12


@pytest.fixture
def nan_caches(monkeypatch):
    """Every KVCache allocated on the CPU starts as NaN (and is counted as holding nothing finite)."""
    allocate = kv_cache.KVCache.__init__

    def poisoned(self, *args, **kwargs):
        allocate(self, *args, **kwargs)
        assert (self.clean == 0).all()  # a CPU cache claims no finite slot before anything is written
        self.keys.fill_(float("nan"))
        self.values.fill_(float("nan"))

    monkeypatch.setattr(kv_cache.KVCache, "__init__", poisoned)


def test_a_masked_nan_key_poisons_attention():
    """Why the zeroing is needed (not a property of our code: of the arithmetic)."""
    q, k, v = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 3, 8), torch.randn(1, 1, 3, 8)
    k[0, 0, 2], v[0, 0, 2] = float("nan"), float("nan")
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=torch.tensor([[True, True, False]]))
    assert out.isnan().all()


@pytest.fixture(scope="module")
def zeroed_reference(greedy_target, prompts8):
    return SpeculativeGenerator(greedy_target, None).generate(prompts8, N_NEW, FixedK(0)).token_ids


@pytest.mark.parametrize("policy", [FixedK(0), FixedK(3), FixedStrategy(Strategy(parse_tree("0,1,0.0,0.1")))],
                         ids=["plain", "chain", "tree"])
def test_ragged_rows_over_nan_memory_decode_as_over_zeros(policy, nan_caches, greedy_target,
                                                          greedy_draft_sometimes, prompts8, zeroed_reference):
    """prompts8 spans 3..17 tokens: each pass attends in one run padded to the longest row, reading the
    shorter rows' never-written slots."""
    result = SpeculativeGenerator(greedy_target, greedy_draft_sometimes).generate(prompts8, N_NEW, policy)
    assert result.token_ids == zeroed_reference


def test_lengths_set_past_what_was_written_read_zeros(nan_caches, greedy_target):
    """Calibration times a pass on top of `context_len` cached tokens it never wrote."""
    cache = greedy_target.new_cache(3, 24)
    cache.set_lengths(None, [10, 4, 17])
    with torch.inference_mode():
        logits = greedy_target(torch.tensor([[5], [6], [7]]), cache)
    assert torch.isfinite(logits).all()
    for r, length in enumerate([10, 4, 17]):
        assert not cache.keys[:, r, :length].isnan().any()
