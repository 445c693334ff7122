"""In-situ timing: generate with a fixed chain k at one batch size on held-out prompts and time every
forward pass and every step (`calibrate.pass_clock.StepRecorder`).

Each point (b, k) is generated once per sweep, the sweeps spread over the whole stage, and within a sweep
the ks of one batch size run in lockstep on the same prompts (calibrate.lockstep): a slow spell of the
machine spoils one generation, not one point. EOS is ignored, a warm-up generation precedes each one and
only full-batch steps count. Prompts follow the acceptance ones, spread from shortest to longest over the
sweeps; random weights run random token ids of such lengths at the profile's given acceptance.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import groupby
from typing import Sequence

import numpy as np

from specbatch.perfmodel.profile.insitu import InSituPassRow, InSituStepRow, pass_rows, step_row
from specbatch.perfmodel.profile import Grid
from specbatch.runtime.generator import SpeculativeGenerator
from specbatch.runtime.policy import FixedK
from specbatch.runtime.sampling import Sampling

from .lockstep import run_lockstep
from .pass_clock import StepRecorder


WARMUP_TOKENS = 8  # new tokens per row of a point's warm-up generation


@dataclass(frozen=True)
class InSituPoint:
    """One generation: chain length k at batch size b, in sweep `sweep` of the stage."""

    batch_size: int
    k: int
    sweep: int = 1


@dataclass(frozen=True)
class InSituResult:
    """What one generation of a point adds to the profile."""

    passes: tuple[InSituPassRow, ...]
    steps: tuple[InSituStepRow, ...]  # the generation's full-batch steps (one row)


def insitu_points(grid: Grid, ks: Sequence[int], every_other_batch_size: bool, sweeps: int = 1) -> list[InSituPoint]:
    """Every chosen batch size x every k of `ks` up to the grid's max_k, once per sweep, in the order they
    are measured: every sweep in the same order, so a point's generations lie one whole sweep apart, and
    the ks of one batch size side by side (a slow spell then shifts them together, and the choice between
    them, which is what the table is made of, less). With `every_other_batch_size` the grid's 1st, 3rd, ...
    batch sizes (quick: 1, 4, 16 of 1, 2, 4, 8, 16) and always its largest."""
    if sweeps < 1:
        raise ValueError(f"in-situ sweeps must be >= 1, found {sweeps}")
    sizes = list(grid.batch_sizes)
    if every_other_batch_size:
        sizes = sorted(set(sizes[::2]) | {sizes[-1]})
    cells = [(b, k) for b in sizes for k in sorted(set(ks)) if k <= grid.max_k]
    return [InSituPoint(b, k, sweep) for sweep in range(1, sweeps + 1) for b, k in cells]


def spread_batch(prompts: Sequence[list[int]], batch_size: int, sweep: int, sweeps: int) -> list[list[int]]:
    """The batch of sweep `sweep` of `sweeps`: `batch_size` consecutive prompts of the length-sorted list,
    starting (sweep - 1) / (sweeps - 1) of the way from the shortest to the longest (the middle for one
    sweep; cycled when there are fewer prompts than a batch).

    >>> [spread_batch([[1] * 5, [1], [1] * 3], 1, s, 2) for s in (1, 2)]
    [[[1]], [[1, 1, 1, 1, 1]]]
    """
    ordered = sorted(prompts, key=len)
    last = max(0, len(ordered) - batch_size)
    start = round(last * (sweep - 1) / (sweeps - 1)) if sweeps > 1 else last // 2
    return [list(ordered[(start + row) % len(ordered)]) for row in range(batch_size)]


def random_prompts(vocab_size: int, count: int, shortest: int, longest: int, seed: int = 0) -> list[list[int]]:
    """`count` prompts of random token ids, their lengths evenly spread from `shortest` to `longest`.

    >>> [len(p) for p in random_prompts(100, 3, 4, 8)]
    [4, 6, 8]
    """
    if not 1 <= shortest <= longest:
        raise ValueError(f"need 1 <= shortest <= longest, got {shortest}, {longest}")
    rng = np.random.default_rng(seed)
    lengths = np.linspace(shortest, longest, count).round().astype(int)
    return [rng.integers(0, vocab_size, size=int(n)).tolist() for n in lengths]


def insitu_groups(points: Sequence[InSituPoint],
                  lockstep_ks: dict[int, list[list[int]]] | None = None) -> list[list[InSituPoint]]:
    """Consecutive points of one batch size and sweep, the ks generated together in lockstep; with
    `lockstep_ks` (calibrate.memory: batch size -> groups of ks that fit in memory together) split into
    those groups.

    >>> [[p.k for p in group] for group in insitu_groups([InSituPoint(1, 0), InSituPoint(1, 2), InSituPoint(2, 0)])]
    [[0, 2], [0]]
    >>> [[p.k for p in g] for g in insitu_groups([InSituPoint(1, k) for k in (0, 2, 3)], {1: [[0], [2, 3]]})]
    [[0], [2, 3]]
    """
    groups = [list(group) for _, group in groupby(points, key=lambda point: (point.batch_size, point.sweep))]
    if lockstep_ks is None:
        return groups
    split = []
    for group in groups:
        planned = lockstep_ks.get(group[0].batch_size, [[point.k for point in group]])
        split.extend(part for ks in planned if (part := [point for point in group if point.k in ks]))
    return split


def measure_insitu(generator: SpeculativeGenerator, points: Sequence[InSituPoint], prompts: Sequence[list[int]],
                   new_tokens: int, sweeps: int, seed: int = 0,
                   synthetic_acceptance: tuple[float, ...] | None = None) -> list[InSituResult | None]:
    """The rows of one generation per point, for points of one batch size and sweep (`insitu_groups`),
    generated on the same prompts in lockstep (calibrate.lockstep: a step of each k in turn, so the ks
    the table chooses between meet the same spells of the machine); a point's entry is None when no
    full-batch step ran (too few new tokens). `synthetic_acceptance` (random weights:
    the given per-position acceptance) accepts draft tokens with those probabilities instead of by
    comparison, so the steps run the pass mix the model predicts for that acceptance."""
    b, sweep = points[0].batch_size, points[0].sweep
    if any((p.batch_size, p.sweep) != (b, sweep) for p in points):
        raise ValueError("in-situ points generated together must share a batch size and a sweep")
    batch = spread_batch(prompts, b, sweep, sweeps)
    # warm-up: a few steps meet every shape of a point (the first use of a shape pays the allocator)
    # with CUDA graphs, a full-length one: the timed generation then finds its caches and graphs (none captured)
    warmup_tokens = new_tokens if generator.cuda_graphs else min(new_tokens, WARMUP_TOKENS)
    for point in points:
        generator.generate(batch, warmup_tokens, FixedK(point.k), Sampling(), seed, synthetic_acceptance)
    recorders = {point: StepRecorder(generator.device) for point in points}
    run_lockstep({point: generator.generation(batch, new_tokens, FixedK(point.k), Sampling(), seed + sweep,
                                              synthetic_acceptance, observer=recorders[point])
                  for point in points})
    return [_rows(point, recorders[point]) for point in points]


def _rows(point: InSituPoint, recorder: StepRecorder) -> InSituResult | None:
    b = point.batch_size
    full = [i for i, record in enumerate(recorder.steps) if record.batch_size == b]
    if not full:
        return None
    records = [(role, *record) for role, rows in recorder.passes.items() for record in rows]
    step = step_row([recorder.step_s[i] for i in full], [recorder.steps[i].context_len for i in full],
                    sum(recorder.steps[i].tokens for i in full), b, point.k, point.sweep)
    return InSituResult(pass_rows(records, b, point.k, sweep=point.sweep), (step,))
