"""Goodput of speculative decoding and the best speculation length k per batch size.

The step time mirrors the runtime's real schedule (`step_passes`):

- k = 0: one target pass over 1 new token per row. No draft pass.
- k >= 1: a first draft pass of n0 tokens, then k-1 draft passes of 1 token, then one target
  pass of k+1 tokens (the k draft tokens plus the position after them). n0 = 2 when at least one
  row of the batch accepted all k draft tokens in the previous step (the draft must catch up its
  own last token and the target's bonus token), else 1; the whole batch pays for the wider pass.
- plus the step overhead measured outside forward passes (sampling, acceptance, bookkeeping).

So S(b, k, L) = P2 * T_d(b, 2, L) + (1 - P2) * T_d(b, 1, L) + (k - 1) * T_d(b, 1, L)
              + T_t(b, k + 1, L) + overhead(b, k),   with P2 = 1 - (1 - prod_{i<=k} alpha_i)^b,

and goodput G(b, k, L) = b * E(k) / S(b, k, L) tokens per second.

Assumptions: rows accept independently with the same alphas; the previous step used the same k;
every pass of a step sees the step's starting context length L (it grows by at most k + 1 within
the step); a finished row leaves immediately (no padding rows).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .acceptance import accept_all_probability, expected_tokens
from .errors import PerfModelError
from .tree import Strategy

# (role, batch_size, new_tokens, context_len) -> milliseconds of one forward pass
LatencyFn = Callable[[str, int, int, int], float]


@dataclass(frozen=True)
class Pass:
    role: str  # "draft" | "target"
    new_tokens: int  # tokens fed per row
    weight: float  # expected number of such passes per step


def catch_up_probability(alphas: Sequence[float], k: int, batch_size: int) -> float:
    """P2: probability that some row of the batch accepted all k draft tokens last step."""
    return 1.0 - (1.0 - accept_all_probability(alphas, k)) ** batch_size


def step_passes(batch_size: int, k: int, alphas: Sequence[float]) -> tuple[Pass, ...]:
    """The forward passes of one step, with their expected counts; draft weights sum to k.

    >>> [(p.role, p.new_tokens, p.weight) for p in step_passes(4, 3, [0.0])]  # no row ever accepts all
    [('draft', 1, 1.0), ('draft', 1, 2.0), ('target', 4, 1.0)]
    """
    if batch_size < 1 or k < 0:
        raise PerfModelError(f"step_passes: need batch_size >= 1 and k >= 0, found {batch_size} and {k}")
    if k == 0:
        return (Pass("target", 1, 1.0),)
    p2 = catch_up_probability(alphas, k, batch_size)
    first = [Pass("draft", 2, p2)] if p2 > 0 else []
    if p2 < 1:
        first.append(Pass("draft", 1, 1.0 - p2))
    rest = [Pass("draft", 1, float(k - 1))] if k > 1 else []
    return tuple(first + rest + [Pass("target", k + 1, 1.0)])


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


def step_time_ms(latency_ms: LatencyFn, overhead: OverheadModel, batch_size: int, k: int, context_len: int,
                 alphas: Sequence[float]) -> float:
    """Expected wall time of one step: its passes weighted by expected count, plus the overhead."""
    passes = step_passes(batch_size, k, alphas)
    forward_ms = sum(p.weight * latency_ms(p.role, batch_size, p.new_tokens, context_len) for p in passes)
    return forward_ms + overhead.overhead_ms(batch_size, k)


@dataclass(frozen=True)
class Candidate:
    k: int
    step_ms: float
    tokens_per_step: float  # per sequence: E(k)
    tokens_per_s: float  # whole batch: b * E(k) / S


@dataclass(frozen=True)
class Choice:
    batch_size: int
    context_len: int
    best_k: int
    tokens_per_s: float
    speedup: float  # over k = 0 at the same batch size and context
    runner_up_k: int | None  # None when max_k = 0
    margin: float | None  # (G(best) - G(runner-up)) / G(best): how decided the choice is
    candidates: tuple[Candidate, ...]  # k = 0..max_k


def evaluate(latency_ms: LatencyFn, overhead: OverheadModel, alphas: Sequence[float], batch_size: int,
             context_len: int, max_k: int, tokens_per_step: Sequence[float] | None = None) -> Choice:
    """Goodput of every k in 0..max_k at one batch size; the best k wins, ties to the smaller k.

    `tokens_per_step[k]`, when given (measured E(k) under the runtime's step dynamics), replaces the
    product formula E(k) = 1 + sum_i prod_{j<=i} alpha_j for the k it covers."""
    if batch_size < 1:
        raise PerfModelError(f"batch size must be >= 1, found {batch_size}")
    candidates = []
    for k in range(max_k + 1):
        step_ms = step_time_ms(latency_ms, overhead, batch_size, k, context_len, alphas)
        measured = tokens_per_step is not None and k < len(tokens_per_step)
        tokens = tokens_per_step[k] if measured else expected_tokens(alphas, k)
        candidates.append(Candidate(k, step_ms, tokens, batch_size * tokens / step_ms * 1e3))
    goodput = np.array([c.tokens_per_s for c in candidates])
    order = np.argsort(-goodput, kind="stable")  # stable: equal goodput keeps the smaller k first
    best = candidates[order[0]]
    runner_up = candidates[order[1]] if max_k > 0 else None
    return Choice(
        batch_size=batch_size, context_len=context_len, best_k=best.k, tokens_per_s=best.tokens_per_s,
        speedup=best.tokens_per_s / candidates[0].tokens_per_s,
        runner_up_k=None if runner_up is None else runner_up.k,
        margin=None if runner_up is None else (best.tokens_per_s - runner_up.tokens_per_s) / best.tokens_per_s,
        candidates=tuple(candidates),
    )


def best_k_per_batch(latency_ms: LatencyFn, overhead: OverheadModel, alphas: Sequence[float], max_batch: int,
                     context_len: int, max_k: int, tokens_per_step: Sequence[float] | None = None
                     ) -> tuple[Choice, ...]:
    """The best k for every batch size 1..max_batch at one context length."""
    if max_batch < 1:
        raise PerfModelError(f"--max-batch must be >= 1, found {max_batch}")
    return tuple(evaluate(latency_ms, overhead, alphas, b, context_len, max_k, tokens_per_step)
                 for b in range(1, max_batch + 1))
