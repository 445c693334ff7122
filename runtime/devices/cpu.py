"""The CPU: float32, synchronous, and tuned for MKL and the caches of a small machine.

Every number below was fitted on the 2-core development CPU (an Intel Xeon, torch's MKL build, one thread)
with the demo pair; `sources` says how. None of them is reachable from a pass on another device.
"""
from __future__ import annotations

from .kind import DeviceKind

# libgomp's idle threads spin this long before sleeping (its default is 300,000): where other busy processes
# share the cores, long spinning barriers wait for descheduled threads and every pass slows down many times
# over with no error. runtime/__init__.py sets it unless the environment does, before torch loads.
GOMP_SPINCOUNT = 10_000

CPU = DeviceKind(
    name="cpu",
    default_dtype="float32",  # exact, and as fast as bfloat16 on CPUs without AMX
    asynchronous=False,
    lazy_cache=True,  # zeroing a ragged batch's cache cost a tenth of its generation (docs/runtime.md)
    cache_zero_ahead_slots=64,
    transposed_projections=True,  # MKL multiplies a row-major right operand 20-40 % faster at decode shapes
    prefill_pass_tokens=1024,
    host_bookkeeping_max_cells=512,
    sdpa_call_keys=32,
    sdpa_row_keys=16,
    slice_write_spans=4,
    prefill_padding=1.25,
    alone_prefill_tokens=32,
    graphs_by_default=False,
    grouped_expert_products=False,  # one product per touched expert after one read-back: free on a CPU
    fused_layers=False,  # the eager layer is tuned for MKL (in-place adds, transposed weights): no gaps to save
    sources={
        "cache_zero_ahead_slots": "rows grow by a token a pass; zeroing in runs of 64 slots keeps it rare",
        "prefill_pass_tokens": "demo pair, 32 and 64 ragged prompts: passes over more than ~1,024 tokens ran "
                               "slower per token (activations leave the cache); no change at 1,111 tokens",
        "host_bookkeeping_max_cells": "demo pair, greedy trees: host bookkeeping is faster up to ~512 cells, "
                                      "where its Python loops start to cost more than small tensor ops",
        "sdpa_call_keys": "timings of the demo shapes, b 1-32, 20-520 keys, inside steps: a call's fixed cost "
                          "is about one row over 32 keys",
        "sdpa_row_keys": "the same timings: a row's fixed cost is about 16 keys",
        "slice_write_spans": "demo pair: up to 4 slice copies per tensor cost less than one scatter",
        "prefill_padding": "demo prompts of 31-108 tokens: padding a group by up to 25 % costs less than a call",
        "alone_prefill_tokens": "demo prompts, b = 32: gathering rows longer than ~32 tokens costs more than a "
                                "call per row (the prefill's attention 7.6 -> 3.4 ms a layer)",
    },
)


def why_no_compiler() -> str | None:
    """Why torch.compile cannot make CPU kernels here (None: it can): inductor writes them in C++."""
    import shutil

    if not any(shutil.which(name) for name in ("c++", "g++", "clang++")):
        return "no C++ compiler on PATH: torch.compile needs one for CPU kernels"
    return None
