"""Batched, ragged, lossless speculative decoding.

Invariants, per active row r of the batch:
  * `committed[r]` tokens are final (prompt + generated) and stored in `tokens[r, :committed[r]]`;
  * the target's cache holds all committed tokens but the last: `target_cache.lengths == committed - 1`;
  * the draft's cache holds a prefix of them: `draft_cache.lengths <= committed - 1` (it lags after
    steps with k = 0, or by one token after a step in which the row accepted every draft token).

One step with k >= 1 (`_speculative_step`):
  1. draft catch-up: one pass over the last n0 committed tokens of every row, n0 = the largest lag
     (rows that lag less are rolled back and re-fed tokens they already hold: same KV, one shape);
     its last logits give draft token 1; then k - 1 passes of 1 token give tokens 2..k;
  2. verify: one target pass over [last committed token, d1..dk] (k + 1 tokens per row);
  3. accept per row (greedy: while the draft token equals the target's argmax; sampling: rejection
     sampling, exactly the target's distribution), plus one token from the target;
  4. roll the caches back to what was accepted: a length reset, no copy.
k = 0 is one target pass of 1 token through the same bookkeeping. Finished rows leave the batch.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from specbatch.perfmodel.errors import SpecbatchError

from specbatch.perfmodel.tree import chain

from . import policy as hooks
from .clock import DeviceClock
from .model import CausalLM, TreeAttention
from .sampling import Sampling, probabilities, sample, uniform
from .tree_decoding import catch_up_input, compact, draft_tree, ngram_tree, plan_for, verify_and_accept


_generation_serial = itertools.count()  # request ids of `generate` rows: (serial of the call, prompt index)


class GenerationError(SpecbatchError):
    """Input the generator cannot run (prompt too long, k too large, mismatched vocabularies...)."""


@dataclass
class GenerationStats:
    steps: int = 0
    k_per_step: list[int] = field(default_factory=list)
    batch_size_per_step: list[int] = field(default_factory=list)
    accepted_per_position: list[int] = field(default_factory=list)  # position i: draft token i accepted
    trials_per_position: list[int] = field(default_factory=list)  # ... proposed with 1..i-1 accepted
    generated_tokens: int = 0
    first_tokens: int = 0  # tokens produced by the prefill pass (one per prompt)
    prefill_s: float = 0.0
    draft_s: float = 0.0  # draft forward passes
    verify_s: float = 0.0  # target forward passes after prefill
    other_s: float = 0.0  # everything else in the steps: sampling, acceptance, bookkeeping
    total_s: float = 0.0
    synthetic_acceptance: float | tuple[float, ...] | None = None  # one probability, or one per draft position
    step_s: list[float] = field(default_factory=list)  # wall time of each step, all passes and overhead
    step_tokens: list[int] = field(default_factory=list)  # tokens each step added (within max_new_tokens)
    # what each step produced over all rows before the cut at max_new_tokens (a finishing row's last step keeps
    # only what it still needed): the per-step draws of E(k) that perfmodel.explain compares with the model
    step_tokens_drawn: list[int] = field(default_factory=list)
    draft_passes: list[tuple[int, int]] = field(default_factory=list)  # (batch size, new tokens) per pass
    target_passes: list[tuple[int, int]] = field(default_factory=list)
    nodes_per_step: list[int] = field(default_factory=list)  # draft tokens verified per row (k for a chain)
    draft_passes_per_step: list[int] = field(default_factory=list)  # the draft's forward passes in each step
    # wall time of the policy's own work per step (choosing, learning from the outcome)
    decision_s: list[float] = field(default_factory=list)

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / t if t else 0.0 for a, t in zip(self.accepted_per_position, self.trials_per_position)]

    @property
    def tokens_per_step(self) -> float:
        rows = sum(self.batch_size_per_step)
        return (self.generated_tokens - self.first_tokens) / rows if rows else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.total_s if self.total_s else 0.0

    @property
    def decision_fraction(self) -> float:
        """The policy's decisions' share of the steps' wall time."""
        total = sum(self.step_s)
        return sum(self.decision_s) / total if total > 0 else 0.0

    def steady_tokens_per_s(self, batch_size: int) -> float | None:
        """Goodput over the steps that ran with the full batch: what G(b, k) models (no prefill, no tail)."""
        full = [i for i, b in enumerate(self.batch_size_per_step) if b == batch_size]
        seconds = sum(self.step_s[i] for i in full)
        return sum(self.step_tokens[i] for i in full) / seconds if full and seconds > 0 else None

    def to_dict(self) -> dict:
        return {
            "steps": self.steps, "k_per_step": self.k_per_step, "batch_size_per_step": self.batch_size_per_step,
            "accepted_per_position": self.accepted_per_position, "trials_per_position": self.trials_per_position,
            "acceptance_per_position": self.acceptance_per_position, "generated_tokens": self.generated_tokens,
            "tokens_per_step": self.tokens_per_step, "tokens_per_s": self.tokens_per_s,
            "prefill_s": self.prefill_s, "draft_s": self.draft_s, "verify_s": self.verify_s,
            "other_s": self.other_s, "total_s": self.total_s, "synthetic_acceptance": self.synthetic_acceptance,
            "decision_s_total": sum(self.decision_s),
            "decision_fraction": self.decision_fraction,
        }


