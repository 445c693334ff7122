"""Synthetic `specbatch.profile/1` files for the perfmodel tests, built from known latency functions.

Three latency generators, from most to least like the model being fitted:
- `roofline_latency`: exactly the roofline form with known parameters (recovery tests);
- `gpu_like_latency`: a roofline whose compute term is quantized in tiles of 64 tokens (GPU matmuls);
- `cpu_like_latency`: per-layer dispatch overhead, a FLOP rate that grows with tokens per pass,
  8-row tile steps, attention at a far lower efficiency than matmuls, and a per-row cost: what
  small models on a CPU look like, and NOT the roofline form.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import numpy as np

from specbatch.perfmodel.latency import RoleShape, RooflineParams


def model_info(parameters: int, layers: int, hidden: int, heads: int, kv_heads: int, bytes_per_weight: int,
               vocab: int = 32000, source: str = "synthetic") -> dict:
    head_dim = hidden // heads
    return {
        "source": source, "model_type": "llama", "random_weights": True, "parameters": parameters,
        "layers": layers, "hidden_size": hidden, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
        "intermediate_size": 4 * hidden, "vocab_size": vocab, "weight_bytes": parameters * bytes_per_weight,
        "kv_bytes_per_token": 2 * layers * kv_heads * head_dim * bytes_per_weight, "max_position_embeddings": 8192,
    }


# A 7B-class target and a 125M-class draft in bfloat16, and the bundled demo pair in float32.
GPU_MODELS = {"target": model_info(6_700_000_000, 32, 4096, 32, 32, 2),
              "draft": model_info(125_000_000, 12, 768, 12, 12, 2)}
CPU_MODELS = {"target": model_info(4_800_000, 6, 256, 4, 4, 4, vocab=259),
              "draft": model_info(420_000, 1, 192, 3, 3, 4, vocab=259)}


def shape_of(info: dict) -> RoleShape:
    return RoleShape(info["parameters"], info["weight_bytes"], info["kv_bytes_per_token"], info["layers"],
                     info["heads"] * info["head_dim"])


GPU_PARAMS = {"target": RooflineParams(overhead_ms=0.35, bandwidth_GBps=3800.0, flops_TFLOPs=520.0,
                                       overlap_exponent=4.0),
              "draft": RooflineParams(overhead_ms=0.6, bandwidth_GBps=2500.0, flops_TFLOPs=300.0, overlap_exponent=4.0)}


def roofline_latency(models: dict = GPU_MODELS, params: dict = GPU_PARAMS) -> Callable[[str, int, int, int], float]:
    def latency_ms(role: str, b: int, n: int, L: int) -> float:
        return float(params[role].latency_ms(shape_of(models[role]), b, n, L))
    return latency_ms


def gpu_like_latency(role: str, b: int, n: int, L: int) -> float:
    """Roofline with the matmul work rounded up to whole 64-token tiles."""
    shape, params = shape_of(GPU_MODELS[role]), GPU_PARAMS[role]
    tiles = math.ceil(b * n / 64) * 64
    compute_ms = (2.0 * shape.parameters * tiles + 4.0 * shape.layers * shape.attention_width * b * n * (L + n)) \
        / (params.flops_TFLOPs * 1e12) * 1e3
    memory_ms = params.memory_ms(shape, b, n, L)
    return params.overhead_ms + (memory_ms ** 4 + compute_ms ** 4) ** 0.25


def cpu_like_latency(role: str, b: int, n: int, L: int) -> float:
    """Small float32 models on a 2-core CPU: dispatch-bound at few tokens, matvecs bound by weight
    reads, matmuls in 4-row register tiles at ~45 GFLOP/s, attention at ~12 GFLOP/s (masked
    SDPA), and a per-row cost for masks and cache indexing."""
    info = CPU_MODELS[role]
    layers, width = info["layers"], info["heads"] * info["head_dim"]
    tokens = b * n
    dispatch_ms = 0.12 + 0.16 * layers  # Python and ATen dispatch of ~15 ops per layer
    weights_ms = info["weight_bytes"] / 15e9 * 1e3
    matmul_ms = max(weights_ms, 2.0 * info["parameters"] * math.ceil(tokens / 4) * 4 / 45e9 * 1e3)
    attention_ms = 4.0 * layers * width * tokens * (L + n) / 12e9 * 1e3
    per_row_ms = 0.012 * layers * b
    return dispatch_ms + matmul_ms + attention_ms + per_row_ms


def default_overheads(b: int, k: int) -> float:
    return 0.05 + 0.004 * b + 0.03 * k


def build_profile(latency_ms: Callable[[str, int, int, int], float], *, models: dict = GPU_MODELS,
                  batch_sizes=(1, 2, 4, 8, 16, 32, 64), context_lens=(128, 512, 2048), max_k: int = 6,
                  noise: float = 0.03, seed: int = 0, acceptance: list[float] | None = None,
                  overheads_ms: Callable[[int, int], float] | None = default_overheads,
                  infeasible: Callable[[str, int, int, int], bool] = lambda role, b, n, L: False,
                  device_kind: str = "cuda", draft_new_tokens=(1, 2)) -> dict:
    """A valid profile dict whose medians are `latency_ms` times lognormal noise of sigma `noise`
    (`draft_new_tokens`: a head's are 1..max_k+1, with `models["draft"]["drafter"]` its kind)."""
    rng = np.random.default_rng(seed)
    new_tokens = {"target": list(range(1, max_k + 2)), "draft": list(draft_new_tokens)}
    timings = []
    for role in ("target", "draft"):
        for b in batch_sizes:
            for n in new_tokens[role]:
                for L in context_lens:
                    row = {"model": role, "batch_size": b, "new_tokens": n, "context_len": L, "reps": 20}
                    if infeasible(role, b, n, L):
                        row.update(median_ms=None, p10_ms=None, p90_ms=None, reps=0, feasible=False)
                    else:
                        median = latency_ms(role, b, n, L) * float(np.exp(noise * rng.standard_normal()))
                        row.update(median_ms=median, p10_ms=0.97 * median, p90_ms=1.05 * median, feasible=True)
                    timings.append(row)
    overheads = []
    if overheads_ms is not None:
        for b in batch_sizes:
            for k in range(max_k + 1):
                value = overheads_ms(b, k)
                overheads.append({"batch_size": b, "k": k, "median_ms": value, "p10_ms": 0.9 * value,
                                  "p90_ms": 1.1 * value, "reps": 20})
    accepted = []
    if acceptance is not None:
        accepted.append({"mode": "greedy", "temperature": None, "top_k": None, "top_p": None, "source": "measured",
                         "per_position": list(acceptance), "trials": [1000 - 50 * i for i in range(len(acceptance))],
                         "prompts": "synthetic", "prompt_count": 64})
    return {
        "schema": "specbatch.profile/1",
        "created_utc": "2026-11-30T01:00:00Z",
        "device": {"kind": device_kind, "name": "synthetic device", "memory_bytes": 80 * 2**30,
                   "dtype": "bfloat16" if device_kind == "cuda" else "float32", "torch_version": "2.5.0",
                   "cpu_threads": 2, "git_revision": None,
                   "execution": "cuda-graphs" if device_kind == "cuda" else "eager"},
        "models": models,
        "grid": {"batch_sizes": list(batch_sizes), "context_lens": list(context_lens), "max_k": max_k,
                 "target_new_tokens": new_tokens["target"], "draft_new_tokens": new_tokens["draft"]},
        "timings": timings,
        "overheads": overheads,
        "acceptance": accepted,
    }


def write_profile(path: Path, profile: dict) -> Path:
    path.write_text(json.dumps(profile))
    return path


def tree_profile() -> dict:
    """A 7B-class target and a 125M-class draft on a GPU-like roofline: verifying many tokens is free at
    batch 1 (weight reads dominate) and costly at batch 64 (matmuls dominate). Acceptance per position
    and at rank 0 agree."""
    obj = build_profile(roofline_latency(), batch_sizes=(1, 2, 4, 8, 16, 32, 64), context_lens=(128, 512),
                        max_k=4, acceptance=[0.7] * 4)
    obj["acceptance"][0]["rank_acceptance"] = [[0.7, 0.15, 0.05]] * 4
    obj["stage2"] = {"file": "ngram.bin", "sha256": "ab" * 32, "guess_accuracy": [0.7, 0.4, 0.2],
                     "query_overhead_ms": 0.05, "query_ms_per_context": 0.0005}
    return obj
