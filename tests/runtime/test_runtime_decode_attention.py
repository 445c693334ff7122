"""The flash calls a pass makes on the CUDA path, run through the CPU reference of the kernel
(tests/runtime/varlen_reference.py): which arguments each pass shape gets (a single token non-causal, so
flash packs the query group and splits the keys; a verify's prefix packed by KV head where the merge is fused,
causal in the eager layer and on a window) and that the outputs equal the sdpa backend's, the oracle, in
float32. The fused functions run uncompiled here (runtime.fused.EAGER: the same code the compiler is given)."""
from __future__ import annotations

import pytest
import torch

import varlen_reference
from specbatch.runtime.attention import TreeAttention
from specbatch.runtime.checkpoint import build_model
from specbatch.runtime.devices import cuda
from specbatch.runtime.fused import EAGER
from torch_fixtures import tiny_llama_config

PROMPT_LENGTHS = (5, 11, 1)  # ragged rows


class RecordedFlash:
    """The reference kernel, with each call's shapes and windows kept."""

    def __init__(self):
        self.calls: list[dict] = []

    def __call__(self, query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                 return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None, seqused_k=None):
        self.calls.append(dict(query_shape=tuple(query.shape), kv_heads=key.shape[1], max_q=max_q,
                               is_causal=is_causal, left=window_size_left, right=window_size_right,
                               used_k=seqused_k.tolist(), cu_q=cum_seq_q.tolist()))
        return varlen_reference.flash_attention_forward(
            query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask,
            scale=scale, window_size_left=window_size_left, window_size_right=window_size_right, seqused_k=seqused_k)


def _models(monkeypatch, fused: bool = True, **config):
    recorded = RecordedFlash()
    found = cuda.varlen_from(recorded)
    monkeypatch.setattr(cuda, "flash_varlen", lambda device: found)
    torch.manual_seed(0)
    reference = build_model(tiny_llama_config(**config), "cpu", torch.float32, seed=3)
    varlen = build_model(tiny_llama_config(**config), "cpu", torch.float32, seed=3)
    reference.attention_backend, varlen.attention_backend = "sdpa", "varlen"
    reference.layer_kernels, varlen.layer_kernels = None, EAGER if fused else None
    return reference, varlen, recorded


def _prefilled(model, max_len: int = 40):
    cache = model.new_cache(len(PROMPT_LENGTHS), max_len)
    generator = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, model.config.vocab_size, (sum(PROMPT_LENGTHS),), generator=generator)
    model(tokens, cache, last=1, new_tokens=list(PROMPT_LENGTHS))
    return cache


def _pass(model, cache, n: int, tree=None):
    generator = torch.Generator().manual_seed(n)
    tokens = torch.randint(0, model.config.vocab_size, (cache.batch_size, n), generator=generator)
    return model(tokens, cache, tree)


@pytest.mark.parametrize("n", [1, 2, 5, 9])
def test_each_pass_shape_makes_its_flash_call_and_attends_as_the_reference(monkeypatch, n):
    reference, varlen, recorded = _models(monkeypatch, fused=True)
    with torch.inference_mode():
        ref_cache, var_cache = _prefilled(reference), _prefilled(varlen)
        recorded.calls.clear()
        expected, got = _pass(reference, ref_cache, n), _pass(varlen, var_cache, n)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    heads, kv_heads, group, b = 4, 2, 2, len(PROMPT_LENGTHS)
    assert len(recorded.calls) == reference.config.num_layers
    call = recorded.calls[0]
    assert not call["is_causal"] and call["right"] == -1 and call["left"] == -1
    if n == 1:  # one query a row: the query heads as they are; flash packs the group itself
        assert call["query_shape"] == (b, heads, 8) and call["max_q"] == 1
        assert call["used_k"] == [length + 1 for length in PROMPT_LENGTHS]
    else:  # the prefix, each KV head's n x group queries in one row of the call
        assert call["query_shape"] == (b * n * group, kv_heads, 8) and call["max_q"] == n * group
        assert call["cu_q"] == [r * n * group for r in range(b + 1)]
        assert call["used_k"] == list(PROMPT_LENGTHS)


def test_the_eager_layers_verify_keeps_the_causal_call(monkeypatch):
    reference, varlen, recorded = _models(monkeypatch, fused=False)
    with torch.inference_mode():
        ref_cache, var_cache = _prefilled(reference), _prefilled(varlen)
        recorded.calls.clear()
        expected, got = _pass(reference, ref_cache, 4), _pass(varlen, var_cache, 4)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    call = recorded.calls[0]
    assert call["is_causal"] and call["max_q"] == 4 and call["query_shape"] == (3 * 4, 4, 8)
    assert call["used_k"] == [length + 4 for length in PROMPT_LENGTHS]


def test_a_pass_on_a_fresh_cache_reads_the_kernels_empty_prefix_as_empty(monkeypatch):
    """No committed key: the kernel gives output 0 and lse +inf; the merge must take only the pass's own."""
    reference, varlen, recorded = _models(monkeypatch)
    with torch.inference_mode():
        expected = _pass(reference, reference.new_cache(3, 16), 4)
        got = _pass(varlen, varlen.new_cache(3, 16), 4)
    assert recorded.calls[0]["used_k"] == [0, 0, 0]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads", [(4, 2), (4, 1), (2, 2)])
def test_a_one_token_tree_level_reads_the_packed_lse_of_grouped_heads(monkeypatch, heads):
    """A tree pass of one node a row, over two in-flight slots: its prefix call is packed (never flash's own
    one-query path, whose lse the merge would then read) and the merge equals sdpa's masked attention."""
    num_heads, num_kv_heads = heads
    reference, varlen, recorded = _models(monkeypatch, num_heads=num_heads, num_kv_heads=num_kv_heads)
    tree_first = TreeAttention(torch.tensor([0, 1]), torch.tensor([[True, False], [True, True]]))
    tree_next = TreeAttention(torch.tensor([0, 1, 1]), torch.tensor([[True, False, True]]))
    with torch.inference_mode():
        ref_cache, var_cache = _prefilled(reference), _prefilled(varlen)
        _pass(reference, ref_cache, 2, tree_first), _pass(varlen, var_cache, 2, tree_first)
        recorded.calls.clear()
        expected, got = _pass(reference, ref_cache, 1, tree_next), _pass(varlen, var_cache, 1, tree_next)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    group = num_heads // num_kv_heads
    call = recorded.calls[0]
    assert call["query_shape"][1] == num_kv_heads and call["max_q"] == group and not call["is_causal"]


def test_a_sliding_window_verify_keeps_the_causal_call(monkeypatch):
    """Each verified token's window starts at its own position: no packed prefix call can say that."""
    reference, varlen, recorded = _models(monkeypatch, sliding_window=6)
    with torch.inference_mode():
        ref_cache, var_cache = _prefilled(reference), _prefilled(varlen)
        recorded.calls.clear()
        expected, got = _pass(reference, ref_cache, 4), _pass(varlen, var_cache, 4)
        one_expected, one_got = _pass(reference, ref_cache, 1), _pass(varlen, var_cache, 1)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(one_got, one_expected, rtol=1e-5, atol=1e-5)
    verify, decode = recorded.calls[0], recorded.calls[-1]
    assert (verify["left"], verify["right"], verify["max_q"]) == (5, 0, 4)
    assert (decode["left"], decode["right"], decode["max_q"], decode["is_causal"]) == (5, -1, 1, False)