@dataclass
class GenerationResult:
    token_ids: list[list[int]]  # generated tokens per prompt, EOS included when it was produced
    stats: GenerationStats


class _PassRecorder:
    """Times draft passes of a tree step into the stats (the tree code calls it once per pass)."""

    def __init__(self, timer: DeviceClock, stats: GenerationStats):
        self.now, self.stats = timer.now, stats

    def __call__(self, batch: int, new_tokens: int, seconds: float) -> None:
        self.stats.draft_s += seconds
        self.stats.draft_passes.append((batch, new_tokens))


class SpeculativeGenerator:
    def __init__(self, target: CausalLM, draft=None, eos_token_ids=(), stage2=None):
        """`draft`: a CausalLM, an n-gram model (runtime.ngram.NGramModel) used alone, or None.
        `stage2`: an n-gram model that speeds up a CausalLM draft's tree drafting (lossless for it)."""
        vocab = target.config.vocab_size
        for role, model in (("draft", draft), ("second-stage n-gram", stage2)):
            size = None if model is None else getattr(model, "vocab_size", None) or model.config.vocab_size
            if size is not None and size != vocab:
                raise GenerationError(f"{role} vocabulary ({size} tokens) differs from the target's "
                                      f"({vocab} tokens): the tokenizers must agree")
        if stage2 is not None and not isinstance(draft, CausalLM):
            raise GenerationError("a second stage needs a draft model to speed up (--draft)")
        self.target, self.draft, self.stage2 = target, draft, stage2
        self.draft_is_model = isinstance(draft, CausalLM)
        self.eos_token_ids = tuple(eos_token_ids)
        self.device = target.lm_head.weight.device

    @property
    def context_limit(self) -> int:
        """Positions both models can address: prompt + generated + draft tokens of a step must fit."""
        return min(self.target.config.max_position_embeddings,
                   self.draft.config.max_position_embeddings if self.draft_is_model else 10**9)

    # ------------------------------------------------------------------ public
    def generate(self, prompts: list[list[int]], max_new_tokens: int, policy, sampling: Sampling = Sampling(),
                 seed: int = 0, synthetic_acceptance: float | tuple[float, ...] | None = None) -> GenerationResult:
        """Generate up to `max_new_tokens` per prompt; `policy(batch_size, context_len)` gives k each step.

        `synthetic_acceptance` (benchmarks and calibrating random weights only) accepts each draft token
        with that probability instead of comparing with the target (a tuple: the probability at each draft
        position given the ones before were accepted, its last value for later positions); every forward
        pass still runs.
        """
        return run_to_end(self.generation(prompts, max_new_tokens, policy, sampling, seed, synthetic_acceptance))

    @torch.inference_mode()
    def generation(self, prompts: list[list[int]], max_new_tokens: int, policy, sampling: Sampling = Sampling(),
                   seed: int = 0, synthetic_acceptance: float | tuple[float, ...] | None = None):
        """`generate`, one unit of work at a time: a Python generator that yields after the prefill and
        after every step (the fraction of the batch's tokens generated so far, 0..1) and returns the
        GenerationResult. Several generations can so be advanced in turns on one thread (calibrate.lockstep:
        contenders timed side by side, step by step); `stats.total_s` counts this generation's own time
        only, not the time spent in others between its turns."""
        self._check(prompts, max_new_tokens, policy)
        resumed = time.perf_counter()
        own_s = 0.0  # this generation's time between its turns
        timer = DeviceClock(self.device)
        stats = GenerationStats(synthetic_acceptance=synthetic_acceptance)
        rng = torch.Generator(device=self.device).manual_seed(seed)
        b = len(prompts)
        prompt_lens = [len(p) for p in prompts]
        max_k = policy.max_k if self.draft is not None else 0
        buffer_len = max(prompt_lens) + max_new_tokens + max_k + 1
        tokens = torch.zeros(b, buffer_len, dtype=torch.long, device=self.device)
        for r, prompt in enumerate(prompts):
            tokens[r, :len(prompt)] = torch.tensor(prompt, dtype=torch.long)
        committed = torch.tensor(prompt_lens, dtype=torch.long, device=self.device)
        target_cache = self.target.new_cache(b, buffer_len)
        # a policy that never drafts (k = 0 throughout) gets no draft cache and no draft prefill: plain decoding
        draft_cache = self.draft.new_cache(b, buffer_len) if self.draft_is_model and max_k > 0 else None

        t0 = timer.now()
        first = self.prefill(tokens, committed, target_cache, draft_cache, sampling, rng)
        committed = committed + 1
        stats.prefill_s = timer.now() - t0

        rows = list(range(b))  # original index of each active row
        serial = next(_generation_serial)
        request_ids = lambda: [(serial, r) for r in rows]  # noqa: E731 - stable ids for a learning policy
        generated = [1] * b
        outputs: list[list[int] | None] = [None] * b
        stats.first_tokens = b
        done = self.finished_rows(first[:, None], torch.ones(b, dtype=torch.long), [1] * b, generated,
                                  [max_new_tokens] * b)
        finished_tokens = 0  # tokens of the rows that already left the batch
        wanted = b * max_new_tokens
        while True:
            if done:
                keep = [i for i in range(len(rows)) if i not in done]
                hooks.release(policy, [(serial, rows[i]) for i in done])
                for i, cut in done.items():
                    start = prompt_lens[rows[i]]
                    outputs[rows[i]] = tokens[i, start:start + cut].tolist()
                    finished_tokens += max_new_tokens
                if not keep:
                    break
                index = torch.tensor(keep, device=self.device)
                tokens, committed = tokens.index_select(0, index), committed.index_select(0, index)
                target_cache.keep_rows(index)
                if draft_cache is not None:
                    draft_cache.keep_rows(index)
                rows = [rows[i] for i in keep]
                generated = [generated[i] for i in keep]
            own_s += time.perf_counter() - resumed
            yield (finished_tokens + sum(generated)) / wanted  # a turn ends: the prefill, or a step, is done
            resumed = time.perf_counter()
            step_start = timer.now()
            # the context a step pays for: attention spans the longest row (shorter rows are masked)
            context, ids = int(committed.max()), request_ids()  # what any policy is told: not its decision time
            decided = time.perf_counter()
            choice = hooks.ask(policy, ids, context) if self.draft is not None else 0
            decision_s = time.perf_counter() - decided
            new, counts = self.step(choice, max_k, tokens, committed, target_cache, draft_cache, sampling, rng,
                                    stats, timer, synthetic_acceptance)
            counts_list = counts.tolist()
            decision_s += self.learn(policy, ids, stats, counts_list)
            stats.decision_s.append(decision_s)
            committed = committed + counts
            stats.step_tokens.append(sum(min(c, max_new_tokens - g) for c, g in zip(counts_list, generated)))
            stats.step_tokens_drawn.append(sum(counts_list))
            for i, c in enumerate(counts_list):
                generated[i] += c
            done = self.finished_rows(new, counts, counts_list, generated, [max_new_tokens] * len(rows))
            stats.step_s.append(timer.now() - step_start)
            stats.other_s += stats.step_s[-1]
        stats.generated_tokens = sum(len(o) for o in outputs)
        stats.other_s -= stats.draft_s + stats.verify_s
        stats.total_s = own_s + time.perf_counter() - resumed
        return GenerationResult(token_ids=outputs, stats=stats)

    @staticmethod
    def learn(policy, request_ids, stats: GenerationStats, counts: list[int]) -> float:
        """Tell a learning policy what the chain step just run gave each row (`counts`: tokens kept per row,
        on the host); returns the seconds the policy spent learning."""
        started = time.perf_counter()
        if stats.nodes_per_step[-1] == stats.k_per_step[-1]:  # a chain (trees teach no per-token rate)
            hooks.report(policy, request_ids, stats.k_per_step[-1], [c - 1 for c in counts])
            hooks.report_draft_passes(policy, len(request_ids), stats.draft_passes_per_step[-1])
        return time.perf_counter() - started

    # ------------------------------------------------------------------ the steps (the engine's too)
    def prefill(self, tokens, prompt_lens, target_cache, draft_cache, sampling, rng) -> torch.Tensor:
        """Feed right-padded prompts `tokens[:, :max(prompt_lens)]` (b rows) into caches whose rows are
        empty; set each row's cache length to its own prompt length (the padding's entries lie beyond
        it, masked and later overwritten), write the target's first token after each prompt in `tokens`
        and return it (b,)."""
        b = tokens.shape[0]
        width = int(prompt_lens.max())
        last_logits = self.target(tokens[:, :width], target_cache)[torch.arange(b), prompt_lens - 1]
        target_cache.lengths = prompt_lens.clone()
        if draft_cache is not None:
            self.draft(tokens[:, :width], draft_cache)
            draft_cache.lengths = prompt_lens.clone()
        first = last_logits.argmax(-1) if sampling.greedy else sample(probabilities(last_logits, sampling), rng)
        tokens[torch.arange(b), prompt_lens] = first
        return first

    def step(self, choice, max_k, tokens, committed, target_cache, draft_cache, sampling, rng, stats,
             timer=None, synthetic_acceptance=None):
        """One speculative step for every row of `tokens` (b, buffer) with the policy's `choice` (k or a
        Strategy): returns the new tokens (b, w) and how many of them each row keeps (b,), written after
        each row's `committed` prefix in `tokens` (beyond the count is scratch); the target cache is left
        at committed + counts - 1. The rows may be a different set at every call (runtime.engine)."""
        timer = timer or DeviceClock(self.device)
        passes_before = len(stats.draft_passes)
        tree, staged = self._strategy(choice)
        k = 0 if tree is None else tree.depth
        if tree is not None and tree.num_nodes > max_k:
            raise GenerationError(f"policy asked for {tree.num_nodes} draft tokens per step, above the "
                                  f"{max_k} the KV cache was sized for")
        if tree is not None and (staged or not tree.is_chain or not self.draft_is_model):
            if synthetic_acceptance is not None:
                raise GenerationError("synthetic acceptance applies to chains of the draft model only")
            new, counts = self._tree_step(tree, staged, tokens, committed, target_cache, draft_cache,
                                          sampling, rng, stats, timer)
            ran_k, nodes = k, tree.num_nodes
        else:
            new, counts = self._step(k, tokens, committed, target_cache, draft_cache, sampling, rng,
                                     synthetic_acceptance, stats, timer)
            ran_k = nodes = new.shape[1] - 1
        stats.nodes_per_step.append(nodes)
        stats.draft_passes_per_step.append(len(stats.draft_passes) - passes_before)
        # write the step's tokens after each row's committed prefix (beyond `counts` is scratch)
        positions = committed[:, None] + torch.arange(new.shape[1], device=self.device)
        tokens.scatter_(1, positions, new)
        target_cache.lengths = committed + counts - 1
        stats.steps += 1
        stats.k_per_step.append(ran_k)
        stats.batch_size_per_step.append(tokens.shape[0])
        return new, counts

    def _strategy(self, choice):
        """A policy's answer (an int k or a perfmodel.tree.Strategy) -> (tree or None, staged)."""
        if isinstance(choice, int):
            return (chain(choice) if choice > 0 else None), False
        if choice.stage2 and self.stage2 is None:
            raise GenerationError(f"strategy {choice.describe()} needs the second stage: pass --stage2 FILE")
        return choice.tree, bool(choice.stage2)

    def _tree_step(self, tree, staged, tokens, committed, target_cache, draft_cache, sampling, rng, stats, timer):
        """A tree step (runtime.tree_decoding): draft, one target pass over every node, keep one path."""
        if tree.max_children > self.target.config.vocab_size:
            raise GenerationError(f"a tree node has {tree.max_children} children, more than the vocabulary's "
                                  f"{self.target.config.vocab_size} tokens")
        plan = plan_for(tree, self.device)
        recorder = _PassRecorder(timer, stats)
        if self.draft_is_model:
            drafted = draft_tree(plan, self.draft, draft_cache, tokens, committed, sampling, rng,
                                 stage2=self.stage2 if staged else None, on_pass=recorder)
        else:
            drafted = ngram_tree(plan, self.draft, tokens, committed, sampling, rng, on_pass=recorder)
        t0 = timer.now()
        target_logits = self.target(drafted.tokens, target_cache, TreeAttention(plan.depths, plan.target_mask))
        stats.verify_s += timer.now() - t0
        b = tokens.shape[0]
        stats.target_passes.append((b, tree.num_nodes + 1))
        path, accepted, bonus = verify_and_accept(plan, drafted, target_logits, sampling, rng)
        keep = torch.arange(tree.depth, device=self.device) < accepted[:, None]
        if not tree.is_chain:  # in a chain, node i already sits where the i-th accepted token belongs
            compact(target_cache, committed, path - 1, keep)  # node j sat at slot committed - 1 + j
        if draft_cache is not None:
            slot = plan.inner_index[path] - 1  # leaves were never fed to the draft
            fed = keep & (slot >= 0)
            if not tree.is_chain:
                compact(draft_cache, committed, slot, fed)
            draft_cache.lengths = committed + fed.sum(1)
        _count_acceptance(stats, accepted, tree.depth)
        new = torch.cat([drafted.tokens.gather(1, path), bonus[:, None]], dim=1)
        new.scatter_(1, accepted[:, None], bonus[:, None])
        return new, accepted + 1

    def _step(self, k, tokens, committed, target_cache, draft_cache, sampling, rng, synthetic, stats, timer):
        """Run one step; returns the new tokens (b, k+1) and how many of them each row keeps (b,)."""
        b = tokens.shape[0]
        draft_tokens, draft_probs = None, None
        if k > 0:
            draft_tokens, draft_probs = self._draft(k, tokens, committed, draft_cache, sampling, rng, stats, timer)
            verify_input = torch.cat([tokens.gather(1, (committed - 1)[:, None]), draft_tokens], dim=1)
        else:
            verify_input = tokens.gather(1, (committed - 1)[:, None])
        t0 = timer.now()
        target_logits = self.target(verify_input, target_cache)  # (b, k+1, vocab)
        stats.verify_s += timer.now() - t0
        stats.target_passes.append((b, k + 1))
        accepted, next_token = accept(draft_tokens, draft_probs, target_logits, sampling, rng, synthetic)
        if k > 0:
            # the draft holds committed + d1..d_{k-1}; keep what was accepted
            draft_cache.lengths = committed + torch.clamp(accepted, max=k - 1)
            _count_acceptance(stats, accepted, k)
            new = torch.cat([draft_tokens, next_token[:, None]], dim=1)
            new.scatter_(1, accepted[:, None], next_token[:, None])
        else:
            new = next_token[:, None]
        return new, accepted + 1

    def _draft(self, k, tokens, committed, draft_cache, sampling, rng, stats, timer):
        """k draft tokens per row (b, k) and their distributions q (b, k, vocab) when sampling."""
        b = tokens.shape[0]
        catch_up = catch_up_input(self.draft, draft_cache, tokens, committed, _PassRecorder(timer, stats))
        proposed, dists = [], []
        step_input = catch_up
        for position in range(1, k + 1):
            t0 = timer.now()
            logits = self.draft(step_input, draft_cache)[:, -1]  # (b, vocab)
            stats.draft_s += timer.now() - t0
            stats.draft_passes.append((b, step_input.shape[1]))
            q = None if sampling.greedy else probabilities(logits, sampling)
            if q is None:
                token = logits.argmax(-1)
            else:
                token = sample(q, rng)
                dists.append(q)
            proposed.append(token)
            step_input = token[:, None]
        draft_tokens = torch.stack(proposed, dim=1)
        return draft_tokens, (torch.stack(dists, dim=1) if dists else None)

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
        longest = max(len(p) for p in prompts)
        if longest >= limit:
            raise GenerationError(f"a prompt has {longest} tokens; the model's context is {limit} positions")
        if longest + max_new_tokens + max_k > limit:
            raise GenerationError(
                f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) + draft tokens per step ({max_k}: "
                f"{policy.describe()}) exceeds the model's context of {limit} positions; lower --max-new-tokens, "
                f"k or the tree's size"
            )

    def finished_rows(self, new, counts, counts_list, generated, max_new_tokens: list[int]) -> dict[int, int]:
        """Rows that hit EOS or their own max_new_tokens in this step -> how many generated tokens they
        keep. `counts_list` is `counts` already on the host (the step needed it anyway)."""
        eos_hits = None
        if self.eos_token_ids:
            is_eos = torch.isin(new, torch.tensor(self.eos_token_ids, device=new.device))
            is_eos &= torch.arange(new.shape[1], device=new.device) < counts[:, None].to(new.device)
            eos_hits = torch.where(is_eos.any(1), is_eos.float().argmax(1), -1).tolist()
        done = {}
        for i, (total, limit) in enumerate(zip(generated, max_new_tokens)):
            before = total - counts_list[i]
            keep = min(total, limit)
            if eos_hits is not None and eos_hits[i] >= 0:
                keep = min(keep, before + eos_hits[i] + 1)
            if keep < total or total >= limit or (eos_hits is not None and eos_hits[i] >= 0):
                done[i] = keep
        return done


