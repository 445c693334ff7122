"""Tree steps: draft a tree of continuations, verify every node in one target pass, keep one path.

A tree is data (`perfmodel.tree.Tree`: node 0 is the root, the row's last committed token; nodes 1..N
breadth-first); a node's children are its parent's top-c draft tokens (greedy) or c tokens sampled without
replacement. `draft_tree` scores the inner nodes with the draft, whose cache holds the committed tokens and
then one slot per inner node, one pass per level; with a second stage (an n-gram that guesses the draft's
tokens) it feeds every inner node at once and re-feeds from the first wrong guess, which changes the cost of
drafting, never its result. `verify_and_accept` runs one target pass under a tree mask and follows the
target (greedy) or recursive rejection sampling (exactly the target's distribution); `compact` moves the
accepted path's keys and values to the row's next slots.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from functools import lru_cache

import torch

from specbatch.perfmodel.tree import Tree, tree_buffers

from .kv_cache import KVCache, upload
from .sampling import Sampling, probabilities, sample, uniform


@dataclass(frozen=True)
class TreePlan:
    """A tree's index tensors on one device, built once per (tree, device)."""

    tree: Tree
    target_mask: torch.Tensor  # (N+1, N+1) ancestor-or-self
    descendants: torch.Tensor  # (N+1, N+1) float: target_mask transposed, for "all ancestors agree" products
    depths: torch.Tensor  # (N+1,)
    children: torch.Tensor  # (N+1, max_children) node ids by rank, -1 padded
    inner: tuple[int, ...]  # non-root inner nodes, breadth-first: the draft's in-flight slots
    inner_index: torch.Tensor  # (N+1,) 1 + slot of an inner node, 0 for the root, -1 for leaves
    inner_mask: torch.Tensor  # (I, I) ancestor-or-self among non-root inner nodes
    inner_offsets: torch.Tensor  # (I,) depth - 1: position relative to the draft's base
    inner_descendants: torch.Tensor  # (I, I) float: inner_mask transposed
    level_ends: tuple[int, ...]  # end slot of each depth's inner nodes (depth 1, 2, ...)
    by_depth: tuple[tuple[int, ...], ...]  # all nodes of depth 1, 2, ...
    parent_of: torch.Tensor  # (N+1,) parent node (root: 0)
    rank_of: torch.Tensor  # (N+1,)
    ancestor_at_depth: torch.Tensor  # (N+1, depth): a node's ancestor at depth 1..depth (itself at its own), 0 past it
    parent_list: tuple[int, ...]  # the same parents as Python ints, for host-side guessing
    depth_list: tuple[int, ...] = ()  # every node's depth (the root's 0), for guessing a level at a time
    _indices: dict = field(default_factory=dict, compare=False, repr=False)  # at() and children_of(), built once

    def at(self, nodes) -> torch.Tensor:
        """Node ids as an index tensor on the plan's device, built once per list of nodes (indexing a
        device tensor with a Python list would copy the list to the device, and wait, every time)."""
        key = ("at", tuple(nodes))
        if key not in self._indices:
            self._indices[key] = torch.tensor(key[1], dtype=torch.long, device=self.depths.device)
        return self._indices[key]

    def children_of(self, nodes) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(owner, rank, child): every child of `nodes`, as which of them it hangs from and its rank."""
        key = ("children", tuple(nodes))
        if key not in self._indices:
            triples = [(i, rank, child) for i, node in enumerate(nodes)
                       for rank, child in enumerate(self.tree.children[node])]
            columns = torch.tensor(triples, dtype=torch.long).reshape(-1, 3).T.to(self.depths.device)
            self._indices[key] = (columns[0], columns[1], columns[2])
        return self._indices[key]


@lru_cache(maxsize=64)
def plan_for(tree: Tree, device: torch.device) -> TreePlan:
    buffers = tree_buffers(tree)
    size = tree.num_nodes + 1
    children = torch.full((size, tree.max_children), -1, dtype=torch.long)
    for node, kids in enumerate(tree.children):
        children[node, :len(kids)] = torch.tensor(kids, dtype=torch.long)
    inner = tuple(node for node in tree.inner_nodes if node != 0)
    inner_index = torch.full((size,), -1, dtype=torch.long)
    inner_index[0] = 0
    for slot, node in enumerate(inner):
        inner_index[node] = slot + 1
    full_mask = torch.from_numpy(buffers.attention_mask)
    inner_t = torch.tensor(inner, dtype=torch.long)
    depths = torch.tensor(tree.depths, dtype=torch.long)
    level_ends = tuple(sum(1 for node in inner if tree.depths[node] <= d) for d in range(1, tree.depth + 1))
    by_depth = tuple(tuple(n for n in range(1, size) if tree.depths[n] == d) for d in range(1, tree.depth + 1))
    parents = torch.tensor([max(p, 0) for p in tree.parents], dtype=torch.long)
    ancestors = torch.zeros(size, max(tree.depth, 1), dtype=torch.long)
    for node in range(1, size):
        walk = node
        while walk > 0:
            ancestors[node, tree.depths[walk] - 1] = walk
            walk = tree.parents[walk]
    inner_mask = full_mask[inner_t][:, inner_t] if inner else torch.zeros(0, 0, dtype=torch.bool)
    ranks = torch.tensor([0] + [p[-1] for p in tree.paths], dtype=torch.long)
    to = dict(device=device)
    return TreePlan(
        tree=tree, target_mask=full_mask.to(**to), descendants=full_mask.T.float().to(**to),
        depths=depths.to(**to), children=children.to(**to), inner=inner, inner_index=inner_index.to(**to),
        inner_mask=inner_mask.to(**to), inner_descendants=inner_mask.T.float().to(**to),
        inner_offsets=(depths[inner_t] - 1).to(**to) if inner else torch.zeros(0, dtype=torch.long, **to),
        level_ends=level_ends, by_depth=by_depth, parent_of=parents.to(**to), rank_of=ranks.to(**to),
        ancestor_at_depth=ancestors.to(**to), parent_list=tuple(max(p, 0) for p in tree.parents),
        depth_list=tuple(tree.depths),
    )


@dataclass
class DraftedTree:
    tokens: torch.Tensor  # (b, N+1): root and every node's token
    unusable: torch.Tensor  # (b, N+1): children sampled past the end of the draft's support
    draft_probs: torch.Tensor | None  # (b, I+1, vocab) the draft's q at the root and each inner node
    rounds: int  # draft passes (or n-gram queries, for an n-gram draft)
    host_tokens: list[list[int]] | None = None  # the same tokens as Python ints, when drafted on the host


def pick_children(scores: torch.Tensor, count: int, sampling: Sampling, rng):
    """The `count` children of each scored node: top tokens (greedy) or a sample without replacement
    (Gumbel top-k: the same law as drawing one by one and removing each draw). `scores` are logits
    (greedy) or probabilities (sampling). Returns (tokens, unusable): a sampled child is unusable when
    the distribution had fewer than `count` tokens with probability > 0."""
    if sampling.greedy:
        return scores.topk(count, dim=-1).indices, None
    u = uniform(scores.shape, rng, scores.device).clamp_(1e-20, 1.0)
    keys = scores.log() - (-u.log()).log()
    values, picks = keys.topk(count, dim=-1)
    return picks, values == float("-inf")


class _TreeState:
    """What the draft knows about one tree while drafting it."""

    def __init__(self, plan: TreePlan, root_tokens: torch.Tensor, sampling: Sampling, vocab: int,
                 host_guesses: bool = False):
        """`host_guesses`: the second stage guesses on the host (a read-back a round: free on a CPU, where
        one look-up per node costs less than a device query per level); else on the device."""
        b, size = root_tokens.shape[0], plan.tree.num_nodes + 1
        device = root_tokens.device
        self.plan, self.sampling, self.host_guesses = plan, sampling, host_guesses
        self.tokens = torch.zeros(b, size, dtype=torch.long, device=device)
        self.tokens[:, 0] = root_tokens
        self.known = torch.zeros(b, size, dtype=torch.bool, device=device)
        self.known[:, 0] = True
        self.valid = torch.zeros(b, len(plan.inner) + 1, dtype=torch.bool, device=device)  # 0: root
        self.unusable = torch.zeros(b, size, dtype=torch.bool, device=device)
        self.probs = None if sampling.greedy else torch.zeros(b, len(plan.inner) + 1, vocab, device=device)

    def picks(self, nodes: list[int], scores: torch.Tensor, rng, is_probs: bool = False):
        """Candidate children of `nodes` from their scores (b, len(nodes), vocab): logits, or
        probabilities when `is_probs` (an n-gram draft). Returns (q or None, tokens, unusable)."""
        if self.sampling.greedy:
            return None, *pick_children(scores, self.plan.tree.max_children, self.sampling, rng)
        q = scores if is_probs else probabilities(scores, self.sampling)
        return (q, *pick_children(q, self.plan.tree.max_children, self.sampling, rng))

    def expand(self, nodes: list[int], picked, newly: torch.Tensor):
        """Nodes whose draft distribution just became known in rows `newly` (b, len(nodes)): store q and
        fix their children's tokens there, from `picked` (the output of `picks`)."""
        q, picks, unusable = picked
        plan = self.plan
        if q is not None:
            slots = plan.inner_index[plan.at(nodes)]
            self.probs[:, slots] = torch.where(newly[..., None], q, self.probs[:, slots])
        owner, rank, child_ids = plan.children_of(nodes)  # which of `nodes` each child hangs from, and its rank
        update = newly[:, owner]  # (b, m)
        self.tokens[:, child_ids] = torch.where(update, picks[:, owner, rank], self.tokens[:, child_ids])
        self.known[:, child_ids] |= update
        if unusable is not None:
            self.unusable[:, child_ids] = torch.where(update, unusable[:, owner, rank], self.unusable[:, child_ids])

    # the interface draft_tree drives (shared with _HostState)
    def absorb_root(self, root_logits: torch.Tensor, rng) -> None:
        b = root_logits.shape[0]
        self.valid[:, 0] = True
        picked = self.picks([0], root_logits[:, None], rng)
        self.expand([0], picked, torch.ones(b, 1, dtype=torch.bool, device=root_logits.device))

    def absorb(self, logits: torch.Tensor, fed: torch.Tensor, start: int, rng) -> None:
        """After a pass over inner slots start..start+n-1: a fed node is valid when its token and every fed
        ancestor's token were the draft's own (the ancestors before `start` are valid in every row); newly
        valid nodes fix their children. All levels at once: the draft's candidate children of every fed node
        are drawn first, then the validity of each node is an AND over its ancestors (one mask product)."""
        end = start + fed.shape[1]
        nodes = list(self.plan.inner[start:end])
        picked = self.picks(nodes, logits, rng)
        node_ids = self.plan.at(nodes)
        parents = self.plan.parent_of[node_ids]
        parent_slot = self.plan.inner_index[parents] - 1  # -1: the root
        fed_parent = parent_slot >= start
        position = (parent_slot - start).clamp(min=0)
        candidate = picked[1][:, position, self.plan.rank_of[node_ids]]  # (b, n): the child the parent's logits give
        known = self.known[:, node_ids]
        truth = torch.where(known | ~fed_parent, self.tokens[:, node_ids], candidate)
        wrong = (fed != truth) | (~known & ~fed_parent)
        # valid: no wrong token among a node's fed ancestors-or-self (a product with the transposed mask)
        valid = (wrong.float() @ self.plan.inner_descendants[start:end, start:end]) == 0
        own = self.plan.inner_index[node_ids]
        newly = valid & ~self.valid[:, own]
        self.valid[:, own] |= valid
        self.expand(nodes, picked, newly)  # a no-op in rows where nothing became valid

    def guess(self, stage2, before_root: torch.Tensor, nodes: list[int]) -> None:
        """The second stage's guesses (as _guess_rows) on the device, a level at a time (a guess needs its
        parent's token, guessed or not): its device queries, nothing read back. With `host_guesses`, on
        the host instead (_guess_rows)."""
        if self.host_guesses:
            tokens = self.tokens.tolist()
            _guess_rows(self.plan, tokens, self.known.tolist(), stage2, before_root.tolist(), nodes)
            self.tokens = upload(tokens, self.tokens.device)
            return
        plan, b = self.plan, self.tokens.shape[0]
        for depth in sorted({plan.depth_list[node] for node in nodes}):
            level = [node for node in nodes if plan.depth_list[node] == depth]
            ids = plan.at(level)
            parents = [plan.parent_list[node] for node in level]
            top = stage2.top_tokens(_context(plan, self, before_root, parents), plan.tree.max_children)
            guessed = top.view(b, len(level), -1).gather(-1, plan.rank_of[ids].expand(b, -1)[..., None])[..., 0]
            self.tokens[:, ids] = torch.where(self.known[:, ids], self.tokens[:, ids], guessed)

    def fed_tokens(self, nodes: list[int]) -> torch.Tensor:
        return self.tokens[:, self.plan.at(nodes)]

    def first_invalid(self) -> int | None:
        """The first inner slot that is not valid in some row; None when all are valid (one read-back)."""
        invalid = (~self.valid[:, 1:]).any(0)
        slots = invalid.shape[0]
        first = int(torch.where(invalid, torch.arange(slots, device=invalid.device), slots).min()) if slots else 0
        return None if first == slots else first

    def result(self, rounds: int) -> DraftedTree:
        return DraftedTree(self.tokens, self.unusable, self.probs, rounds)


