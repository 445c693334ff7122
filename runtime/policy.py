"""Policies: how many tokens the draft proposes, asked again at every step.

A policy is called with the current batch size and the longest row's context and returns `k >= 0` or
a `perfmodel.tree.Strategy` (a chain or a tree, with or without the n-gram second stage).
`max_k` tells the generator how much KV-cache margin to allocate: the most draft tokens a step verifies.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class FixedK:
    k: int

    def __post_init__(self):
        if self.k < 0:
            raise ValueError(f"--k must be >= 0, got {self.k}")

    @property
    def max_k(self) -> int:
        return self.k

    def __call__(self, batch_size: int, context_len: int) -> int:
        return self.k

    def describe(self) -> str:
        return f"k={self.k}"


class TableK:
    """k from a `specbatch.table/1` file (perfmodel.table), looked up by batch size and context."""

    def __init__(self, path: str | Path):
        from perfmodel.table import load_table

        self.path = Path(path)
        self.table = load_table(self.path)
        self.max_k = max(entry.k for bucket in self.table.buckets for entry in bucket.entries)

    def __call__(self, batch_size: int, context_len: int) -> int:
        return self.table.lookup(batch_size, context_len)

    def describe(self) -> str:
        return f"table {self.path.name}"


class FixedStrategy:
    """The same strategy (a chain, a tree, with or without the second stage) at every step."""

    def __init__(self, strategy):
        self.strategy = strategy
        self.max_k = strategy.tree.num_nodes if strategy.tree is not None else 0

    def __call__(self, batch_size: int, context_len: int):
        return self.strategy

    def describe(self) -> str:
        return self.strategy.describe()
