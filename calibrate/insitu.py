"""In-situ timing: generate with a fixed chain k at one batch size on held-out prompts, and time every
forward pass (`calibrate.pass_clock.PassClock`) and every step (the generator's own step clock).

One point (b, k) is one short warm-up generation (discarded: the first use of a batch size's shapes pays
the allocator) and then `rounds` timed generations with EOS ignored, so every row runs `new_tokens` tokens.
Only full-batch steps count (the batch thins out in the last steps), and only their passes. The rows
are `perfmodel.insitu`'s: passes grouped by width and context, one step row per round.

The prompts are held out from the acceptance measurement (the prompts after the ones it used), sorted
by length, and the rounds take b consecutive prompts spread from the shortest to the longest: the
context a pass pays for is the longest row's, which grows with b when prompts are drawn at random, so
spreading them gives every batch size short and long contexts and lets the fit tell the context's cost
from the batch size's.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from perfmodel.insitu import InSituPassRow, InSituStepRow, pass_rows, step_row
from perfmodel.profile import Grid
from runtime.generator import SpeculativeGenerator
from runtime.policy import FixedK
from runtime.sampling import Sampling

from .pass_clock import PassClock


WARMUP_TOKENS = 8  # new tokens per row of a point's warm-up generation


@dataclass(frozen=True)
class InSituPoint:
    batch_size: int
    k: int


@dataclass(frozen=True)
class InSituResult:
    """What one point adds to the profile."""

    passes: tuple[InSituPassRow, ...]
    steps: tuple[InSituStepRow, ...]  # one per round (rounds with the same mean context pooled)


def insitu_points(grid: Grid, ks: Sequence[int], every_other_batch_size: bool) -> list[InSituPoint]:
    """Every chosen batch size x every k of `ks` up to the grid's max_k; with `every_other_batch_size`
    the grid's 1st, 3rd, ... batch sizes (quick: 1, 4, 16 of 1, 2, 4, 8, 16) and always its largest."""
    sizes = list(grid.batch_sizes)
    if every_other_batch_size:
        sizes = sorted(set(sizes[::2]) | {sizes[-1]})
    return [InSituPoint(b, k) for b in sizes for k in sorted(set(ks)) if k <= grid.max_k]


class _ContextLog:
    """FixedK(k) that notes the context the generator asks it about at every step (the longest row's)."""

    def __init__(self, k: int):
        self.policy, self.contexts = FixedK(k), []

    @property
    def max_k(self) -> int:
        return self.policy.max_k

    def __call__(self, batch_size: int, context_len: int) -> int:
        self.contexts.append(context_len)
        return self.policy(batch_size, context_len)

    def describe(self) -> str:
        return self.policy.describe()


def spread_batches(prompts: Sequence[list[int]], batch_size: int, rounds: int) -> list[list[list[int]]]:
    """`rounds` batches of `batch_size` consecutive prompts of the length-sorted list, from the shortest to
    the longest (cycled when there are fewer prompts than a batch).

    >>> spread_batches([[1] * 5, [1], [1] * 3], 1, 2)
    [[[1]], [[1, 1, 1, 1, 1]]]
    """
    ordered = sorted(prompts, key=len)
    last = max(0, len(ordered) - batch_size)
    starts = [round(last * r / (rounds - 1)) if rounds > 1 else last // 2 for r in range(rounds)]
    return [[list(ordered[(start + row) % len(ordered)]) for row in range(batch_size)] for start in starts]


def measure_insitu(generator: SpeculativeGenerator, point: InSituPoint, prompts: Sequence[list[int]],
                   new_tokens: int, rounds: int, seed: int = 0) -> InSituResult | None:
    """The point's rows; None when no full-batch step had its passes timed (too few new tokens)."""
    b = point.batch_size
    batches = spread_batches(prompts, b, rounds)
    # warm-up: a few steps meet every shape of the point (the first use of a shape pays the allocator)
    generator.generate(batches[len(batches) // 2], min(new_tokens, WARMUP_TOKENS), FixedK(point.k), Sampling(), seed)
    records, by_context = [], {}  # rounded mean context -> [step seconds, contexts, tokens]
    for round_index, batch in enumerate(batches, start=1):
        policy = _ContextLog(point.k)
        with PassClock({"draft": generator.draft, "target": generator.target}, generator.device) as clock:
            stats = generator.generate(batch, new_tokens, policy, Sampling(), seed + round_index).stats
        passes = clock.step_records(stats)
        full = [i for i, size in enumerate(stats.batch_size_per_step) if size == b]
        if passes is None or not full:
            continue
        records += [(role, *record) for role, rows in passes.items() for record in rows]
        contexts = [policy.contexts[i] for i in full]
        pooled = by_context.setdefault(round(sum(contexts) / len(contexts)), [[], [], 0])
        pooled[0] += [stats.step_s[i] for i in full]
        pooled[1] += contexts
        pooled[2] += sum(stats.step_tokens[i] for i in full)
    if not by_context:
        return None
    steps = [step_row(seconds, contexts, tokens, b, point.k) for seconds, contexts, tokens in by_context.values()]
    return InSituResult(pass_rows(records, b, point.k), _distinct_contexts(steps))


def _distinct_contexts(steps: list[InSituStepRow]) -> tuple[InSituStepRow, ...]:
    """Two pooled groups whose contexts round alike would collide on (b, k, context): keep the larger."""
    kept: dict[int, InSituStepRow] = {}
    for row in steps:
        if row.context_len not in kept or row.reps > kept[row.context_len].reps:
            kept[row.context_len] = row
    return tuple(sorted(kept.values(), key=lambda row: row.context_len))