class _HostState:
    """The same bookkeeping as _TreeState for GREEDY drafting, on Python ints: at small batch sizes a
    step's cost is dominated by the number of small tensor operations, not their size, and here each
    round costs one top-k and one transfer (plus the pass). Results are identical to _TreeState's."""

    def __init__(self, plan: TreePlan, root_tokens: torch.Tensor):
        size = plan.tree.num_nodes + 1
        self.plan, self.device = plan, root_tokens.device
        self.tokens = [[token] + [0] * (size - 1) for token in root_tokens.tolist()]
        self.known = [[True] + [False] * (size - 1) for _ in self.tokens]
        self.valid = [[True] + [False] * len(plan.inner) for _ in self.tokens]  # slot 0: the root
        self.slot = [-1] * size  # inner slot of a node (root 0, leaves -1), as plan.inner_index
        for index, node in enumerate(plan.inner):
            self.slot[node] = index + 1
        self.slot[0] = 0

    def _expand(self, row: int, node: int, top: list[int]) -> None:
        line, sure = self.tokens[row], self.known[row]
        for rank, child in enumerate(self.plan.tree.children[node]):
            line[child], sure[child] = top[rank], True

    def absorb_root(self, root_logits: torch.Tensor, rng) -> None:
        count = self.plan.tree.max_children
        for row, top in enumerate(root_logits.topk(count, dim=-1).indices.tolist()):
            self._expand(row, 0, top)

    def absorb(self, logits: torch.Tensor, fed: torch.Tensor, start: int, rng) -> None:
        plan, count = self.plan, self.plan.tree.max_children
        nodes = plan.inner[start:start + fed.shape[1]]
        parent = plan.parent_list
        tops = logits.topk(count, dim=-1).indices.tolist()  # (b, n, count)
        for row, (line, sure, valid, fed_row, top_row) in enumerate(
                zip(self.tokens, self.known, self.valid, fed.tolist(), tops)):
            for j, node in enumerate(nodes):  # breadth-first: a parent is settled before its children
                own = self.slot[node]
                if valid[own]:
                    continue
                if valid[self.slot[parent[node]]] and sure[node] and fed_row[j] == line[node]:
                    valid[own] = True
                    self._expand(row, node, top_row[j])

    def guess(self, stage2, before_root: torch.Tensor, nodes: list[int]) -> None:
        _guess_rows(self.plan, self.tokens, self.known, stage2, before_root.tolist(), nodes)

    def fed_tokens(self, nodes: list[int]) -> torch.Tensor:
        return torch.tensor([[line[node] for node in nodes] for line in self.tokens], device=self.device)

    def first_invalid(self) -> int | None:
        for index in range(1, len(self.plan.inner) + 1):
            if not all(valid[index] for valid in self.valid):
                return index - 1
        return None

    def result(self, rounds: int) -> DraftedTree:
        tokens = torch.tensor(self.tokens, dtype=torch.long, device=self.device)
        return DraftedTree(tokens, torch.zeros_like(tokens, dtype=torch.bool), None, rounds, self.tokens)


