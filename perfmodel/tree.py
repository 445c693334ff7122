"""Draft trees as data: a tree is a set of paths of child ranks.

A path `(0, 1)` is "the draft's second most likely continuation of its most likely first token": rank 0
is the draft's top child, rank r its (r+1)-th. A chain of k draft tokens is the tree
`(0,), (0, 0), ..., (0,) * k`. The root (index 0) is the last committed token; nodes 1..N are the
paths in breadth-first order (by depth, then by ranks), so a parent always comes before its children.

A valid tree is prefix-closed (the parent of every path is in the set) and rank-closed (a rank-r child
comes with its siblings of ranks 0..r-1, because children are the draft's top-c tokens, or the first
c tokens sampled without replacement). `TreeSpecError` names the first path that breaks a rule.

This module is pure Python and numpy: the runtime turns the buffers into tensors, the performance
model uses the same shapes to predict acceptance and cost.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from typing import Iterable, Sequence

import numpy as np

from .errors import PerfModelError

Path = tuple[int, ...]


class TreeSpecError(PerfModelError):
    """A tree spec that is not a valid set of rank paths; the message names the first bad path."""


def path_text(path: Path) -> str:
    return ".".join(str(rank) for rank in path)


@dataclass(frozen=True)
class Tree:
    """Nodes 1..N are `paths` in breadth-first order; node 0 is the root (the last committed token)."""

    paths: tuple[Path, ...]

    @property
    def num_nodes(self) -> int:
        """Draft tokens in the tree (the root excluded)."""
        return len(self.paths)

    @property
    def depth(self) -> int:
        """Draft tokens on the longest root-to-leaf path: what a chain-only reader would use as k."""
        return max((len(p) for p in self.paths), default=0)

    @cached_property
    def index(self) -> dict[Path, int]:
        return {path: i + 1 for i, path in enumerate(self.paths)}

    @cached_property
    def parents(self) -> tuple[int, ...]:
        """Parent node of every node; the root's is -1."""
        return (-1,) + tuple(self.index.get(p[:-1], 0) for p in self.paths)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        return (0,) + tuple(len(p) for p in self.paths)

    @cached_property
    def ranks(self) -> tuple[int, ...]:
        """Rank of every node among its siblings; the root's is -1."""
        return (-1,) + tuple(p[-1] for p in self.paths)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """Children of every node, by rank."""
        kids: list[list[int]] = [[] for _ in range(self.num_nodes + 1)]
        for node in range(1, self.num_nodes + 1):
            kids[self.parents[node]].append(node)  # breadth-first order lists siblings by rank
        return tuple(tuple(k) for k in kids)

    @property
    def max_children(self) -> int:
        return max(len(k) for k in self.children)

    @cached_property
    def inner_nodes(self) -> tuple[int, ...]:
        """Nodes with children, root included: the draft must score these; leaves cost no draft pass."""
        return tuple(node for node, kids in enumerate(self.children) if kids)

    @property
    def is_chain(self) -> bool:
        return all(rank == 0 for rank in self.ranks[1:])

    def spec(self) -> str:
        """The compact text form `parse_tree` reads back: paths joined by commas, ranks by dots."""
        return ",".join(path_text(p) for p in self.paths)

    def to_json(self) -> list[list[int]]:
        return [list(p) for p in self.paths]


def chain(k: int) -> Tree:
    """The tree of a plain chain of k draft tokens."""
    return Tree(tuple((0,) * depth for depth in range(1, k + 1)))


def make_tree(paths: Iterable[Sequence[int]], where: str = "--tree") -> Tree:
    """Validate paths (any order) and return the tree with its nodes in breadth-first order."""
    seen: set[Path] = set()
    ordered: list[Path] = []
    for raw in paths:
        if isinstance(raw, (str, bytes)) or not isinstance(raw, Sequence):
            raise TreeSpecError(f"{where}: path {raw!r} is not a list of ranks")
        if not raw:
            raise TreeSpecError(f"{where}: an empty path (the root is implicit; list only draft tokens)")
        if any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in raw):
            raise TreeSpecError(f"{where}: path {list(raw)} has a rank that is not an integer >= 0")
        path = tuple(int(r) for r in raw)
        if path in seen:
            raise TreeSpecError(f"{where}: path {path_text(path)} is listed twice")
        seen.add(path)
        ordered.append(path)
    if not ordered:
        raise TreeSpecError(f"{where}: the tree has no paths")
    ordered.sort(key=lambda p: (len(p), p))
    for path in ordered:
        if len(path) > 1 and path[:-1] not in seen:
            raise TreeSpecError(f"{where}: path {path_text(path)} has no parent {path_text(path[:-1])}")
        if path[-1] > 0 and path[:-1] + (path[-1] - 1,) not in seen:
            raise TreeSpecError(f"{where}: path {path_text(path)} has no lower-ranked sibling "
                                f"{path_text(path[:-1] + (path[-1] - 1,))}")
    return Tree(tuple(ordered))


