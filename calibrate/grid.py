"""The calibration grid: which forward passes and which steps are timed.

The runtime's step with k >= 1 is a draft pass of n0 tokens (n0 = 1, or 2 when some row accepted all
k drafts last step and the draft must catch up the bonus token), then k - 1 draft passes of 1 token,
then one target pass of k + 1 tokens; k = 0 is one target pass of 1 token. So the grid times the
target at n = 1..max_k+1 and the draft at n = 1 and 2, for every batch size b and context length L,
and the per-step overhead for every (b, k). Nothing else is needed to predict a step.
"""
from __future__ import annotations

from dataclasses import dataclass

from perfmodel.profile import Grid
from runtime.config import ModelConfig

from .errors import CalibrationError

DRAFT_NEW_TOKENS = (1, 2)  # the 1-token pass and the 2-token catch-up pass

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


def make_grid(batch_sizes, context_lens, max_k: int) -> Grid:
    """A sorted, de-duplicated grid; every value is checked to be a positive integer (context >= 1)."""
    for option, values in (("--batch-sizes", batch_sizes), ("--context-lens", context_lens)):
        if not values:
            raise CalibrationError(f"{option}: needs at least one value")
        for value in values:
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise CalibrationError(f"{option}: {value!r} is not a positive integer")
    if isinstance(max_k, bool) or not isinstance(max_k, int) or max_k < 1:
        raise CalibrationError(f"--max-k: must be a positive integer (the longest speculation timed), got {max_k!r}")
    return Grid(batch_sizes=tuple(sorted(set(batch_sizes))), context_lens=tuple(sorted(set(context_lens))),
                max_k=max_k, target_new_tokens=tuple(range(1, max_k + 2)), draft_new_tokens=DRAFT_NEW_TOKENS)


def check_grid_fits(grid: Grid, target: ModelConfig, draft: ModelConfig) -> None:
    """The longest context plus the verify pass (max_k + 1 tokens) must fit both models' positions."""
    needed = max(grid.context_lens) + grid.max_k + 1
    for role, config in (("target", target), ("draft", draft)):
        if needed > config.max_position_embeddings:
            raise CalibrationError(
                f"--context-lens: context {max(grid.context_lens)} + max_k {grid.max_k} + 1 = {needed} positions "
                f"exceeds the {role}'s maximum of {config.max_position_embeddings}; lower --context-lens or --max-k")


def timing_points(grid: Grid) -> list[TimingPoint]:
    """Draft first (cheap), then target; within a role, points sharing (L, b) are adjacent so one
    KV cache serves all their new-token counts."""
    points = []
    for role, new_tokens in (("draft", grid.draft_new_tokens), ("target", grid.target_new_tokens)):
        for context_len in grid.context_lens:
            for batch_size in grid.batch_sizes:
                points.extend(TimingPoint(role, batch_size, n, context_len) for n in new_tokens)
    return points


def overhead_points(grid: Grid) -> list[OverheadPoint]:
    return [OverheadPoint(b, k) for b in grid.batch_sizes for k in range(grid.max_k + 1)]


def merge_grids(old: Grid, new: Grid) -> Grid:
    """The grid of a resumed profile: the union of what was measured and what is asked now."""
    if old.max_k != new.max_k:
        raise CalibrationError(f"--resume: the profile was measured with --max-k {old.max_k}, not {new.max_k}")
    return make_grid(old.batch_sizes + new.batch_sizes, old.context_lens + new.context_lens, new.max_k)
