"""One wall clock for every contender, ours and the peers; our generations timed one after another or
in lockstep.

Lockstep (`--interleave steps`, the default). This VM's CPUs change speed by themselves: each vCPU
independently runs at one of two speeds about 1.5x apart, for spells of half a second to tens of
seconds (a fixed 64x64 matmul loop on each core: 0.61 against 0.94 ms, its two cores uncorrelated,
r = -0.07 over 0.5 s windows; the demo target's reference pass: 2.5 against 3.6 ms). Generations run
back to back (`--interleave runs`) take a second or more each, so two policies of one round often ran
at different speeds. `time_lockstep` advances every contender's generation one turn at a time (its
prefill, then one step: runtime.generator `SpeculativeGenerator.generation`) on the same thread, always
the one furthest behind in the fraction of its tokens generated, so all of them go through their
generations together, a step of each within milliseconds of the others', and meet the same spells of
the machine. Measured on the demo pair, two identical k = 4 contenders, 16 rounds at b = 4 and 10 at
b = 8 (`/tmp`-free re-run: docs/fidelity.md, "Lockstep"): the per-round spread of their log ratio fell
from 7.3 % and 4.0 % back to back to 0.6 % and 0.7 % in lockstep.

What it changes in a step: the step before it was usually another contender's, so its own KV cache and
activations may have left the CPU's caches (the weights are shared). Ties in progress (identical
contenders advance identically) go to the earliest in the round's balanced order: the second of two
identical steps in a row ran ~0.8 % faster, and the balanced order gives every contender each place
equally often, so that cancels over rounds. Peers (transformers, vLLM) run in their own loops and stay
back to back.
"""
from __future__ import annotations

import time
from collections import Counter
from typing import Any, Sequence

import torch

from runtime.generator import GenerationStats, SpeculativeGenerator

from .config import BenchConfig
from calibrate.pass_clock import PassClock, measured_steps


def wall_clock(device: torch.device) -> float:
    """Wall clock; on CUDA, after the queued kernels have run, so they are counted where they ran."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def time_ours(generator: SpeculativeGenerator, prompts: list[list[int]], policy, config: BenchConfig,
              seed: int) -> dict[str, Any]:
    """One generation with our runtime; the same outer wall clock as the peers."""
    start = wall_clock(generator.device)
    # each pass timed on its own for `explain` (the clock syncs where the generator's timer already does)
    with PassClock({"draft": generator.draft, "target": generator.target}, generator.device) as clock:
        result = generator.generate(prompts, config.max_new_tokens, policy, config.sampling, seed,
                                    config.synthetic_acceptance)
    return measured_run(result.stats, clock, len(prompts), wall_clock(generator.device) - start)


def next_turn(progress: dict[str, float], priority: Sequence[str]) -> str:
    """The contender furthest behind (the smallest fraction of its tokens generated); among equals the
    earliest in `priority`.

    >>> next_turn({"a": 0.5, "b": 0.25, "c": 0.25}, ["c", "b", "a"])
    'c'
    """
    return min((name for name in priority if name in progress), key=progress.__getitem__)


def time_lockstep(generator: SpeculativeGenerator, prompts: list[list[int]], policies: Sequence[tuple[str, Any]],
                  config: BenchConfig, seed: int) -> dict[str, dict[str, Any]]:
    """Every (name, policy) generating `prompts` in lockstep (module docstring), in `policies`' order
    among equals; per name what `time_ours` gives, its seconds being its own turns' time only."""
    clock = PassClock({"draft": generator.draft, "target": generator.target}, generator.device)
    records = {name: {role: [] for role in clock.models} for name, _ in policies}  # each contender's passes
    turns = {name: generator.generation(prompts, config.max_new_tokens, policy, config.sampling, seed,
                                        config.synthetic_acceptance) for name, policy in policies}
    progress = {name: 0.0 for name in turns}
    order = [name for name, _ in policies]
    finished: dict[str, GenerationStats] = {}
    with clock:
        while turns:
            name = next_turn(progress, order)
            clock.records = records[name]  # its passes go to its own records
            try:
                progress[name] = next(turns[name])
            except StopIteration as done:
                finished[name] = done.value.stats
                del turns[name], progress[name]
    measured = {}
    for name in order:
        clock.records = records[name]
        measured[name] = measured_run(finished[name], clock, len(prompts), finished[name].total_s)
    return measured


def measured_run(stats: GenerationStats, clock: PassClock, batch_size: int, seconds: float) -> dict[str, Any]:
    """What a RunRecord keeps of one generation (bench.results)."""
    b = batch_size
    full = [k for k, size in zip(stats.k_per_step, stats.batch_size_per_step) if size == b]
    nodes = [n for n, size in zip(stats.nodes_per_step, stats.batch_size_per_step) if size == b]
    return dict(generated_tokens=stats.generated_tokens, seconds=seconds, steps=stats.steps,
                full_batch_steps=len(full), accepted_per_position=list(stats.accepted_per_position),
                trials_per_position=list(stats.trials_per_position), k_counts_full_batch=dict(Counter(full)),
                nodes_counts_full_batch=dict(Counter(nodes)), steady_tokens_per_s=stats.steady_tokens_per_s(b),
                measured_steps=measured_steps(stats, clock, b), step_seconds=sum(stats.step_s),
                decision_seconds=sum(stats.decision_s))