def parse_tree(text: str, where: str = "--tree") -> Tree:
    """A tree from text: `chain:K`, a JSON list of rank lists, or paths like `0,1,0.0,0.1`.

    >>> parse_tree("0,1,0.0").paths
    ((0,), (1,), (0, 0))
    >>> parse_tree("[[0], [0, 0], [1]]").spec()
    '0,1,0.0'
    """
    text = text.strip()
    if text.startswith("chain:"):
        value = text.split(":", 1)[1]
        if not value.isdigit() or int(value) < 1:
            raise TreeSpecError(f"{where}: {text!r} needs a chain length >= 1, as in chain:4")
        return chain(int(value))
    if text.startswith("["):
        try:
            paths = json.loads(text)
        except json.JSONDecodeError as err:
            raise TreeSpecError(f"{where}: not valid JSON ({err.msg} at character {err.pos})") from None
        if not isinstance(paths, list):
            raise TreeSpecError(f"{where}: a JSON tree is a list of rank lists")
        return make_tree(paths, where)
    paths = []
    for item in text.replace(" ", ",").split(","):
        if not item:
            continue
        parts = item.split(".")
        if not all(part.isdigit() for part in parts):
            raise TreeSpecError(f"{where}: path {item!r} is not ranks joined by dots (as in 0.1.0)")
        paths.append([int(part) for part in parts])
    return make_tree(paths, where)


@dataclass(frozen=True)
class TreeBuffers:
    attention_mask: np.ndarray  # (N+1, N+1) bool: node i may attend to node j (j is i or an ancestor)
    position_offsets: np.ndarray  # (N+1,) int: depth of each node, added to the root's position
    retrieve_indices: np.ndarray  # (leaves, depth+1) int: node indices root-to-leaf, padded with -1


def tree_buffers(tree: Tree) -> TreeBuffers:
    """Attention mask, position offsets and root-to-leaf paths of a tree, root included as node 0.

    >>> b = tree_buffers(parse_tree("0,1,0.0"))
    >>> b.attention_mask.astype(int)
    array([[1, 0, 0, 0],
           [1, 1, 0, 0],
           [1, 0, 1, 0],
           [1, 1, 0, 1]])
    >>> b.position_offsets
    array([0, 1, 1, 2])
    >>> b.retrieve_indices  # one row per leaf, leaves in node order
    array([[ 0,  2, -1],
           [ 0,  1,  3]])
    """
    size = tree.num_nodes + 1
    mask = np.zeros((size, size), dtype=bool)
    for node in range(size):
        ancestor = node
        while ancestor >= 0:
            mask[node, ancestor] = True
            ancestor = tree.parents[ancestor]
    leaves = [node for node in range(size) if not tree.children[node]]
    retrieve = np.full((len(leaves), tree.depth + 1), -1, dtype=np.int64)
    for row, leaf in enumerate(leaves):
        path = np.flatnonzero(mask[leaf])  # ancestors in breadth-first order are root-to-leaf order
        retrieve[row, :len(path)] = path
    return TreeBuffers(mask, np.array(tree.depths, dtype=np.int64), retrieve)


# ---------------------------------------------------------------- acceptance of a tree
def node_probabilities(tree: Tree, rank_acceptance: Sequence[Sequence[float]]) -> np.ndarray:
    """P(node is on the accepted path) for nodes 1..N, with independent depths:
    the product over the path of `rank_acceptance[depth-1][rank]` (the probability that the target's
    token at that depth is the draft's rank-r child). Depths past the table reuse its last row; ranks
    past a row count as never accepted.
    """
    if not rank_acceptance:
        raise PerfModelError("tree acceptance: no per-rank acceptance values")
    reach = np.ones(tree.num_nodes + 1)
    for node in range(1, tree.num_nodes + 1):
        row = rank_acceptance[min(tree.depths[node], len(rank_acceptance)) - 1]
        rank = tree.ranks[node]
        reach[node] = reach[tree.parents[node]] * (row[rank] if rank < len(row) else 0.0)
    return reach[1:]


