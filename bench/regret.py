"""The table's regret as a paired ratio with a bootstrap interval: is it the model, or the machine's noise?

A round's policies share its prompts, seed and moment of the machine, so the ratio is taken per round first:
regret(k) = 1 - exp(mean_r log(table_r / k_r)), against the best fixed k in hindsight, with a 95 % interval
from resampling whole rounds (BOOTSTRAP_SAMPLES, fixed seed). Verdict against REGRET_GOAL: "met" (the whole
interval at or below it), "missed" (above) or "not resolved" (straddling); *settled* when the interval is also
no wider than ±goal, which `resolve_regret` adds paired rounds for (docs/validation.md).

Assumes rounds are exchangeable (no trend left after the balanced order); with few rounds the percentile
interval is too narrow rather than too wide.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

REGRET_GOAL = 0.03  # the bench's goal: the table within 3 % of the best fixed k
BOOTSTRAP_SAMPLES = 2000
BOOTSTRAP_SEED = 0  # fixed: the same bench data gives the same interval


@dataclass(frozen=True)
class PairedRegret:
    against: str  # the fixed-k policy of the headline (the best in hindsight)
    rounds: int  # rounds where both ran
    regret: float  # 1 - geometric mean of the paired ratios
    low: float  # 95 % bootstrap interval of the regret
    high: float
    goal: float
    per_k: dict[str, float]  # regret against every fixed k, paired the same way

    @property
    def settled(self) -> bool:
        """A verdict from an interval no wider than ±goal (see the module docstring)."""
        return self.verdict != "not resolved" and (self.high - self.low) / 2 <= self.goal

    @property
    def verdict(self) -> str:
        if self.high <= self.goal:
            return "met"
        if self.low > self.goal:
            return "missed"
        return "not resolved"

    def to_json(self) -> dict[str, Any]:
        return {"against": self.against, "rounds": self.rounds, "regret": self.regret,
                "ci95": [self.low, self.high], "goal": self.goal, "verdict": self.verdict,
                "settled": self.settled,
                "per_k": dict(self.per_k), "method": "1 - geometric mean of per-round table / k ratios; "
                                                     f"bootstrap over rounds ({BOOTSTRAP_SAMPLES} samples)"}


def _regret(log_ratios: np.ndarray) -> np.ndarray:
    return 1.0 - np.exp(log_ratios.mean(axis=-1))


def paired_regret(table_by_round: dict[int, float], fixed_by_round: dict[str, dict[int, float]], against: str,
                  goal: float = REGRET_GOAL) -> PairedRegret | None:
    """Regret of the table against each fixed-k policy from per-round goodputs ({round: tokens/s});
    the interval is the headline's (`against`). None when no round has both the table and `against`."""
    rounds = sorted(r for r in table_by_round if r in fixed_by_round.get(against, {}))
    if not rounds:
        return None
    per_k = {}
    for name, by_round in fixed_by_round.items():
        common = [r for r in sorted(table_by_round) if r in by_round]
        if common:
            per_k[name] = float(_regret(np.log([table_by_round[r] / by_round[r] for r in common])))
    logs = np.log([table_by_round[r] / fixed_by_round[against][r] for r in rounds])
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    samples = _regret(logs[rng.integers(0, len(logs), size=(BOOTSTRAP_SAMPLES, len(logs)))])
    low, high = np.percentile(samples, [2.5, 97.5])
    return PairedRegret(against, len(rounds), float(_regret(logs)), float(low), float(high), goal, per_k)


def paired_ratio(numerator: dict[int, float], denominator: dict[int, float]) -> dict[str, Any] | None:
    """numerator / denominator over the rounds where both ran: the geometric mean of the per-round ratios
    and its 95 % bootstrap interval over rounds (as `paired_regret`); None without a common round.

    >>> paired_ratio({0: 2.0, 1: 8.0}, {0: 1.0, 1: 2.0})["ratio"]  # sqrt(2 x 4)
    2.8284271247461903
    """
    rounds = sorted(r for r in numerator if r in denominator)
    if not rounds:
        return None
    logs = np.log([numerator[r] / denominator[r] for r in rounds])
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    samples = np.exp(logs[rng.integers(0, len(logs), size=(BOOTSTRAP_SAMPLES, len(logs)))].mean(axis=1))
    low, high = np.percentile(samples, [2.5, 97.5])
    return {"rounds": len(rounds), "ratio": float(np.exp(logs.mean())), "ci95": [float(low), float(high)]}


def rates_by_round(runs: Sequence[Any], batch_size: int, policy: str) -> dict[int, float]:
    """{round: steady-state tokens/s (wall tokens/s where no steady state)} of one policy's timed rounds."""
    return {r.round: (r.steady_tokens_per_s if r.steady_tokens_per_s is not None else r.wall_tokens_per_s)
            for r in runs if r.batch_size == batch_size and r.policy == policy and not r.warmup}


