"""The prediction error of a bench run, term by term (`perfmodel.explain`), at every batch size.

For each batch size the explained policy is the table's when a table ran (its strategy at that batch
size and the run's mean context), else the best fixed k in hindsight; its timed rounds are pooled (the
full-batch steps of every round, each pass timed by `calibrate.pass_clock`).
"""
from __future__ import annotations

from typing import Sequence

from specbatch.perfmodel.errors import PerfModelError
from specbatch.perfmodel.explain import Explanation, explain
from specbatch.perfmodel.tree import Strategy

from .policies import TABLE_POLICY, BenchPolicy, fixed_policy_name, table_strategy
from .predict import Predictor
from .results import BatchResult, RunRecord


def pooled_steps(runs: Sequence[RunRecord]):
    """The measured full-batch steps of timed rounds (one policy, one batch size), pooled; None if none."""
    pooled = None
    for run in runs:
        pooled = run.measured_steps if pooled is None else pooled.merged(run.measured_steps)
    return pooled


def explained_policy(batch: BatchResult, policies: dict[str, BenchPolicy]) -> tuple[str, Strategy]:
    """The table's policy and strategy at this batch size, else the best fixed k's."""
    table = policies.get(TABLE_POLICY)
    if table is not None:
        return TABLE_POLICY, table_strategy(table.policy, batch.batch_size, batch.context_len)
    return fixed_policy_name(batch.best_k), Strategy.from_k(batch.best_k)


def pooled_context_len(runs: Sequence[RunRecord], default: float) -> float:
    """The mean context of the pooled full-batch steps (each round's own, weighted by its steps): a
    step's time is linear in its context, so the pooled steps' mean time is predicted at this context."""
    weighted = [(run.measured_steps.steps, run.context_len) for run in runs if run.context_len is not None]
    steps = sum(n for n, _ in weighted)
    return sum(n * context for n, context in weighted) / steps if steps else default


def table_rounds(table, batch_size: int,
                 runs: Sequence[RunRecord]) -> tuple[Strategy | None, list[RunRecord], str | None]:
    """The table's most-run strategy at this batch size and the rounds that ran it alone, with a note when
    other rounds were left out. A table with several context buckets may choose differently in different
    rounds (their contexts differ) or within one (the context grows past a bucket edge); pooled, such
    rounds mix passes of several widths, and one strategy's prediction set against them explains nothing."""
    groups: dict[str, tuple[Strategy, list[RunRecord]]] = {}
    mixed = 0
    for run in runs:
        ran = set(run.k_counts_full_batch)
        strategy = table_strategy(table, batch_size, round(run.context_len)) if run.context_len is not None else None
        if strategy is None or len(ran) != 1 or strategy.k not in ran or len(run.nodes_counts_full_batch) > 1:
            mixed += 1  # several strategies in one round, or not the one its mean context looks up
            continue
        groups.setdefault(strategy.describe(), (strategy, []))[1].append(run)
    if not groups:
        return None, [], (f"no decomposition at batch size {batch_size}: the table changed strategy within every "
                          f"round ({mixed})")
    counted = {name: sum(r.measured_steps.steps for r in group) for name, (_, group) in groups.items()}
    name = max(counted, key=counted.get)
    strategy, chosen = groups[name]
    if len(groups) == 1 and not mixed:
        return strategy, chosen, None
    others = [f"{other} in {len(group)}" for other, (_, group) in groups.items() if other != name]
    if mixed:
        others.append(f"several strategies in {mixed}")
    return strategy, chosen, (f"decomposition at b = {batch_size}: the table ran {name} in {len(chosen)} rounds, "
                              f"{', '.join(others)}; the decomposition is {name}'s, over its rounds")


def explain_batch(batch: BatchResult, runs: Sequence[RunRecord], predictor: Predictor,
                  policies: dict[str, BenchPolicy]) -> tuple[Explanation | None, str | None]:
    """The explanation at one batch size (None without full-batch steps), and a note on what it left out."""
    from specbatch.perfmodel.model import step_model

    name, strategy = explained_policy(batch, policies)
    chosen = [run for run in runs if run.batch_size == batch.batch_size and run.policy == name and not run.warmup
              and run.measured_steps]
    note = None
    if name == TABLE_POLICY and chosen:
        strategy, chosen, note = table_rounds(policies[TABLE_POLICY].policy, batch.batch_size, chosen)
        if strategy is None:
            return None, note
    measured = pooled_steps(chosen)
    if measured is None:
        return None, note
    context = round(pooled_context_len(chosen, batch.context_len))
    return explain(step_model(predictor.fitted, predictor.acceptance), strategy, measured, context,
                   predictor.fitted.experts_touched), note


