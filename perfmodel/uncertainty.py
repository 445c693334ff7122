"""Acceptance is a sample estimate: its confidence interval, and when two choices are a tie.

Per-position acceptance alpha_i was estimated from trials_i reached positions; its 95 % interval is the
normal approximation alpha_i +- z * sqrt(alpha_i (1 - alpha_i) / trials_i).

E(k), tokens per step: when the profile carries the standard error of the step-aligned E(k) (calibrate
computes it across prompts, the independent units: `ratio_standard_error`), that; else the delta method
on the alphas, treated as independent: dE/dalpha_j = sum_{i>=j} prod_{l<=i} alpha_l / alpha_j.

Goodput G = b E / S: only E is uncertain here (the latency fit's error is reported by `fit`), so the
relative standard error of G is SE(E) / E. Two strategies are a tie when their predicted goodputs differ
by less than z times the standard error of that difference: with the profile's per-prompt step counts,
the paired one (`paired_difference_se`: both E(k) come from the same prompts, and a prompt that is easy
for k = 4 is easy for k = 5, so most of their uncertainty cancels in the difference); without them,
z * sqrt(se_1^2 + se_2^2), as if independent (wider: conservative).

Assumptions and where they break: positions of one continuation overlap (a step's windows share tokens),
so the per-position trials are not independent and the alpha interval is too narrow; the E(k) of two k
come from the same continuations and are positively correlated, which only the paired form accounts
for; the unpaired fallback calls ties conservatively. Trees (replayed or from rank acceptance) carry no
interval here and are never called a tie.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from .acceptance import AcceptanceModel, extend_alphas
from .tree import Strategy

Z95 = 1.959964  # two-sided 95 % normal quantile


def alpha_half_width(alpha: float, trials: int, z: float = Z95) -> float | None:
    """Half-width of the 95 % interval of one acceptance rate; None without trials.

    >>> round(alpha_half_width(0.75, 300), 4)  # 1.96 * sqrt(0.75 * 0.25 / 300)
    0.049
    """
    if trials <= 0:
        return None
    return z * math.sqrt(alpha * (1.0 - alpha) / trials)


def expected_tokens_se(alphas: Sequence[float], trials: Sequence[int], k: int) -> float | None:
    """SE of E(k) = 1 + sum_i prod_{j<=i} alpha_j by the delta method (independent alphas); None when a
    position up to k has no trials. Positions past the measured list reuse the last one, as E(k) does."""
    if k == 0:
        return 0.0
    values = np.array(extend_alphas(alphas, k))
    counts = list(trials)[:k] + [list(trials)[-1]] * max(0, k - len(trials)) if trials else []
    if len(counts) < k or min(counts) <= 0:
        return None
    survival = np.cumprod(values)  # P(tokens 1..i accepted)
    variance = 0.0
    for j in range(k):
        if values[j] <= 0:
            continue  # dE/dalpha_j needs alpha_j > 0; a zero rate contributes nothing to E past j
        derivative = survival[j:].sum() / values[j]
        variance += derivative ** 2 * values[j] * (1.0 - values[j]) / counts[j]
    return math.sqrt(variance)


def ratio_standard_error(numerators: Sequence[float], denominators: Sequence[float]) -> float:
    """SE of sum(numerators) / sum(denominators) with the units (prompts) as independent clusters:
    sqrt(n / (n - 1) * sum (x_u - R y_u)^2) / sum y_u (the linearization of a ratio estimator); 0 for one unit.

    >>> ratio_standard_error([2, 4], [1, 1])  # R = 3; residuals -1, 1: sqrt(2 * 2) / 2
    1.0
    """
    x, y = np.asarray(numerators, dtype=float), np.asarray(denominators, dtype=float)
    n, total = len(x), float(y.sum())
    if n < 2 or total <= 0:
        return 0.0
    ratio = float(x.sum()) / total
    return math.sqrt(n / (n - 1) * float(((x - ratio * y) ** 2).sum())) / total


def tokens_per_step_se(acceptance: AcceptanceModel, strategy: Strategy) -> float | None:
    """SE of the E a prediction uses for `strategy`: the measured E(k)'s own when the profile has it, else
    the delta method on the per-position alphas; None for trees and for acceptance without a sample size."""
    if strategy.kind == "tree":
        return None
    k = strategy.k
    measured = acceptance.tokens_per_step
    if measured is not None and k < len(measured):
        se = acceptance.tokens_per_step_se
        return None if se is None or k >= len(se) else se[k]
    if acceptance.trials is None:
        return None
    return expected_tokens_se(acceptance.per_position, acceptance.trials, k)


def relative_goodput_se(acceptance: AcceptanceModel, strategy: Strategy) -> float | None:
    """SE(G) / G = SE(E) / E."""
    se = tokens_per_step_se(acceptance, strategy)
    return None if se is None else se / acceptance.expected_tokens(strategy.k)


def is_tie(goodput_1: float, goodput_2: float, relative_se_1: float | None, relative_se_2: float | None,
           z: float = Z95) -> bool:
    """|G1 - G2| < z * sqrt(se1^2 + se2^2); never a tie when either has no interval."""
    if relative_se_1 is None or relative_se_2 is None:
        return False
    combined = z * math.hypot(goodput_1 * relative_se_1, goodput_2 * relative_se_2)
    return abs(goodput_1 - goodput_2) < combined


def paired_difference_se(acceptance: AcceptanceModel, goodput_1: float, k_1: int, goodput_2: float,
                         k_2: int) -> float | None:
    """SE of G_1 - G_2 for two chains, prompt by prompt: with E_i = sum_u t_iu / sum_u s_iu (the prompts u),
    G_i moves with prompt u by G_i / E_i * (t_iu - E_i s_iu) / sum_u s_iu, and the SE is
    sqrt(n / (n - 1) * sum_u (that of G_1 - that of G_2)^2). None without per-prompt counts for both k."""
    counts = acceptance.step_counts_by_prompt
    if counts is None or not 1 <= min(k_1, k_2) or max(k_1, k_2) > len(counts):
        return None
    influence = np.zeros(len(counts[0]))
    for goodput, k, sign in ((goodput_1, k_1, 1.0), (goodput_2, k_2, -1.0)):
        tokens, steps = np.array(counts[k - 1], dtype=float).T
        ratio = tokens.sum() / steps.sum()
        influence += sign * goodput / ratio * (tokens - ratio * steps) / steps.sum()
    n = len(influence)
    return math.sqrt(n / (n - 1) * float((influence ** 2).sum())) if n > 1 else None


def choices_tie(acceptance: AcceptanceModel, best: Strategy, goodput_best: float, other: Strategy,
                goodput_other: float, z: float = Z95) -> tuple[bool, float | None]:
    """(tie?, the difference's 95 % half-width relative to the best goodput): paired when the profile has
    per-prompt counts for both chains, else as if independent (`is_tie`)."""
    if best.kind != "tree" and other.kind != "tree" and best.k == other.k:
        return False, None  # the same E (a chain with and without the second stage): acceptance cannot decide
    if best.kind != "tree" and other.kind != "tree":
        se = paired_difference_se(acceptance, goodput_best, best.k, goodput_other, other.k)
        if se is not None:
            return abs(goodput_best - goodput_other) < z * se, z * se / goodput_best
    se_best, se_other = relative_goodput_se(acceptance, best), relative_goodput_se(acceptance, other)
    if se_best is None or se_other is None:
        return False, None
    width = z * math.hypot(goodput_best * se_best, goodput_other * se_other)
    return is_tie(goodput_best, goodput_other, se_best, se_other, z), width / goodput_best


def table_tie_notes(table, acceptance: AcceptanceModel, z: float = Z95) -> list[str]:
    """One note per run of batch sizes whose chosen strategy and runner-up are within the combined
    acceptance uncertainty: 'b = 3-8: k = 4 or 5: indistinguishable ...'; the same run in several
    context buckets is one note naming them."""
    found: dict[tuple, list] = {}  # (first b, last b, best, runner-up) -> [contexts, largest interval in %]
    for bucket in table.buckets:
        runs: list[list] = []  # [first b, last b, best, runner-up, largest interval in %]
        for entry in bucket.entries:
            if entry.runner_up_k is None or entry.margin is None:
                continue
            best = entry.chosen()
            runner = entry.runner_up_strategy or Strategy.from_k(entry.runner_up_k)
            g_best = entry.predicted_tokens_per_s
            tie, relative_width = choices_tie(acceptance, best, g_best, runner, g_best * (1.0 - entry.margin), z)
            if not tie:
                continue
            width = 100 * relative_width
            if runs and runs[-1][1] == entry.batch_size - 1 and runs[-1][2:4] == [best, runner]:
                runs[-1][1], runs[-1][4] = entry.batch_size, max(runs[-1][4], width)
            else:
                runs.append([entry.batch_size, entry.batch_size, best, runner, width])
        for first, last, best, runner, width in runs:
            seen = found.setdefault((first, last, best, runner), [[], 0.0])
            seen[0].append(bucket.context_len)
            seen[1] = max(seen[1], width)
    if len(table.buckets) > 1:
        return _bucket_tie_notes(found, len(table.buckets))
    notes = []
    for (first, last, best, runner), (_, width) in found.items():
        span = f"b = {first}" if first == last else f"b = {first}-{last}"
        notes.append(f"{span}: {_name(best)} or {_name(runner)}: indistinguishable (goodputs within "
                     f"the acceptance uncertainty, up to ±{width:.1f} %)")
    return notes


def _bucket_tie_notes(found: dict, bucket_count: int) -> list[str]:
    """Several buckets: the ties every bucket shares as one note, then one note per bucket for the rest."""
    def tie(first, last, best, runner):
        return f"{first if first == last else f'{first}-{last}'} {_name(best)} or {_name(runner)}"

    shared = {key: value for key, value in found.items() if len(value[0]) == bucket_count}
    notes = [f"b = {tie(*key)} (every context): indistinguishable (goodputs within the acceptance "
             f"uncertainty, up to ±{width:.1f} %)" for key, (_, width) in shared.items()]
    by_context: dict[int, list] = {}
    for key, (contexts, width) in found.items():
        if key not in shared:
            for context in contexts:
                by_context.setdefault(context, []).append((key, width))
    for context in sorted(by_context):
        ties = by_context[context]
        notes.append(f"context {context}: indistinguishable (within the acceptance uncertainty, up to "
                     f"±{max(w for _, w in ties):.1f} %) at b = " + "; ".join(tie(*key) for key, _ in ties))
    return notes


def _name(strategy: Strategy) -> str:
    return f"k = {strategy.k}" if strategy.kind != "tree" and not strategy.stage2 else strategy.describe(30)


def choice_tie_notes(choice, acceptance: AcceptanceModel, z: float = Z95) -> list[str]:
    """For `query`: the candidates of a `strategy.StrategyChoice` indistinguishable from its best."""
    best = choice.best
    tied = [c.strategy for c in choice.ranked[1:]
            if choices_tie(acceptance, best.strategy, best.tokens_per_s, c.strategy, c.tokens_per_s, z)[0]]
    if not tied:
        return []
    names = " or ".join(_name(s) for s in [best.strategy] + tied)
    return [f"b = {choice.batch_size}: {names}: indistinguishable (goodputs within the acceptance uncertainty)"]