def _context(plan: TreePlan, state: _TreeState, before_root: torch.Tensor, nodes: list[int]) -> torch.Tensor:
    """(b * len(nodes), 2): the two tokens before each node's next token (grandparent... parent = node)."""
    node_t = plan.at(nodes)
    parent = plan.parent_of[node_t]
    last = state.tokens[:, node_t]
    previous = torch.where(node_t > 0, state.tokens[:, parent], before_root[:, None])
    return torch.stack([previous, last], dim=-1).reshape(-1, 2)


def level_starts(plan: TreePlan) -> list[int]:
    """The first inner slot of every level of inner nodes below the root: without a second stage the
    draft feeds one level per pass, each node its own pick, so every fed node is valid.

    >>> from specbatch.perfmodel.tree import parse_tree
    >>> level_starts(plan_for(parse_tree("0,0.0,0.1,0.0.0,0.0.0.0"), torch.device("cpu")))  # inner: 0, 0.0, 0.0.0
    [0, 1, 2]
    """
    return [start for start in dict.fromkeys((0, *plan.level_ends)) if start < len(plan.inner)]


def _forward(forward, model, inputs, cache, attention=None, last=None):
    """One draft pass, through `forward` when the caller gave one."""
    if forward is None:
        return model(inputs, cache, attention, last)
    return forward(model, inputs, cache, attention, last)


