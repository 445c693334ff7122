"""Batched, ragged, lossless speculative decoding.

The rows of a step are a `runtime.batch.BatchState` (its invariants are in that module). One chain step
with k >= 1 (`SpeculativeGenerator.step`):
  1. `_draft_chain`: one catch-up pass over the last n0 committed tokens of every row, n0 = the largest
     lag (rows that lag less are rolled back and re-feed tokens they already hold: same KV, one shape);
     its last logits give draft token 1; then k - 1 passes of 1 token give tokens 2..k;
  2. `_verify`: one target pass over [last committed token, d1..dk] (k + 1 tokens per row);
  3. `accept`: per row (greedy: while the draft token equals the target's argmax; sampling: rejection
     sampling, exactly the target's distribution), plus one token from the target;
  4. `_commit`: write the kept tokens and roll the caches back to them (a length reset, no copy);
  5. one read-back: what each row kept (and the draft cache's new lengths) reach the host in a single
     transfer, the step's only wait for the device; the host mirrors of every length follow from it.
k = 0 is one target pass of 1 token through the same bookkeeping; trees go through runtime.tree_decoding.
Finished rows leave the batch (their slots refilled in place, runtime.batch). Instrumentation is the
caller's: an optional `StepObserver` runs and times the step passes and receives a `StepRecord` per step;
without one nothing is timed but the prefill and the whole generation.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from specbatch.perfmodel.tree import chain

from . import policy as hooks
from .attention import TreeAttention
from .batch import BatchState, apply_moves, fill_holes
from .cache_pool import CachePool, owner_key
from .clock import DeviceClock
from .devices import device_kind, graphs_by_default, host_bookkeeping_by_default
from .fused import warm_prefill
from .kv_cache import KVCache, upload
from .model import CausalLM
from .acceptance import accept, count_acceptance
from .sampling import Sampling, probabilities, sample
from .drafters import drafter_for
from .errors import GenerationError
from .tree_decoding import compact, plan_for, verify_and_accept


_generation_serial = itertools.count()  # request ids of `generate` rows: (serial of the call, prompt index)


@dataclass
class GenerationStats:
    """What a generation reports: its tokens and steps, the draft depth and batch size of each step,
    acceptance per draft position and wall time."""

    steps: int = 0
    k_per_step: list[int] = field(default_factory=list)  # draft depth of each step (a tree's depth; 0: none)
    batch_size_per_step: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)  # position i: draft token i accepted
    trials_per_position: list[int] = field(default_factory=list)  # ... proposed with 1..i-1 accepted
    generated_tokens: int = 0
    first_tokens: int = 0  # tokens produced by the prefill pass (one per prompt)
    prefill_s: float = 0.0
    total_s: float = 0.0  # this generation's own time: between its turns, not in others' (`generation`)
    synthetic_acceptance: float | tuple[float, ...] | None = None  # one probability, or one per draft position

    def add_step(self, batch_size: int, k: int, counts: list[int]) -> None:
        """A step of draft depth k over `batch_size` rows, row r keeping counts[r] tokens."""
        self.steps += 1
        self.k_per_step.append(k)
        self.batch_size_per_step.append(batch_size)
        count_acceptance(self.accepted_per_position, self.trials_per_position, counts, k)

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / t if t else 0.0 for a, t in zip(self.accepted_per_position, self.trials_per_position)]

    @property
    def tokens_per_step(self) -> float:
        rows = sum(self.batch_size_per_step)
        return (self.generated_tokens - self.first_tokens) / rows if rows else 0.0

    @property
    def wall_tokens_per_s(self) -> float:
        """Generated tokens per second of the whole generation, prefill included (perfmodel's `tokens_per_s`
        is the steady goodput b E / S of full-batch steps; bench measures that as `steady_tokens_per_s`)."""
        return self.generated_tokens / self.total_s if self.total_s else 0.0

    def to_dict(self) -> dict:
        return {
            "steps": self.steps, "k_per_step": self.k_per_step, "batch_size_per_step": self.batch_size_per_step,
            "accepted_per_position": self.accepted_per_position, "trials_per_position": self.trials_per_position,
            "acceptance_per_position": self.acceptance_per_position, "generated_tokens": self.generated_tokens,
            "tokens_per_step": self.tokens_per_step, "wall_tokens_per_s": self.wall_tokens_per_s,
            "prefill_s": self.prefill_s, "total_s": self.total_s, "synthetic_acceptance": self.synthetic_acceptance,
        }


@dataclass
class GenerationResult:
    token_ids: list[list[int]]  # generated tokens per prompt, EOS included when it was produced
    stats: GenerationStats


@dataclass(frozen=True)
class Step:
    """What `SpeculativeGenerator.step` did."""

    new: torch.Tensor  # (b, w): each row's new tokens (beyond counts[r] scratch), on the device
    counts: torch.Tensor  # (b,): how many of them row r keeps (its accepted draft tokens + 1), on the device
    k: int  # draft depth (a chain's k, a tree's depth)
    nodes: int  # draft tokens verified per row (k for a chain)
    draft_passes: int  # the draft's forward passes (a staged chain's rounds)
    kept: list[list[int]]  # each row's kept tokens, on the host (read back once, at the end of the step)

    @property
    def counts_host(self) -> list[int]:
        return [len(tokens) for tokens in self.kept]


@dataclass(frozen=True)
class StepRecord:
    """One step of a generation, as its observer receives it."""

    batch_size: int
    context_len: int  # the longest row's committed tokens, what the policy was told
    k: int
    nodes: int
    draft_passes: int
    tokens: int  # what the rows kept, within max_new_tokens
    tokens_drawn: int  # what the step produced over all rows before that cut: a draw of b * E(k)
    decision_s: float  # the policy's own time: choosing, and learning from the outcome


class StepObserver(Protocol):
    """What bench and calibrate attach to a generation (calibrate.pass_clock.StepRecorder)."""

    def run_pass(self, role: str, model, tokens: torch.Tensor, cache: KVCache, attention=None,
                 last: int | None = None) -> torch.Tensor:
        """Run (and time) one forward pass of a step: `model(tokens, cache, attention, last)`."""

    def step_started(self) -> None: ...

    def step_finished(self, record: StepRecord) -> None: ...


def _run_pass(observer: StepObserver | None, role: str, model, tokens, cache, attention=None,
              last: int | None = None) -> torch.Tensor:
    if observer is None:
        return model(tokens, cache, attention, last)
    return observer.run_pass(role, model, tokens, cache, attention, last)


class _DraftPasses:
    """Runs a step's draft passes (runtime.tree_decoding calls it too): counts them, for a learning
    policy, and hands them to the observer, when there is one. `runner`: what runs the draft's passes
    (the model, or its CUDA graphs)."""

    def __init__(self, observer: StepObserver | None, runner=None):
        self.observer, self.count, self.runner = observer, 0, runner

    def __call__(self, model, tokens, cache, attention=None, last: int | None = None) -> torch.Tensor:
        self.count += 1
        return _run_pass(self.observer, "draft", self.runner or model, tokens, cache, attention, last)


def slot_order(prompts: list[list[int]]) -> list[int]:
    """Which prompt each slot of a batch takes: the longest first (ties in the given order), so that rows of
    similar length sit together and a CPU pass attends in few runs, each padded little
    (runtime.attention.plan_runs). A row keeps its slot until it finishes."""
    return sorted(range(len(prompts)), key=lambda r: -len(prompts[r]))


def context_limit(target: CausalLM, draft) -> int:
    """Positions a pair can address: the target's, and the draft's when it is a model (an n-gram has none)."""
    return min(target.config.max_position_embeddings,
               draft.config.max_position_embeddings if isinstance(draft, CausalLM) else 10**9)


class SpeculativeGenerator:
    def __init__(self, target: CausalLM, draft=None, eos_token_ids=(), stage2=None,
                 host_bookkeeping: bool | None = None, cuda_graphs: bool | None = None):
        """`draft`: a CausalLM, an n-gram model (runtime.ngram.NGramModel) used alone, or None.
        `stage2`: an n-gram model that speeds up a CausalLM draft's tree drafting (lossless for it).
        `host_bookkeeping`: small greedy trees keep their drafting bookkeeping on the host, a read-back
        per draft round (default: where the device's record allows it, runtime.devices: on the CPU, where
        reading back costs nothing and small tensor operations cost most; never on CUDA).
        `cuda_graphs`: decode, verify and draft-head passes replay CUDA graphs (runtime.cuda_graphs; CUDA, half
        precision), captured on first use per batch bucket and width for each KV cache; None: the device's
        default (on CUDA in half precision; `--eager` says False)."""
        from .heads import DraftHead

        vocab = target.config.vocab_size
        for role, model in (("draft", draft), ("second-stage n-gram", stage2)):
            if isinstance(model, DraftHead):
                continue  # loading checked its vocabulary against its target's (runtime.heads.config)
            size = None if model is None else getattr(model, "vocab_size", None) or model.config.vocab_size
            if isinstance(model, CausalLM) and size < vocab and model.logits_size == vocab:
                continue  # a draft padded to the target's vocabulary (loading checked that the tokens agree)
            if size is not None and size != vocab:
                raise GenerationError(f"{role} vocabulary ({size} tokens) differs from the target's "
                                      f"({vocab} tokens): the tokenizers must agree")
        if stage2 is not None and not isinstance(draft, CausalLM):
            raise GenerationError("a second stage needs a draft model to speed up (--draft)")
        self.target, self.draft, self.stage2 = target, draft, stage2
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = target.lm_head.weight.device
        self.kind = device_kind(self.device)
        self.host_bookkeeping = (host_bookkeeping_by_default(self.device) if host_bookkeeping is None
                                 else host_bookkeeping)
        self.target_runner = target  # what runs the target's step passes
        from .cuda_graphs import DRAFT_GRAPH_MAX_WIDTH, SLOT_GRANULARITY, GraphedHead, GraphedModel

        self.cuda_graphs = (graphs_by_default(self.device, target.lm_head.weight.dtype) if cuda_graphs is None
                            else cuda_graphs)
        draft_runner = None
        if self.cuda_graphs:
            self.target_runner = GraphedModel(target)
            draft_runner = (GraphedModel(draft, max_width=DRAFT_GRAPH_MAX_WIDTH) if isinstance(draft, CausalLM)
                            else GraphedHead(draft)
                            if isinstance(draft, DraftHead) else None)
        self.drafter = drafter_for(draft, stage2, self.host_bookkeeping, draft_runner)
        # kept from finished generations, per policy (`release_caches`)
        self._spare_caches = CachePool(self._new_cache, SLOT_GRANULARITY if self.cuda_graphs else 1)

    def _new_cache(self, role: str, batch_size: int, max_len: int):
        if role == "target":
            return self.target.new_cache(batch_size, max_len)
        return self.drafter.new_cache(batch_size, max_len)

    @property
    def draft_is_model(self) -> bool:
        """Whether a separate draft model drafts (its own weights and KV cache)."""
        return self.drafter.kind == "draft_model"

    @property
    def draft_runner(self):
        """What runs a draft model's step passes (the model, or its CUDA graphs); None for other drafters."""
        return self.drafter.runner if self.draft_is_model else None

    @property
    def models(self) -> dict:
        return {"target": self.target, "draft": self.draft}

    def graph_stats(self) -> dict:
        """CUDA graphs so far (runtime.cuda_graphs.GraphedModel.stats), both models added up: captures,
        capture_s (host seconds spent capturing, outside any step's time) and kept (graphs alive now)."""
        runners = [r for r in (self.target_runner, *self.drafter.runners()) if hasattr(r, "stats")]
        stats = [r.stats() for r in runners]
        return {name: sum(s[name] for s in stats) for name in ("captures", "capture_s", "kept")}

    def capture_graphs(self, target_cache, draft_cache, max_k: int) -> int:
        """Capture every CUDA graph chain steps of k = 0..max_k replay on these caches (each bucket of their
        rows, largest first), so that none is captured once requests run: a server calls it at start-up, as
        its memory plan counts them (calibrate.memory.serving_graph_bytes). Returns the captures made (0
        without graphs)."""
        if not self.cuda_graphs:
            return 0
        features = self.drafter.feature_layers if draft_cache is not None else None
        for model, cache in ((self.target, target_cache), (self.drafter.model, draft_cache)):
            if isinstance(model, CausalLM) and cache is not None:
                warm_prefill(model, cache, features if model is self.target else None)
        made = self.target_runner.capture_ahead(target_cache, [(k + 1, None, features) for k in range(max_k + 1)])
        runner = self.drafter.runners()[0] if self.drafter.runners() else None
        if draft_cache is not None and hasattr(runner, "capture_ahead"):
            made += runner.capture_ahead(draft_cache, self.drafter.graph_keys(max_k))
        return made

    @property
    def context_limit(self) -> int:
        """Positions both models can address: prompt + generated + draft tokens of a step must fit."""
        return min(self.target.config.max_position_embeddings, self.drafter.context_limit)

    # ------------------------------------------------------------------ public
    def generate(self, prompts: list[list[int]], max_new_tokens: int, policy, sampling: Sampling = Sampling(),
                 seed: int = 0, synthetic_acceptance: float | tuple[float, ...] | None = None,
                 observer: StepObserver | None = None) -> GenerationResult:
        """Generate up to `max_new_tokens` per prompt; `policy(batch_size, context_len)` gives k each step.

        `synthetic_acceptance` (benchmarks and calibrating random weights only) accepts each draft token
        with that probability instead of comparing with the target (a tuple: the probability at each draft
        position given the ones before were accepted, its last value for later positions); every forward
        pass still runs. `observer` (bench, calibrate) sees every step pass and every step.
        """
        return run_to_end(self.generation(prompts, max_new_tokens, policy, sampling, seed, synthetic_acceptance,
                                          observer))

    @torch.inference_mode()
    def generation(self, prompts: list[list[int]], max_new_tokens: int, policy, sampling: Sampling = Sampling(),
                   seed: int = 0, synthetic_acceptance: float | tuple[float, ...] | None = None,
                   observer: StepObserver | None = None):
        """`generate`, one unit of work at a time: a Python generator that yields after the prefill and
        after every step (the fraction of the batch's tokens generated so far, 0..1) and returns the
        GenerationResult. Several generations can so be advanced in turns on one thread (calibrate.lockstep:
        contenders timed side by side, step by step); `stats.total_s` counts this generation's own time
        only, not the time spent in others between its turns."""
        self._check(prompts, max_new_tokens, policy)
        # host time: the prefill and every step end with a read-back, so the device is idle at each reading
        clock = DeviceClock(self.device).host_s
        resumed, own_s = clock(), 0.0  # own_s: this generation's time between its turns
        stats = GenerationStats(synthetic_acceptance=synthetic_acceptance)
        b = len(prompts)
        rows = slot_order(prompts)  # original index of each running row, by slot
        prompts = [prompts[r] for r in rows]
        rng = torch.Generator(device=self.device).manual_seed(seed)
        owner = owner_key(policy)  # each policy gets its own kept caches back (runtime.cache_pool)
        state = self._new_batch(prompts, max_new_tokens, policy.max_k if self.draft is not None else 0, sampling,
                                rng, synthetic_acceptance, owner)
        started = clock()
        first = self.prefill(state, prompts)
        stats.prefill_s = clock() - started

        serial = next(_generation_serial)
        request_ids = lambda: [(serial, r) for r in rows]  # noqa: E731 - stable ids for a learning policy
        generated = [[token] for token in first]  # each running row's tokens so far, on the host
        outputs: list[list[int] | None] = [None] * b
        stats.first_tokens = b
        done = self.finished_rows(generated, [1] * b, [max_new_tokens] * b)
        finished_tokens = 0  # tokens of the rows that already left the batch
        wanted = b * max_new_tokens
        while True:
            if done:
                hooks.release(policy, [(serial, rows[i]) for i in done])
                for i, keep in done.items():
                    outputs[rows[i]] = generated[i][:keep]
                    finished_tokens += max_new_tokens
                remaining = len(rows) - len(done)
                if not remaining:
                    break
                moves = fill_holes(state, list(done), len(rows))
                rows, generated = apply_moves(rows, moves, remaining), apply_moves(generated, moves, remaining)
                state = state.rows(0, remaining)
            own_s += clock() - resumed
            yield (finished_tokens + sum(map(len, generated))) / wanted  # a turn ends: the prefill, or a step
            resumed = clock()
            if observer is not None:
                observer.step_started()
            # the context a step pays for: the longest row's (what any policy is told)
            context, ids = int(state.host_committed.max()), request_ids()
            decided = time.perf_counter()
            choice = hooks.ask(policy, ids, context) if self.draft is not None else 0
            decision_s = time.perf_counter() - decided
            step = self.step(state, choice, observer)
            counts = step.counts_host
            decision_s += self.learn(policy, ids, step, counts)
            stats.add_step(len(counts), step.k, counts)
            kept = sum(min(c, max_new_tokens - len(g)) for c, g in zip(counts, generated))
            for row_tokens, new in zip(generated, step.kept):
                row_tokens.extend(new)
            done = self.finished_rows(generated, counts, [max_new_tokens] * len(rows))
            if observer is not None:
                observer.step_finished(StepRecord(len(counts), context, step.k, step.nodes, step.draft_passes,
                                                  kept, sum(counts), decision_s))
        stats.generated_tokens = sum(len(o) for o in outputs)
        stats.total_s = own_s + clock() - resumed
        for role, cache in (("target", state.target_cache), ("draft", state.draft_cache)):
            self._spare_caches.keep(role, cache, owner)
        return GenerationResult(token_ids=outputs, stats=stats)

    @staticmethod
    def learn(policy, request_ids, step: Step, counts: list[int]) -> float:
        """Tell a learning policy what the chain step just run gave each row (`counts`: tokens kept per row,
        on the host); returns the seconds the policy spent learning."""
        started = time.perf_counter()
        if step.nodes == step.k:  # a chain (trees teach no per-token rate)
            hooks.report(policy, request_ids, step.k, [c - 1 for c in counts])
            hooks.report_draft_passes(policy, len(request_ids), step.draft_passes)
        return time.perf_counter() - started

    def _new_batch(self, prompts: list[list[int]], max_new_tokens: int, max_k: int, sampling: Sampling, rng,
                   synthetic_acceptance, owner=None) -> BatchState:
        """The prompts in a buffer with room for every token of the generation, and empty caches;
        `committed` holds each prompt's length until the prefill."""
        b, prompt_lens = len(prompts), [len(p) for p in prompts]
        buffer_len = max(prompt_lens) + max_new_tokens + max_k + 1
        host_tokens = np.zeros((b, buffer_len), dtype=np.int64)
        for r, prompt in enumerate(prompts):
            host_tokens[r, :len(prompt)] = prompt
        # a policy that never drafts (k = 0 throughout) gets no draft cache and no draft prefill: plain decoding
        take = self._spare_caches.take
        draft_cache = take("draft", b, buffer_len, owner) if self.drafter.model is not None and max_k > 0 else None
        host_committed = np.asarray(prompt_lens, dtype=np.int64)
        return BatchState(upload(host_tokens, self.device), upload(host_committed, self.device), host_committed,
                          take("target", b, buffer_len, owner), draft_cache, max_k, sampling, rng, synthetic_acceptance)

    def release_caches(self) -> None:
        """Free the KV caches kept from earlier generations."""
        self._spare_caches.clear()

    # ------------------------------------------------------------------ the steps (the engine's too)
    def prefill(self, state: BatchState, prompts: list[list[int]], continuing: bool = False) -> list[int]:
        """Feed each row's prompt (`state.tokens` already holds it, `state.committed` counts it) into the
        caches, packed with no padding; write the target's first token after each prompt, count it
        committed and return the first tokens (on the host: the prefill's one read-back). The caches'
        rows start empty, or, `continuing`, hold the prompt's beginning (`prefill_part`): `prompts` is then
        each row's rest."""
        if not continuing:
            for cache in (state.target_cache, state.draft_cache):
                if cache is not None:
                    cache.set_lengths(None, np.zeros(len(prompts), dtype=np.int64))
        counts = [len(p) for p in prompts]
        passes = prefill_passes(counts, self.kind.prefill_pass_tokens)
        features = self.drafter.feature_layers if state.draft_cache is not None else None
        last_logits, after_first = [], []  # the target's at each row's last token, (rows, V) per pass
        for start, end in passes:
            packed = _packed(prompts[start:end], self.device)
            rows = state if len(passes) == 1 else state.rows(start, end - start)
            out = self.target(packed, rows.target_cache, last=1, new_tokens=counts[start:end], features=features)
            logits, taken = out if features is not None else (out, None)
            last_logits.append(logits[:, 0])
            if rows.draft_cache is not None:
                after_first.append(self.drafter.prefill(rows.draft_cache, rows.tokens, packed, counts[start:end],
                                                        taken))
        last_logits = last_logits[0] if len(last_logits) == 1 else torch.cat(last_logits)  # (b, V)
        sampling = state.sampling
        first = last_logits.argmax(-1) if sampling.greedy else sample(probabilities(last_logits, sampling), state.rng)
        state.tokens.scatter_(1, state.committed[:, None], first[:, None])
        state.set_committed(state.committed + 1, state.host_committed + 1)
        for run in after_first:
            if run is not None:
                run()
        return first.tolist()

    def prefill_part(self, state: BatchState, parts: list[list[int]]) -> None:
        """Feed a part of each row's prompt into both caches (a chunked prefill: the serving engine runs
        decode steps between the parts of a long prompt); the last part goes through `prefill`."""
        counts = [len(p) for p in parts]
        packed = _packed(parts, self.device)
        features = self.drafter.feature_layers if state.draft_cache is not None else None
        out = self.target(packed, state.target_cache, last=0, new_tokens=counts, features=features)
        if state.draft_cache is not None:  # the tokens after each part are the prompt's: all written already
            run = self.drafter.prefill(state.draft_cache, state.tokens, packed, counts,
                                       out[1] if features is not None else None)
            if run is not None:
                run()

    def step(self, state: BatchState, choice, observer: StepObserver | None = None) -> Step:
        """One speculative step for every row of `state` with the policy's `choice` (k or a Strategy): each
        row's new tokens are written after its committed prefix, `state.committed` advances by what the row
        keeps, and both caches follow. The rows may be a different set at every call (runtime.engine).
        The step reads the device back once, at its end (`Step.kept`)."""
        tree, staged = self._strategy(choice)
        if tree is not None and tree.num_nodes > state.max_k:
            raise GenerationError(f"policy asked for {tree.num_nodes} draft tokens per step, above the "
                                  f"{state.max_k} the KV cache was sized for")
        passes = _DraftPasses(observer, self.draft_runner)
        if tree is not None and (staged or not tree.is_chain or not self.drafter.drafts_chains):
            if state.synthetic_acceptance is not None:
                raise GenerationError("synthetic acceptance applies to chains of a draft model or a head only")
            new, counts, draft_lengths = self._tree_step(state, tree, staged, passes, observer)
            k, nodes = tree.depth, tree.num_nodes
        else:
            k = nodes = 0 if tree is None else tree.depth
            draft_tokens, draft_probs = self.drafter.chain(state, k, passes) if k else (None, None)
            target_logits, features = self._verify(state, draft_tokens, observer)  # (b, k + 1, vocab)
            accepted, bonus = accept(draft_tokens, draft_probs, target_logits, state.sampling, state.rng,
                                     state.synthetic_acceptance)
            new, counts = self._chain_tokens(draft_tokens, accepted, bonus), accepted + 1
            draft_lengths = (self.drafter.settle_chain(state, k, accepted, new, features, passes)
                             if state.draft_cache is not None else None)
        return Step(new, counts, k, nodes, passes.count, self._commit(state, new, counts, draft_lengths))

    def _strategy(self, choice):
        """A policy's answer (an int k or a perfmodel.tree.Strategy) -> (tree or None, staged)."""
        if isinstance(choice, int):
            return (chain(choice) if choice > 0 else None), False
        if choice.stage2 and self.stage2 is None:
            raise GenerationError(f"strategy {choice.describe()} needs the second stage: pass --stage2 FILE")
        return choice.tree, bool(choice.stage2)

    def _verify(self, state: BatchState, draft_tokens, observer: StepObserver | None) -> torch.Tensor:
        """The target's logits (b, k + 1, vocab) over each row's last committed token and its draft tokens, and
        its hidden states there when the drafter reads them (else None)."""
        last = state.tokens.gather(1, (state.committed - 1)[:, None])  # (b, 1)
        verify_input = last if draft_tokens is None else torch.cat([last, draft_tokens], dim=1)
        features = self.drafter.feature_layers if state.draft_cache is not None else None
        return self._target_pass(observer, verify_input, state.target_cache, None, features)

    def _target_pass(self, observer, tokens, cache, attention, features):
        """The target's pass over `tokens` (a chain's verify, or a tree's nodes under `attention`): (its logits,
        its hidden states at `features` for a drafter that reads them, else None)."""
        if features is None:
            return _run_pass(observer, "target", self.target_runner, tokens, cache, attention), None
        runner = self.target_runner

        def with_features(tokens, cache, attention=None, last=None):
            return runner(tokens, cache, attention, last, features=features)
        return _run_pass(observer, "target", with_features, tokens, cache, attention)

    @staticmethod
    def _chain_tokens(draft_tokens, accepted, bonus) -> torch.Tensor:
        """A chain step's tokens (b, k + 1): the draft's, the target's after the accepted ones."""
        if draft_tokens is None:
            return bonus[:, None]
        new = torch.cat([draft_tokens, bonus[:, None]], dim=1)
        new.scatter_(1, accepted[:, None], bonus[:, None])
        return new

    @staticmethod
    def _commit(state: BatchState, new: torch.Tensor, counts: torch.Tensor, draft_lengths) -> list[list[int]]:
        """Write the step's tokens after each row's committed prefix (beyond `counts` is scratch), read back
        what each row kept (and the draft cache's lengths) in ONE transfer, and advance every length on
        the device and on the host. Returns each row's kept tokens."""
        positions = state.committed[:, None] + torch.arange(new.shape[1], device=new.device)
        state.tokens.scatter_(1, positions, new)
        columns = [counts[:, None], new] if draft_lengths is None else [counts[:, None], draft_lengths[:, None], new]
        host = torch.cat(columns, dim=1).tolist()  # the step's one read-back
        host_counts = np.asarray([row[0] for row in host], dtype=np.int64)
        committed = state.committed + counts
        state.set_committed(committed, state.host_committed + host_counts)
        state.target_cache.set_lengths(committed - 1, state.host_committed - 1)
        if draft_lengths is not None:
            state.draft_cache.set_lengths(draft_lengths, [row[1] for row in host])
        skip = len(columns) - 1
        return [row[skip:skip + count] for row, count in zip(host, host_counts.tolist())]

    def _tree_step(self, state: BatchState, tree, staged: bool, passes: _DraftPasses, observer):
        """A tree step (runtime.tree_decoding): draft, one target pass over every node, keep one path;
        returns the new tokens (b, depth + 1), how many of them each row keeps (b,) and the draft cache's
        new lengths (b,) (None without a draft cache)."""
        if tree.max_children > self.target.config.vocab_size:
            raise GenerationError(f"a tree node has {tree.max_children} children, more than the vocabulary's "
                                  f"{self.target.config.vocab_size} tokens")
        plan = plan_for(tree, self.device)
        committed = state.committed
        drafted = self.drafter.tree(state, plan, staged, passes)
        features = self.drafter.feature_layers if state.draft_cache is not None else None
        target_logits, target_features = self._target_pass(observer, drafted.tokens, state.target_cache,
                                                           TreeAttention(plan.depths, plan.target_mask), features)
        path, accepted, bonus = verify_and_accept(plan, drafted, target_logits, state.sampling, state.rng)
        keep = torch.arange(tree.depth, device=self.device) < accepted[:, None]
        if not tree.is_chain:  # in a chain, node i already sits where the i-th accepted token belongs
            compact(state.target_cache, committed, path - 1, keep)  # node j sat at slot committed - 1 + j
        new = torch.cat([drafted.tokens.gather(1, path), bonus[:, None]], dim=1)
        new.scatter_(1, accepted[:, None], bonus[:, None])
        draft_lengths = (self.drafter.settle_tree(state, plan, path, keep, accepted, new, target_features, passes)
                         if state.draft_cache is not None else None)
        return new, accepted + 1, draft_lengths

    # ------------------------------------------------------------------ checks and bookkeeping
    def _check(self, prompts, max_new_tokens, policy):
        if not prompts:
            raise GenerationError("no prompts given")
        if max_new_tokens <= 0:
            raise GenerationError(f"--max-new-tokens must be positive, got {max_new_tokens}")
        if any(len(p) == 0 for p in prompts):
            raise GenerationError("a prompt encodes to zero tokens")
        max_k = policy.max_k if self.draft is not None else 0
        if max_k < 0:
            raise GenerationError(f"k must be >= 0, got {max_k}")
        limit = self.context_limit
        limiter = "target" if limit == self.target.config.max_position_embeddings else "draft"  # the shorter one
        longest = max(len(p) for p in prompts)
        if longest >= limit:
            raise GenerationError(f"a prompt has {longest} tokens; the {limiter} model's context is {limit} positions")
        if longest + max_new_tokens + max_k > limit:
            raise GenerationError(
                f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) + draft tokens per step ({max_k}: "
                f"{policy.describe()}) exceeds the {limiter} model's context of {limit} positions; lower "
                f"--max-new-tokens, k or the tree's size"
            )

    def finished_rows(self, generated: list[list[int]], counts: list[int], max_new_tokens: list[int]) -> dict[int, int]:
        """Rows whose last step (row i kept counts[i] tokens, the tail of generated[i]) hit EOS or their own
        max_new_tokens -> how many generated tokens they keep. On the host."""
        eos = self.eos_token_ids
        done = {}
        for i, (tokens, limit) in enumerate(zip(generated, max_new_tokens)):
            total = len(tokens)
            keep = min(total, limit)
            hit = next((j for j in range(total - counts[i], total) if tokens[j] in eos), None) if eos else None
            if hit is not None:
                keep = min(keep, hit + 1)
            if keep < total or total >= limit or hit is not None:
                done[i] = keep
        return done


def prefill_passes(counts: list[int], budget: int | None) -> list[tuple[int, int]]:
    """Consecutive rows (start, end) fed together, each pass's tokens within `budget` (the device's
    `prefill_pass_tokens`; None: one pass); a row longer than the budget is a pass of its own.

    >>> prefill_passes([600, 500, 300, 200, 2000, 10], 1024)
    [(0, 1), (1, 4), (4, 5), (5, 6)]
    """
    if budget is None:
        return [(0, len(counts))]
    passes, start, tokens = [], 0, 0
    for row, count in enumerate(counts):
        if row > start and tokens + count > budget:
            passes.append((start, row))
            start, tokens = row, 0
        tokens += count
    passes.append((start, len(counts)))
    return passes


def _packed(prompts: list[list[int]], device) -> torch.Tensor:
    """Every row's tokens one row after another (a ragged pass's input), on `device`."""
    return upload(np.concatenate([np.asarray(p, dtype=np.int64) for p in prompts]), device)


def run_to_end(generation):
    """Drive a `SpeculativeGenerator.generation` to its end; its GenerationResult."""
    while True:
        try:
            next(generation)
        except StopIteration as finished:
            return finished.value
