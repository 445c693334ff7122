"""The forward passes of one step, as the runtime schedules them (runtime/generator.py for chains,
runtime/tree_decoding.py for trees), each with its expected count per step; `strategy.StepModel` weighs
them by pass latency and adds the step overhead (`overhead.OverheadModel`).

`step_passes` (a chain), `tree_step` (a tree; a chain gives the same passes) and `staged_step` (with the
n-gram second stage, its rounds counted exactly by `staged_rounds` and `valid_within`, checked against the
Monte Carlo `simulate_staged_rounds` in the tests). The derivations and assumptions: docs/model.md, "The
step's passes".
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np

from .acceptance import accept_all_probability
from .errors import PerfModelError
from .tree import Tree


@dataclass(frozen=True)
class Pass:
    role: str  # "draft" | "target"
    new_tokens: int  # tokens fed per row
    weight: float  # expected number of such passes per step


@dataclass(frozen=True)
class TreeStep:
    """One step's passes (with expected counts), its n-gram work and its expected draft passes."""

    passes: tuple[Pass, ...]
    ngram_queries: float = 0.0  # expected n-gram queries (one per round with the second stage)
    ngram_contexts: float = 0.0  # expected (row, node) guesses, over all of them

    @property
    def draft_passes(self) -> float:
        """Expected draft passes per step (rounds, with the second stage)."""
        return sum(p.weight for p in self.passes if p.role == "draft")


def catch_up_probability(leaf_end_probability: float, batch_size: int) -> float:
    """P(w = 2): some row of the batch accepted a path that ends at a leaf last step."""
    return 1.0 - (1.0 - leaf_end_probability) ** batch_size


def leaf_end_probability(tree: Tree, node_probabilities: Sequence[float]) -> float:
    """P_leafend = sum over leaves of P(leaf on the accepted path); `node_probabilities` for nodes 1..N."""
    return float(sum(node_probabilities[node - 1] for node in range(1, tree.num_nodes + 1) if not tree.children[node]))


def _catch_up(batch_size: int, extra: int, p_leaf_end: float) -> list[Pass]:
    """The first draft pass: w + extra tokens, w = 2 with P(w = 2), else 1."""
    p2 = catch_up_probability(p_leaf_end, batch_size)
    passes = [Pass("draft", 2 + extra, p2)] if p2 > 0 else []
    if p2 < 1:
        passes.append(Pass("draft", 1 + extra, 1.0 - p2))
    return passes


def step_passes(batch_size: int, k: int, alphas: Sequence[float]) -> tuple[Pass, ...]:
    """The forward passes of one chain step without the second stage; draft weights sum to k.

    >>> [(p.role, p.new_tokens, p.weight) for p in step_passes(4, 3, [0.0])]  # no row ever accepts all
    [('draft', 1, 1.0), ('draft', 1, 2.0), ('target', 4, 1.0)]
    """
    if batch_size < 1 or k < 0:
        raise PerfModelError(f"step_passes: need batch_size >= 1 and k >= 0, found {batch_size} and {k}")
    if k == 0:
        return (Pass("target", 1, 1.0),)
    rest = [Pass("draft", 1, float(k - 1))] if k > 1 else []
    first = _catch_up(batch_size, 0, accept_all_probability(alphas, k))  # a chain's only leaf is its last token
    return tuple(first + rest + [Pass("target", k + 1, 1.0)])


def head_step_passes(batch_size: int, k: int) -> tuple[Pass, ...]:
    """The forward passes of one chain step drafted by a head (runtime/drafters/head.py): k - 1 head passes of
    one token, the target's verify pass of k + 1, and the head's pass of k + 1 over the verified positions (its
    width is k + 1 whatever was accepted: it re-reads them all). At k = 0 that pass has one token: the head
    keeps up with the target even when it does not draft.

    >>> [(p.role, p.new_tokens, p.weight) for p in head_step_passes(4, 3)]
    [('draft', 1, 2.0), ('target', 4, 1.0), ('draft', 4, 1.0)]
    """
    if batch_size < 1 or k < 0:
        raise PerfModelError(f"head_step_passes: need batch_size >= 1 and k >= 0, found {batch_size} and {k}")
    drafting = [Pass("draft", 1, float(k - 1))] if k > 1 else []
    return tuple(drafting + [Pass("target", k + 1, 1.0), Pass("draft", k + 1, 1.0)])


def _check(tree: Tree, batch_size: int) -> None:
    if batch_size < 1 or tree.num_nodes < 1:
        raise PerfModelError(f"tree step: need batch_size >= 1 and a tree with nodes, found {batch_size} "
                             f"and {tree.num_nodes} nodes")


def inner_per_depth(tree: Tree) -> tuple[int, ...]:
    """Inner nodes at depths 1..H (the root, at depth 0, not counted)."""
    depths = [tree.depths[node] for node in tree.inner_nodes[1:]]
    return tuple(depths.count(d) for d in range(1, max(depths, default=0) + 1))