def _guess_rows(plan: TreePlan, tokens: list[list[int]], known: list[list[bool]], stage2, before: list[int],
                nodes: list[int]) -> None:
    """Give `nodes` (inner, breadth-first) whose tokens are not known yet the second stage's guess of the
    draft's rank-r child, from the two tokens before it on its path (guessed ones included), in place.
    On the host with Python ints: one transfer per round instead of several small ops per level."""
    parent, rank = plan.parent_list, plan.tree.ranks
    for row, (line, sure) in enumerate(zip(tokens, known)):
        for node in nodes:
            if not sure[node]:
                up = parent[node]
                line[node] = stage2.top_tokens_host(line[parent[up]] if up > 0 else before[row], line[up])[rank[node]]


def ngram_tree(plan: TreePlan, ngram, tokens: torch.Tensor, committed: torch.Tensor, sampling: Sampling,
               rng) -> DraftedTree:
    """Draft a tree with an n-gram model alone: one batched query per level of inner nodes (a round each)."""
    b = tokens.shape[0]
    rows = torch.arange(b, device=tokens.device)
    state = _TreeState(plan, tokens[rows, committed - 1], sampling, ngram.vocab_size)
    before_root = torch.where(committed >= 2, tokens[rows, (committed - 2).clamp(min=0)], -1)
    everyone = lambda n: torch.ones(b, n, dtype=torch.bool, device=tokens.device)  # noqa: E731
    levels = [[0]] + [[n for n in plan.by_depth[d] if plan.tree.children[n]] for d in range(len(plan.by_depth))]
    rounds = 0
    for nodes in levels:
        if not nodes:
            break
        context = _context(plan, state, before_root, nodes)
        if sampling.greedy:  # the n-gram's own ranking gives the children directly
            top = ngram.top_tokens(context, plan.tree.max_children).view(b, len(nodes), -1)
            state.expand(nodes, (None, top, None), everyone(len(nodes)))
        else:
            q = ngram.distributions(context).view(b, len(nodes), -1)
            state.expand(nodes, state.picks(nodes, q, rng, is_probs=True), everyone(len(nodes)))
        rounds += 1
    return DraftedTree(state.tokens, state.unusable, state.probs, rounds)


