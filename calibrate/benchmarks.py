"""The two things timed on the device: one forward pass, and one generation step's overhead.

A pass is timed on the runtime's own model and KV cache as the generator calls it, every row's cache set
to length L (attention cost depends on how many keys there are, not their values). A step's overhead is
everything the generator does outside forward passes, read from a step recorder (calibrate.pass_clock)
while generating with a fixed chain or tree; the n-gram's query time is taken out, as the model adds it
from the query-cost fit.
"""
from __future__ import annotations

import itertools
import time
from typing import Callable

import torch

from specbatch.perfmodel.profile import Grid, TimingRow
from specbatch.runtime.clock import DeviceClock
from specbatch.runtime.cuda_graphs import (DRAFT_GRAPH_MAX_WIDTH, GraphedHead, GraphedModel, GraphRunner,
                                           bucket_for)
from specbatch.runtime.generator import SpeculativeGenerator
from specbatch.runtime.heads import DraftHead, HeadPasses
from specbatch.runtime.model import CausalLM, KVCache
from specbatch.runtime.policy import FixedK, FixedStrategy
from specbatch.runtime.sampling import Sampling

from .grid import TimingPoint, new_tokens_at
from .pass_clock import StepRecorder
from .store import timing_row
from .timing import Clock, Measurement, RepetitionRule, device_timed_ms, is_out_of_memory, repeat

OVERHEAD_PROMPT_TOKENS = 8  # short: the overhead barely depends on the context, and each sample's prefill is waste


