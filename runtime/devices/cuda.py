"""CUDA: half precision, queued work, captured graphs, and flash attention straight over the KV cache.

The varlen backend calls aten's `_flash_attention_forward` directly: from torch 2.10 on its schema takes
`seqused_k` (each row's key count over fixed slots) and `window_size_left/right`, and flash handles grouped
query heads natively. torch's public `varlen_attn` wraps the same op but its keywords differ per version
(2.11 has neither `enable_gqa` nor `seqused_k`), may route to cuDNN (no GQA, no `seqused_k`) and allocates an
rng tensor every call. `flash_varlen()` checks the schema once and a one-token call on the device before the
backend counts as usable; otherwise passes run on sdpa and the reason is logged once.
"""
from __future__ import annotations

import inspect
import logging
from typing import Callable, NamedTuple

from .kind import DeviceKind

log = logging.getLogger("specbatch.runtime")

CUDA = DeviceKind(
    name="cuda",
    default_dtype="bfloat16",
    asynchronous=True,
    lazy_cache=False,  # a fill is cheap on a GPU: every slot is zeroed once, at allocation
    cache_zero_ahead_slots=0,
    transposed_projections=False,  # cuBLAS's fast case is the native (out, in) layout
    prefill_pass_tokens=None,  # a larger pass only fills the device better
    host_bookkeeping_max_cells=0,  # a read-back waits for the device: trees keep their bookkeeping there
    sdpa_call_keys=None,  # sdpa runs on CUDA only as the fallback (float32, no flash): one call, padded
    sdpa_row_keys=None,
    slice_write_spans=0,  # the scatter from device lengths, which a captured graph replays
    prefill_padding=float("inf"),
    alone_prefill_tokens=None,
    graphs_by_default=True,
    grouped_expert_products=True,  # capturable: no read-back of the routing; the kernel skips empty groups
    fused_layers=True,  # a layer's 12 small kernels cost ~2 us each even inside a graph (runtime.fused)
    sources={
        "cache_zero_ahead_slots": "not used: the cache is zeroed at allocation",
        "prefill_pass_tokens": "not tuned: one pass (launches, not cache sizes, bound a GPU prefill)",
        "host_bookkeeping_max_cells": "not tuned: never (a read-back costs a device round trip)",
        "sdpa_call_keys": "not tuned: the fallback makes one call (a kernel launch costs more than padding)",
        "sdpa_row_keys": "not tuned: as sdpa_call_keys",
        "slice_write_spans": "not tuned: the scatter, capturable",
        "prefill_padding": "not tuned: one padded call, as sdpa_call_keys",
        "alone_prefill_tokens": "not tuned: as prefill_padding",
    },
)

# what our varlen backend needs of the flash op's schema (torch >= 2.10)
REQUIRED_ARGUMENTS = ("seqused_k", "window_size_left", "window_size_right", "scale")


class FlashVarlen(NamedTuple):
    """Flash attention over packed queries and fixed-size key slots; `None` fields: unusable, and why."""

    attend: Callable | None
    reason: str | None


def argument_names(op) -> set[str]:
    """An op's argument names, from its schema (a torch op) or its signature (a Python stand-in)."""
    overload = getattr(op, "default", op)
    schema = getattr(overload, "_schema", None)
    if schema is not None:
        return {argument.name for argument in schema.arguments}
    return set(inspect.signature(op).parameters)


def varlen_from(op) -> FlashVarlen:
    """Our varlen call over `op` (aten's `_flash_attention_forward` or a stand-in with its schema), or why not.

    The call: q (T_q, H, D), k and v (slots, H_kv, D), cu_q / cu_k int32 (rows + 1,) offsets, used_k int32
    (rows,) keys each row uses from its offset, window_left (-1: none) -> (out (T_q, H, D), lse (H, T_q))."""
    if op is None:
        return FlashVarlen(None, "this torch has no aten._flash_attention_forward")
    missing = [name for name in REQUIRED_ARGUMENTS if name not in argument_names(op)]
    if missing:
        return FlashVarlen(None, f"this torch's aten._flash_attention_forward lacks {', '.join(missing)} "
                                 f"(torch >= 2.10 has them)")

    def attend(q, k, v, cu_q, cu_k, max_q: int, max_k: int, used_k, window_left: int = -1, causal: bool = True):
        # causal aligns each row's queries with its last keys; a window also bounds them on the left
        out, lse, *_ = op(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal and window_left < 0, False,
                          window_size_left=window_left, window_size_right=0 if causal else -1, seqused_k=used_k)
        return out, lse

    return FlashVarlen(attend, None)


_resolved: dict[str, FlashVarlen] = {}


def flash_varlen(device) -> FlashVarlen:
    """The flash varlen call on `device` when it is usable there (schema and a one-token trial, once per
    device), else why not, logged once."""
    import torch

    key = str(device)
    if key not in _resolved:
        found = varlen_from(getattr(torch.ops.aten, "_flash_attention_forward", None))
        if found.attend is not None:
            found = _trial(found, torch.device(device))
        if found.reason:
            log.warning("attention: flash varlen unusable on %s (%s); passes run on sdpa", device, found.reason)
        _resolved[key] = found
    return _resolved[key]


def _trial(found: FlashVarlen, device) -> FlashVarlen:
    import torch

    try:
        one = torch.zeros(1, 2, 64, dtype=torch.bfloat16, device=device)
        offsets = torch.tensor([0, 1], dtype=torch.int32, device=device)
        found.attend(one, one[:, :1], one[:, :1], offsets, offsets, 1, 1, offsets[1:])
        torch.cuda.synchronize(device)
    except (RuntimeError, TypeError, NotImplementedError) as error:
        return FlashVarlen(None, f"a trial call failed: {str(error).splitlines()[0][:160]}")
    return found


def why_no_compiler() -> str | None:
    """Why torch.compile cannot make CUDA kernels here (None: it can): inductor writes them in triton."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed: torch.compile needs it for CUDA kernels"
    return None


def attention_backend(dtype_is_half: bool, device) -> str:
    """varlen in half precision where flash is usable, else sdpa."""
    return "varlen" if dtype_is_half and flash_varlen(device).attend is not None else "sdpa"
