"""A separate draft model: its own KV cache, chains, trees, and the n-gram second stage that speeds up its trees.

The draft's cache holds a prefix of each row's committed tokens (it lags after steps at k = 0, or by one token
after a step in which the row accepted every draft token). Each step starts with one catch-up pass over the
tokens it lacks (`catch_up_input`); a chain then takes k - 1 passes of one token, a tree one pass per level
(or, with a second stage, passes that feed guessed nodes and re-feed from the first wrong guess).
"""
from __future__ import annotations

import numpy as np
import torch

from ..attention import TreeAttention
from ..devices import device_kind
from ..kv_cache import KVCache
from ..model import CausalLM
from ..sampling import Sampling
from ..tree_decoding import DraftedTree, TreePlan, _forward, _HostState, _TreeState, compact, level_starts
from .base import Drafter, draw


class DraftModelDrafter(Drafter):
    kind = "draft_model"
    drafts_chains = True

    def __init__(self, model: CausalLM, stage2=None, host_bookkeeping: bool = False, runner=None):
        """`runner`: what runs the step passes (the model's CUDA graphs), default the model itself."""
        self.model, self.stage2, self.host_bookkeeping = model, stage2, host_bookkeeping
        self.runner = runner or model
        self.vocab_size = model.config.vocab_size

    @property
    def context_limit(self) -> int:
        return self.model.config.max_position_embeddings

    def runners(self) -> list:
        return [self.runner]

    def prefill(self, cache, tokens, packed, counts, features):
        self.model(packed, cache, last=0, new_tokens=counts)
        return None

    def graph_keys(self, max_k: int) -> list[tuple]:
        # one-token drafting passes and the two-token catch-up, each keeping the last position's logits
        from ..cuda_graphs import DRAFT_GRAPH_MAX_WIDTH

        return [(n, 1, None) for n in range(1, DRAFT_GRAPH_MAX_WIDTH + 1)] if max_k > 0 else []

    def chain(self, state, k: int, passes):
        step_input = catch_up_input(self.model, state.draft_cache, state.tokens, state.committed,
                                    state.host_committed, passes)
        proposed, dists = [], []
        for _ in range(k):
            logits = passes(self.model, step_input, state.draft_cache, last=1)[:, -1]  # (b, vocab)
            token, q = draw(logits, state)
            proposed.append(token)
            if q is not None:
                dists.append(q)
            step_input = token[:, None]
        return torch.stack(proposed, dim=1), (torch.stack(dists, dim=1) if dists else None)

    def settle_chain(self, state, k, accepted, new, features, passes):
        # the cache holds d1..d_{k-1} beyond the committed tokens: it keeps what was accepted of them
        return state.committed + torch.clamp(accepted, max=k - 1) if k else None

    def tree(self, state, plan, staged: bool, passes):
        return draft_tree(plan, self.model, state.draft_cache, state.tokens, state.committed, state.host_committed,
                          state.sampling, state.rng, stage2=self.stage2 if staged else None, forward=passes,
                          host_bookkeeping=self.host_bookkeeping)

    def settle_tree(self, state, plan, path, keep, accepted, new, features, passes):
        slot = plan.inner_index[path] - 1  # leaves were never fed to the draft
        fed = keep & (slot >= 0)
        if not plan.tree.is_chain:
            compact(state.draft_cache, state.committed, slot, fed)
        return state.committed + fed.sum(1)


