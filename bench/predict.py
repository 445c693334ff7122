"""The performance model beside the measurements: predicted goodput G(b, k, L) for every policy it can
predict, and `--tree auto` (the model's best tree at batch size 1), both from a specbatch.model/1 file.

`perfmodel.model` is imported where it is used: a bench run without --model does not load it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from specbatch.perfmodel.errors import PerfModelError
from specbatch.perfmodel.tree import Strategy, Tree
from specbatch.runtime.sampling import Sampling

from .config import BenchError
from .policies import BenchPolicy, policy_family, table_strategy
from .results import BatchResult, RunRecord


@dataclass(frozen=True)
class Predictor:
    """The performance model's goodput G(b, k, L) (perfmodel, from a specbatch.model/1 file)."""

    fitted: Any  # perfmodel.model.FittedModel
    acceptance: Any  # perfmodel.acceptance.AcceptanceModel
    acceptance_note: str  # which acceptance the predictions use, for bench.json

    def tokens_per_s(self, batch_size: int, k: int, context_len: int) -> float:
        return self.strategy_tokens_per_s(batch_size, Strategy.from_k(k), context_len)

    def strategy_tokens_per_s(self, batch_size: int, strategy: Strategy, context_len: int) -> float:
        """A tree's or a staged step's goodput; PerfModelError when the model lacks rank acceptance
        (trees) or second-stage measurements (+ngram)."""
        from specbatch.perfmodel.model import evaluate_strategy

        return float(evaluate_strategy(self.fitted, strategy, batch_size, context_len, self.acceptance).tokens_per_s)


def load_predictor(model_path: str | os.PathLike, sampling: Sampling, synthetic_acceptance: float | None) -> Predictor:
    """Read the model file and pick the acceptance that matches how the bench generates.

    Synthetic runs accept with probability α at every position, so α is what the prediction must
    use. Real runs use the profile's measurement for the same decoding mode (greedy, or sampling at
    the same temperature) when the profile has one, else its first entry (and say so).
    """
    from specbatch.perfmodel.acceptance import acceptance_from_user
    from specbatch.perfmodel.model import choose_acceptance, load_model

    fitted = load_model(model_path)
    if synthetic_acceptance is not None:
        return Predictor(fitted, acceptance_from_user([synthetic_acceptance], "--synthetic-acceptance"),
                         f"synthetic α={synthetic_acceptance:g} at every position")
    mode = "greedy" if sampling.greedy else "sampling"
    for entry in fitted.acceptance:
        if entry.mode == mode and (sampling.greedy or entry.temperature == sampling.temperature):
            return Predictor(fitted, entry, f"the profile's {sampling.describe()} measurement")
    chosen = choose_acceptance(fitted, None, str(model_path))
    return Predictor(fitted, chosen, f"the profile's first acceptance entry ({chosen.mode}); none matches "
                                     f"{sampling.describe()}")


def resolve_auto_tree(predictor: Predictor, model_path, context_len: int, staged: bool) -> tuple[Tree, str]:
    """--tree auto: the performance model's best tree at batch size 1 and the bench's context, among
    grown trees ("tree" family) or, when a second stage is benchmarked and the model measured one,
    among trees with and without it ("all"). Returns the tree and why it was chosen, for the note."""
    from specbatch.perfmodel.model import query_strategies

    if predictor.acceptance.rank_acceptance is None:
        raise BenchError(f"--tree auto: {model_path} has no rank acceptance (per depth and rank) in "
                         f"{predictor.acceptance_note}; calibrate again to measure it, or give a tree spec")
    family = "all" if staged and predictor.fitted.stage2 is not None else "tree"
    try:
        choice = query_strategies(predictor.fitted, predictor.acceptance, 1, context_len, strategies=family)
    except PerfModelError as error:
        raise BenchError(f"--tree auto: {error}") from None
    best = next((c for c in choice.ranked if c.strategy.kind == "tree"), None)
    if best is None:
        raise BenchError(f"--tree auto: {model_path} proposes no tree (its rank acceptance grows only chains); "
                         "give a tree spec")
    tree = best.strategy.tree
    why = (f"the performance model's best tree at batch size 1 and context {context_len} among its {family!r} "
           f"candidates ({best.strategy.describe(40)}: {best.tokens_per_s:.4g} tokens/s predicted); its "
           f"{tree.num_nodes} nodes: {tree.spec()}")
    return tree, why


def add_predictions(batches: list[BatchResult], predictor: Predictor, policies: dict[str, BenchPolicy],
                    runs: Sequence[RunRecord] = ()) -> list[str]:
    """Predicted goodput for every fixed k, for the table's strategy, and for trees and staged steps
    (evaluate_strategy). Each timed round is predicted at the context its own full-batch steps paid for
    (`RunRecord.context_len`; the batch's mean context where a run has none): the longest of b prompts
    varies from round to round and goodput is not linear in it. `predicted_tokens_per_s` is the median of
    the rounds' predictions, `prediction_error` the geometric mean over rounds of predicted / measured - 1. Returns
    notes: one per policy family the model cannot predict (no rank acceptance for trees, no
    second-stage measurements for +ngram)."""
    failed: dict[str, tuple[list[str], str]] = {}  # family -> (policies, the first error)
    for batch in batches:
        for policy in batch.policies:
            ours = policies.get(policy.policy)
            if ours is None or policy.k is None or policy_family(policy.policy) == "adaptive":
                continue  # a peer, or a policy whose strategy changes step by step
            records = [r for r in runs if r.batch_size == batch.batch_size and r.policy == policy.policy
                       and not r.warmup and r.steady_tokens_per_s]
            contexts = [r.context_len or batch.context_len for r in records] or [batch.context_len]
            try:
                predicted = [_predicted(predictor, ours, batch.batch_size, context) for context in contexts]
            except PerfModelError as error:
                names, _ = failed.setdefault(policy_family(policy.policy), ([], str(error)))
                if policy.policy not in names:
                    names.append(policy.policy)
                continue
            policy.predicted_tokens_per_s = float(np.median(predicted))
            if records:
                ratios = [p / r.steady_tokens_per_s for p, r in zip(predicted, records)]
                policy.prediction_error = float(np.exp(np.mean(np.log(ratios)))) - 1.0
    return [f"no prediction for {', '.join(names)}: {message}" for names, message in failed.values()]


def _predicted(predictor: Predictor, ours: BenchPolicy, batch_size: int, context_len: float) -> float:
    """One policy's predicted goodput at one context (the table's strategy there, for the table)."""
    context = int(round(context_len))
    strategy = ours.strategy if ours.strategy is not None else table_strategy(ours.policy, batch_size, context)
    return predictor.strategy_tokens_per_s(batch_size, strategy, context)
