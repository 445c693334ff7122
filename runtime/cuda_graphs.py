"""Decode and verify passes replayed as CUDA graphs: one graph per (batch bucket, tokens per row, logits).

A uniform pass on the varlen backend is capturable by construction: everything it computes comes from
device tensors whose addresses never change (the weights, the cache's keys, values and lengths, updated in
place), and nothing in it reads the device or depends on host values but its shapes. `GraphedModel` wraps a
`CausalLM` with the same call: a uniform pass over rows 0..b-1 of a cache runs as the graph captured for the
smallest bucket >= b (rows b..bucket-1 are spare slots of the same cache: their lengths are reset to 0
before every replay, so what they compute is harmless and never read); anything else (a prefill, a tree
pass, the CPU) runs the model as usual. What a graph cannot do is the host's side of a pass: replaying
checks the cache's room and advances the host lengths itself.

Graphs are captured on first use per key and kept per cache (a cache is the serving engine's pool, or one
generation's buffers); `capture` is injectable so the bookkeeping is tested on the CPU
(tests/runtime/test_runtime_cuda_graphs.py); the graphs themselves are tested on a GPU (marked tests).
"""
from __future__ import annotations

from bisect import bisect_left
from typing import Callable

import torch

from .attention import choose_backend
from .kv_cache import KVCache

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
WARMUP_RUNS = 2  # before a capture, on a side stream (cuBLAS and the allocator settle their workspaces)


def bucket_for(batch_size: int, capacity: int) -> int:
    """The smallest bucket holding `batch_size` rows that the cache has room for (its capacity otherwise).

    >>> bucket_for(5, 64), bucket_for(5, 6), bucket_for(300, 400)
    (8, 6, 300)
    """
    index = bisect_left(BATCH_BUCKETS, batch_size)
    bucket = BATCH_BUCKETS[index] if index < len(BATCH_BUCKETS) else batch_size
    return min(bucket, capacity)


def capture_cuda_graph(run: Callable[[], torch.Tensor], reset: Callable[[], None], cache: KVCache,
                       pool) -> tuple[Callable[[], None], torch.Tensor, object]:
    """Warm `run` (a pass over `cache`) up on a side stream, capture it, and return (replay, output, the
    graph's memory pool, for the next capture to share; `pool` None: a new one). `reset` runs before each
    warm-up and before the capture, outside the graph (a run advances the cache's lengths)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(WARMUP_RUNS):
            reset()
            run()
    torch.cuda.current_stream().wait_stream(stream)
    reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = run()
    return graph.replay, output, graph.pool()


class _Graph:
    """One captured pass: its static input and output, and how to replay it."""

    def __init__(self, tokens: torch.Tensor, output: torch.Tensor, replay: Callable[[], None]):
        self.tokens, self.output, self.replay = tokens, output, replay


class GraphedModel:
    """A CausalLM whose uniform varlen passes replay CUDA graphs (see the module docstring)."""

    def __init__(self, model, capture=None):
        """`capture`: how a pass is captured (default `capture_cuda_graph`; the tests' stand-in on a CPU)."""
        self.model, self.capture = model, capture
        self.config = model.config
        self.graphs: dict[tuple, _Graph] = {}
        self.pool = None  # one memory pool for all of this model's graphs, made at the first capture

    def __getattr__(self, name):  # everything else is the model's (new_cache, lm_head, ...)
        return getattr(self.model, name)

    def eligible(self, cache: KVCache | None, tree, new_tokens) -> bool:
        if cache is None or tree is not None or new_tokens is not None or cache.start != 0:
            return False
        return choose_backend(cache, self.model.attention_backend, None, self.config.sliding_window) == "varlen"

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, cache: KVCache | None = None, tree=None, last: int | None = None,
                 new_tokens: list[int] | None = None):
        if not self.eligible(cache, tree, new_tokens):
            return self.model(tokens, cache, tree, last, new_tokens)
        b, n = tokens.shape
        needed = cache.longest() + n
        if needed > cache.max_len:
            raise ValueError(f"KV cache overflow: {needed} positions needed, {cache.max_len} allocated")
        root = cache.root
        bucket = bucket_for(b, root.batch_size)
        key = (id(root), bucket, n, last)
        graph = self.graphs.get(key) or self._capture(key, root, b, bucket, n, last)
        root.lengths[b:bucket].zero_()  # spare rows: their passes stay inside their slots
        root.host_lengths[b:bucket] = 0
        graph.tokens[:b].copy_(tokens)
        graph.replay()
        root.host_lengths[:bucket] += n  # the graph advanced the device lengths (spare rows too); the host's: ours
        return None if graph.output is None else graph.output[:b]

    def _capture(self, key, root: KVCache, b: int, bucket: int, n: int, last: int | None) -> _Graph:
        view = root.rows(0, bucket)
        tokens = torch.zeros(bucket, n, dtype=torch.long, device=root.device)
        saved = view.lengths.clone(), view.host_lengths.copy()
        # warm-up runs write where the real pass will (live rows) or at the start of spare slots
        safe = saved[1].copy()
        safe[b:] = 0

        def reset():
            view.set_lengths(None, safe)

        def run():
            return self.model(tokens, view, None, last)

        replay, output, self.pool = (self.capture or capture_cuda_graph)(run, reset, view, self.pool)
        view.set_lengths(saved[0], saved[1])  # warm-up and capture moved them; the real pass has not run
        self.graphs[key] = _Graph(tokens, output, replay)
        return self.graphs[key]
