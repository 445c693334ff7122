"""From timed runs to results: RunRecord (one generation) -> PolicyResult (one policy at one batch
size, over its rounds) -> BatchResult (every policy at one batch size) -> BenchResult (the run).

Policies are ranked by steady-state goodput where it was measured (`compared_rate`). Each batch
size's `strategy_comparison` puts the best chain (the best fixed k, k = 0 included), the best tree and
the best staged policy side by side, against plain decoding and the best chain.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .config import BenchConfig, synthetic_label
from .policies import HF_ASSISTED, HF_GREEDY, TABLE_POLICY, fixed_policy_name, policy_family

COMPARISON_KEYS = ("best_chain", "best_tree", "best_staged")


@dataclass
class RunRecord:
    """One timed generation, in the order it ran."""

    batch_size: int
    round: int  # warm-up rounds are negative: -warmup_rounds .. -1
    policy: str
    generated_tokens: int
    seconds: float
    steps: int = 0
    full_batch_steps: int = 0  # steps that ran with all batch_size rows
    accepted_per_position: list[int] = field(default_factory=list)
    trials_per_position: list[int] = field(default_factory=list)
    k_counts_full_batch: dict[int, int] = field(default_factory=dict)  # k -> steps, full-batch steps only
    nodes_counts_full_batch: dict[int, int] = field(default_factory=dict)  # draft tokens per row -> steps, ditto
    # tokens / seconds over the steps that ran with the full batch (no prefill, no thinning tail):
    # the steady state the performance model's G(b, k) describes; None for peers
    steady_tokens_per_s: float | None = None
    # perfmodel.explain.MeasuredSteps: the full-batch steps with each pass timed (`explain`); None for peers
    measured_steps: Any = None
    # the context the full-batch steps paid for (their target passes' longest row, mean over those steps);
    # None for peers: each round is predicted at its own context (bench.predict)
    context_len: float | None = None
    step_seconds: float = 0.0  # the steps' wall time (GenerationStats.step_s summed)
    decision_seconds: float = 0.0  # of which the policy's own decisions (GenerationStats.decision_s summed)

    @property
    def warmup(self) -> bool:
        return self.round < 0

    @property
    def wall_tokens_per_s(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds > 0 else 0.0


@dataclass
class PolicyResult:
    policy: str  # "k=3", "table", "tree:0,1,0.0", "k=3+ngram", "tree:0,1,0.0+ngram", "hf-greedy", "hf-assisted"
    k: int | None  # fixed k or a tree's depth; the table's most frequent k at full batch; None for peers
    wall_tokens_per_s: list[float]  # one per timed round, in round order
    median_wall_tokens_per_s: float
    p10_wall_tokens_per_s: float
    p90_wall_tokens_per_s: float
    min_wall_tokens_per_s: float
    max_wall_tokens_per_s: float
    acceptance: float | None  # accepted / proposed draft tokens, pooled over positions and rounds
    acceptance_per_position: list[float]  # P(draft token i accepted | tokens 1..i-1 were)
    trials_per_position: list[int]  # how many draft tokens i were proposed: each rate's sample size
    full_batch_step_fraction: float | None  # None for peers: generate() does not report its steps
    median_steady_tokens_per_s: float | None = None  # full-batch steps only: compare with predictions
    p10_steady_tokens_per_s: float | None = None
    p90_steady_tokens_per_s: float | None = None
    predicted_tokens_per_s: float | None = None  # median over rounds of each round's prediction at its context
    # geometric mean over rounds of predicted / measured steady goodput - 1, each round predicted at its own
    # context (bench.predict)
    prediction_error: float | None = None
    # what ran (Strategy.describe(): "none", "chain k=3", "tree 0,1,0.0 (3 nodes) +ngram"); the table's
    # strategy at this batch size and the run's mean context; None for peers
    strategy: str | None = None
    nodes: int | None = None  # draft tokens verified per row per step (most frequent at full batch); None for peers

    @property
    def rounds(self) -> int:
        return len(self.wall_tokens_per_s)


@dataclass
class PeerRatio:
    ours: str
    theirs: str
    ratio: float  # ours / theirs, medians of the same rounds


@dataclass
class BatchResult:
    batch_size: int
    context_len: int  # mean context over a run (prompt + half the new tokens): where predictions are taken
    policies: list[PolicyResult]
    best_k: int  # the best fixed k in hindsight (highest median tokens/s)
    best_tokens_per_s: float
    table_k: int | None
    table_regret: float | None  # 1 - table / best fixed k; negative when the table beat every fixed k
    table_speedup: float | None  # table / k = 0
    peer_ratios: list[PeerRatio] = field(default_factory=list)
    # best_chain | best_tree | best_staged -> {policy, strategy, steady_tokens_per_s, vs_plain, vs_best_chain}
    # or None when no such policy ran; see `strategy_comparison`
    strategy_comparison: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    # perfmodel.explain.Explanation.to_json() of the table's (else the best fixed k's) pooled rounds
    explanation: dict[str, Any] | None = None
    paired_regret: dict[str, Any] | None = None  # bench.regret.paired_regret(...).to_json()
    adaptive: dict[str, Any] | None = None  # bench.regret.add_adaptive_comparison: adaptive / table, paired
    machine_speed: dict[str, Any] | None = None  # bench.speed.MachineSpeed.at(): reference pass vs calibration

    def policy(self, name: str) -> PolicyResult | None:
        return next((p for p in self.policies if p.policy == name), None)


@dataclass
class BenchResult:
    config: BenchConfig
    device: dict[str, Any]
    models: dict[str, Any]
    prompts: dict[str, Any]
    batches: list[BatchResult]
    runs: list[RunRecord]  # every generation, warm-ups included, in execution order
    notes: list[str]
    vllm: Any = None  # bench.vllm.compare.Comparison with --peers vllm
    interrupted: bool = False  # Ctrl-C: `batches` are the batch sizes with a finished round

    @property
    def synthetic(self) -> str | None:
        return synthetic_label(self.config.synthetic_acceptance)


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, p10, p90 (linear interpolation), min and max of a non-empty list."""
    array = np.asarray(values, dtype=float)
    return {"median": float(np.median(array)), "p10": float(np.percentile(array, 10)),
            "p90": float(np.percentile(array, 90)), "min": float(array.min()), "max": float(array.max())}


