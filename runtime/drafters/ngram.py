"""An n-gram model drafting alone: trees, one batched query per level (a chain is a tree of one child per level)."""
from __future__ import annotations

from ..tree_decoding import ngram_tree
from .base import Drafter


class NGramDrafter(Drafter):
    kind = "ngram"

    def __init__(self, ngram):
        self.ngram, self.vocab_size = ngram, ngram.vocab_size

    def tree(self, state, plan, staged: bool, passes):
        drafted = ngram_tree(plan, self.ngram, state.tokens, state.committed, state.sampling, state.rng)
        passes.count = drafted.rounds  # the n-gram's queries, a round per level
        return drafted