def tree_step(tree: Tree, batch_size: int, p_leaf_end: float) -> TreeStep:
    """Passes of a tree step without the second stage.

    >>> t = Tree(((0,), (1,), (0, 0)))  # node 1 is inner; nodes 2, 3 are leaves
    >>> [(p.role, p.new_tokens, p.weight) for p in tree_step(t, 1, 0.25).passes]
    [('draft', 2, 0.25), ('draft', 1, 0.75), ('draft', 1, 1.0), ('target', 4, 1.0)]
    """
    _check(tree, batch_size)
    levels = [Pass("draft", count, 1.0) for count in inner_per_depth(tree)]
    return TreeStep(tuple(_catch_up(batch_size, 0, p_leaf_end) + levels + [Pass("target", tree.num_nodes + 1, 1.0)]))


def head_tree_step(tree: Tree, batch_size: int) -> TreeStep:
    """Passes of a tree step drafted by a head (runtime/drafters/head.py): one head pass per level of inner nodes
    (its width the level's count: each node fed with its parent's output), the target's pass over every node
    (N + 1 tokens, returning the hidden states the head reads), and the head's pass over the accepted path's
    depth + 1 positions (its width is depth + 1 whatever was accepted, as a chain's k + 1). No catch-up: the head
    never lags. A chain of k is the tree whose levels hold one node each: `head_step_passes(b, k)`.

    >>> t = Tree(((0,), (1,), (0, 0)))  # node 1 is inner; nodes 2, 3 are leaves
    >>> [(p.role, p.new_tokens, p.weight) for p in head_tree_step(t, 1).passes]
    [('draft', 1, 1.0), ('target', 4, 1.0), ('draft', 3, 1.0)]
    """
    _check(tree, batch_size)
    levels = [Pass("draft", count, 1.0) for count in inner_per_depth(tree)]
    return TreeStep(tuple(levels + [Pass("target", tree.num_nodes + 1, 1.0), Pass("draft", tree.depth + 1, 1.0)]))


# ---------------------------------------------------------------- the second stage's rounds

def _inner_accuracy(tree: Tree, guess_accuracy: Sequence[float]) -> tuple[tuple[int, ...], np.ndarray]:
    """Non-root inner nodes (breadth-first) and the probability that each one's guess is right."""
    inner = tree.inner_nodes[1:]
    ranks = [tree.ranks[node] for node in inner]
    return inner, np.array([guess_accuracy[r] if r < len(guess_accuracy) else 0.0 for r in ranks], dtype=float)


@lru_cache(maxsize=256)
def valid_within(tree: Tree, guess_accuracy: tuple[float, ...]) -> np.ndarray:
    """A[j, m] = P(in one row, the first j non-root inner nodes (breadth-first) all have at most m
    wrong guesses on their paths), j = 0..I, m = 0..H. Breadth-first prefixes are subtrees, so
    A[j, m] = g_root(m) with g_v(m) = prod over v's children c in the prefix of
    acc_c * g_c(m) + (1 - acc_c) * g_c(m - 1), and g(-1) = 0."""
    inner, accuracy = _inner_accuracy(tree, guess_accuracy)
    height = max((tree.depths[node] for node in inner), default=0)
    table = np.ones((len(inner) + 1, height + 1))
    slot = {node: i for i, node in enumerate(inner)}
    for j in range(1, len(inner) + 1):
        g = {}
        for node in reversed((0,) + inner[:j]):  # children before parents
            value = np.ones(height + 1)
            for child in tree.children[node]:
                if child in g:
                    a = accuracy[slot[child]]
                    shifted = np.concatenate([[0.0], g[child][:-1]])  # g_c(m - 1)
                    value = value * (a * g[child] + (1.0 - a) * shifted)
            g[node] = value
        table[j] = g[0]
    table.flags.writeable = False  # cached and shared
    return table


@dataclass(frozen=True)
class StagedRounds:
    """Expected draft work of the second stage's rounds t >= 2 at one batch size."""

    expected_rounds: float  # including round 1
    width_weight: tuple[float, ...]  # [s]: expected passes over s inner nodes in rounds >= 2, s = 0..I
    start_weight: tuple[float, ...]  # [j]: expected rounds >= 2 whose suffix starts at inner index j


def staged_rounds(tree: Tree, batch_size: int, guess_accuracy: Sequence[float]) -> StagedRounds:
    """Exact expected rounds and suffix widths (see the module docstring).

    >>> r = staged_rounds(Tree(((0,), (0, 0), (0, 0, 0))), 1, [0.0])  # every guess wrong
    >>> r.expected_rounds, r.width_weight
    (3.0, (0.0, 1.0, 1.0))
    """
    if batch_size < 1:
        raise PerfModelError(f"staged rounds: batch size must be >= 1, found {batch_size}")
    table = valid_within(tree, tuple(float(a) for a in guess_accuracy)) ** batch_size  # P(q >= j) per m
    count, height = table.shape[0] - 1, table.shape[1] - 1
    start = np.zeros(count + 1)
    for m in range(height):  # round t = m + 2 starts at q with P(q >= j) = table[j, m]
        start[:count] += np.maximum(0.0, table[:count, m] - table[1:, m])
    width = start[::-1].copy()  # a suffix from index j is I - j wide
    width[0] = 0.0
    return StagedRounds(1.0 + float(start[:count].sum()), tuple(float(w) for w in width),
                        tuple(float(s) for s in start))


