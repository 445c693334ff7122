"""Several generations on one thread in lockstep: a turn of each (its prefill, then one step) in turn,
always the one furthest behind in the fraction of its tokens generated.

Why. This VM's CPUs change speed by themselves: each vCPU, independently of the other, runs at one of
two speeds about 1.6x apart, in spells of half a second to tens of seconds (`python -m bench.cpu_spells`:
a fixed matmul loop pinned to each core; slow windows 1.62-1.66x the fastest, 15-44 % of the 0.5 s
windows slow, the two cores' correlation r = -0.25 and +0.17 in two runs on 2026-12-01). Generations
run one after another take a second or more each, so two policies compared back to back often ran at
different speeds. In lockstep all of them go through their generations together, a step of each within
milliseconds of the others', and meet the same spells of the machine. Two identical k = 4 contenders on
the demo pair (`python -m bench.pairing_noise`, which generates the same rounds both ways): the spread
over rounds of their log ratio fell from 10.1 % back to back to 1.4 % in lockstep at b = 4 (16 rounds),
from 13.4 % to 1.6 % at b = 8 (10 rounds).

What it changes in a step: the step before it was usually another generation's, so its own KV cache
and activations may have left the CPU's caches (the weights are shared). Ties in progress (identical
generations advance identically) go to the earliest in the caller's order; the second of two identical
steps in a row ran ~0.8 % faster in a first trial without rotation, so callers rotate the order (bench:
the round's balanced order; with it the A/A ratios above were 1.003 and 1.001).

Used by bench (a round's policies, bench.timing) and calibrate (the in-situ stage: every k of one batch
size and sweep, calibrate.insitu), so the k the table chooses between were timed at the same moments.
"""
from __future__ import annotations

from typing import Any, Iterator, Sequence

from .pass_clock import PassClock


def next_turn(progress: dict[str, float], priority: Sequence[str]) -> str:
    """The generation furthest behind (the smallest fraction of its tokens generated); among equals the
    earliest in `priority`.

    >>> next_turn({"a": 0.5, "b": 0.25, "c": 0.25}, ["c", "b", "a"])
    'c'
    """
    return min((name for name in priority if name in progress), key=progress.__getitem__)


def run_lockstep(generations: dict[str, Iterator[float]], clock: PassClock) -> dict[str, tuple[Any, dict]]:
    """Drive every `SpeculativeGenerator.generation` of `generations` to its end in lockstep, ties going
    by the dict's order; per name its GenerationResult and its own pass records (`clock` wraps the models
    the generations share and is switched to a generation's records before each of its turns)."""
    order = list(generations)
    records = {name: {role: [] for role in clock.models} for name in order}
    progress = {name: 0.0 for name in order}
    pending = dict(generations)
    finished: dict[str, Any] = {}
    with clock:
        while pending:
            name = next_turn(progress, order)
            clock.records = records[name]  # its passes go to its own records
            try:
                progress[name] = next(pending[name])
            except StopIteration as done:
                finished[name] = done.value
                del pending[name], progress[name]
    return {name: (finished[name], records[name]) for name in order}
