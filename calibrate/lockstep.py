"""Several generations on one thread in lockstep: a turn of each (its prefill, then one step) in turn,
always the one furthest behind in the fraction of its tokens generated, ties to the earliest in the
caller's order (callers rotate it).

Why: on a machine whose speed changes by itself for seconds at a time, generations timed one after
another meet different speeds; in lockstep every contender's steps run within milliseconds of the
others' and meet the same ones (docs/calibration.md gives the figures). What it changes in a step: the
step before it was usually another generation's, so its own KV cache may have left the CPU's caches.
Used by bench (a round's policies, bench.timing) and calibrate (the ks of one batch size, calibrate.insitu).
"""
from __future__ import annotations

from typing import Any, Iterator, Sequence


def next_turn(progress: dict[str, float], priority: Sequence[str]) -> str:
    """The generation furthest behind (the smallest fraction of its tokens generated); among equals the
    earliest in `priority`.

    >>> next_turn({"a": 0.5, "b": 0.25, "c": 0.25}, ["c", "b", "a"])
    'c'
    """
    return min((name for name in priority if name in progress), key=progress.__getitem__)


def run_lockstep(generations: dict[str, Iterator[float]]) -> dict[str, Any]:
    """Drive every `SpeculativeGenerator.generation` of `generations` to its end in lockstep, ties going
    by the dict's order; per name its GenerationResult (each generation's own observer, if it has one,
    sees only its own steps)."""
    order = list(generations)
    progress = {name: 0.0 for name in order}
    pending = dict(generations)
    finished: dict[str, Any] = {}
    while pending:
        name = next_turn(progress, order)
        try:
            progress[name] = next(pending[name])
        except StopIteration as done:
            finished[name] = done.value
            del pending[name], progress[name]
    return {name: finished[name] for name in order}
