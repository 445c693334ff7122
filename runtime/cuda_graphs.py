"""Decode, verify and draft-head passes replayed as CUDA graphs: one graph per (batch bucket, tokens per row, ...).

A uniform pass on the varlen backend is capturable by construction: everything it computes comes from
device tensors whose addresses never change (the weights, the cache's keys, values and lengths, updated in
place), and nothing in it reads the device or depends on host values but its shapes. `GraphedModel` wraps a
`CausalLM` with the same call: a uniform pass over rows 0..b-1 of a cache runs as the graph captured for the
smallest bucket >= b (keyed by the width, the logits kept and the feature layers a head reads); anything else
(a prefill, a tree pass, the CPU) runs the model as usual. `GraphedHead` does the same for a draft head's passes
on its HeadCache (runtime.heads), its tokens and its hidden-state inputs copied into static buffers; both share
`GraphRunner`. What a graph cannot do is the host's side of a pass: replaying checks the cache's room and
advances the host lengths.

Spare rows. Rows b..bucket-1 of the cache run inside the graph too, and they may belong to someone (the
serving engine prefills a long prompt in parts in the row after the running ones). So a spare row keeps its
length: the pass writes its keys and values after the row's content, where nothing is read, and the row's
length is put back afterwards; only a row with no room left for the pass (which no prompt being filled can
be) starts at 0 for it.

Graphs live on the cache they were captured on (an attribute of its root) and go when it goes; the
generator keeps caches per policy (runtime.cache_pool), so a warmed-up run replays and never captures. A
miss captures the bucket and every smaller one at that width: a batch shrinks through them as rows finish.
A graph's outputs (logits, a target's features, a head's outputs) and a head's hidden-state inputs go to one
buffer per key of the model (`GraphRunner.buffers`), shared by every cache's graph of that key (lockstep
generations take turns a step at a time, each step consuming its outputs), so the memory they hold does not
grow with the caches (calibrate.memory counts it).
`capture` is injectable so the bookkeeping is tested on the CPU (tests/runtime/test_runtime_cuda_graphs.py,
test_runtime_head_graphs.py); the graphs themselves are tested on a GPU (marked tests).
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
# A draft model's graphed passes: its one-token passes and the two-token catch-up after a step that accepted every
# draft token. A wider catch-up (after steps at k = 0, the lag grows without bound) runs eagerly: each new width
# would capture every smaller bucket, uncounted by the memory plan (calibrate.memory counts widths 1 and 2).
DRAFT_GRAPH_MAX_WIDTH = 2
GRAPHS_ATTRIBUTE = "cuda_graphs"  # a root KVCache's graphs: {(bucket, tokens per row, ...): _Graph}


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
    """Warm `run` (a pass over `cache`) up on a side stream, capture it there, and return (replay, output, the
    graph's memory pool, for the next capture to share; `pool` None: a new one). `reset` runs before each
    warm-up and before the capture, outside the graph (a run advances the cache's lengths).

    The capture is begun and ended by hand rather than in `torch.cuda.graph`, whose entry synchronizes the
    device, collects garbage and empties the allocator's cache at every capture: dozens of captures ahead of
    serving would each pay that, and emptying the cache hands back the blocks the next capture would reuse.
    The side stream waits for the current one and the warm-up ran on it, so what the capture reads is ready."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(WARMUP_RUNS):
            reset()
            run()
        reset()  # on the side stream too: after the warm-up in stream order, before the capture begins
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=pool)
        try:
            output = run()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    return graph.replay, output, graph.pool()


class _Graph:
    """One captured pass: its static inputs and outputs, and how to replay it."""

    def __init__(self, inputs: tuple[torch.Tensor, ...], output, replay: Callable[[], None]):
        self.inputs, self.output, self.replay = inputs, output, replay


def capture_buckets(capacity: int) -> list[int]:
    """Every bucket a batch of 1..capacity rows replays on a cache of `capacity` rows, largest first.

    >>> capture_buckets(6), capture_buckets(20)
    ([6, 4, 2, 1], [20, 16, 8, 4, 2, 1])
    """
    return sorted({bucket_for(b, capacity) for b in range(1, capacity + 1)}, reverse=True)


def graphs_of(root: KVCache) -> dict:
    """The graphs captured on a root cache (made empty on first use): they die with it."""
    graphs = getattr(root, GRAPHS_ATTRIBUTE, None)
    if graphs is None:
        graphs = {}
        setattr(root, GRAPHS_ATTRIBUTE, graphs)
    return graphs


def _first_rows(output, b: int):
    """A graph's output (a tensor, None, or a tuple of them) cut to the pass's b rows."""
    if isinstance(output, tuple):
        return tuple(_first_rows(part, b) for part in output)
    return None if output is None else output[:b]


class GraphRunner:
    """What graphed passes share, whatever the network (see the module docstring): the bucket, the ladder, the
    spare rows, the host's lengths, the buffers a key's graphs share. A subclass says what a pass's static
    inputs are and how it runs (`_static_pass`), and which calls are graphed."""

    def __init__(self, model, capture=None, max_width: int | None = None):
        """`capture`: how a pass is captured (default `capture_cuda_graph`; the tests' stand-in on a CPU).
        `max_width`: wider passes run eagerly (a draft model's: DRAFT_GRAPH_MAX_WIDTH), so the graph keys stay
        bounded and the memory plan counts them."""
        self.model, self.capture, self.max_width = model, capture, max_width
        self.config = model.config
        self.pool = None  # one memory pool for all of this model's graphs, made at the first capture
        self.roots = weakref.WeakSet()  # the caches holding graphs of this model
        self.buffers: dict[tuple, torch.Tensor] = {}  # (what, bucket, n, ...) -> the buffer its graphs share
        self.captures, self.capture_s = 0, 0.0

    def __getattr__(self, name):  # everything else is the model's (new_cache, lm_head, ...)
        return getattr(self.model, name)

    def stats(self) -> dict:
        """captures so far, the host seconds they took, and the graphs alive now (on caches still alive)."""
        kept = sum(len(graphs_of(root)) for root in list(self.roots))
        return {"captures": self.captures, "capture_s": self.capture_s, "kept": kept}

    def release_outputs(self) -> None:
        """Free the shared buffers once no graph uses them (every cache with graphs is gone)."""
        if not self.stats()["kept"]:
            self.buffers.clear()

    def eligible(self, cache: KVCache | None, tree, new_tokens) -> bool:
        if cache is None or tree is not None or new_tokens is not None or cache.start != 0:
            return False
        return choose_backend(cache, self.model.attention_backend, None, self.config.sliding_window) == "varlen"

    def _buffer(self, key: tuple, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
        """The buffer `key` names, shared by every cache's graph that uses it: made at its first capture, on the
        current stream, outside graphs."""
        if key not in self.buffers:  # zeros: spare rows read an input buffer's rows past the call's
            self.buffers[key] = torch.zeros(shape, dtype=dtype, device=device)
        return self.buffers[key]

    def _replay(self, cache: KVCache, key: tuple, inputs: tuple[torch.Tensor, ...]):
        """The pass `key` (its width n first) over rows 0..b-1 of `cache` with `inputs` ((b, n, ...) each), as
        the graph of b's bucket: its outputs' first b rows."""
        b, n = inputs[0].shape[:2]
        needed = cache.longest() + n
        if needed > cache.max_len:
            raise ValueError(f"KV cache overflow: {needed} positions needed, {cache.max_len} allocated")
        root = cache.root
        bucket = bucket_for(b, root.batch_size)
        graph = graphs_of(root).get((bucket, *key)) or self._capture_ladder(root, b, bucket, key)
        full = self._spare_rows_without_room(root, b, bucket, n)
        for row in full:
            root.lengths[row].zero_()
        for static, given in zip(graph.inputs, inputs):
            static[:b].copy_(given)
        graph.replay()
        root.host_lengths[:b] += n  # the graph advanced the device lengths; the host's are ours
        root.lengths[b:bucket] -= n  # spare rows: back to their own lengths (device work, no read-back)
        for row in full:
            root.lengths[row].fill_(int(root.host_lengths[row]))
        return _first_rows(graph.output, b)

    def capture_ahead(self, cache: KVCache, keys) -> int:
        """Capture each of `keys` (what `_replay` keys a pass by, its width first) at every bucket of the root
        cache's rows, largest first into this runner's one pool (a smaller graph's memory comes out of what the
        larger ones hold), so that a served or timed pass only replays. Keys this runner passes eagerly (wider
        than its max_width, or not a graphed pass on this cache) are left out. Returns the captures made."""
        root = cache.root
        if not self.eligible(root, None, None):
            return 0
        graphs, made = graphs_of(root), 0
        wanted = [key for key in dict.fromkeys(keys) if self.max_width is None or key[0] <= self.max_width]
        for bucket in capture_buckets(root.batch_size):
            for key in wanted:
                if (bucket, *key) not in graphs:
                    graphs[(bucket, *key)] = self._capture(root, bucket, bucket, key, settle=False)
                    made += 1
        self.roots.add(root)
        synchronize(root.device)
        return made

    @staticmethod
    def _spare_rows_without_room(root: KVCache, b: int, bucket: int, n: int) -> list[int]:
        """Spare rows whose content leaves no room for n more tokens: they run the pass from 0 instead."""
        return [row for row in range(b, bucket) if root.host_lengths[row] + n > root.max_len]

    def _capture_ladder(self, root: KVCache, b: int, bucket: int, key: tuple) -> _Graph:
        """Capture `key` at `bucket` and at every smaller bucket not captured yet on `root`."""
        graphs = graphs_of(root)
        for smaller in BATCH_BUCKETS:
            if smaller < bucket and (smaller, *key) not in graphs:
                graphs[(smaller, *key)] = self._capture(root, min(b, smaller), smaller, key)
        graphs[(bucket, *key)] = self._capture(root, b, bucket, key)
        self.roots.add(root)
        return graphs[(bucket, *key)]

    def _capture(self, root: KVCache, b: int, bucket: int, key: tuple, settle: bool = True) -> _Graph:
        """`settle`: wait for the device after the capture, so its time is not the next step's (capturing
        ahead waits once, after the last)."""
        started = time.perf_counter()
        n = key[0]
        view = root.rows(0, bucket)
        saved = view.lengths.clone(), view.host_lengths.copy()
        # warm-up runs write where the real pass will: after every row's content (spare rows' included)
        safe = saved[1].copy()
        safe[b:] = [0 if length + n > root.max_len else length for length in safe[b:]]

        def reset():
            view.set_lengths(None, safe)

        inputs, run = self._static_pass(view, bucket, key)
        replay, output, self.pool = (self.capture or capture_cuda_graph)(run, reset, view, self.pool)
        view.set_lengths(saved[0], saved[1])  # warm-up and capture moved them; the real pass has not run
        if settle:
            synchronize(root.device)  # the capture's time is its own, not the next step's
        self.captures += 1
        self.capture_s += time.perf_counter() - started
        return _Graph(inputs, output, replay)

    def _static_pass(self, view: KVCache, bucket: int, key: tuple):
        """(the pass's static inputs, a function running it on them over `view` that returns its outputs
        written into the shared buffers: the pass's own go back to the pool after the capture)."""
        raise NotImplementedError


def _into(buffer: torch.Tensor | None, value: torch.Tensor | None) -> torch.Tensor | None:
    return None if value is None else buffer.copy_(value)


class GraphedModel(GraphRunner):
    """A CausalLM whose uniform varlen passes replay CUDA graphs, keyed (bucket, n, last, feature ids)."""

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, cache: KVCache | None = None, tree=None, last: int | None = None,
                 new_tokens: list[int] | None = None, features: tuple[int, ...] | None = None):
        if not self.eligible(cache, tree, new_tokens) or (self.max_width is not None
                                                          and tokens.shape[1] > self.max_width):
            return self.model(tokens, cache, tree, last, new_tokens, features=features)
        return self._replay(cache, (tokens.shape[1], last, features), (tokens,))

    def _static_pass(self, view: KVCache, bucket: int, key: tuple):
        n, last, features = key
        dtype, device = self.model.lm_head.weight.dtype, view.device
        tokens = torch.zeros(bucket, n, dtype=torch.long, device=device)  # (bucket, n)
        logits = None if last == 0 else self._buffer(
            ("logits", bucket, n, last), (bucket, n if last is None else min(last, n), self.config.vocab_size),
            dtype, device)
        taken = None if features is None else self._buffer(
            ("features", bucket, n, features), (bucket, n, len(features) * self.config.hidden_size), dtype, device)

        def run():
            out = self.model(tokens, view, None, last, features=features)
            return _into(logits, out) if features is None else (_into(logits, out[0]), taken.copy_(out[1]))

        return (tokens,), run


class GraphedHead(GraphRunner):
    """A draft head (runtime.heads.DraftHead) whose passes over rows 0..b-1 of its HeadCache replay CUDA graphs,
    keyed (bucket, n, from_target, last), with the same call: a drafting pass (one token, the head's own output in,
    logits out) or a pass over the verified positions (the target's features in, no logits)."""

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, inputs: torch.Tensor, cache: KVCache, last: int | None = None,
                 new_tokens: list[int] | None = None, from_target: bool = True):
        if not self.eligible(cache, None, new_tokens):
            return self.model(tokens, inputs, cache, last, new_tokens, from_target)
        return self._replay(cache, (tokens.shape[1], from_target, last), (tokens, inputs))

    def _static_pass(self, view: KVCache, bucket: int, key: tuple):
        n, from_target, last = key
        head, device = self.model, view.device
        dtype, hidden = head.layers[0].o.weight.dtype, head.config.hidden_size
        width = head.head_config.feature_size if from_target else hidden
        tokens = torch.zeros(bucket, n, dtype=torch.long, device=device)  # (bucket, n)
        inputs = self._buffer(("inputs", bucket, n, from_target), (bucket, n, width), dtype, device)
        logits = None if last == 0 else self._buffer(
            ("logits", bucket, n, last), (bucket, n if last is None else min(last, n), head.logits_size), dtype, device)
        outputs = self._buffer(("outputs", bucket, n), (bucket, n, hidden), dtype, device)

        def run():
            out = head(tokens, inputs, view, last, None, from_target)
            return _into(logits, out[0]), outputs.copy_(out[1])

        return (tokens, inputs), run
