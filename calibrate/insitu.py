"""In-situ timing: generate with a fixed chain k at one batch size on held-out prompts, and time every
forward pass (`calibrate.pass_clock.PassClock`) and every step (the generator's own step clock).

One point (b, k) is one warm-up generation (discarded: the first use of a batch size's shapes pays the
allocator) and then `rounds` timed generations, each on the next b prompts, with EOS ignored so every
row runs `new_tokens` tokens. Only full-batch steps count (the batch thins out in the last steps), and
only their passes. The rows are `perfmodel.insitu`'s: passes grouped by width and context, one step row.
The prompts are held out from the acceptance measurement (the prompts after the ones it used), so the
steps' tokens per step are a check of E(k) as well.
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


@dataclass(frozen=True)
class InSituPoint:
    batch_size: int
    k: int


@dataclass(frozen=True)
class InSituResult:
    """What one point adds to the profile."""

    passes: tuple[InSituPassRow, ...]
    step: InSituStepRow


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


def measure_insitu(generator: SpeculativeGenerator, point: InSituPoint, prompts: Sequence[list[int]],
                   new_tokens: int, rounds: int, seed: int = 0) -> InSituResult | None:
    """The point's rows; None when no full-batch step had its passes timed (too few new tokens)."""
    b = point.batch_size
    batches = [[list(prompts[(r * b + row) % len(prompts)]) for row in range(b)] for r in range(rounds + 1)]
    generator.generate(batches[0], new_tokens, FixedK(point.k), Sampling(), seed)  # warm-up
    records, step_seconds, contexts, tokens = [], [], [], 0
    for round_index, batch in enumerate(batches[1:], start=1):
        policy = _ContextLog(point.k)
        with PassClock({"draft": generator.draft, "target": generator.target}, generator.device) as clock:
            stats = generator.generate(batch, new_tokens, policy, Sampling(), seed + round_index).stats
        passes = clock.step_records(stats)
        if passes is None:
            continue
        records += [(role, *record) for role, rows in passes.items() for record in rows]
        full = [i for i, size in enumerate(stats.batch_size_per_step) if size == b]
        step_seconds += [stats.step_s[i] for i in full]
        contexts += [policy.contexts[i] for i in full]
        tokens += sum(stats.step_tokens[i] for i in full)
    if not step_seconds:
        return None
    return InSituResult(pass_rows(records, b, point.k), step_row(step_seconds, contexts, tokens, b, point.k))