def add_paired_regret(batches: Sequence[Any], runs: Sequence[Any], fixed_names: dict[int, str],
                      table_name: str) -> None:
    """Set each batch's `paired_regret` (when the table ran) against the best fixed k in hindsight."""
    for batch in batches:
        table = rates_by_round(runs, batch.batch_size, table_name)
        if not table:
            continue
        fixed = {name: rates_by_round(runs, batch.batch_size, name) for name in fixed_names.values()}
        found = paired_regret(table, fixed, fixed_names[batch.best_k])
        batch.paired_regret = None if found is None else found.to_json()


def add_adaptive_comparison(batches: Sequence[Any], runs: Sequence[Any], adaptive_name: str, table_name: str,
                            fixed_names: dict[int, str], first_phase_rounds: int | None = None) -> None:
    """Set each batch's `adaptive` (when the adaptive policy ran): its steady-state goodput over the
    table's and over the best fixed k's (in hindsight), paired per round (`paired_ratio`), and the share
    of its steps' time its own decisions took (median and largest over rounds). With
    `first_phase_rounds` (--workload switch: the rounds before the population changes) the ratio over the
    table is also given per phase."""
    for batch in batches:
        adaptive = rates_by_round(runs, batch.batch_size, adaptive_name)
        if not adaptive:
            continue
        shares = [r.decision_seconds / r.step_seconds for r in runs if r.batch_size == batch.batch_size
                  and r.policy == adaptive_name and not r.warmup and r.step_seconds > 0]
        best = fixed_names[batch.best_k]
        found: dict[str, Any] = {
            "vs_best_fixed": {"against": best, **(paired_ratio(adaptive, rates_by_round(runs, batch.batch_size, best))
                                                  or {})},
            "decision_share": {"median": float(np.median(shares)), "max": float(max(shares))} if shares else None,
        }
        table = rates_by_round(runs, batch.batch_size, table_name)
        if table:
            found["vs_table"] = paired_ratio(adaptive, table)
            if first_phase_rounds is not None:
                found["vs_table_by_phase"] = {
                    phase: paired_ratio({r: g for r, g in adaptive.items() if (r < first_phase_rounds) == first},
                                        table)
                    for phase, first in (("first", True), ("second", False))}
        batch.adaptive = found


def resolve_regret(b: int, runs: list[Any], config: Any, fixed_ks: Sequence[int],
                   run_pair: Callable[[int, list[str]], None], max_extra: int | None = None) -> list[str]:
    """Extra paired rounds at batch size b until the table's paired regret against the best fixed k in
    hindsight is settled (bench.regret: a verdict, from a 95 % interval no wider than ±goal), at most
    `max_extra` (default `config.resolve_rounds`).

    Only the two policies of the pair run (alternating which goes first), so a round costs two
    generations, not one per contender; the best fixed k is re-chosen from the medians after every
    round (only the pair's rounds grow, the others keep theirs). Returns the notes to print."""
    from .policies import TABLE_POLICY, fixed_policy_name

    goal = f"{100 * REGRET_GOAL:g} %"
    limit = config.resolve_rounds if max_extra is None else min(max_extra, config.resolve_rounds)
    fixed_names = {k: fixed_policy_name(k) for k in fixed_ks}
    for extra in range(limit + 1):
        timed = [r for r in runs if r.batch_size == b and not r.warmup]
        best_k = max(fixed_ks, key=lambda k: (ranked_rate(timed, fixed_names[k], k), -k))
        fixed = {name: rates_by_round(runs, b, name) for name in fixed_names.values()}
        found = paired_regret(rates_by_round(runs, b, TABLE_POLICY), fixed, fixed_names[best_k])
        if found is None or found.settled:
            if extra == 0:
                return []
            verdict = "no pair" if found is None else found.verdict
            return [f"b = {b}: {extra} extra paired rounds (table and the best fixed k alone) settled the "
                    f"paired regret: {verdict} against the {goal} goal"]
        if extra == limit:
            break
        run_pair(config.rounds + extra, [TABLE_POLICY, fixed_names[best_k]])
    interval = f"95 % interval {100 * found.low:.1f}% to {100 * found.high:.1f}%"
    if found.verdict == "not resolved":
        return [f"b = {b}: the paired regret is still not resolved after {limit} extra paired "
                f"rounds ({interval} straddles the {goal} goal; --resolve-rounds sets how many)"]
    return [f"b = {b}: {found.verdict}, but after {limit} extra paired rounds the {interval} is still "
            f"wider than ±{goal}: a noisy machine (--resolve-rounds sets how many)"]


def ranked_rate(timed: Sequence[Any], name: str, k: int) -> float:
    """The figure `results.summarize_batch` ranks fixed k by, for one policy's timed runs."""
    from .results import compared_rate, summarize_policy

    records = [r for r in timed if r.policy == name]
    return compared_rate(summarize_policy(name, k, records)) if records else float("-inf")