def run_to_end(generation):
    """Drive a `SpeculativeGenerator.generation` to its end; its GenerationResult."""
    while True:
        try:
            next(generation)
        except StopIteration as finished:
            return finished.value


def accept(draft_tokens, draft_probs, target_logits, sampling: Sampling, rng, synthetic: float | None = None):
    """How many draft tokens each row accepts (b,) and the target's token after them (b,).

    Greedy: accept while the draft token equals the target's argmax; the next token is the argmax at the
    first disagreement (or after the last draft token). Sampling: accept x with probability
    min(1, p(x)/q(x)); at the first rejection sample from norm(max(0, p - q)); if all are accepted,
    sample the bonus token from p. With `synthetic`, each draft token is accepted with that probability.
    """
    b = target_logits.shape[0]
    k = 0 if draft_tokens is None else draft_tokens.shape[1]
    rows = torch.arange(b, device=target_logits.device)
    if sampling.greedy:
        target_choice = target_logits.argmax(-1)  # (b, k+1)
        if k == 0:
            return torch.zeros(b, dtype=torch.long, device=rows.device), target_choice[:, 0]
        if synthetic is None:
            agree = draft_tokens == target_choice[:, :k]
        else:
            agree = uniform((b, k), rng, rows.device) < synthetic_threshold(synthetic, k, rows.device)
        accepted = agree.long().cumprod(1).sum(1)
        return accepted, target_choice[rows, accepted]
    p = probabilities(target_logits, sampling)  # (b, k+1, vocab)
    if k == 0:
        return torch.zeros(b, dtype=torch.long, device=rows.device), sample(p[:, 0], rng)
    u = uniform((b, k), rng, rows.device)
    if synthetic is None:
        p_draft = p[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)
        q_draft = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
        agree = u * q_draft < p_draft  # u < p/q without dividing by q
    else:
        agree = u < synthetic_threshold(synthetic, k, rows.device)
    accepted = agree.long().cumprod(1).sum(1)
    p_next = p[rows, accepted]  # (b, vocab)
    if synthetic is not None:
        return accepted, sample(p_next, rng)
    q_next = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)[rows, accepted]
    residual = torch.clamp(p_next - q_next, min=0.0)  # q_next is 0 when every draft token was accepted
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_next)  # p == q up to rounding
    return accepted, sample(residual, rng)


def synthetic_threshold(synthetic: float | tuple[float, ...], k: int, device):
    """The acceptance probability of draft positions 1..k: one for all, or one per position (the last
    value for positions beyond the given ones), as a tensor that broadcasts over the rows."""
    if isinstance(synthetic, (int, float)):
        return float(synthetic)
    return torch.tensor([synthetic[min(i, len(synthetic) - 1)] for i in range(k)], device=device)


def _count_acceptance(stats: GenerationStats, accepted: torch.Tensor, k: int) -> None:
    while len(stats.trials_per_position) < k:
        stats.trials_per_position.append(0)
        stats.accepted_per_position.append(0)
    positions = torch.arange(1, k + 1, device=accepted.device)
    trials = (accepted[:, None] >= positions - 1).sum(0).tolist()
    hits = (accepted[:, None] >= positions).sum(0).tolist()
    for i in range(k):
        stats.trials_per_position[i] += trials[i]
        stats.accepted_per_position[i] += hits[i]

