"""Draft-side early stop: a chain step stops proposing when the next token no longer pays for itself.

While a plain chain step drafts (runtime.generator `_draft`), each draft pass j yields the draft's
distribution q_j over the j-th token of every row. Before token j is sampled, `DraftStop.propose(j, top)`
decides for the whole batch (the batch shares one shape) whether to propose it:
  * each row's chance of accepting token j is c(top_rj), the draft's top probability mapped through an
    online calibration (`SignalCalibration`): ten bins of top probability, each a Beta posterior whose
    prior mean is the bin's centre (a calibrated draft: accepted as often as it is sure) worth 4
    pseudo-trials, updated after every step with what the target really accepted at that position;
  * the expected gain is dE_j = sum over rows of P(row reached j) * c(top_rj), with P(reached j) the
    product of c over the row's earlier positions in this step;
  * its marginal cost is dS_j = one more draft pass T_d(b, 1, L) plus the wider verify
    T_t(b, j + 1, L) - T_t(b, j, L), from the step model;
  * token j is proposed iff dE_j / dS_j >= E_{j-1} / S_{j-1}: it raises the step's goodput, where
    E_{j-1} is the batch's expected tokens with j - 1 draft tokens and S_{j-1} the model's step time of a
    chain of j - 1. The policy's k is the ceiling; the stop only shortens a step.

Lossless. The decision to propose token j uses only what is known before token j is drawn: the
committed prefix, the draft tokens 1..j-1 (each row's context before j), the draft's distribution q_j
(a function of that context) and the calibration learnt from earlier steps. It never looks at the
sampled token j nor at the acceptance draws. So, conditionally on everything before position j, the
target's rejection sampling at j sees a draft token drawn from q_j (proposed) or none (the target's own
token from p): either way the committed token at j is distributed as p(. | prefix) — the same argument
that makes any k chosen before a step lossless, applied position by position. Greedy: the committed
tokens are the target's argmaxes whatever the draft proposed. When the stop comes after pass j, that
pass fed token j - 1 to the draft; its cache keeps it (runtime.generator sets the draft cache length).
"""
from __future__ import annotations

import time
from typing import Callable

from perfmodel.strategy import StepModel

SIGNAL_BINS = 10  # bins of the draft's top probability
SIGNAL_PRIOR_TRIALS = 4.0  # pseudo-trials per bin, prior mean = the bin's centre


class SignalCalibration:
    """P(the target accepts a draft token | the draft's top probability there), per bin, learnt online.
    Plain Python lists: a step touches a few dozen (row, position) pairs, where numpy's per-call cost
    would dominate."""

    def __init__(self, bins: int = SIGNAL_BINS, prior_trials: float = SIGNAL_PRIOR_TRIALS):
        self.bins = bins
        self.hits = [(i + 0.5) / bins * prior_trials for i in range(bins)]
        self.trials = [prior_trials] * bins
        self.rate = [h / t for h, t in zip(self.hits, self.trials)]

    def index(self, top: list[float]) -> list[int]:
        last = self.bins - 1
        return [min(int(p * self.bins), last) for p in top]

    def update(self, bin_index: int, accepted: bool) -> None:
        self.trials[bin_index] += 1.0
        self.hits[bin_index] += accepted
        self.rate[bin_index] = self.hits[bin_index] / self.trials[bin_index]


class DraftStop:
    """The batch-level stop rule of one chain step at a time (see the module docstring)."""

    def __init__(self, model: StepModel, chain_step_ms: Callable[[int, int, int], float],
                 calibration: SignalCalibration | None = None):
        self.model, self.chain_step_ms = model, chain_step_ms
        self.calibration = calibration or SignalCalibration()
        self.decision_s = 0.0  # this step's time spent in `propose`
        self._costs: dict[tuple[int, int, int], list[tuple[float, float]]] = {}
        self.plan(1, 1, 0)

    def plan(self, batch_size: int, context_len: int, k: int) -> None:
        """A new step of at most k draft tokens over `batch_size` rows at context `context_len`."""
        self.batch_size, self.context_len, self.k = batch_size, context_len, k
        self.signal_bins: list[list[int]] = []  # per proposed position: each row's bin
        self.reach = [1.0] * batch_size  # P(the row accepted every token proposed so far)
        self.expected_tokens = float(batch_size)
        self.decision_s = 0.0
        key = (batch_size, context_len, k)
        if k > 0 and key not in self._costs:  # (S_{j-1}, dS_j) for j = 1..k, from the step model, once
            if len(self._costs) > 4096:
                self._costs.clear()
            self.model.prefetch(batch_size, context_len, k + 1)  # usually warm: the policy's choice asked first
            latency = self.model._latency
            self._costs[key] = [(self.chain_step_ms(batch_size, context_len, j - 1),
                                 latency("draft", batch_size, 1, context_len)
                                 + latency("target", batch_size, j + 1, context_len)
                                 - latency("target", batch_size, j, context_len)) for j in range(1, k + 1)]
        self._step_costs = self._costs.get(key)

    def propose(self, position: int, top_probabilities) -> bool:
        """Whether to propose draft token `position` (1-based), given each row's top probability of q_j."""
        started = time.perf_counter()
        bins = self.calibration.index(top_probabilities.tolist())
        rate = self.calibration.rate
        reach = [r * rate[i] for r, i in zip(self.reach, bins)]  # P(row reaches and accepts token j)
        gain = sum(reach)
        step_ms, marginal_ms = self._step_costs[position - 1]
        worth = gain * step_ms >= self.expected_tokens * marginal_ms
        if worth:
            self.signal_bins.append(bins)
            self.reach = reach
            self.expected_tokens += gain
        self.decision_s += time.perf_counter() - started
        return worth

    def observe(self, accepted) -> None:
        """After the step: row i accepted `accepted[i]` of the proposed tokens; teach the calibration."""
        accepted = list(accepted)
        if self.signal_bins and len(accepted) == len(self.signal_bins[0]):
            update = self.calibration.update
            for position, bins in enumerate(self.signal_bins, start=1):
                for a, bin_index in zip(accepted, bins):
                    if a >= position - 1:  # the row reached this token: every earlier one was accepted
                        update(bin_index, a >= position)
        self.signal_bins = []