def expected_tree_tokens(tree: Tree, rank_acceptance: Sequence[Sequence[float]]) -> float:
    """Tokens a row gains per tree step: 1 (the target's own token) + expected accepted path length.

    >>> expected_tree_tokens(parse_tree("0,1,0.0"), [[0.5, 0.25], [0.5, 0.25]])  # 1 + .5 + .25 + .25
    2.0
    """
    return 1.0 + float(node_probabilities(tree, rank_acceptance).sum())


def simulate_tree_steps(tree: Tree, rank_sequences: Sequence[Sequence[int]]) -> tuple[float, float]:
    """Replay greedy tree steps over recorded rank sequences: (tokens per step, P(a step's accepted path
    ends at a leaf)). A sequence lists, along the target's own greedy continuation of a prompt, the rank
    of the target's token among the draft's (R for "R or worse"). Because accepted tokens ARE the target's
    tokens, the draft's rank at every node a step reaches is the recorded one: the replay is exact for
    greedy decoding, dependencies between depths included. A step starts where the last ended and walks
    down while the node has a child of the recorded rank; it gains the walk's length plus the target's
    own token at the next position. As calibrate's chain estimate does, only steps whose whole depth lies
    inside the sequence are counted (a step cut short by the sequence's end would under-count).

    >>> simulate_tree_steps(parse_tree("0,1,0.0"), [[1, 0, 2, 0, 0, 4]])  # steps [1]+0, []+2, [0,0]+4
    (2.0, 0.6666666666666666)
    """
    by_rank = [{tree.ranks[child]: child for child in kids} for kids in tree.children]
    steps = tokens = leaf_ends = 0
    for sequence in rank_sequences:
        position = 0
        while position + tree.depth <= len(sequence):
            node, accepted = 0, 0
            while by_rank[node]:  # a leaf ends the walk; a node's depth < tree.depth keeps the index inside
                child = by_rank[node].get(sequence[position + accepted])
                if child is None:
                    break
                node, accepted = child, accepted + 1
            steps += 1
            tokens += accepted + 1
            leaf_ends += accepted > 0 and not tree.children[node]
            position += accepted + 1
    if steps == 0:
        raise PerfModelError(f"tree acceptance: no rank sequence is as long as the tree's depth ({tree.depth})")
    return tokens / steps, leaf_ends / steps


def grow_tree(rank_acceptance: Sequence[Sequence[float]], num_nodes: int, max_depth: int,
              max_rank: int | None = None) -> Tree:
    """The tree of `num_nodes` nodes with the largest expected accepted length, built greedily: add the
    frontier node most likely to be on the accepted path (a child of a tree node at the next rank).
    Greedy is optimal here because a node is never more likely than its parent or lower-ranked sibling
    when acceptance falls with rank, which the draft's ranking makes true in practice.
    """
    if num_nodes < 1 or max_depth < 1:
        raise PerfModelError(f"tree: need num_nodes >= 1 and max_depth >= 1, got {num_nodes}, {max_depth}")
    ranks_known = max(len(row) for row in rank_acceptance)
    max_rank = ranks_known if max_rank is None else min(max_rank, ranks_known)

    def accept(depth: int, rank: int) -> float:
        row = rank_acceptance[min(depth, len(rank_acceptance)) - 1]
        return row[rank] if rank < len(row) else 0.0

    chosen: list[Path] = []
    reach: dict[Path, float] = {(): 1.0}
    frontier = {(0,): accept(1, 0)}
    while len(chosen) < num_nodes and frontier:
        path = max(frontier, key=lambda p: (frontier[p], -len(p), tuple(-r for r in p)))
        reach[path] = frontier.pop(path)
        chosen.append(path)
        if len(path) < max_depth:
            frontier[path + (0,)] = reach[path] * accept(len(path) + 1, 0)
        if path[-1] + 1 < max_rank:
            sibling = path[:-1] + (path[-1] + 1,)
            frontier[sibling] = reach[path[:-1]] * accept(len(path), path[-1] + 1)
    return make_tree(chosen, "grown tree")


# ---------------------------------------------------------------- strategies
STRATEGY_KINDS = ("none", "chain", "tree")


