"""Continuous batching: requests join and leave the running batch between speculative steps.

Every iteration (`Engine.step`): drop cancelled requests, admit waiting ones (first come, first served,
up to `max_batch_size` rows and the KV token budget), prefill the newcomers in one pass, then run ONE
speculative step for every running row with the strategy the policy gives for the *current* batch size
and longest context, hand each request its new tokens (and text), and free the slots of finished rows.
The prefill and the step are `SpeculativeGenerator.prefill` / `.step`: the offline generator's own.

Slots. One `runtime.batch.BatchState` of `max_batch_size` rows holds every request's tokens and both
models' caches; running request i sits in row i, so the running rows are always rows 0..b-1 and a step
works on a view of them (`BatchState.rows`, no copy). A leaving row is replaced by the last running row
(`runtime.batch.fill_holes`: one row's live entries copied), and a newcomer takes the next free row: a
slot is reused as soon as it is freed.

Assumptions: one thread calls `step` (the torch work); `submit` and `cancel` may be called from any
thread. Greedy rows give exactly their solo greedy tokens whoever shares the batch (the step is
lossless for each row; only float rounding of batched passes could move a near-tie). Sampled rows draw
from their own generator (seed per request); a seeded request is reproducible for a given sequence of
strategies (with a fixed chain, whatever shares its batch; trees draw a batch-dependent amount).
"""
from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from specbatch.perfmodel.errors import SpecbatchError

from . import policy as hooks
from .detokenize import INCOMPLETE, IncrementalText
from .engine_metrics import EngineMetrics, describe_choice
from .batch import BatchState, apply_moves, fill_holes
from .generator import SpeculativeGenerator
from .kv_cache import upload
from .sampling import RowGenerators, RowSampling, Sampling

log = logging.getLogger("specbatch.engine")


class EngineError(SpecbatchError):
    """A request the engine cannot take (too long, over the KV budget, bad settings)."""


class KVCacheTooSmall(EngineError):
    """Not one KV slot fits in the memory given to the KV cache."""


class QueueFull(EngineError):
    """The waiting queue is at its bound: try again later (HTTP 429)."""


class EngineClosed(EngineError):
    """The engine is shutting down and takes no new requests (HTTP 503)."""


@dataclass(frozen=True)
class EngineConfig:
    max_batch_size: int = 32  # running rows; the largest batch size of the table is the natural bound
    kv_budget_tokens: int | None = None  # tokens reserved by running requests; None: every slot full
    max_waiting: int = 1024  # queued requests beyond which submit raises QueueFull
    max_context_tokens: int | None = None  # prompt + max_tokens of one request; None: the models' context
    kv_cache_bytes: int | None = None  # both models' KV slots fit in this; None: max_batch_size slots
    prefill_chunk_tokens: int = 512  # a longer prompt is prefilled in parts of this size, decode steps between


@dataclass(frozen=True)
class Event:
    """What a request got from one iteration: new tokens and text since its last event."""

    request_id: str
    token_ids: list[int]
    text: str  # '' when the engine has no decoder
    finish_reason: str | None  # 'stop' (EOS or a stop string), 'length', 'cancelled', 'error'; None: more comes
    prompt_tokens: int
    completion_tokens: int  # so far


@dataclass(frozen=True)
class Request:
    id: str
    prompt_ids: tuple[int, ...]
    max_tokens: int
    sampling: Sampling = Sampling()
    seed: int | None = None  # None: a random seed (sampling only)
    stop: tuple[str, ...] = ()  # stop strings: the text ends before the first one (needs a decoder)
    on_event: Callable[[Event], None] | None = None  # called from the engine's thread


@dataclass
class _Row:
    request: Request
    reserved_tokens: int
    seed: int  # the request's random stream (runtime.sampling.RowGenerators)
    draws: int = 0  # uniforms it has drawn so far: where its stream resumes
    generated: list[int] = field(default_factory=list)
    emitted_tokens: int = 0
    emitted_chars: int = 0
    text: IncrementalText | None = None  # the row's text, decoded a step's tokens at a time


class _Cancelled(Exception):
    """A request cancelled while its long prompt was prefilled."""


class _Lengths:
    """A state's lengths (committed tokens, both caches), on the device and the host, to put back after a
    step that failed half-way (its passes had advanced the caches)."""

    def __init__(self, state: BatchState):
        caches = [c for c in (state.target_cache, state.draft_cache) if c is not None]
        self.committed = state.committed.clone(), state.host_committed.copy()
        self.caches = [(cache.lengths.clone(), cache.host_lengths.copy()) for cache in caches]

    def restore(self, state: BatchState) -> None:
        state.set_committed(*self.committed)
        caches = [c for c in (state.target_cache, state.draft_cache) if c is not None]
        for cache, (device, host) in zip(caches, self.caches):
            cache.set_lengths(device, host)


