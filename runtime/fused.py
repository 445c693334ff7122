"""A decoder layer's small tensor work in few kernels: the residual add with the next norm, the query and key
norms with RoPE, the gated activation, and a verify's in-flight attention with its merge.

Inside a CUDA graph a kernel costs its own run time plus a gap of a few microseconds; a Llama layer's 17
kernels (runtime.model) spend 12 of them on work that moves a few kilobytes (RoPE's four, the two residual
adds, the two norms, SiLU and its product...). `LayerKernels` holds these parts as plain functions of tensors;
`compiled_kernels()` gives the same functions through `torch.compile` (inductor fuses each into one kernel
where it can: a pointwise region, or a row reduction with its pointwise work around it), which
`CausalLM` uses for cache passes where the device's record says so (`DeviceKind.fused_layers`: CUDA). The
matrix products, the flash call and the cache writes stay as they are (opaque to the compiler, and captured
by our own graphs like every kernel of a pass).

Bounded compile: shapes are dynamic (one compile serves every batch size and width; dynamo specialises 1
apart, so a function compiles a few times, not per shape), and inductor caches what it compiled on disk, so
a later process reuses it. Compiling happens at the first pass of a shape class, which is a graph's warm-up
(runtime.cuda_graphs) or the capture ahead of serving, never inside a captured or timed pass. Where compiling
is not possible (no triton for the device), the layer runs its eager kernels and says why once; a function
whose compile fails on some shape runs eager from then on, said once.
The functions compute what the eager layer computes, with the same ops (`F.rms_norm`, `rotate_half_split`,
which the eager layer uses too): equal within float rounding (inductor may reorder a sum), tested in float32 on
the CPU, which compiles too.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .attention import in_flight_merge

log = logging.getLogger("specbatch.runtime")


def rotate_half_split(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the half-split layout: x * cos + rotate_half(x) * sin, where rotate_half(x) = (-x2, x1).
    (-x2, x1) * sin is (x2, x1) * (-sin, sin): a roll by half the head, times a sine whose first half is
    negated once per pass (runtime.model.rope_tables). Four kernels a layer instead of five (no negation, no copy into
    a concatenation), each rounding as before: the same values bit for bit."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


def add_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """(RMSNorm of x + delta, x + delta): the residual stream's add and the next sublayer's input norm."""
    summed = x + delta
    return F.rms_norm(summed, (summed.shape[-1],), weight, eps), summed


def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def gated(gate_up: torch.Tensor, act: Callable) -> torch.Tensor:
    """act(gate) * up of the fused gate-and-up projection's output."""
    gate, up = gate_up.chunk(2, dim=-1)
    return act(gate) * up


def queries_and_keys(qkv: torch.Tensor, cos, signed_sin, q_norm_weight, k_norm_weight, eps: float, num_heads: int,
                     num_kv_heads: int, head_dim: int, rotary_dim: int | None, query_factor: float | None):
    """The (…, tokens, heads, head_dim) queries and keys of the fused q/k/v projection's output: per-head
    norms (Qwen3's), RoPE in the half-split layout (partial where `rotary_dim`), the queries' scale."""
    qk = qkv[..., :(num_heads + num_kv_heads) * head_dim].unflatten(-1, (num_heads + num_kv_heads, head_dim))
    if q_norm_weight is not None:
        q, k = qk.split((num_heads, num_kv_heads), dim=-2)
        qk = torch.cat((F.rms_norm(q, (head_dim,), q_norm_weight, eps), F.rms_norm(k, (head_dim,), k_norm_weight, eps)),
                       dim=-2)
    if cos is not None:
        if rotary_dim:
            qk = torch.cat((rotate_half_split(qk[..., :rotary_dim], cos, signed_sin), qk[..., rotary_dim:]), dim=-1)
        else:
            qk = rotate_half_split(qk, cos, signed_sin)
    q, k = qk.split((num_heads, num_kv_heads), dim=-2)
    if query_factor is not None:
        q = q * query_factor
    return q.contiguous(), k.contiguous()


@dataclass(frozen=True)
class LayerKernels:
    """The fused parts a layer calls (plain functions, or their compiled forms); `compiled`: which."""

    add_norm: Callable
    norm: Callable
    gated: Callable
    queries_and_keys: Callable
    in_flight_merge: Callable
    compiled: bool


EAGER = LayerKernels(add_norm, norm, gated, queries_and_keys, in_flight_merge, compiled=False)
# one compile per function per shape class and model config (eps, head counts...): room for a target, a draft and
# a head, each in uniform (b, n, d) and packed (T, d) passes, with dynamo's specialisation of sizes 1
COMPILED_VARIANTS_PER_FUNCTION = 64
_compiled: LayerKernels | None = None
_unavailable: dict[str, str] = {}


def compiled_kernels() -> LayerKernels:
    """The fused functions through torch.compile (inductor, dynamic shapes, whole graphs), made once."""
    global _compiled
    if _compiled is None:
        import torch._dynamo

        limit = torch._dynamo.config.cache_size_limit
        torch._dynamo.config.cache_size_limit = max(limit, COMPILED_VARIANTS_PER_FUNCTION)
        torch._dynamo.config.accumulated_cache_size_limit = max(
            torch._dynamo.config.accumulated_cache_size_limit, 4 * COMPILED_VARIANTS_PER_FUNCTION)

        def compile_(function):
            return _CompiledOrEager(function, torch.compile(function, dynamic=True, fullgraph=True))

        _compiled = LayerKernels(*(compile_(f) for f in (add_norm, norm, gated, queries_and_keys, in_flight_merge)),
                                 compiled=True)
    return _compiled


_said: set[str] = set()


class _CompiledOrEager:
    """A compiled function that falls back to its eager form for good, said once, when compiling fails (an
    inductor or triton error on some shape): a bug of the function itself fails again eagerly, and shows."""

    def __init__(self, eager: Callable, compiled: Callable):
        self.eager, self.compiled, self.failed = eager, compiled, False

    def __call__(self, *args):
        if not self.failed:
            try:
                return self.compiled(*args)
            except Exception as error:  # noqa: BLE001 - whatever the compiler raised, the eager form decides
                self.failed = True
                log.warning("layers: compiling %s failed (%s); it runs eager from now on", self.eager.__name__,
                            str(error).splitlines()[0][:200] if str(error) else type(error).__name__)
        return self.eager(*args)


def kernels_for(device) -> LayerKernels | None:
    """The compiled kernels where the device's record fuses layers and compiling is possible there, else None
    (the eager layer; why is logged once)."""
    from .devices import why_layers_unfused

    reason = why_layers_unfused(device)
    if reason is None:
        return compiled_kernels()
    if reason not in _said:
        _said.add(reason)
        log.info("layers: eager kernels on %s (%s)", device, reason)
    return None


def warm_prefill(model, cache, features) -> None:
    """A prefill of 2 and 3 tokens on `cache`'s first rows (a CausalLM's), then undone: what a first prefill
    compiles (these kernels in their packed shapes; graphs cover the other passes) is compiled before any request
    runs. Nothing to do where the model's layers run eager."""
    kernels = model.fused_kernels()
    if kernels is None or not kernels.compiled:
        return
    rows = cache.rows(0, min(2, cache.batch_size))
    counts = [2, 3][:rows.batch_size]
    saved = rows.lengths.clone(), rows.host_lengths.copy()
    tokens = torch.zeros(sum(counts), dtype=torch.long, device=rows.device)
    with torch.inference_mode():
        model(tokens, rows, last=1, new_tokens=counts, features=features)
    rows.set_lengths(*saved)