def random_tokens(vocab_size: int, batch_size: int, new_tokens: int, device: str, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(vocab_size, (batch_size, new_tokens), generator=generator).to(device)  # (b, n)


def forward_sampler(model: CausalLM, cache: KVCache, tokens: torch.Tensor, context_len: int,
                    clock: DeviceClock, last: int | None = None) -> Callable[[], float]:
    """A function that times one pass of `tokens` (b, n) on top of `context_len` cached tokens, in ms,
    between two marks of the device clock (`device_timed_ms`). `last`: the logits the pass computes, as the
    runtime's passes of that role do (the draft's catch-up pass: the last position only)."""
    lengths = [context_len] * tokens.shape[0]

    @torch.inference_mode()
    def sample_ms() -> float:
        cache.set_lengths(None, lengths)  # outside the timed region: the runtime's lengths are already set
        return device_timed_ms(lambda: model(tokens, cache, None, last), clock)

    return sample_ms


def _graphed(role: str, model):
    """What runs a role's passes with graphs on, as the generator builds it (a draft model's passes wider than
    DRAFT_GRAPH_MAX_WIDTH run eagerly there: so here)."""
    if isinstance(model, DraftHead):
        return GraphedHead(model)
    return GraphedModel(model, max_width=DRAFT_GRAPH_MAX_WIDTH if role == "draft" else None)


class WithFeatures:
    """A target whose passes also return the hidden states a head reads (`features`), as the runtime's verify
    pass does when a head drafts; everything else is the wrapped runner's."""

    def __init__(self, runner, features: tuple[int, ...]):
        self.runner, self.features = runner, features

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def __call__(self, tokens, cache, tree=None, last=None):
        return self.runner(tokens, cache, tree, last, features=self.features)


class ForwardTimer:
    """Times forward passes at grid points, keeping one KV cache while consecutive points share
    (model, b, L): allocating a cache per point would cost more than many of the passes. With `graphs`, a
    pass of b rows replays the CUDA graph of b's bucket, as generation runs it (runtime.cuda_graphs; a head's
    passes too): the cache has the bucket's rows, and the graph is captured before the point's samples."""

    def __init__(self, models: dict[str, CausalLM], grid: Grid, device: str, rule: RepetitionRule,
                 clock: Clock = time.perf_counter, graphs: bool = False,
                 text_windows: dict[str, Callable[[int, int, int], torch.Tensor | None]] | None = None):
        """`clock`: the repetition budget's (host time; a fake one in tests); passes are timed on the device.
        `text_windows`: per role, (b, n, seed) -> the token ids of its timed passes (calibrate.routing.TextWindows:
        a mixture of experts routes text as it routes in use, not as it routes random ids); other roles are fed
        random ids, which cost a dense model the same."""
        # what runs each role's passes: its graphs (a head's too, as the runtime's HeadDrafter), or the model
        self.runners = {role: _graphed(role, model) if graphs else model for role, model in models.items()}
        # a head's passes with a model's call (drafting at 1 token, the verified positions at more)
        self.models = {role: HeadPasses(self.runners[role]) if isinstance(model, DraftHead) else self.runners[role]
                       for role, model in models.items()}
        head = models.get("draft")
        if isinstance(head, DraftHead) and "target" in models:  # the target's passes copy out what the head reads
            self.models["target"] = WithFeatures(self.models["target"], head.head_config.feature_layers)
        self.grid, self.device, self.rule, self.graphs = grid, device, rule, graphs
        self.clock, self.device_clock = clock, DeviceClock(device)
        self.key, self.cache = None, None
        self.text_windows = text_windows or {}

    def _cache_for(self, point: TimingPoint) -> KVCache:
        key = (point.model, point.batch_size, point.context_len)
        if key != self.key:
            self.forget()  # free the previous cache before allocating the next
            new_tokens = new_tokens_at(self.grid, point.model, point.batch_size)
            graphed = isinstance(self.runners[point.model], GraphRunner)
            rows = bucket_for(point.batch_size, 10**9) if graphed else point.batch_size
            cache = self.models[point.model].new_cache(rows, point.context_len + max(new_tokens))
            self.cache = cache.rows(0, point.batch_size) if rows != point.batch_size else cache
            self.key = key
        return self.cache

    def measure(self, point: TimingPoint) -> Measurement:
        model = self.models[point.model]
        cache = self._cache_for(point)
        seed = point.batch_size * 1000 + point.new_tokens
        windows = self.text_windows.get(point.model)
        tokens = None if windows is None else windows(point.batch_size, point.new_tokens, seed)
        tokens = random_tokens(model.config.vocab_size, point.batch_size, point.new_tokens, self.device, seed) \
            if tokens is None else tokens.to(self.device)
        # the runtime's draft passes use their last position's logits (runtime.generator); the target's all
        sampler = forward_sampler(model, cache, tokens, point.context_len, self.device_clock,
                                  last=1 if point.model == "draft" else None)
        if isinstance(self.runners[point.model], GraphRunner):
            sampler()  # the capture: never one of the point's samples
        return repeat(sampler, self.rule, self.clock)

    def forget(self) -> None:
        self.key, self.cache = None, None
        if self.graphs:  # the cache took its graphs along: their shared buffers can go too
            for runner in self.runners.values():
                runner.release_outputs()


def release_memory(device: str) -> None:
    """After an out-of-memory error: hand the allocator's cached blocks back so later points can fit."""
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def time_point(timer: ForwardTimer, point: TimingPoint) -> TimingRow:
    """The point's timing row; a point that runs out of memory is recorded as infeasible."""
    try:
        return timing_row(point, timer.measure(point))
    except Exception as error:  # noqa: BLE001 - only out-of-memory is recorded, the rest re-raised
        if not is_out_of_memory(error):
            raise
    timer.forget()  # outside the except block: the traceback would keep the failed pass's tensors alive
    release_memory(timer.device)
    return timing_row(point, None)


def expected_tokens_per_step(acceptance: float, k: int) -> float:
    """E(k) with a constant per-token acceptance: 1 + a + a^2 + ... + a^k."""
    return sum(acceptance ** i for i in range(k + 1))


def overhead_sampler(target: CausalLM, draft: CausalLM, batch_size: int, k: int, acceptance: float,
                     steps_per_sample: int, seed: int = 0, cuda_graphs: bool | None = None) -> Callable[[], float]:
    """A function that generates with FixedK(k) on `batch_size` random prompts and returns the
    generator's time outside forward passes per step, in ms.

    Draft tokens are accepted with probability `acceptance` (the generator's synthetic acceptance):
    with random weights the models would never agree, and how many tokens rows accept decides how
    often the 2-token catch-up runs and how ragged the rows get, both part of the overhead. EOS is
    disabled so every row runs the same number of tokens; the batch shrinks only in the last steps.
    """
    generator = SpeculativeGenerator(target, draft, eos_token_ids=(), cuda_graphs=cuda_graphs)
    prompts = random_tokens(target.config.vocab_size, batch_size, OVERHEAD_PROMPT_TOKENS, "cpu", seed).tolist()
    new_tokens = 1 + round(steps_per_sample * expected_tokens_per_step(acceptance, k))  # +1: prefill's token
    calls = itertools.count()

    def sample_ms() -> float:
        recorder = StepRecorder(generator.device, pass_contexts=False)
        generator.generate(prompts, new_tokens, FixedK(k), Sampling(), seed=seed + next(calls),
                           synthetic_acceptance=acceptance, observer=recorder)
        return recorder.overhead_s() / len(recorder.steps) * 1000.0

    return sample_ms


class TimedNGram:
    """An n-gram second stage that adds up the time of its queries: the device queries (`top_tokens`,
    `distributions`) between two marks of `clock` (a runtime.clock.DeviceClock: events on CUDA, read back
    when `seconds` is read, after the generation), the host look-ups the runtime makes while guessing
    (`top_tokens_host`) on its host clock. Anything else is the wrapped model's."""

    def __init__(self, ngram, clock: DeviceClock):
        self.ngram, self.clock = ngram, clock
        self.host_s, self._device_marks = 0.0, []

    def __getattr__(self, name):
        return getattr(self.ngram, name)

    @property
    def seconds(self) -> float:
        """Every query's time since the last `reset` (read it once the generation has ended)."""
        return self.host_s + sum(self.clock.elapsed_s(start, end) for start, end in self._device_marks)

    def reset(self) -> None:
        self.host_s, self._device_marks = 0.0, []

    def _device(self, method, *args):
        start = self.clock.mark()
        out = method(*args)
        self._device_marks.append((start, self.clock.mark()))
        return out

    def top_tokens(self, contexts: torch.Tensor, count: int) -> torch.Tensor:
        return self._device(self.ngram.top_tokens, contexts, count)

    def distributions(self, contexts: torch.Tensor) -> torch.Tensor:
        return self._device(self.ngram.distributions, contexts)

    def top_tokens_host(self, u: int, v: int) -> tuple[int, ...]:
        started = self.clock.host_s()
        out = self.ngram.top_tokens_host(u, v)
        self.host_s += self.clock.host_s() - started
        return out


def tree_overhead_sampler(target: CausalLM, draft: CausalLM, prompts: list[list[int]], strategy,
                          expected_tokens: float, steps_per_sample: int, stage2=None, seed: int = 0,
                          clock: DeviceClock | None = None, cuda_graphs: bool | None = None) -> Callable[[], float]:
    """A function that generates with `strategy` (a perfmodel.tree.Strategy: a tree, with the second
    stage or not) from `prompts` (one per row, real text: acceptance is real) and returns the time per
    step outside forward passes and n-gram queries, in ms. `expected_tokens` (per row and step) sizes
    a sample to about `steps_per_sample` steps; EOS is disabled; `clock` (the target's device by default)
    times the n-gram's queries."""
    clock = clock or DeviceClock(target.lm_head.weight.device)
    timed = TimedNGram(stage2, clock) if stage2 is not None else None
    generator = SpeculativeGenerator(target, draft, eos_token_ids=(), stage2=timed, cuda_graphs=cuda_graphs)
    policy = FixedStrategy(strategy)
    new_tokens = 1 + round(steps_per_sample * expected_tokens)  # +1: prefill's token
    calls = itertools.count()

    def sample_ms() -> float:
        if timed is not None:
            timed.reset()
        recorder = StepRecorder(generator.device, pass_contexts=False)
        generator.generate(prompts, new_tokens, policy, Sampling(), seed=seed + next(calls), observer=recorder)
        queries_s = timed.seconds if timed is not None else 0.0
        return max(0.0, recorder.overhead_s() - queries_s) / len(recorder.steps) * 1000.0

    return sample_ms
