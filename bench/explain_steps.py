"""The prediction error of a bench run, term by term (`perfmodel.explain`), at every batch size.

For each batch size the explained policy is the table's when a table ran (its strategy at that batch
size and the run's mean context), else the best fixed k in hindsight; its timed rounds are pooled (the
full-batch steps of every round, each pass timed by `bench.pass_clock`).
"""
from __future__ import annotations

from typing import Sequence

from perfmodel.errors import PerfModelError
from perfmodel.explain import Explanation, explain
from perfmodel.tree import Strategy

from .policies import TABLE_POLICY, BenchPolicy, fixed_policy_name, table_strategy
from .predict import Predictor
from .results import BatchResult, RunRecord


def pooled_steps(runs: Sequence[RunRecord], batch_size: int, policy: str):
    """The measured full-batch steps of one policy's timed rounds at one batch size, pooled; None if none."""
    pooled = None
    for run in runs:
        if run.batch_size == batch_size and run.policy == policy and not run.warmup and run.measured_steps:
            pooled = run.measured_steps if pooled is None else pooled.merged(run.measured_steps)
    return pooled


def explained_policy(batch: BatchResult, policies: dict[str, BenchPolicy]) -> tuple[str, Strategy]:
    """The table's policy and strategy at this batch size, else the best fixed k's."""
    table = policies.get(TABLE_POLICY)
    if table is not None:
        return TABLE_POLICY, table_strategy(table.policy, batch.batch_size, batch.context_len)
    return fixed_policy_name(batch.best_k), Strategy.from_k(batch.best_k)


def explain_batch(batch: BatchResult, runs: Sequence[RunRecord], predictor: Predictor,
                  policies: dict[str, BenchPolicy]) -> Explanation | None:
    from perfmodel.model import step_model

    name, strategy = explained_policy(batch, policies)
    measured = pooled_steps(runs, batch.batch_size, name)
    if measured is None:
        return None
    return explain(step_model(predictor.fitted, predictor.acceptance), strategy, measured, batch.context_len)


def add_explanations(batches: list[BatchResult], runs: Sequence[RunRecord], predictor: Predictor,
                     policies: dict[str, BenchPolicy]) -> list[str]:
    """Set each batch's `explanation`; returns notes for the batch sizes that could not be explained."""
    notes = []
    for batch in batches:
        try:
            found = explain_batch(batch, runs, predictor, policies)
        except PerfModelError as error:
            notes.append(f"no decomposition at batch size {batch.batch_size}: {error}")
            continue
        if found is None:
            notes.append(f"no decomposition at batch size {batch.batch_size}: no full-batch steps with timed passes")
            continue
        batch.explanation = found.to_json()
    return notes