def draft_tree(plan: TreePlan, draft: CausalLM, cache: KVCache, tokens: torch.Tensor, committed: torch.Tensor,
               host_committed: np.ndarray, sampling: Sampling, rng, stage2=None, forward=None,
               host_bookkeeping: bool = False) -> DraftedTree:
    """Draft one tree per row with a draft model; leaves the draft cache at `committed` plus the
    inner nodes' slots (see the module docstring). `forward(model, tokens, cache, attention, last)` runs each
    draft pass when given (the generator counts and observes them); by default the model is called.
    Without a second stage the passes go level by level and every fed node is the draft's own: no pass
    waits for the device. With one, which slots to re-feed is read back after each pass.
    `host_bookkeeping`: small greedy trees keep their bookkeeping on the host (_HostState)."""
    b = tokens.shape[0]
    device = tokens.device
    rows = torch.arange(b, device=device)
    root_tokens = tokens[rows, committed - 1]
    most = device_kind(tokens.device).host_bookkeeping_max_cells
    if host_bookkeeping and sampling.greedy and b * (plan.tree.num_nodes + 1) <= most:
        state = _HostState(plan, root_tokens)
    else:
        state = _TreeState(plan, root_tokens, sampling, draft.config.vocab_size, host_guesses=host_bookkeeping)
    before_root = torch.where(committed >= 2, tokens[rows, (committed - 2).clamp(min=0)], -1)
    inner = list(plan.inner)
    catch_up = catch_up_input(draft, cache, tokens, committed, host_committed, forward)
    width = catch_up.shape[1]
    if stage2 is not None and inner:
        state.guess(stage2, before_root, inner)
        fed = state.fed_tokens(inner)
        offsets = torch.cat([torch.arange(width, device=device), width + plan.inner_offsets])
        mask = torch.zeros(width + len(inner), width + len(inner), dtype=torch.bool, device=device)
        mask[:width, :width] = torch.ones(width, width, dtype=torch.bool, device=device).tril()
        mask[width:, :width] = True
        mask[width:, width:] = plan.inner_mask
        logits = _forward(forward, draft, torch.cat([catch_up, fed], dim=1), cache, TreeAttention(offsets, mask),
                          last=len(inner) + 1)
        state.absorb_root(logits[:, 0], rng)
        state.absorb(logits[:, 1:], fed, 0, rng)
    else:
        logits = _forward(forward, draft, catch_up, cache, last=1)
        state.absorb_root(logits[:, -1], rng)
    rounds = 1
    starts = iter(level_starts(plan)) if stage2 is None else None
    while (start := next(starts, None) if starts is not None else state.first_invalid()) is not None:
        if stage2 is None:
            end = next(e for e in plan.level_ends if e > start)
        else:
            state.guess(stage2, before_root, inner[start:])
            end = len(inner)
        cache.set_lengths(committed + start, host_committed + start)
        fed = state.fed_tokens(inner[start:end])
        attention = TreeAttention(plan.inner_offsets[:end], plan.inner_mask[start:end, :end])
        logits = _forward(forward, draft, fed, cache, attention)
        state.absorb(logits, fed, start, rng)
        rounds += 1
    cache.set_lengths(committed + len(inner), host_committed + len(inner))
    return state.result(rounds)




def catch_up_input(draft: CausalLM, cache: KVCache, tokens: torch.Tensor, committed: torch.Tensor,
                   host_committed: np.ndarray, forward=None) -> torch.Tensor:
    """The draft's catch-up input (b, width): each row's last `width` committed tokens, width = the
    largest lag of the draft behind `committed`, with the cache rolled back to committed - width (rows
    that lag less re-feed tokens they hold: same KV, one shape). A row can re-feed at most its whole
    prefix: when the largest lag exceeds the shortest row (serving: a newcomer beside a row that ran
    k = 0 for a while), passes of min(committed) - 1 tokens first bring the laggards closer. Planned from
    the host lengths: nothing is read back."""
    steps = lambda n: torch.arange(n, device=tokens.device)  # noqa: E731
    while int((host_committed - cache.host_lengths).max()) > int(host_committed.min()):
        width = int(host_committed.min()) - 1  # >= 1: a row holds its prompt and a first token
        host_start = np.minimum(cache.host_lengths, host_committed - 1 - width)
        start = torch.minimum(cache.lengths, committed - 1 - width)
        cache.set_lengths(start, host_start)
        _forward(forward, draft, tokens.gather(1, start[:, None] + steps(width)), cache, last=0)
    width = int((host_committed - cache.host_lengths).max())
    cache.set_lengths(committed - width, host_committed - width)
    return tokens.gather(1, (committed - width)[:, None] + steps(width))
