"""A reference `torch.nn.attention.varlen.varlen_attn` for the CPU: the documented contract, row by row, in
float32 (the kernel is CUDA-only). The runtime's varlen backend is tested through it on the CPU (its
layouts, offsets, key counts, windows and the tree's log-sum-exp merge); marked GPU tests compare the real
kernel with the CPU backend.

Contract (torch 2.13, torch/nn/attention/varlen.py): q (T_q, H, D), k and v (T_k, H_kv, D); cu_seq_q and
cu_seq_k int32 (N + 1,) start offsets; seqused_k int32 (N,): row i uses keys cu_seq_k[i] ..
cu_seq_k[i] + seqused_k[i] - 1; window_size (left, right): (-1, -1) full, (-1, 0) causal, (W, 0) causal
with W keys to the left; causal masks align the queries with the LAST keys (query j of n sits at key
position used - n + j). Returns (T_q, H, D) and, when asked, the log-sum-exp as (H, T_q) float32: the
layout of the flash kernel's output and of torch's own fake (meta) implementation (the docstring's
(T_q, H) is not what the kernel returns). A query that sees no key gets output 0 and lse +inf, as the
kernel's unsplit epilogue writes it (not the -inf of an empty log-sum-exp).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class AuxRequest:
    lse: bool = False


def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    assert block_table is None
    assert query.dim() == 3 and key.dim() == 3 and value.dim() == 3, (query.shape, key.shape)
    assert cu_seq_q.dtype == torch.int32 and cu_seq_k.dtype == torch.int32
    assert seqused_k is None or seqused_k.dtype == torch.int32
    heads, kv_heads = query.shape[1], key.shape[1]
    assert heads == kv_heads or (enable_gqa and heads % kv_heads == 0)
    rows = len(cu_seq_q) - 1
    out = torch.zeros(query.shape, dtype=torch.float32)
    lse = torch.full((query.shape[1], query.shape[0]), float("inf"))
    scale = scale if scale is not None else 1 / math.sqrt(query.shape[-1])
    left, right = window_size
    for i in range(rows):
        q0, q1 = int(cu_seq_q[i]), int(cu_seq_q[i + 1])
        k0 = int(cu_seq_k[i])
        used = int(seqused_k[i]) if seqused_k is not None else int(cu_seq_k[i + 1]) - k0
        n = q1 - q0
        assert n <= max_q and used <= max_k
        q = query[q0:q1].float()  # (n, H, D)
        k = key[k0:k0 + used].float().repeat_interleave(heads // kv_heads, dim=1)  # (used, H, D)
        v = value[k0:k0 + used].float().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("nhd,mhd->hnm", q, k) * scale
        query_pos = torch.arange(n)[:, None] + used - n
        key_pos = torch.arange(used)[None, :]
        allowed = torch.ones(n, used, dtype=torch.bool)
        if right >= 0:
            allowed &= key_pos <= query_pos + right
        if left >= 0:
            allowed &= key_pos >= query_pos - left
        scores = scores.masked_fill(~allowed, float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # (H, n)
        weights = torch.nan_to_num((scores - row_lse[..., None]).exp())
        out[q0:q1] = torch.einsum("hnm,mhd->nhd", weights, v)
        # as the kernel (FA2's softmax epilogue, unsplit): a query that sees no key has output 0 and lse +inf
        lse[:, q0:q1] = row_lse.masked_fill(row_lse == float("-inf"), float("inf"))
    out = out.to(query.dtype)
    if return_aux is not None and return_aux.lse:
        return out, lse
    return out


def flash_attention_forward(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal,
                            return_debug_mask, *, scale=None, window_size_left=None, window_size_right=None,
                            seqused_k=None, alibi_slopes=None, block_table=None, num_splits=None):
    """A stand-in with the schema of aten's `_flash_attention_forward` (torch >= 2.10), which the varlen backend
    calls: flash attends grouped query heads natively; is_causal means the window (-1, 0)."""
    assert dropout_p == 0.0 and not return_debug_mask and alibi_slopes is None
    left = -1 if window_size_left is None else window_size_left
    right = (0 if is_causal else -1) if window_size_right is None else window_size_right
    if is_causal:
        assert (left, right) == (-1, 0)
    out, lse = varlen_attn(query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, return_aux=AuxRequest(True),
                           scale=scale, window_size=(left, right), enable_gqa=True, seqused_k=seqused_k)
    return out, lse, torch.zeros(2, dtype=torch.int64), torch.zeros(0), torch.zeros(0)


def use_reference_flash(monkeypatch) -> None:
    """Route the varlen backend's kernel through the CPU reference, on every device."""
    from specbatch.runtime.devices import cuda

    found = cuda.varlen_from(flash_attention_forward)
    monkeypatch.setattr(cuda, "flash_varlen", lambda device: found)
