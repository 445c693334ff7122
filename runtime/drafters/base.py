"""The drafter interface the generator drives (runtime.drafters); this base drafts nothing (k = 0)."""
from __future__ import annotations

import torch

from ..batch import BatchState
from ..sampling import probabilities, sample


def draw(logits: torch.Tensor, state: BatchState) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A draft token per row from the drafter's logits (b, vocab): its argmax (greedy), or a sample with its
    distribution q (b, vocab), which verification needs."""
    if state.sampling.greedy:
        return logits.argmax(-1), None
    q = probabilities(logits, state.sampling)
    return sample(q, state.rng), q


class Drafter:
    """Nothing drafts: every step is plain decoding. Subclasses draft chains, trees, or both."""

    kind = "none"
    model = None  # the network whose KV cache the drafter keeps (None: it keeps no cache)
    feature_layers: tuple[int, ...] | None = None  # the target's hidden states it reads (heads)
    drafts_chains = False  # False: a chain is drafted as a tree of one child per level
    vocab_size: int | None = None

    def new_cache(self, batch_size: int, max_len: int):
        return None if self.model is None else self.model.new_cache(batch_size, max_len)

    def kv_bytes_per_token(self) -> int:
        """The drafter's KV-cache bytes per token (0: it keeps none)."""
        if self.model is None:
            return 0
        config = self.model.config
        return config.kv_bytes_per_token(next(self.model.parameters()).element_size())

    @property
    def context_limit(self) -> int:
        """Positions the drafter can address (the target's limit applies anyway)."""
        return 10**9

    def runners(self) -> list:
        """What runs the drafter's passes, for graph statistics."""
        return []

    def graph_keys(self, max_k: int) -> list[tuple]:
        """The keys of the graphed passes chain steps of k = 0..max_k run on the drafter's cache
        (runtime.cuda_graphs: width first), for capturing them ahead."""
        return []

    def prefill(self, cache, tokens: torch.Tensor, packed: torch.Tensor, counts: list[int], features):
        """Feed a prefill pass's rows into the drafter's cache (`cache`: those rows; `tokens`: their token
        buffer; `packed`: the pass's tokens; `features`: the target's hidden states of them, when the drafter
        reads some). Returns what remains to run once the rows' first tokens are written, or None."""
        return None

    def chain(self, state: BatchState, k: int, passes):
        """k draft tokens per row (b, k) and, when sampling, their distributions (b, k, vocab)."""
        raise NotImplementedError(f"a {self.kind} drafter drafts no chains")

    def settle_chain(self, state: BatchState, k: int, accepted: torch.Tensor, new: torch.Tensor, features,
                     passes) -> torch.Tensor | None:
        """After a chain step's verify: `accepted` (b,) draft tokens kept per row, `new` (b, k + 1) the step's
        tokens, `features` the target's hidden states at the verified positions. Returns the drafter cache's
        new lengths (b,) on the device, or None to leave them."""
        return None

    def tree(self, state: BatchState, plan, staged: bool, passes):
        """A drafted tree per row (runtime.tree_decoding.DraftedTree)."""
        raise NotImplementedError(f"a {self.kind} drafter drafts no trees")

    def settle_tree(self, state: BatchState, plan, path: torch.Tensor, keep: torch.Tensor, accepted: torch.Tensor,
                    new: torch.Tensor, features, passes) -> torch.Tensor | None:
        """After a tree step's verify: the accepted `path` (b, depth) of node ids, `keep` (b, depth) the
        accepted prefix of it, `accepted` (b,) its length, `new` (b, depth + 1) the step's tokens, `features` the
        target's hidden states at every node (b, nodes + 1, ...) when the drafter reads them. Returns the drafter
        cache's new lengths, or None."""
        return None