def pooled_acceptance(records: Sequence[RunRecord]) -> tuple[float | None, list[float], list[int]]:
    """(accepted / proposed over all positions, per-position conditional rates, trials per position)."""
    width = max((len(r.trials_per_position) for r in records), default=0)
    accepted, trials = [0] * width, [0] * width
    for record in records:
        for i, (a, t) in enumerate(zip(record.accepted_per_position, record.trials_per_position)):
            accepted[i] += a
            trials[i] += t
    proposed = sum(trials)
    per_position = [a / t if t else 0.0 for a, t in zip(accepted, trials)]
    return (sum(accepted) / proposed if proposed else None), per_position, trials


def _most_frequent(counts: Counter[int]) -> int | None:
    """The most frequent value (ties: the smaller)."""
    if not counts:
        return None
    return min(counts, key=lambda value: (-counts[value], value))


def most_frequent_k(records: Sequence[RunRecord]) -> int | None:
    """The k the table chose most often at full batch size (ties: the smaller k)."""
    counts: Counter[int] = Counter()
    for record in records:
        counts.update(record.k_counts_full_batch)
    return _most_frequent(counts)


def most_frequent_nodes(records: Sequence[RunRecord]) -> int | None:
    """Draft tokens verified per row in most full-batch steps (ties: the fewer)."""
    counts: Counter[int] = Counter()
    for record in records:
        counts.update(record.nodes_counts_full_batch)
    return _most_frequent(counts)


def summarize_policy(policy: str, k: int | None, records: Sequence[RunRecord],
                     strategy: str | None = None) -> PolicyResult:
    """Aggregate the timed rounds of one policy at one batch size; `strategy` says what ran."""
    rates = [r.wall_tokens_per_s for r in sorted(records, key=lambda r: r.round)]
    stats = spread(rates)
    acceptance, per_position, trials = pooled_acceptance(records)
    steps = sum(r.steps for r in records)
    full_fraction = sum(r.full_batch_steps for r in records) / steps if steps else None
    steady = [r.steady_tokens_per_s for r in records if r.steady_tokens_per_s is not None]
    steady_stats = spread(steady) if steady else {"median": None, "p10": None, "p90": None}
    return PolicyResult(
        median_steady_tokens_per_s=steady_stats["median"], p10_steady_tokens_per_s=steady_stats["p10"],
        p90_steady_tokens_per_s=steady_stats["p90"],
        policy=policy, k=k, wall_tokens_per_s=rates, median_wall_tokens_per_s=stats["median"],
        p10_wall_tokens_per_s=stats["p10"], p90_wall_tokens_per_s=stats["p90"], min_wall_tokens_per_s=stats["min"],
        max_wall_tokens_per_s=stats["max"], acceptance=acceptance, acceptance_per_position=per_position,
        trials_per_position=trials, full_batch_step_fraction=full_fraction, strategy=strategy,
        nodes=most_frequent_nodes(records),
    )