@dataclass(frozen=True)
class Strategy:
    """What one speculative step does: nothing (plain decoding), a chain of k draft tokens, or a tree;
    with or without the n-gram second stage that speeds up the draft's own drafting (lossless for the
    draft: the tokens it proposes are the same, only the number and width of its passes change).

    >>> Strategy(parse_tree("0,1,0.0"), stage2=True).describe()
    'tree 0,1,0.0 (3 nodes) +ngram'
    >>> Strategy.from_k(4).describe(), Strategy.from_k(0).kind
    ('chain k=4', 'none')
    """

    tree: Tree | None = None  # None: no speculation (k = 0)
    stage2: bool = False  # draft accelerated by the n-gram second stage

    def __post_init__(self):
        if self.tree is not None and self.tree.num_nodes == 0:
            object.__setattr__(self, "tree", None)  # chain(0) is no speculation
        if self.tree is None and self.stage2:
            raise PerfModelError("strategy: the n-gram second stage needs draft tokens (a chain or a tree)")

    @classmethod
    def from_k(cls, k: int, stage2: bool = False) -> "Strategy":
        """A chain of k draft tokens; k = 0 is no speculation."""
        if k < 0:
            raise PerfModelError(f"strategy: k must be >= 0, found {k}")
        return cls(chain(k) if k else None, stage2)

    @property
    def kind(self) -> str:
        if self.tree is None:
            return "none"
        return "chain" if self.tree.is_chain else "tree"

    @property
    def k(self) -> int:
        """Draft tokens on the longest path (the tree's depth; 0 for none): what a chain-only reader uses."""
        return 0 if self.tree is None else self.tree.depth

    @property
    def draft_tokens(self) -> int:
        """Draft tokens the target verifies per row (the tree's nodes; k for a chain; 0 for none)."""
        return 0 if self.tree is None else self.tree.num_nodes

    def describe(self, max_spec_chars: int | None = None) -> str:
        """'none', 'chain k=4', 'tree 0,1,0.0 (3 nodes)'; ' +ngram' when the second stage is on. The tree's
        full spec (parse_tree reads it back) unless `max_spec_chars` cuts it, with '...'."""
        if self.kind == "none":
            return "none"
        if self.kind == "chain":
            text = f"chain k={self.k}"
        else:
            spec = self.tree.spec()
            if max_spec_chars is not None and len(spec) > max_spec_chars:
                cut = spec[:max_spec_chars + 1].rfind(",")  # keep whole paths only
                spec = (spec[:cut] + ",...") if cut > 0 else "..."
            text = f"tree {spec} ({self.tree.num_nodes} nodes)"
        return text + (" +ngram" if self.stage2 else "")

    def to_json(self) -> dict:
        return {"kind": self.kind, "k": self.k, "tree": None if self.tree is None else self.tree.to_json(),
                "stage2": self.stage2}

    @classmethod
    def from_json(cls, obj, where: str = "strategy") -> "Strategy":
        """Read `to_json`'s object; kind and k must agree with the tree. Errors name `where`."""
        if not isinstance(obj, dict):
            raise PerfModelError(f"{where}: expected an object with kind, k, tree, stage2, found {obj!r}")
        for key in ("kind", "k", "tree", "stage2"):
            if key not in obj:
                raise PerfModelError(f"{where}.{key}: missing")
        kind, k, paths, stage2 = obj["kind"], obj["k"], obj["tree"], obj["stage2"]
        if kind not in STRATEGY_KINDS:
            raise PerfModelError(f"{where}.kind: {kind!r} is not one of {', '.join(STRATEGY_KINDS)}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise PerfModelError(f"{where}.k: expected an integer >= 0, found {k!r}")
        if not isinstance(stage2, bool):
            raise PerfModelError(f"{where}.stage2: expected true or false, found {stage2!r}")
        if paths is not None and not isinstance(paths, list):
            raise PerfModelError(f"{where}.tree: expected a list of rank lists or null, found {paths!r}")
        tree = None if paths is None else make_tree(paths, f"{where}.tree")
        if tree is None and stage2:
            raise PerfModelError(f"{where}.stage2: true needs a tree (no speculation has no drafting to speed up)")
        strategy = cls(tree, stage2)
        if strategy.kind != kind:
            raise PerfModelError(f"{where}.kind: {kind!r} does not match its tree, which is a {strategy.kind}")
        if strategy.k != k:
            raise PerfModelError(f"{where}.k: {k} does not match its tree's depth {strategy.k}")
        return strategy
