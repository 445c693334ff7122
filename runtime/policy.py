"""Policies: how many tokens the draft proposes, asked again at every step.

A policy is called with the current batch size and the longest row's context and returns `k >= 0` or
a `perfmodel.tree.Strategy` (a chain or a tree, with or without the n-gram second stage).
`max_k` tells the generator how much KV-cache margin to allocate: the most draft tokens a step verifies.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specbatch.perfmodel.errors import UsageError


@dataclass(frozen=True)
class FixedK:
    k: int

    def __post_init__(self):
        if self.k < 0:
            raise UsageError(f"--k must be >= 0, got {self.k}")

    @property
    def max_k(self) -> int:
        return self.k

    def __call__(self, batch_size: int, context_len: int) -> int:
        return self.k

    def describe(self) -> str:
        return f"k={self.k}"


class TableK:
    """The strategy of a `specbatch.table/1` table (perfmodel.table), by batch size and context: a chain
    of k, or a tree with or without the second stage when the table's entries carry a strategy.
    `source` is a table file or an in-memory `perfmodel.table.Table` (e.g. computed for --tree auto)."""

    def __init__(self, source):
        from specbatch.perfmodel.table import Table, load_table

        self.table = source if isinstance(source, Table) else load_table(Path(source))
        self.name = "the performance model's choice" if isinstance(source, Table) else f"table {Path(source).name}"
        strategies = [entry.chosen() for bucket in self.table.buckets for entry in bucket.entries]
        self.max_k = max(s.tree.num_nodes if s.tree is not None else 0 for s in strategies)
        self.needs_stage2 = any(s.stage2 for s in strategies)

    def __call__(self, batch_size: int, context_len: int):
        strategy = self.table.strategy(batch_size, context_len)
        return strategy if strategy.kind == "tree" or strategy.stage2 else strategy.k

    def describe(self) -> str:
        return self.name


class FixedStrategy:
    """The same strategy (a chain, a tree, with or without the second stage) at every step."""

    def __init__(self, strategy):
        self.strategy = strategy
        self.max_k = strategy.tree.num_nodes if strategy.tree is not None else 0

    def __call__(self, batch_size: int, context_len: int):
        return self.strategy

    def describe(self) -> str:
        return self.strategy.describe(60)


# ---------------------------------------------------------------------- the optional feedback hooks
# A policy may also learn from what happened (runtime.adaptive.AdaptivePolicy). The generator and the
# engine go through these functions, so a plain policy (the callables above) needs none of it:
#   choose(request_ids, context_len) -> k | Strategy   instead of policy(batch_size, context_len);
#   observe(request_ids, proposed, accepted)            after a chain step, per row (a request id each);
#   release(request_ids)                                when requests leave (finished, cancelled);
#   observe_draft_passes(batch_size, passes)            after a chain step: the draft's forward passes in it
#                                                       (a staged chain's rounds tell how well the n-gram guessed).

def ask(policy, request_ids, context_len: int):
    """The policy's strategy for a step over these requests (rows in batch order)."""
    choose = getattr(policy, "choose", None)
    return choose(request_ids, context_len) if choose is not None else policy(len(request_ids), context_len)


def report(policy, request_ids, proposed: int, accepted) -> None:
    """Tell a learning policy what a chain step of `proposed` draft tokens gave each row."""
    observe = getattr(policy, "observe", None)
    if observe is not None:
        observe(request_ids, proposed, accepted)


def report_draft_passes(policy, batch_size: int, passes: int) -> None:
    """Tell a learning policy how many draft passes the chain step just run took."""
    observe = getattr(policy, "observe_draft_passes", None)
    if observe is not None:
        observe(batch_size, passes)


def release(policy, request_ids) -> None:
    forget = getattr(policy, "release", None)
    if forget is not None and request_ids:
        forget(request_ids)