def verify_and_accept(plan: TreePlan, drafted: DraftedTree, target_logits: torch.Tensor, sampling: Sampling, rng):
    """Accepted path (b, depth) of node ids, how many nodes each row accepted (b,), and the target's
    token after them (b,). `target_logits` (b, N+1, vocab) come from one pass over the tree."""
    b = target_logits.shape[0]
    device = target_logits.device
    rows = torch.arange(b, device=device)
    depth = plan.tree.depth
    path = torch.zeros(b, depth, dtype=torch.long, device=device)
    accepted = torch.zeros(b, dtype=torch.long, device=device)
    current = torch.zeros(b, dtype=torch.long, device=device)
    alive = torch.ones(b, dtype=torch.bool, device=device)
    if sampling.greedy and drafted.host_tokens is not None:
        return _accept_greedy_host(plan, drafted.host_tokens, target_logits.argmax(-1).tolist(), device)
    if sampling.greedy:
        # a node can be accepted when its token is the target's argmax at its parent; the accepted path
        # is the deepest node whose whole ancestry can (greedy siblings differ, so there is one path)
        choice = target_logits.argmax(-1)  # (b, N+1)
        agrees = drafted.tokens == choice[:, plan.parent_of]
        agrees[:, 0] = True
        reachable = ((~agrees).float() @ plan.descendants) == 0  # (b, N+1)
        deepest = torch.where(reachable, plan.depths, -1).argmax(1)
        accepted = plan.depths[deepest]
        path = plan.ancestor_at_depth[deepest]
        return path, accepted, choice.gather(1, deepest[:, None]).squeeze(1)
    p_all = probabilities(target_logits, sampling)
    bonus = torch.zeros(b, dtype=torch.long, device=device)
    for level in range(depth + 1):
        p = p_all[rows, current]
        kids = plan.children[current] if level < depth else torch.full((b, 1), -1, dtype=torch.long, device=device)
        q = drafted.draft_probs[rows, plan.inner_index[current].clamp(min=0)]
        moved = torch.zeros(b, dtype=torch.bool, device=device)
        nxt = current.clone()
        for j in range(kids.shape[1]):
            child = kids[:, j].clamp(min=0)
            # every rank is tried in every row (a row that cannot try it changes nothing): no early exit
            # that would read the device back
            can = alive & ~moved & (kids[:, j] >= 0) & ~drafted.unusable.gather(1, child[:, None]).squeeze(1)
            x = drafted.tokens.gather(1, child[:, None])
            px, qx = p.gather(1, x).squeeze(1), q.gather(1, x).squeeze(1)
            ok = can & (uniform((b,), rng, device) * qx < px)
            nxt = torch.where(ok, child, nxt)
            moved |= ok
            rejected = (can & ~ok)[:, None]
            residual = (p - q).clamp(min=0.0)
            mass = residual.sum(-1, keepdim=True)
            p = torch.where(rejected, torch.where(mass > 0, residual / mass.clamp_min(1e-30), p), p)
            q_left = q.scatter(1, x, 0.0)
            q = torch.where(rejected, q_left / q_left.sum(-1, keepdim=True).clamp_min(1e-30), q)
        stop = alive & ~moved
        bonus = torch.where(stop, sample(p, rng), bonus)
        if level < depth:
            path[:, level] = torch.where(moved, nxt, 0)
        accepted += moved.long()
        current = nxt
        alive = moved
    return path, accepted, bonus


