"""The step overhead: time a speculative step spends outside forward passes (sampling, acceptance,
bookkeeping), interpolated from the profile's measured rows. `strategy.StepModel` adds it to the
passes of `schedule`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .tree import Strategy


def _linear(x: float, xs: np.ndarray, ys: np.ndarray) -> float:
    """Piecewise-linear interpolation that extrapolates with the edge segments' slopes."""
    if len(xs) == 1:
        return float(ys[0])
    if x <= xs[0]:
        return float(ys[0] + (x - xs[0]) * (ys[1] - ys[0]) / (xs[1] - xs[0]))
    if x >= xs[-1]:
        return float(ys[-1] + (x - xs[-1]) * (ys[-1] - ys[-2]) / (xs[-1] - xs[-2]))
    return float(np.interp(x, xs, ys))


def _interpolate(rows: Sequence[tuple[float, float, float]], batch_size: int, size: int) -> float:
    """Linear in b within each measured size, then linear in size; clipped at 0."""
    table = np.array(rows, dtype=float)
    sizes = np.unique(table[:, 1])
    per_size = []
    for value in sizes:
        at_size = table[table[:, 1] == value]
        at_size = at_size[np.argsort(at_size[:, 0])]
        per_size.append(_linear(batch_size, at_size[:, 0], at_size[:, 2]))
    return max(0.0, _linear(size, sizes, np.array(per_size)))


@dataclass(frozen=True)
class OverheadModel:
    """Per-step overhead outside forward passes, from the profile's measured (b, k) rows.

    Linear in b within each measured k, then linear in k; the edges extrapolate linearly and the
    result is clipped at 0. Without rows the overhead is 0, which reports must say.

    Tree steps (and chains run with the second stage) do more bookkeeping than chains (tree masks,
    picking the accepted path, compacting the cache); `tree_rows` are their measurements keyed by
    (b, tree nodes), interpolated the same way along nodes instead of k (`step_overhead_ms`).
    """

    rows: tuple[tuple[int, int, float], ...]  # (batch_size, k, median_ms)
    tree_rows: tuple[tuple[int, int, bool, float], ...] = ()  # (batch_size, tree_nodes, stage2, median_ms)

    @property
    def measured(self) -> bool:
        return bool(self.rows)

    def overhead_ms(self, batch_size: int, k: int) -> float:
        if not self.rows:
            return 0.0
        return _interpolate(self.rows, batch_size, k)

    def tree_source(self, stage2: bool) -> str:
        """Which rows a tree step's overhead comes from: 'tree' (same stage-2 flag), 'tree, other
        stage-2 flag', 'chain' (the chain rows at k = depth) or 'none' (taken as 0)."""
        flags = {flag for _, _, flag, _ in self.tree_rows}
        if stage2 in flags:
            return "tree"
        if flags:
            return "tree, other stage-2 flag"
        return "chain" if self.rows else "none"

    def step_overhead_ms(self, batch_size: int, strategy: Strategy) -> float:
        """Overhead of one step of `strategy`. No speculation and plain chains: the (b, k) rows.
        Trees and chains with the second stage: the tree rows measured with the same stage-2 flag,
        by (b, nodes); without such rows the other flag's (the bookkeeping is mostly the tree's);
        without tree rows the chain rows at k = the tree's depth (a lower bound: no tree masks);
        without any rows 0."""
        if strategy.tree is None or (strategy.kind == "chain" and not strategy.stage2):
            return self.overhead_ms(batch_size, strategy.k)
        source = self.tree_source(strategy.stage2)
        if source.startswith("tree"):
            flag = strategy.stage2 if source == "tree" else not strategy.stage2
            rows = [(b, nodes, ms) for b, nodes, stage2, ms in self.tree_rows if stage2 == flag]
            return _interpolate(rows, batch_size, strategy.tree.num_nodes)
        return self.overhead_ms(batch_size, strategy.k)