def expected_guesses(tree: Tree, guess_accuracy: Sequence[float]) -> float:
    """Expected (node) guesses per row and step: I in round 1, plus E[W(parent)] for every inner node
    whose parent is not the root (see the module docstring).

    >>> expected_guesses(Tree(((0,), (0, 0), (0, 0, 0))), [0.0])  # round 1: 2; node 0.0 again once
    3.0
    """
    inner, accuracy = _inner_accuracy(tree, guess_accuracy)
    wrongs = {0: 0.0}  # E[W(node)]
    for node, a in zip(inner, accuracy):
        wrongs[node] = wrongs[tree.parents[node]] + 1.0 - a
    return float(len(inner) + sum(wrongs[tree.parents[node]] for node in inner))


def staged_step(tree: Tree, batch_size: int, p_leaf_end: float, guess_accuracy: Sequence[float]) -> TreeStep:
    """Passes and n-gram queries of a tree step with the second stage.

    >>> s = staged_step(Tree(((0,), (0, 0), (0, 0, 0))), 1, 0.0, [0.0])
    >>> [(p.role, p.new_tokens, p.weight) for p in s.passes]
    [('draft', 3, 1.0), ('draft', 2, 1.0), ('draft', 1, 1.0), ('target', 4, 1.0)]
    >>> s.ngram_queries, s.ngram_contexts  # one query per round; guesses: 2, then 0.0 again, then none
    (3.0, 3.0)
    """
    _check(tree, batch_size)
    inner = tree.inner_nodes[1:]
    if not inner:  # nothing to guess: the runtime drafts as without the second stage
        return tree_step(tree, batch_size, p_leaf_end)
    rounds = staged_rounds(tree, batch_size, guess_accuracy)
    later = [Pass("draft", s, w) for s, w in sorted(enumerate(rounds.width_weight), reverse=True) if s and w > 0]
    passes = _catch_up(batch_size, len(inner), p_leaf_end) + later + [Pass("target", tree.num_nodes + 1, 1.0)]
    return TreeStep(tuple(passes), ngram_queries=rounds.expected_rounds,
                    ngram_contexts=batch_size * expected_guesses(tree, guess_accuracy))


# ---------------------------------------------------------------- Monte Carlo check of the rounds

@dataclass(frozen=True)
class SimulatedRounds:
    rounds: np.ndarray  # (draws,) rounds per step, round 1 included
    widths: np.ndarray  # (draws, max rounds - 1) inner nodes fed in rounds 2, 3, ...; 0 after the last
    guesses: np.ndarray  # (draws,) (row, node) guesses over all rounds: the n-gram's contexts


def simulate_staged_rounds(tree: Tree, batch_size: int, guess_accuracy: Sequence[float], draws: int = 4000,
                           seed: int = 0) -> SimulatedRounds:
    """Run the rounds themselves (guess, feed the suffix, mark valid, repeat), vectorized over draws
    and rows: an independent check of `staged_rounds`, which uses the closed form instead."""
    inner, accuracy = _inner_accuracy(tree, guess_accuracy)
    rng = np.random.default_rng(seed)
    slot = {node: i for i, node in enumerate(inner)}
    parent = [slot.get(tree.parents[node], -1) for node in inner]  # -1: the root (valid after round 1)
    shape = (draws, batch_size)
    valid = np.zeros(shape + (len(inner),), dtype=bool)
    known = np.zeros_like(valid)  # true token known: the parent's logits are valid
    rounds = np.ones(draws, dtype=int)
    widths = []
    start = np.zeros(draws, dtype=int)  # suffix start of the current round, per draw
    active = np.ones(draws, dtype=bool)
    guesses = np.zeros(draws, dtype=int)
    while active.any():
        fed_ok = np.zeros_like(valid)
        for i in range(len(inner)):
            in_suffix = (i >= start)[:, None]
            guesses += (in_suffix & ~known[..., i] & active[:, None]).sum(axis=1)
            right = valid[..., i] | known[..., i] | (rng.random(shape) < accuracy[i])
            above = np.ones(shape, dtype=bool) if parent[i] < 0 else np.where(
                (parent[i] >= start)[:, None], fed_ok[..., parent[i]], valid[..., parent[i]])
            fed_ok[..., i] = in_suffix & right & above & active[:, None]
        valid |= fed_ok
        for i in range(len(inner)):  # a valid parent's logits reveal its children's true tokens
            if parent[i] >= 0:
                known[..., i] |= valid[..., parent[i]]
            else:
                known[..., i] = True
        invalid_anywhere = ~valid.all(axis=1)  # (draws, I)
        active = invalid_anywhere.any(axis=1)
        start = np.where(active, invalid_anywhere.argmax(axis=1), len(inner))
        widths.append(np.where(active, len(inner) - start, 0))
        rounds += active
    return SimulatedRounds(rounds, np.stack(widths[:-1], axis=1) if len(widths) > 1 else np.zeros((draws, 0), int),
                           guesses)
