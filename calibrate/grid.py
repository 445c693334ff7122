"""The calibration grid: which forward passes and which steps are timed.

It mirrors the runtime's schedule: a chain step of k >= 1 is a draft pass of 1 or 2 tokens, k - 1 draft
passes of 1 and a target pass of k + 1, so the target is timed at n = 1..max_k+1 and the draft at n = 1, 2
for every batch size b and context length L, plus the step overhead of every (b, k). Tree steps are wider
(a tree of N nodes verifies N + 1 tokens per row) and pay at small batch sizes, so WIDE passes are added
only at b <= WIDE_MAX_BATCH, within the models' positions; `new_tokens_at` says which n each b times.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from specbatch.perfmodel.profile import Grid
from specbatch.runtime.config import ModelConfig

from .errors import CalibrationError

DRAFT_NEW_TOKENS = (1, 2)  # the 1-token pass and the 2-token catch-up pass
TARGET_WIDE_NEW_TOKENS = (16, 32, 64)  # tree verify passes: N + 1 tokens per row, N up to 64 nodes
DRAFT_WIDE_NEW_TOKENS = (4, 8, 16, 32, 64)  # levels of inner nodes; staged rounds: catch-up + inner nodes
WIDE_MAX_BATCH = 4  # wide passes are timed at batch sizes up to this: where trees can pay

# Sized so that calibrating the bundled demo pair on a 2-core CPU takes about a minute: powers of two
# up to 32 show the fall of the best k with the batch; two context lengths fix a linear term in L.
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
DEFAULT_CONTEXT_LENS = (128, 512)
DEFAULT_MAX_K = 8  # the range of Su et al. (k = 0..8)
# --quick: a coarser grid for a first look or a smoke test (about 15 s on the demo pair).
QUICK_BATCH_SIZES = (1, 2, 4, 8, 16)  # five sizes: enough draft rows (5 x 2 widths) for `fit`
QUICK_CONTEXT_LENS = (256,)


@dataclass(frozen=True)
class TimingPoint:
    model: str  # target | draft
    batch_size: int
    new_tokens: int
    context_len: int


@dataclass(frozen=True)
class OverheadPoint:
    batch_size: int
    k: int


@dataclass(frozen=True)
class TreeOverheadPoint:
    """A tree step's overhead: the tree grown to `tree_nodes` nodes from the measured rank acceptance
    (its depth, the row's k, is known once that is measured)."""

    batch_size: int
    tree_nodes: int
    stage2: bool


def make_grid(batch_sizes, context_lens, max_k: int, head: bool = False) -> Grid:
    """A sorted, de-duplicated grid; every value is checked to be a positive integer (context >= 1). `head`: the
    draft is a head, whose chain passes read 1 token (drafting) or k + 1 (the verified positions): 1..max_k+1 at
    every b, and a tree's levels the wide widths (at small b, as a draft model's)."""
    for option, values in (("--batch-sizes", batch_sizes), ("--context-lens", context_lens)):
        if not values:
            raise CalibrationError(f"{option}: needs at least one value")
        for value in values:
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise CalibrationError(f"{option}: {value!r} is not a positive integer")
    if isinstance(max_k, bool) or not isinstance(max_k, int) or max_k < 1:
        raise CalibrationError(f"--max-k: must be a positive integer (the longest speculation timed), got {max_k!r}")
    target_wide = tuple(n for n in TARGET_WIDE_NEW_TOKENS if n > max_k + 1)
    draft_chain = tuple(range(1, max_k + 2)) if head else DRAFT_NEW_TOKENS
    draft_wide = tuple(n for n in DRAFT_WIDE_NEW_TOKENS if n > max(draft_chain))
    return Grid(batch_sizes=tuple(sorted(set(batch_sizes))), context_lens=tuple(sorted(set(context_lens))),
                max_k=max_k, target_new_tokens=tuple(range(1, max_k + 2)) + target_wide,
                draft_new_tokens=draft_chain + draft_wide)


def draft_chain_tokens(grid: Grid) -> int:
    """The widest draft pass a chain step makes: a draft model's catch-up (2 tokens), a head's pass over the
    verified positions (max_k + 1: a head's grid times every width 1..max_k+1, `make_grid`, where a draft
    model's jumps from 2 to the wide 4)."""
    chain = tuple(range(1, grid.max_k + 2))
    head = grid.draft_new_tokens[:len(chain)] == chain and grid.max_k + 1 > max(DRAFT_NEW_TOKENS)
    return grid.max_k + 1 if head else max(DRAFT_NEW_TOKENS)


def check_grid_fits(grid: Grid, target: ModelConfig, draft: ModelConfig) -> None:
    """The longest context plus the verify pass (max_k + 1 tokens) must fit both models' positions."""
    needed = max(grid.context_lens) + grid.max_k + 1
    for role, config in (("target", target), ("draft", draft)):
        if needed > config.max_position_embeddings:
            raise CalibrationError(
                f"--context-lens: context {max(grid.context_lens)} + max_k {grid.max_k} + 1 = {needed} positions "
                f"exceeds the {role}'s maximum of {config.max_position_embeddings}; lower --context-lens or --max-k")


def fit_wide_passes(grid: Grid, target: ModelConfig, draft: ModelConfig) -> Grid:
    """The grid without the wide passes that would exceed either model's positions on top of the
    longest context (the chain passes are checked by `check_grid_fits`, which refuses instead)."""
    room = min(target.max_position_embeddings, draft.max_position_embeddings) - max(grid.context_lens)
    keep = lambda values, chain: tuple(n for n in values if n <= chain or n <= room)  # noqa: E731
    return replace(grid, target_new_tokens=keep(grid.target_new_tokens, grid.max_k + 1),
                   draft_new_tokens=keep(grid.draft_new_tokens, draft_chain_tokens(grid)))


def wide_batch_sizes(grid: Grid) -> tuple[int, ...]:
    """Batch sizes whose wide passes are timed: those <= WIDE_MAX_BATCH, or the smallest one."""
    return tuple(b for b in grid.batch_sizes if b <= max(WIDE_MAX_BATCH, min(grid.batch_sizes)))


def new_tokens_at(grid: Grid, role: str, batch_size: int) -> tuple[int, ...]:
    """The new-token counts timed for `role` at `batch_size`: the chain's always, wide ones at small b."""
    values, chain = ((grid.target_new_tokens, grid.max_k + 1) if role == "target"
                     else (grid.draft_new_tokens, draft_chain_tokens(grid)))
    wide = batch_size in wide_batch_sizes(grid)
    return tuple(n for n in values if n <= chain or wide)


def timing_points(grid: Grid) -> list[TimingPoint]:
    """Draft first (cheap), then target; within a role, points sharing (L, b) are adjacent so one
    KV cache serves all their new-token counts."""
    points = []
    for role in ("draft", "target"):
        for context_len in grid.context_lens:
            for batch_size in grid.batch_sizes:
                points.extend(TimingPoint(role, batch_size, n, context_len)
                              for n in new_tokens_at(grid, role, batch_size))
    return points


def overhead_points(grid: Grid) -> list[OverheadPoint]:
    return [OverheadPoint(b, k) for b in grid.batch_sizes for k in range(grid.max_k + 1)]


def tree_overhead_points(grid: Grid, tree_nodes: tuple[int, ...], stage2: bool) -> list[TreeOverheadPoint]:
    """Every batch size x tree size, without the second stage and, when there is one, with it."""
    flags = (False, True) if stage2 else (False,)
    return [TreeOverheadPoint(b, n, flag) for b in grid.batch_sizes for n in tree_nodes for flag in flags]


def merge_grids(old: Grid, new: Grid) -> Grid:
    """The grid of a resumed profile: the union of what was measured and what is asked now (an older
    profile without wide passes gains them; its measured points are kept)."""
    if old.max_k != new.max_k:
        raise CalibrationError(f"--resume: the profile was measured with --max-k {old.max_k}, not {new.max_k}")
    union = lambda a, b: tuple(sorted(set(a) | set(b)))  # noqa: E731
    return Grid(batch_sizes=union(old.batch_sizes, new.batch_sizes),
                context_lens=union(old.context_lens, new.context_lens), max_k=new.max_k,
                target_new_tokens=union(old.target_new_tokens, new.target_new_tokens),
                draft_new_tokens=union(old.draft_new_tokens, new.draft_new_tokens))
