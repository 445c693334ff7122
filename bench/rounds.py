"""Running a bench plan: interleaved rounds at every batch size, then the extra paired rounds that settle
the table's regret, then vLLM (`--peers vllm`) in its own environment.

Each round runs every contender once, in `plan.balanced_order`, all on the same prompts and seed; our
policies advance in lockstep, a step of each in turn (`bench.timing`), unless `--interleave runs`.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable

from .config import BenchError
from .peers import time_peer
from .plan import BenchPlan, balanced_order
from .results import RunRecord
from .timing import time_lockstep, time_ours

# Extra paired rounds (`regret.resolve_regret`): up to --resolve-rounds at small batch sizes, where a round
# costs little and the table's choice matters most; above, at most as many generations as the batch size's
# own rounds ran (rounds x contenders / 2 pairs), so a large batch size's time at most doubles.
RESOLVE_MAX_BATCH = 8


class BenchInterrupted(KeyboardInterrupt):
    """Ctrl-C during the rounds; carries every generation run so far and the notes left so far."""

    def __init__(self, runs: list[RunRecord], notes: list[str]):
        super().__init__("interrupted")
        self.runs, self.notes = runs, notes


@dataclass
class RoundRunner:
    """Runs rounds of a plan, keeping every generation in the order it ran; `on_run(record, done, total)`
    is called after each (the CLI's progress bar)."""

    plan: BenchPlan
    on_run: Callable[[RunRecord, int, int], None] | None = None
    runs: list[RunRecord] = field(default_factory=list)
    total: int = 0  # generations expected, raised as extra paired rounds come
    timed_captures: int = 0  # CUDA graphs captured inside timed rounds (a warm-up should leave none)

    def __post_init__(self):
        self.total = max(self.total, self.plan.run_count())

    def run_round(self, batch_size: int, round_index: int, names: list[str]) -> None:
        """One round of `names` at this batch size (negative `round_index`: a warm-up round)."""
        plan, config = self.plan, self.plan.config
        if plan.speed is not None and round_index >= 0:
            plan.speed.check(batch_size)
        seed = config.seed + round_index + config.warmup_rounds  # the same for every policy in a round
        prompts = plan.batch_prompts(batch_size, round_index)
        order = balanced_order(names, round_index)
        together = [name for name in order if name in plan.policies] if config.interleave == "steps" else []
        measured: dict[str, dict[str, Any]] = {}
        captures = plan.generator.graph_stats()["captures"]
        if len(together) > 1:  # ours in lockstep (bench.timing), then the peers back to back
            measured = time_lockstep(plan.generator, prompts, [(name, plan.policies[name].policy) for name in together],
                                     config, seed)
            order = together + [name for name in order if name not in plan.policies]
        for name in order:
            if name not in measured:
                measured[name] = time_ours(plan.generator, prompts, plan.policies[name].policy, config, seed) \
                    if name in plan.policies else time_peer(plan.peers, name, prompts, config, seed, plan.device)
            if round_index >= 0:
                self.timed_captures += plan.generator.graph_stats()["captures"] - captures
            captures = plan.generator.graph_stats()["captures"]
            self.runs.append(RunRecord(batch_size=batch_size, round=round_index, policy=name, **measured[name]))
            self.total = max(self.total, len(self.runs))
            if self.on_run is not None:
                self.on_run(self.runs[-1], len(self.runs), self.total)


def run_batch_size(runner: RoundRunner, batch_size: int) -> list[str]:
    """The warm-up and timed rounds at one batch size, bracketed by reference-pass checks, then the extra
    paired rounds while the table's regret is unsettled; returns their notes."""
    from .regret import resolve_regret

    plan, config = runner.plan, runner.plan.config
    names = plan.contenders(batch_size)
    for round_index in range(-config.warmup_rounds, config.rounds):
        runner.run_round(batch_size, round_index, names)
    if plan.speed is not None:
        plan.speed.check(batch_size)  # after the last round too: the rounds are bracketed
    # not on `switch`: every extra round would come from the second population, tilting the pairs
    if plan.table is None or not config.resolve_rounds or config.workload == "switch":
        return []
    cap = None if batch_size <= RESOLVE_MAX_BATCH else config.rounds * len(names) // 2
    return resolve_regret(batch_size, runner.runs, config, config.fixed_ks, partial(runner.run_round, batch_size),
                          cap)


def run_rounds(plan: BenchPlan, on_run: Callable[[RunRecord, int, int], None] | None = None
               ) -> tuple[list[RunRecord], list[str]]:
    """Every round of the plan, batch size by batch size; returns the runs and the notes they left.
    Ctrl-C raises BenchInterrupted with what was measured."""
    runner = RoundRunner(plan, on_run)
    notes: list[str] = []
    # warnings raised while measuring (e.g. a batch size beyond the table) become notes in the result
    # instead of lines in the middle of the progress bar
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        try:
            for batch_size in plan.config.batch_sizes:
                notes += run_batch_size(runner, batch_size)
        except KeyboardInterrupt:
            raise BenchInterrupted(runner.runs, notes + _warning_notes(caught)) from None
    return runner.runs, notes + _warning_notes(caught) + graph_notes(plan.generator, runner.timed_captures)


def graph_notes(generator, timed_captures: int) -> list[str]:
    """What the CUDA graphs cost (captured in warm-up rounds, outside every timed region) and any capture a
    timed round paid for."""
    if not generator.cuda_graphs:
        return []
    stats = generator.graph_stats()
    notes = [f"CUDA graphs: {stats['captures']} captured in {stats['capture_s']:.2f} s (warm-up rounds, not "
             f"timed), {stats['kept']} kept"]
    if timed_captures:
        notes.append(f"warning: {timed_captures} CUDA graph(s) were captured inside timed rounds (a shape the "
                     "warm-up did not meet): those rounds include the capture")
    return notes


def _warning_notes(caught) -> list[str]:
    """The warnings a run raised as notes: a NoteWarning (a table's range) is a note as it stands, any other
    says it is a warning."""
    from specbatch.perfmodel.errors import NoteWarning

    return list(dict.fromkeys(str(w.message) if issubclass(w.category, NoteWarning) else f"warning: {w.message}"
                              for w in caught))


def complete_rounds(plan: BenchPlan, runs: list[RunRecord]) -> tuple[list[RunRecord], list[int]]:
    """What an interrupted run keeps: warm-ups, and the rounds every contender finished (an extra paired
    round: both of its policies); and the batch sizes with at least one such timed round."""
    config = plan.config
    groups: dict[tuple[int, int], list[RunRecord]] = {}
    for run in runs:
        groups.setdefault((run.batch_size, run.round), []).append(run)
    kept, measured = set(), []
    for (b, round_index), group in groups.items():
        needed = len(plan.contenders(b)) if round_index < config.rounds else 2
        if round_index < 0 or len({r.policy for r in group}) == needed:
            kept |= {id(run) for run in group}
            if round_index >= 0 and b not in measured:
                measured.append(b)
    return [run for run in runs if id(run) in kept], measured


def run_vllm_peer(plan: BenchPlan):
    """--peers vllm: vLLM plain and with our exported table, interleaved with ours (bench.vllm.compare);
    None without it."""
    config = plan.config
    if "vllm" not in config.peers:
        return None
    from .vllm.compare import VllmError, compare

    try:
        return compare(config.table_path, list(plan.prompts), list(config.batch_sizes), config.max_new_tokens,
                       config.rounds, plan.models.target_dir, plan.models.draft_dir, generator=plan.generator)
    except VllmError as error:
        raise BenchError(f"--peers vllm: {error}") from None