def peer_ratios(batch: BatchResult, ours: str) -> list[PeerRatio]:
    """Ours / theirs: plain vs plain (runtime efficiency), then our speculation vs each peer."""
    pairs = [(fixed_policy_name(0), HF_GREEDY), (ours, HF_GREEDY), (ours, HF_ASSISTED)]
    ratios, seen = [], set()
    for mine, theirs in pairs:
        a, b = batch.policy(mine), batch.policy(theirs)
        if a is None or b is None or (mine, theirs) in seen or b.median_wall_tokens_per_s <= 0:
            continue
        seen.add((mine, theirs))
        ratios.append(PeerRatio(ours=mine, theirs=theirs,
                                ratio=a.median_wall_tokens_per_s / b.median_wall_tokens_per_s))
    return ratios


def compared_rate(policy: PolicyResult) -> float:
    """The figure policies are ranked by: steady-state goodput when measured, else wall tokens/s."""
    steady = policy.median_steady_tokens_per_s
    return steady if steady is not None else policy.median_wall_tokens_per_s


def _ratio(numerator: float, denominator: float) -> float | None:
    return numerator / denominator if denominator > 0 else None


def strategy_comparison(policies: Sequence[PolicyResult], best_chain: PolicyResult,
                        plain: PolicyResult) -> dict[str, dict[str, Any] | None]:
    """The best chain (the best fixed k, k = 0 included), the best tree and the best staged policy
    (k=K+ngram or tree:SPEC+ngram) side by side, each ranked by `compared_rate` (ties: the one run
    first), with its ratio to plain decoding (k = 0) and to the best chain; None where none ran."""
    plain_rate, chain_rate = compared_rate(plain), compared_rate(best_chain)

    def entry(policy: PolicyResult | None) -> dict[str, Any] | None:
        if policy is None:
            return None
        rate = compared_rate(policy)
        return {"policy": policy.policy, "strategy": policy.strategy, "steady_tokens_per_s": rate,
                "vs_plain": _ratio(rate, plain_rate), "vs_best_chain": _ratio(rate, chain_rate)}

    def best(family: str) -> PolicyResult | None:
        members = [p for p in policies if policy_family(p.policy) == family]
        return max(members, key=compared_rate) if members else None  # max keeps the first of equals

    return dict(zip(COMPARISON_KEYS, (entry(best_chain), entry(best("tree")), entry(best("staged")))))


def summarize_batch(batch_size: int, context_len: int, policies: list[PolicyResult], fixed_ks: Sequence[int],
                    has_peers: bool) -> BatchResult:
    """Best fixed k in hindsight, the table's k, regret and speedup over k = 0, and the side-by-side
    comparison of the best chain, tree and staged policy (`strategy_comparison`).

    Compared on steady-state goodput (the full-batch steps: every draft and verify pass and the step
    overhead, without the prefill, which is the same for every k, and without the thinning tail of a
    fixed batch, which a continuously refilled server does not have); on wall-clock tokens/s where a
    run has no steady state to report."""
    by_name = {p.policy: p for p in policies}
    fixed = [by_name[fixed_policy_name(k)] for k in fixed_ks]
    best = max(fixed, key=lambda p: (compared_rate(p), -p.k))  # ties go to the smaller k
    plain = by_name[fixed_policy_name(0)]
    table = by_name.get(TABLE_POLICY)
    batch = BatchResult(
        batch_size=batch_size, context_len=context_len, policies=policies, best_k=best.k,
        best_tokens_per_s=compared_rate(best), table_k=table.k if table else None,
        table_regret=1.0 - compared_rate(table) / compared_rate(best) if table else None,
        table_speedup=compared_rate(table) / compared_rate(plain) if table else None,
        strategy_comparison=strategy_comparison(policies, best, plain),
    )
    if has_peers:
        batch.peer_ratios = peer_ratios(batch, TABLE_POLICY if table else fixed_policy_name(best.k))
    return batch

