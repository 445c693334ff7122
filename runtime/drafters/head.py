"""A head (EAGLE-3, MTP) drafting from the target's hidden states, on its own one-layer KV cache.

Between steps the head's cache spans each row's committed tokens but the last (as the target's does) and
`HeadCache.hidden` holds its output at the last one, so a chain step of k tokens is:
  1. draft token 1 from that output (the LM head alone), then k - 1 passes of one token, each on the token
     just drafted and the head's own previous output;
  2. the target verifies [last committed, d1..dk] and returns its hidden states at those k + 1 positions;
  3. `settle_chain`: the head's cache is cut back to the committed tokens and one pass of k + 1 tokens per row
     re-reads the verified positions from the target's hidden states (the accepted ones and the target's
     token after them; entries past them are dropped with the length), and keeps its output at each row's
     last accepted position for the next step.
So a step costs the head k - 1 one-token passes and one pass of k + 1 tokens (k = 0: that pass of one token,
which keeps the head current). That first pass reads every verified position, accepted or not, so its width is
k + 1 whatever was accepted (as vLLM's padded drafter batch); the step model counts it so.
"""
from __future__ import annotations

import numpy as np
import torch

from ..attention import TreeAttention
from ..errors import GenerationError
from ..tree_decoding import _TreeState, level_starts
from .base import Drafter, draw


class HeadDrafter(Drafter):
    kind = "head"
    drafts_chains = True

    def __init__(self, head, runner=None):
        """`runner`: what runs the step passes (the head's CUDA graphs), default the head itself."""
        self.head = self.model = head
        self.runner = runner or head
        self.feature_layers = head.head_config.feature_layers
        self.vocab_size = head.logits_size

    def runners(self) -> list:
        return [self.runner]

    def prefill(self, cache, tokens, packed, counts, features):
        """The head's entries for the prompt's positions 1..n: each token with the target's hidden state before
        it. The last entry pairs with the row's first generated token, so this runs once that is written."""
        starts = cache.host_lengths.copy()  # the target's lengths before this pass: the same rows, the same tokens

        def after_first_tokens():
            rows = np.repeat(np.arange(len(counts)), counts)
            positions = np.concatenate([np.arange(s + 1, s + 1 + n) for s, n in zip(starts, counts)])
            shifted = tokens[torch.from_numpy(rows).to(tokens.device), torch.from_numpy(positions).to(tokens.device)]
            _, outputs = self.head(shifted, features, cache, last=0, new_tokens=list(counts))
            ends = torch.from_numpy(np.cumsum(counts) - 1).to(outputs.device)
            cache.hidden.copy_(outputs[ends])
        return after_first_tokens

    def graph_keys(self, max_k: int) -> list[tuple]:
        # (width, from the target, logits kept): the drafting pass, and the pass over each step's k + 1 verified
        # positions (at k = 0 too: the head never lags)
        return [(1, False, 1)] + [(k + 1, True, 0) for k in range(max_k + 1)]

    def chain(self, state, k: int, passes):
        cache, head, runner = state.draft_cache, self.head, self.runner
        hidden = cache.hidden[:, None]  # (b, 1, hidden): the head's output at each row's last committed token
        logits = head.logits(hidden)[:, -1]  # (b, vocab)
        proposed, dists = [], []
        for i in range(k):
            token, q = draw(logits, state)
            proposed.append(token)
            if q is not None:
                dists.append(q)
            if i + 1 < k:
                def run(tokens, cache, attention=None, last=1, hidden=hidden):
                    return runner(tokens, hidden, cache, last=last, from_target=False)
                out, hidden = passes(run, token[:, None], cache, None, 1)
                logits = out[:, -1]
        return torch.stack(proposed, dim=1), (torch.stack(dists, dim=1) if dists else None)

    def settle_chain(self, state, k, accepted, new, features, passes):
        return self._reread(state, new, features, accepted, passes)

    def _reread(self, state, new, verified, accepted, passes):
        """Cut the head's cache back to the committed tokens (dropping the step's drafted entries), re-read the
        verified positions, `new` (b, n) with the target's hidden states `verified` (b, n, F) before each, in one
        pass, and keep the output at each row's last accepted position. Returns the cache's new lengths."""
        cache = state.draft_cache
        cache.set_lengths(state.committed - 1, state.host_committed - 1)
        runner = self.runner

        def run(tokens, cache, attention=None, last=0):
            return runner(tokens, verified, cache, last=0)
        _, outputs = passes(run, new, cache, None, 0)  # (b, n, hidden)
        cache.hidden.copy_(outputs.gather(1, accepted[:, None, None].expand(-1, 1, outputs.shape[-1]))[:, 0])
        return state.committed + accepted

    def tree(self, state, plan, staged: bool, passes):
        """A tree per row, a level of inner nodes per head pass (runtime.tree_decoding's bookkeeping): each node
        is fed with its token and its parent's output (the root's: `HeadCache.hidden`) into in-flight slots under
        the tree mask, from the slot where a chain's second token would sit; its logits give its children."""
        if staged:
            raise GenerationError("a head drafts without the n-gram second stage")
        cache, head = state.draft_cache, self.head
        b = state.tokens.shape[0]
        rows = torch.arange(b, device=state.tokens.device)
        tree_state = _TreeState(plan, state.tokens[rows, state.committed - 1], state.sampling, self.vocab_size)
        tree_state.absorb_root(head.logits(cache.hidden[:, None])[:, -1], state.rng)
        inner = list(plan.inner)
        outputs = cache.hidden.new_empty(b, len(inner) + 1, cache.hidden.shape[-1])  # [:, 0]: the root's
        outputs[:, 0] = cache.hidden
        rounds = 1
        for start in level_starts(plan):
            end = next(e for e in plan.level_ends if e > start)
            cache.set_lengths(state.committed - 1 + start, state.host_committed - 1 + start)
            fed = tree_state.fed_tokens(inner[start:end])
            parents = plan.inner_index[plan.parent_of[plan.at(inner[start:end])]]  # 0: the root, i + 1: slot i
            attention = TreeAttention(plan.inner_offsets[:end], plan.inner_mask[start:end, :end])

            def run(tokens, cache, attention=None, last=None, inputs=outputs[:, parents]):
                return head(tokens, inputs, cache, last=last, from_target=False, tree=attention)
            logits, level = passes(run, fed, cache, attention)
            outputs[:, start + 1:end + 1] = level
            tree_state.absorb(logits, fed, start, state.rng)
            rounds += 1
        cache.set_lengths(state.committed - 1 + len(inner), state.host_committed - 1 + len(inner))
        return tree_state.result(rounds)

    def settle_tree(self, state, plan, path, keep, accepted, new, features, passes):
        """As `settle_chain`, over the accepted path: the target's hidden states at the root and the path's nodes
        (the tree verify returned them for every node), the step's tokens after each."""
        positions = torch.cat([torch.zeros_like(path[:, :1]), path], dim=1)  # (b, depth + 1): root, then the path
        verified = features.gather(1, positions[..., None].expand(-1, -1, features.shape[-1]))
        return self._reread(state, new, verified, accepted, passes)  # drops the tree's in-flight entries too