class Engine:
    def __init__(self, generator: SpeculativeGenerator, policy, config: EngineConfig = EngineConfig(),
                 decode: Callable[[list[int]], str] | None = None):
        self.generator, self.policy, self.config, self.decode = generator, policy, config, decode
        self.max_k = policy.max_k if generator.draft is not None else 0
        limit = generator.context_limit
        self.max_context_tokens = config.max_context_tokens or limit - self.max_k
        if config.max_batch_size < 1 or config.max_waiting < 0:
            raise EngineError("max_batch_size must be >= 1 and max_waiting >= 0")
        if self.max_context_tokens + self.max_k > limit:
            raise EngineError(f"max_context_tokens {self.max_context_tokens} + {self.max_k} draft tokens per "
                              f"step exceed the models' context of {limit} positions")
        slot_len = self.max_context_tokens + self.max_k + 1  # generated tokens + one step's draft margin
        b = self.max_batch_size = min(config.max_batch_size, self.slots_that_fit(slot_len))
        self.kv_budget_tokens = config.kv_budget_tokens or b * slot_len
        device = generator.device
        draft_pool = generator.drafter.new_cache(b, slot_len) if self.max_k > 0 else None
        self._pool = BatchState(torch.zeros(b, slot_len, dtype=torch.long, device=device),
                                torch.zeros(b, dtype=torch.long, device=device), np.zeros(b, dtype=np.int64),
                                generator.target.new_cache(b, slot_len), draft_pool, self.max_k)
        # every graph the steps will replay, captured now: none while requests run (runtime.cuda_graphs)
        started = time.perf_counter()
        self.graphs_captured = generator.capture_graphs(self._pool.target_cache, draft_pool, self.max_k)
        self.graph_capture_s = time.perf_counter() - started
        if self.graphs_captured:
            log.info("CUDA graphs: %d captured ahead of serving in %.1f s", self.graphs_captured,
                     self.graph_capture_s)
        self._rows: list[_Row] = []
        self._waiting: deque[Request] = deque()
        self._cancelled: set[str] = set()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._cancel_everything = False
        # a policy with a step model (runtime.adaptive) records each step beside its prediction: /metrics shows it
        self.metrics = EngineMetrics(fidelity=getattr(policy, "fidelity", None))

    def kv_bytes_per_token(self) -> int:
        """Both models' KV-cache bytes per token (in the models' dtype)."""
        target = self.generator.target
        drafter = self.generator.drafter.kv_bytes_per_token() if self.max_k > 0 else 0
        return target.config.kv_bytes_per_token(target.lm_head.weight.element_size()) + drafter

    def slots_that_fit(self, slot_len: int) -> int:
        """Running rows whose KV slots of `slot_len` tokens fit in `kv_cache_bytes` (unbounded: None)."""
        if self.config.kv_cache_bytes is None:
            return self.config.max_batch_size
        slot_bytes = slot_len * self.kv_bytes_per_token()
        slots = self.config.kv_cache_bytes // slot_bytes
        if slots < 1:
            raise KVCacheTooSmall(f"one KV slot of {slot_len} tokens takes {slot_bytes / 2**30:.3g} GiB, more than the "
                              f"{self.config.kv_cache_bytes / 2**30:.3g} GiB KV cache; give more memory or a smaller "
                              "context per request")
        return int(slots)

    # ------------------------------------------------------------------ any thread
    def reservation(self, prompt_len: int, max_tokens: int) -> int:
        """KV tokens a request reserves: prompt, every token it may generate, one step's draft margin."""
        return prompt_len + max_tokens + self.max_k + 1

    def check(self, prompt_len: int, max_tokens: int, stop: tuple[str, ...] = ()) -> None:
        """Raise EngineError when a request of this shape can never run here."""
        if prompt_len == 0:
            raise EngineError("the prompt encodes to zero tokens")
        if max_tokens < 1:
            raise EngineError(f"max_tokens must be >= 1, got {max_tokens}")
        if prompt_len + max_tokens > self.max_context_tokens:
            raise EngineError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the context of "
                              f"{self.max_context_tokens} tokens")
        if self.reservation(prompt_len, max_tokens) > self.kv_budget_tokens:
            raise EngineError(f"the request needs {self.reservation(prompt_len, max_tokens)} KV tokens, above the "
                              f"budget of {self.kv_budget_tokens}")
        if stop and self.decode is None:
            raise EngineError("stop strings need a tokenizer to decode text")

    def submit(self, request: Request) -> None:
        self.check(len(request.prompt_ids), request.max_tokens, request.stop)
        with self._lock:
            if self._closed:
                raise EngineClosed("the server is shutting down")
            if len(self._waiting) >= self.config.max_waiting:
                raise QueueFull(f"{len(self._waiting)} requests are waiting (the bound is {self.config.max_waiting})")
            self._waiting.append(request)
        self._wake.set()

    def cancel(self, request_id: str) -> None:
        with self._lock:
            self._cancelled.add(request_id)
        self._wake.set()

    def cancel_all_soon(self) -> None:
        """Ask the engine's thread to end every request (shutdown) at its next iteration."""
        with self._lock:
            self._cancel_everything = True
        self._wake.set()

    def close(self) -> None:
        """Take no new requests (running and waiting ones go on until `cancel_all` or their end)."""
        with self._lock:
            self._closed = True

    @property
    def running(self) -> int:
        return len(self._rows)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    @property
    def reserved_tokens(self) -> int:
        return sum(row.reserved_tokens for row in list(self._rows))

    # ------------------------------------------------------------------ the engine's thread
    def run(self, stop: threading.Event, idle_wait_s: float = 0.05) -> None:
        """Iterate until `stop` is set; a failing iteration ends its requests with 'error', not the loop."""
        while not stop.is_set():
            try:
                worked = self.step()
            except Exception:  # noqa: BLE001 - the server must outlive a bad step; the requests learn of it
                log.exception("engine step failed; its requests end with finish_reason 'error'")
                self._finish_all("error")
                worked = True
            if not worked:
                self._wake.wait(idle_wait_s)
                self._wake.clear()
        if self._cancel_everything:
            self.cancel_all()

    def cancel_all(self, reason: str = "cancelled") -> None:
        """End every waiting and running request now (shutdown); call from the engine's thread or when
        it has stopped."""
        with self._lock:
            waiting, self._waiting = list(self._waiting), deque()
            self._cancel_everything = False
        for request in waiting:
            self._emit(request, [], "", reason, 0)
        self._finish_all(reason)

    @torch.inference_mode()
    def step(self) -> bool:
        """One iteration; False when there was nothing to do."""
        if self._cancel_everything:
            self.cancel_all()
            return False
        self._drop_cancelled()
        joined = self._admit()
        if joined:
            self._prefill(joined)
        if not self._rows:
            return bool(joined)
        self._speculative_step()
        return True

    def _drop_cancelled(self) -> None:
        with self._lock:
            if not self._cancelled:
                return
            cancelled, self._cancelled = self._cancelled, set()
            dropped = [r for r in self._waiting if r.id in cancelled]
            self._waiting = deque(r for r in self._waiting if r.id not in cancelled)
        for request in dropped:
            self._emit(request, [], "", "cancelled", 0)
        gone = [i for i, row in enumerate(self._rows) if row.request.id in cancelled]
        for i in gone:
            self._emit(self._rows[i].request, [], "", "cancelled", len(self._rows[i].generated))
        self._remove(gone, "cancelled")

    def _admit(self) -> list[_Row]:
        joined: list[_Row] = []
        reserved = self.reserved_tokens
        with self._lock:
            while self._waiting and len(self._rows) + len(joined) < self.max_batch_size:
                request = self._waiting[0]
                need = self.reservation(len(request.prompt_ids), request.max_tokens)
                if reserved + need > self.kv_budget_tokens:
                    break  # first come, first served: the head waits for room, nobody overtakes it
                self._waiting.popleft()
                reserved += need
                seed = request.seed if request.seed is not None else secrets.randbits(63)
                text = None if self.decode is None else IncrementalText(self.decode)
                joined.append(_Row(request, need, seed, text=text))
        return joined

    def _batch_sampling(self, rows: list[_Row]):
        """(Sampling, rng) for a set of rows: the plain greedy path when every row is greedy."""
        if all(row.request.sampling.greedy for row in rows):
            return Sampling(), None
        return (RowSampling(tuple(row.request.sampling for row in rows)),
                RowGenerators([row.seed for row in rows], [row.draws for row in rows], self.generator.device))

    @staticmethod
    def _advance_streams(rows: list[_Row], rng) -> None:
        """After a pass that drew from `rng`, each row's stream resumes past what it drew."""
        if rng is not None:
            for row in rows:
                row.draws += rng.drawn

    def _prefill(self, joined: list[_Row]) -> None:
        """Prefill the newcomers: short prompts together in one packed pass, each long one in parts with
        the running rows' decode steps between them (they wait one part at most). A prefill that fails
        ends its own requests with 'error', no one else's."""
        chunk = self.config.prefill_chunk_tokens
        short = [row for row in joined if len(row.request.prompt_ids) <= chunk]
        if short:
            self._guarded_prefill(short, lambda state, prompts: self.generator.prefill(state, prompts))
        for row in joined:
            if len(row.request.prompt_ids) > chunk:
                self._prefill_in_parts(row, chunk)

    def _guarded_prefill(self, rows: list[_Row], run) -> None:
        """Prefill `rows` into the slots after the running ones with `run(state, prompts)` -> first tokens,
        then let them run; on failure they end with 'error'. Running rows may leave during `run` (a chunked
        prefill steps them): the newcomers then move down next to the rows still running."""
        start, n = len(self._rows), len(rows)
        prompts = [list(row.request.prompt_ids) for row in rows]
        sampling, rng = self._batch_sampling(rows)
        state = self._pool.rows(start, n, sampling=sampling, rng=rng)
        try:
            longest = max(map(len, prompts))
            host_tokens = np.zeros((n, longest), dtype=np.int64)
            for j, prompt in enumerate(prompts):
                host_tokens[j, :len(prompt)] = prompt
            state.tokens[:, :longest] = upload(host_tokens, state.tokens.device)
            state.set_committed(None, [len(p) for p in prompts])
            first = run(state, prompts)
        except _Cancelled:
            for row in rows:
                self._emit(row.request, [], "", "cancelled", 0)
                self.metrics.observe_finish("cancelled")
            return
        except Exception:  # noqa: BLE001 - a request that cannot be prefilled must not end the others
            log.exception("prefill of %d request(s) failed; they end with finish_reason 'error'", n)
            for row in rows:
                self._emit(row.request, [], "", "error", 0)
                self.metrics.observe_finish("error")
            return
        position = len(self._rows)
        for j in range(n if position != start else 0):  # destinations lie below their sources
            self._pool.move_row(start + j, position + j)
        self._advance_streams(rows, rng)
        self._rows.extend(rows)
        self.metrics.observe_prefill(sum(map(len, prompts)))
        self._deliver(list(range(position, position + n)), [[t] for t in first])

    def _prefill_in_parts(self, row: _Row, chunk: int) -> None:
        """A long prompt in parts of `chunk` tokens, a decode step of the running rows after each part."""
        prompt = list(row.request.prompt_ids)
        last = (len(prompt) - 1) // chunk * chunk  # where the final part (1..chunk tokens) starts

        def run(state, prompts):
            for cache in (state.target_cache, state.draft_cache):
                if cache is not None:
                    cache.set_lengths(None, [0])
            for begin in range(0, last, chunk):
                self.generator.prefill_part(state, [prompt[begin:begin + chunk]])
                if self._rows:
                    self._speculative_step()
                if self._take_cancelled(row.request.id):
                    raise _Cancelled()
            return self.generator.prefill(state, [prompt[last:]], continuing=True)

        self._guarded_prefill([row], run)

    def _take_cancelled(self, request_id: str) -> bool:
        with self._lock:
            if request_id in self._cancelled:
                self._cancelled.discard(request_id)
                return True
        return False

    def _speculative_step(self) -> None:
        b = len(self._rows)
        sampling, rng = self._batch_sampling(self._rows)
        state = self._pool.rows(0, b, sampling=sampling, rng=rng)
        request_ids = [row.request.id for row in self._rows]
        context = int(state.host_committed.max())  # what any policy is told: not its decision time
        started = time.perf_counter()
        choice = hooks.ask(self.policy, request_ids, context) if self.generator.draft is not None else 0
        decision_s = time.perf_counter() - started
        saved = _Lengths(state)
        try:
            step = self.generator.step(state, choice)
        except Exception:  # noqa: BLE001 - find the rows that fail alone; the others go on
            log.exception("a step over %d rows failed; retrying each row alone", b)
            saved.restore(state)
            self._rows_alone(choice)
            return
        self._advance_streams(self._rows, rng)
        counts = step.counts_host
        decision_s += self.generator.learn(self.policy, request_ids, step, counts)
        self.metrics.observe_step(describe_choice(choice), step.k, step.nodes, counts,
                                  time.perf_counter() - started, decision_s)
        self._deliver(list(range(b)), step.kept)

    def _rows_alone(self, choice) -> None:
        """After a failed step: each row steps alone; the rows that fail alone end with 'error'."""
        kept, failed = [], []
        for i, row in enumerate(self._rows):
            sampling, rng = self._batch_sampling([row])
            state = self._pool.rows(i, 1, sampling=sampling, rng=rng)
            saved = _Lengths(state)
            try:
                kept.append(self.generator.step(state, choice).kept[0])
                self._advance_streams([row], rng)
            except Exception:  # noqa: BLE001
                log.exception("request %s fails alone; it ends with finish_reason 'error'", row.request.id)
                saved.restore(state)
                kept.append([])
                failed.append(row)
        self._deliver(list(range(len(self._rows))), kept)
        gone = [i for i, row in enumerate(self._rows) if any(row is f for f in failed)]
        for i in gone:
            self._emit(self._rows[i].request, [], "", "error", len(self._rows[i].generated))
        self._remove(gone, "error")

    def _deliver(self, indices: list[int], kept_tokens: list[list[int]]) -> None:
        """Add each row's new tokens, find the rows that finished, emit events, free finished slots."""
        rows = [self._rows[i] for i in indices]
        for row, tokens in zip(rows, kept_tokens):
            row.generated.extend(tokens)
        done = self.generator.finished_rows([row.generated for row in rows], [len(t) for t in kept_tokens],
                                            [row.request.max_tokens for row in rows])
        finished, emitted = [], 0
        for j, row in enumerate(rows):
            reason = None
            if j in done:
                keep = done[j]
                reason = "length" if keep >= row.request.max_tokens and not self._ends_with_eos(row, keep) else "stop"
                del row.generated[keep:]
            text, stopped = self._text(row, final=reason is not None)
            if stopped:
                reason = "stop"
                del row.generated[self._tokens_behind_text(row):]  # tokens past the stop never reach the client
            upto = len(row.generated) if reason or not row.request.stop else self._tokens_behind_text(row)
            fresh = row.generated[row.emitted_tokens:upto]
            row.emitted_tokens += len(fresh)
            emitted += len(fresh)
            if fresh or text or reason:
                self._emit(row.request, fresh, text, reason, row.emitted_tokens)
            if reason:
                finished.append(indices[j])
                self.metrics.observe_finish(reason)
        self.metrics.observe_tokens(emitted)
        self._remove(finished, None)

    def _ends_with_eos(self, row: _Row, keep: int) -> bool:
        return keep > 0 and row.generated[keep - 1] in self.generator.eos_token_ids

    def _text(self, row: _Row, final: bool) -> tuple[str, bool]:
        """New text for a row and whether a stop string ended it. Text that could still become a stop
        string, or that ends inside a multi-byte character, is held back until it cannot."""
        if self.decode is None:
            return "", False
        text = row.text.extend(row.generated, final)  # certain text: never ends inside a character unless final
        hits = [i for i in (text.find(s) for s in row.request.stop) if i >= 0]
        stopped = bool(hits)
        if stopped:
            text = text[:min(hits)]
        elif not final:
            held = max([n for s in row.request.stop for n in range(1, len(s)) if text.endswith(s[:n])], default=0)
            text = text[:len(text) - held]
        fresh = text[row.emitted_chars:]
        row.emitted_chars = max(row.emitted_chars, len(text))
        return fresh, stopped

    def _tokens_behind_text(self, row: _Row) -> int:
        """The fewest tokens whose text covers what the client was sent (never fewer than were sent): with
        stop strings, tokens wait with their held-back text, and those past a stop are never sent or counted."""
        if row.emitted_chars >= len(self.decode(row.generated)):
            return len(row.generated)
        for count in range(row.emitted_tokens, len(row.generated)):
            text = self.decode(row.generated[:count])
            if len(text) >= row.emitted_chars and not text.endswith(INCOMPLETE):
                return count
        return len(row.generated)

    def _emit(self, request: Request, tokens: list[int], text: str, reason: str | None, completion: int) -> None:
        if request.on_event is None:
            return
        try:
            request.on_event(Event(request.id, tokens, text, reason, len(request.prompt_ids), completion))
        except Exception:  # noqa: BLE001 - a listener's bug must not stop the other requests
            log.exception("event listener of request %s failed", request.id)

    def _remove(self, indices: list[int], reason: str | None) -> None:
        """Free the slots of rows `indices`: the last running row moves into each freed slot."""
        hooks.release(self.policy, [self._rows[i].request.id for i in indices])
        moves = fill_holes(self._pool, indices, len(self._rows))
        self._rows = apply_moves(self._rows, moves, len(self._rows) - len(set(indices)))
        if reason and indices:
            for _ in indices:
                self.metrics.observe_finish(reason)

    def _finish_all(self, reason: str) -> None:
        for row in self._rows:
            self._emit(row.request, [], "", reason, len(row.generated))
        self._remove(list(range(len(self._rows))), reason)