def _accept_greedy_host(plan: TreePlan, tokens: list[list[int]], choice: list[list[int]], device):
    """verify_and_accept's greedy rule on Python ints: follow the child equal to the target's argmax."""
    children, depth = plan.tree.children, plan.tree.depth
    paths, accepted, bonus = [], [], []
    for line, wanted in zip(tokens, choice):
        node, path = 0, []
        while True:
            nxt = next((c for c in children[node] if line[c] == wanted[node]), None)
            if nxt is None:
                break
            path.append(nxt)
            node = nxt
        accepted.append(len(path))
        bonus.append(wanted[node])
        paths.append(path + [0] * (depth - len(path)))
    as_tensor = functools.partial(torch.tensor, dtype=torch.long, device=device)
    return as_tensor(paths), as_tensor(accepted), as_tensor(bonus)


def compact(cache: KVCache, base: torch.Tensor, source_slots: torch.Tensor, keep: torch.Tensor) -> None:
    """Move the kept entries of each row to contiguous slots: slot base + i takes base + source_slots[:, i]
    where keep[:, i] (a prefix of each row). Sources never lie before their destinations."""
    if source_slots.shape[1] == 0:
        return
    rows = torch.arange(cache.batch_size, device=base.device)[:, None]
    steps = torch.arange(source_slots.shape[1], device=base.device)
    destination = base[:, None] + steps
    source = torch.where(keep, base[:, None] + source_slots, destination)
    cache.keys[:, rows, destination] = cache.keys[:, rows, source]
    cache.values[:, rows, destination] = cache.values[:, rows, source]