def add_explanations(batches: list[BatchResult], runs: Sequence[RunRecord], predictor: Predictor,
                     policies: dict[str, BenchPolicy]) -> list[str]:
    """Set each batch's `explanation`; returns notes for the batch sizes that could not be explained, or whose
    table ran several strategies."""
    notes = []
    for batch in batches:
        try:
            found, note = explain_batch(batch, runs, predictor, policies)
        except PerfModelError as error:
            notes.append(f"no decomposition at batch size {batch.batch_size}: {error}")
            continue
        if note is not None:
            notes.append(note)
        if found is None:
            if note is None:
                notes.append(f"no decomposition at batch size {batch.batch_size}: no full-batch steps with timed "
                             "passes")
            continue
        batch.explanation = found.to_json()
    return notes


def run_explain(config, models, prompts: Sequence[list[int]],
                k: int | None) -> tuple[Explanation, list[str], dict | None]:
    """`specbatch explain`: one policy at `config.batch_sizes[0]` (the table's when `config.table_path`,
    else the tree in `config.trees`, else the fixed `k`): `config.warmup_rounds` discarded generations,
    then `config.rounds` timed ones, each on the next prompts, their full-batch steps pooled and set
    against the model in `config.model_path` at the rounds' mean attended context. Where the model file
    kept calibration's reference pass, it is timed again before every timed round and after the last
    (bench.speed), and the third value is the machine's speed against calibration's (else None)."""
    from specbatch.perfmodel.model import step_model
    from specbatch.runtime.generator import SpeculativeGenerator
    from specbatch.runtime.policy import FixedK, FixedStrategy, TableK

    from specbatch.calibrate.pass_clock import StepRecorder

    from .config import BenchError, tree_from_spec
    from .plan import check_context
    from .predict import load_predictor
    from .speed import machine_speed_for, speed_note
    from .workload import attended_context_len, round_prompts, timed_round_prompts

    b = config.batch_sizes[0]
    predictor = load_predictor(config.model_path, config.sampling, config.synthetic_acceptance)
    batches = timed_round_prompts(prompts, b, config.warmup_rounds, config.rounds)
    context_len = attended_context_len(batches, config.max_new_tokens)
    if config.table_path is not None:
        policy = TableK(config.table_path)
        strategy = table_strategy(policy, b, context_len)
    elif config.trees:
        strategy = Strategy(tree_from_spec(config.trees[0]), stage2=models.stage2 is not None)
        policy = FixedStrategy(strategy)
    elif models.stage2 is not None and k > 0:  # a chain drafted with the second stage
        strategy = Strategy.from_k(k, stage2=True)
        policy = FixedStrategy(strategy)
    else:
        strategy, policy = Strategy.from_k(k), FixedK(k)
    if strategy.k > 0 and models.draft is None:
        raise BenchError("explain: a strategy with draft tokens needs a draft model (--draft)")
    check_context(models, prompts, config, policy.max_k)
    generator = SpeculativeGenerator(models.target, models.draft, eos_token_ids=(), stage2=models.stage2)
    speed = machine_speed_for(models.target, predictor.fitted.noise, generator.device, config.model_path,
                              graphs=generator.cuda_graphs)
    pooled = None
    for round_index in range(-config.warmup_rounds, config.rounds):
        if speed is not None and round_index >= 0:
            speed.check(b)
        batch_prompts = round_prompts(prompts, b, round_index, config.warmup_rounds, config.rounds)
        recorder = StepRecorder(generator.device)
        generator.generate(batch_prompts, config.max_new_tokens, policy, config.sampling,
                           config.seed + round_index + config.warmup_rounds, config.synthetic_acceptance,
                           observer=recorder)
        steps = recorder.measured_steps(b) if round_index >= 0 else None
        if steps is not None:
            pooled = steps if pooled is None else pooled.merged(steps)
    if speed is not None:
        speed.check(b)  # the rounds are bracketed
    if pooled is None:
        raise BenchError(f"explain: no full-batch steps with timed passes at batch size {b}; raise --max-new-tokens")
    fitted = predictor.fitted
    machine = speed.at(b) if speed is not None else None
    notes = [f"predictions use {predictor.acceptance_note}", *fitted.timing_source_notes(),
             *fitted.extrapolation_notes(b, [context_len], strategy.k), *fitted.strategy_notes([strategy]),
             *speed_note(machine)]
    return (explain(step_model(fitted, predictor.acceptance), strategy, pooled, context_len, fitted.experts_touched),
            notes, machine)
