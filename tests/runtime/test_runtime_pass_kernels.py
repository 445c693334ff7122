"""Kernels a decode or verify pass launches on the CUDA path (the varlen backend), counted on the CPU by the
step-op counter (bench.step_ops) with the attention kernel's CPU stand-in counted as the one kernel it is on a
GPU, and each fused function (runtime.fused, run uncompiled here) as one kernel: what inductor makes of a
pointwise region or a row reduction with its pointwise work. Once CUDA graphs make launches cheap, each kernel
still costs its gap on the GPU; this is the budget a change to the model's code has to argue with. Oracle: the
layer's kernels listed by hand. (Whether inductor keeps each fused function to one kernel is for the GPU run
to show: `calibrate/gpu_reference.sh` profiles a pass.)"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import varlen_reference
from specbatch.bench.step_ops import OpCounter, counting
from specbatch.runtime import devices, fused
from specbatch.runtime.checkpoint import build_model
from specbatch.runtime.devices import cuda
from torch_fixtures import tiny_llama_config

# the eager layer: input norm, qkv, RoPE (x * cos, roll, * signed sin, add), K and V written, attention, o,
# residual add, norm, gate_up, SiLU, its multiply, down, residual add
LLAMA_LAYER_KERNELS = 17
# the fused layer (runtime.fused): the previous layer's residual add with this input norm, qkv, RoPE of q and k,
# K and V written, attention, o, residual add with the norm, gate_up, SiLU with its product, down
FUSED_LLAMA_LAYER_KERNELS = 11
# a verify's attention in the fused layer: the queries packed by KV head, the prefix's flash call, the in-flight
# tokens' attention merged with it: two more than a decode's one call
FUSED_VERIFY_ATTENTION_KERNELS = 3


def _as_one_kernel(counter: OpCounter, function):
    """`function` counted as one launch, whatever ops it runs on the CPU."""

    def one_kernel(*args, **kwargs):
        before = dict(counter.counts)
        result = function(*args, **kwargs)
        counter.counts.update(before, launches=before["launches"] + 1)
        return result

    return one_kernel


def kernels_of_a_pass(monkeypatch, layers: int, new_tokens: int, fused_layer: bool) -> int:
    """Launches of one pass of `new_tokens` a row on top of a prompt, with the CPU running by the CUDA record
    (runtime.devices: no lazy cache, projections as stored, scatter writes) and the varlen backend."""
    monkeypatch.setitem(devices.KINDS, "cpu", replace(devices.KINDS["cuda"], name="cpu"))
    counter = OpCounter()
    reference = cuda.varlen_from(varlen_reference.flash_attention_forward)
    monkeypatch.setattr(cuda, "flash_varlen",
                        lambda device: cuda.FlashVarlen(_as_one_kernel(counter, reference.attend), None))
    model = build_model(tiny_llama_config(num_layers=layers), "cpu", torch.bfloat16)
    model.attention_backend = "varlen"
    model.layer_kernels = None
    if fused_layer:
        model.layer_kernels = fused.LayerKernels(
            *(_as_one_kernel(counter, getattr(fused.EAGER, name))
              for name in ("add_norm", "norm", "gated", "queries_and_keys", "in_flight_merge")), compiled=False)
    cache = model.new_cache(2, 32)
    with torch.inference_mode():
        model(torch.ones(2, 4, dtype=torch.long), cache)  # a prompt first: the pass below decodes on top
        tokens = torch.ones(2, new_tokens, dtype=torch.long)
        counter.counts.update(syncs=0, launches=0, uploads=0)
        with counting(counter):
            model(tokens, cache, None, 1)
    assert counter.counts["syncs"] == 0 and counter.counts["uploads"] == 0
    return counter.counts["launches"]


def _per_layer(monkeypatch, new_tokens: int, fused_layer: bool) -> float:
    one, three = (kernels_of_a_pass(monkeypatch, layers, new_tokens, fused_layer) for layers in (1, 3))
    return (three - one) / 2


@pytest.mark.parametrize("new_tokens", [1, 5])
def test_an_eager_llama_layer_launches_its_listed_kernels_and_no_more(monkeypatch, new_tokens):
    assert _per_layer(monkeypatch, new_tokens, fused_layer=False) == LLAMA_LAYER_KERNELS


def test_a_fused_llama_layer_launches_its_listed_kernels_and_no_more(monkeypatch):
    assert _per_layer(monkeypatch, 1, fused_layer=True) == FUSED_LLAMA_LAYER_KERNELS
    assert _per_layer(monkeypatch, 5, fused_layer=True) == (FUSED_LLAMA_LAYER_KERNELS - 1
                                                              + FUSED_VERIFY_ATTENTION_KERNELS)
    assert FUSED_LLAMA_LAYER_KERNELS < LLAMA_LAYER_KERNELS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_four_kernels_is_the_rotate_half_formula_bit_for_bit(dtype):
    """x * cos + rotate_half(x) * sin, rotate_half(x) = (-x2, x1), as transformers writes it: the same values."""
    from specbatch.runtime.model import _rotate

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 4, 16, generator=generator).to(dtype)
    angles = torch.rand(3, 5, 1, 8, generator=generator) * 100
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((angles.sin(), angles.sin()), -1)
    rotate_half = torch.cat((-x[..., 8:], x[..., :8]), dim=-1)
    textbook = x * cos.to(dtype) + rotate_half * sin.to(dtype)
    signed_sin = torch.cat((-angles.sin(), angles.sin()), -1).to(dtype)
    assert torch.equal(_rotate(x, cos.to(dtype), signed_sin), textbook)
