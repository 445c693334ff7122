"""Counters the serving engine keeps (what GET /metrics shows): constant memory however long it runs.

Written by the engine's thread, read by the HTTP thread: every update and `snapshot` takes one lock, so
a snapshot is consistent (acceptance per position never shows a hit without its trial).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field

from .acceptance import count_acceptance

# upper bounds of the step-time histogram, seconds: a step of the demo pair on a CPU takes 2-50 ms,
# a 7B target on a GPU 10-100 ms
STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


def describe_choice(choice) -> str:
    """A policy's answer as one short label: 'none', 'chain k=3', 'tree 0,1,0.0 (3 nodes)'."""
    if isinstance(choice, int):
        return f"chain k={choice}" if choice > 0 else "none"
    return choice.describe(60)


@dataclass
class EngineMetrics:
    steps_total: int = 0
    prefill_passes_total: int = 0
    prompt_tokens_total: int = 0
    generated_tokens_total: int = 0
    finished_total: dict[str, int] = field(default_factory=dict)  # finish reason -> requests
    accepted_per_position: list[int] = field(default_factory=list)  # draft token i accepted
    trials_per_position: list[int] = field(default_factory=list)  # ... proposed with 1..i-1 accepted
    strategy: str = "none"  # of the last step
    k: int = 0  # draft depth of the last step (a chain's k)
    draft_tokens: int = 0  # draft tokens verified per row in the last step (a tree's nodes)
    batch_size: int = 0  # rows in the last step
    step_bucket_counts: list[int] = field(default_factory=lambda: [0] * (len(STEP_BUCKETS_S) + 1))
    step_seconds_sum: float = 0.0
    decision_seconds_sum: float = 0.0  # the policy's own work (runtime.adaptive); its share of step_seconds_sum
    # per strategy label (describe_choice): steps, their seconds, the tokens they committed over all rows, and
    # the rows they ran on; a policy's mix over time is the difference of two snapshots
    by_strategy: dict[str, dict[str, float]] = field(default_factory=dict)
    # the policy's runtime.fidelity.LiveFidelity (its step model's predictions beside the measured steps), or None:
    # it keeps its own lock
    fidelity: object | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def observe_step(self, strategy: str, k: int, nodes: int, counts: list[int], seconds: float,
                     decision_s: float = 0.0) -> None:
        """One speculative step of draft depth k, `nodes` draft tokens verified per row, row r committing
        counts[r] tokens, in `seconds`, of which `decision_s` were the policy's own."""
        with self._lock:
            mix = self.by_strategy.setdefault(strategy, {"steps": 0, "seconds": 0.0, "tokens": 0, "rows": 0})
            mix["steps"] += 1
            mix["seconds"] += seconds
            mix["tokens"] += sum(counts)
            mix["rows"] += len(counts)
            self.steps_total += 1
            self.strategy, self.batch_size = strategy, len(counts)
            self.k, self.draft_tokens = k, nodes
            count_acceptance(self.accepted_per_position, self.trials_per_position, counts, k)
            bucket = next((i for i, bound in enumerate(STEP_BUCKETS_S) if seconds <= bound), len(STEP_BUCKETS_S))
            self.step_bucket_counts[bucket] += 1
            self.step_seconds_sum += seconds
            self.decision_seconds_sum += decision_s

    def observe_prefill(self, prompt_tokens: int) -> None:
        with self._lock:
            self.prefill_passes_total += 1
            self.prompt_tokens_total += prompt_tokens

    def observe_tokens(self, count: int) -> None:
        with self._lock:
            self.generated_tokens_total += count

    def observe_finish(self, reason: str) -> None:
        with self._lock:
            self.finished_total[reason] = self.finished_total.get(reason, 0) + 1

    def snapshot(self) -> dict:
        fidelity = None if self.fidelity is None else self.fidelity.snapshot()  # its own lock, not held with ours
        with self._lock:
            return {
                "steps_total": self.steps_total, "prefill_passes_total": self.prefill_passes_total,
                "prompt_tokens_total": self.prompt_tokens_total,
                "generated_tokens_total": self.generated_tokens_total,
                "finished_total": dict(self.finished_total),
                "accepted_per_position": list(self.accepted_per_position),
                "trials_per_position": list(self.trials_per_position),
                "strategy": self.strategy, "k": self.k, "draft_tokens": self.draft_tokens,
                "batch_size": self.batch_size, "step_bucket_counts": list(self.step_bucket_counts),
                "step_seconds_sum": self.step_seconds_sum, "decision_seconds_sum": self.decision_seconds_sum,
                "by_strategy": {name: dict(mix) for name, mix in self.by_strategy.items()},
                "fidelity": fidelity,
            }
