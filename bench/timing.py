"""One wall clock for every contender, ours and the peers; our generations timed one after another
(`--interleave runs`) or in lockstep, a step of each in turn (`--interleave steps`, the default:
calibrate.lockstep says why). Peers (transformers, vLLM) run in their own loops, back to back.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

from specbatch.calibrate.lockstep import run_lockstep
from specbatch.calibrate.pass_clock import PassClock, measured_steps
from specbatch.runtime.clock import DeviceClock
from specbatch.runtime.generator import GenerationStats, SpeculativeGenerator

from .config import BenchConfig


def time_ours(generator: SpeculativeGenerator, prompts: list[list[int]], policy, config: BenchConfig,
              seed: int) -> dict[str, Any]:
    """One generation with our runtime; the same outer wall clock as the peers."""
    clock = DeviceClock(generator.device)
    start = clock.now()
    # each pass timed on its own for `explain` (the clock syncs where the generator's timer already does)
    with PassClock({"draft": generator.draft, "target": generator.target}, generator.device) as passes:
        result = generator.generate(prompts, config.max_new_tokens, policy, config.sampling, seed,
                                    config.synthetic_acceptance)
    return measured_run(result.stats, passes, len(prompts), clock.now() - start)


def time_lockstep(generator: SpeculativeGenerator, prompts: list[list[int]], policies: Sequence[tuple[str, Any]],
                  config: BenchConfig, seed: int) -> dict[str, dict[str, Any]]:
    """Every (name, policy) generating `prompts` in lockstep, ties going by `policies`' order; per name
    what `time_ours` gives, its seconds being its own turns' time only."""
    clock = PassClock({"draft": generator.draft, "target": generator.target}, generator.device)
    generations = {name: generator.generation(prompts, config.max_new_tokens, policy, config.sampling, seed,
                                              config.synthetic_acceptance) for name, policy in policies}
    measured = {}
    for name, (result, records) in run_lockstep(generations, clock).items():
        clock.records = records
        measured[name] = measured_run(result.stats, clock, len(prompts), result.stats.total_s)
    return measured


def measured_run(stats: GenerationStats, clock: PassClock, batch_size: int, seconds: float) -> dict[str, Any]:
    """What a RunRecord keeps of one generation (bench.results)."""
    b = batch_size
    records = clock.step_records(stats)
    contexts = [context for batch, _, context, _ in (records or {}).get("target", []) if batch == b]
    full = [k for k, size in zip(stats.k_per_step, stats.batch_size_per_step) if size == b]
    nodes = [n for n, size in zip(stats.nodes_per_step, stats.batch_size_per_step) if size == b]
    return dict(generated_tokens=stats.generated_tokens, seconds=seconds, steps=stats.steps,
                full_batch_steps=len(full), accepted_per_position=list(stats.accepted_per_position),
                trials_per_position=list(stats.trials_per_position), k_counts_full_batch=dict(Counter(full)),
                nodes_counts_full_batch=dict(Counter(nodes)), steady_tokens_per_s=stats.steady_tokens_per_s(b),
                measured_steps=measured_steps(stats, clock, b), step_seconds=sum(stats.step_s),
                context_len=sum(contexts) / len(contexts) if contexts else None,
                decision_seconds=sum(stats.decision_s))
