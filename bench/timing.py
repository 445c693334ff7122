"""One wall clock for every contender, ours and the peers; our generations timed one after another
(`--interleave runs`) or in lockstep, a step of each in turn (`--interleave steps`, the default:
calibrate.lockstep says why), each with a step recorder (calibrate.pass_clock) for `explain`. Peers
(transformers, vLLM) run in their own loops, back to back.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Sequence

from specbatch.calibrate.lockstep import run_lockstep
from specbatch.calibrate.pass_clock import StepRecorder
from specbatch.runtime.clock import DeviceClock
from specbatch.runtime.generator import GenerationStats, SpeculativeGenerator

from .config import BenchConfig


def time_ours(generator: SpeculativeGenerator, prompts: list[list[int]], policy, config: BenchConfig,
              seed: int) -> dict[str, Any]:
    """One generation with our runtime; the same outer wall clock as the peers."""
    clock, recorder = DeviceClock(generator.device), StepRecorder(generator.device)
    start = clock.now()
    result = generator.generate(prompts, config.max_new_tokens, policy, config.sampling, seed,
                                config.synthetic_acceptance, observer=recorder)
    return measured_run(result.stats, recorder, len(prompts), clock.now() - start)


def time_lockstep(generator: SpeculativeGenerator, prompts: list[list[int]], policies: Sequence[tuple[str, Any]],
                  config: BenchConfig, seed: int) -> dict[str, dict[str, Any]]:
    """Every (name, policy) generating `prompts` in lockstep, ties going by `policies`' order; per name
    what `time_ours` gives, its seconds being its own turns' time only."""
    recorders = {name: StepRecorder(generator.device) for name, _ in policies}
    generations = {name: generator.generation(prompts, config.max_new_tokens, policy, config.sampling, seed,
                                              config.synthetic_acceptance, observer=recorders[name])
                   for name, policy in policies}
    return {name: measured_run(result.stats, recorders[name], len(prompts), result.stats.total_s)
            for name, result in run_lockstep(generations).items()}


def measured_run(stats: GenerationStats, recorder: StepRecorder, batch_size: int, seconds: float) -> dict[str, Any]:
    """What a RunRecord keeps of one generation (bench.results)."""
    b = batch_size
    contexts = [context for batch, _, context, _ in recorder.passes["target"] if batch == b]
    full = [k for k, size in zip(stats.k_per_step, stats.batch_size_per_step) if size == b]
    nodes = [record.nodes for record in recorder.steps if record.batch_size == b]
    return dict(generated_tokens=stats.generated_tokens, seconds=seconds, steps=stats.steps,
                full_batch_steps=len(full), accepted_per_position=list(stats.accepted_per_position),
                trials_per_position=list(stats.trials_per_position), k_counts_full_batch=dict(Counter(full)),
                nodes_counts_full_batch=dict(Counter(nodes)), steady_tokens_per_s=recorder.steady_tokens_per_s(b),
                measured_steps=recorder.measured_steps(b), step_seconds=sum(recorder.step_s),
                context_len=sum(contexts) / len(contexts) if contexts else None,
                decision_seconds=recorder.decision_s())
