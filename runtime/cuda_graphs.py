"""Decode and verify passes replayed as CUDA graphs: one graph per (batch bucket, tokens per row, logits).

A uniform pass on the varlen backend is capturable by construction: everything it computes comes from
device tensors whose addresses never change (the weights, the cache's keys, values and lengths, updated in
place), and nothing in it reads the device or depends on host values but its shapes. `GraphedModel` wraps a
`CausalLM` with the same call: a uniform pass over rows 0..b-1 of a cache runs as the graph captured for the
smallest bucket >= b; anything else (a prefill, a tree pass, the CPU) runs the model as usual. What a graph
cannot do is the host's side of a pass: replaying checks the cache's room and advances the host lengths.

Spare rows. Rows b..bucket-1 of the cache run inside the graph too, and they may belong to someone (the
serving engine prefills a long prompt in parts in the row after the running ones). So a spare row keeps its
length: the pass writes its keys and values after the row's content, where nothing is read, and the row's
length is put back afterwards; only a row with no room left for the pass (which no prompt being filled can
be) starts at 0 for it.

Graphs live on the cache they were captured on (an attribute of its root) and go when it goes; the
generator keeps caches per policy (runtime.cache_pool), so a warmed-up run replays and never captures. A
miss captures the bucket and every smaller one at that width: a batch shrinks through them as rows finish.
A graph's logits go to one buffer per (bucket, width, logits kept) of the model, shared by every cache's
graph of that key (lockstep generations take turns a step at a time, each step consuming its logits), so
the memory they hold does not grow with the caches (calibrate.memory counts it).
`capture` is injectable so the bookkeeping is tested on the CPU (tests/runtime/test_runtime_cuda_graphs.py);
the graphs themselves are tested on a GPU (marked tests).
"""
from __future__ import annotations

import time
import weakref
from bisect import bisect_left
from typing import Callable

import torch

from .attention import choose_backend
from .devices import synchronize
from .kv_cache import KVCache

BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
WARMUP_RUNS = 2  # before a capture, on a side stream (cuBLAS and the allocator settle their workspaces)
SLOT_GRANULARITY = 128  # with graphs, caches get slots per row in multiples of this: a kept one fits longer prompts
GRAPHS_ATTRIBUTE = "cuda_graphs"  # a root KVCache's graphs: {(bucket, tokens per row, last): _Graph}


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


def graphs_of(root: KVCache) -> dict:
    """The graphs captured on a root cache (made empty on first use): they die with it."""
    graphs = getattr(root, GRAPHS_ATTRIBUTE, None)
    if graphs is None:
        graphs = {}
        setattr(root, GRAPHS_ATTRIBUTE, graphs)
    return graphs


class GraphedModel:
    """A CausalLM whose uniform varlen passes replay CUDA graphs (see the module docstring)."""

    def __init__(self, model, capture=None):
        """`capture`: how a pass is captured (default `capture_cuda_graph`; the tests' stand-in on a CPU)."""
        self.model, self.capture = model, capture
        self.config = model.config
        self.pool = None  # one memory pool for all of this model's graphs, made at the first capture
        self.roots = weakref.WeakSet()  # the caches holding graphs of this model
        self.outputs: dict[tuple, torch.Tensor] = {}  # (bucket, n, last) -> the logits buffer its graphs share
        self.captures, self.capture_s = 0, 0.0

    def __getattr__(self, name):  # everything else is the model's (new_cache, lm_head, ...)
        return getattr(self.model, name)

    def stats(self) -> dict:
        """captures so far, the host seconds they took, and the graphs alive now (on caches still alive)."""
        kept = sum(len(graphs_of(root)) for root in list(self.roots))
        return {"captures": self.captures, "capture_s": self.capture_s, "kept": kept}

    def release_outputs(self) -> None:
        """Free the shared logits buffers once no graph writes to them (every cache with graphs is gone)."""
        if not self.stats()["kept"]:
            self.outputs.clear()

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
        graph = graphs_of(root).get((bucket, n, last)) or self._capture_ladder(root, b, bucket, n, last)
        full = self._spare_rows_without_room(root, b, bucket, n)
        for row in full:
            root.lengths[row].zero_()
        graph.tokens[:b].copy_(tokens)
        graph.replay()
        root.host_lengths[:b] += n  # the graph advanced the device lengths; the host's are ours
        root.lengths[b:bucket] -= n  # spare rows: back to their own lengths (device work, no read-back)
        for row in full:
            root.lengths[row].fill_(int(root.host_lengths[row]))
        return None if graph.output is None else graph.output[:b]

    @staticmethod
    def _spare_rows_without_room(root: KVCache, b: int, bucket: int, n: int) -> list[int]:
        """Spare rows whose content leaves no room for n more tokens: they run the pass from 0 instead."""
        return [row for row in range(b, bucket) if root.host_lengths[row] + n > root.max_len]

    def _capture_ladder(self, root: KVCache, b: int, bucket: int, n: int, last: int | None) -> _Graph:
        """Capture (bucket, n, last) and every smaller bucket at that width not captured yet on `root`."""
        graphs = graphs_of(root)
        for smaller in BATCH_BUCKETS:
            if smaller < bucket and (smaller, n, last) not in graphs:
                graphs[(smaller, n, last)] = self._capture(root, min(b, smaller), smaller, n, last)
        graphs[(bucket, n, last)] = self._capture(root, b, bucket, n, last)
        self.roots.add(root)
        return graphs[(bucket, n, last)]

    def _capture(self, root: KVCache, b: int, bucket: int, n: int, last: int | None) -> _Graph:
        started = time.perf_counter()
        view = root.rows(0, bucket)
        tokens = torch.zeros(bucket, n, dtype=torch.long, device=root.device)
        saved = view.lengths.clone(), view.host_lengths.copy()
        # warm-up runs write where the real pass will: after every row's content (spare rows' included)
        safe = saved[1].copy()
        safe[b:] = [0 if length + n > root.max_len else length for length in safe[b:]]

        def reset():
            view.set_lengths(None, safe)

        if last != 0 and (bucket, n, last) not in self.outputs:  # made here, on the current stream, outside graphs
            positions = n if last is None else min(last, n)
            self.outputs[(bucket, n, last)] = torch.empty(bucket, positions, self.config.vocab_size,
                                                          dtype=self.model.lm_head.weight.dtype, device=root.device)
        shared = self.outputs.get((bucket, n, last))

        def run():
            logits = self.model(tokens, view, None, last)
            # the pass's own logits go back to the pool after the capture; the graph writes the shared buffer
            return None if logits is None else shared.copy_(logits)

        replay, output, self.pool = (self.capture or capture_cuda_graph)(run, reset, view, self.pool)
        view.set_lengths(saved[0], saved[1])  # warm-up and capture moved them; the real pass has not run
        synchronize(root.device)  # the capture's time is its own, not the next step's
        self.captures += 1
        self.capture_s += time.perf_counter() - started
        return _Graph(tokens, output, replay)
