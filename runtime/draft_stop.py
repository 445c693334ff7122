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
  * a step of m tokens costs S_m, the model's step time of a chain of m (S_0: no draft token, one
    target pass);
  * token j is proposed iff some depth m in j..k (k the policy's planned k, the ceiling) gives a step
    goodput at least that of stopping now, less the margin: (1 + margin) E_m / S_m >= E_{j-1} / S_{j-1},
    where E_{j-1} is the batch's expected tokens with the j - 1 tokens proposed so far, and
        E_m = E_{j-1} + dE_j * (1 + alpha_{j+1} + alpha_{j+1} alpha_{j+2} + ... + alpha_{j+1}..alpha_m),
    the tokens after j accepted at the calibrated per-position rates (their draft confidences are not
    known yet). m = j alone is the myopic rule dE_j / (S_j - S_{j-1}) >= E_{j-1} / S_{j-1}; looking
    ahead to the plan's depth matters where the goodput is flat or dips in m (a wider verify that
    costs little more up to a tile or thread boundary, a fitted curve with a bend): there the myopic
    rule stopped at the first token that did not pay alone, although it and the next ones together
    did (on the demo pair's idle-machine fit, G(k) dipped at k = 3 at b = 12).
  * the stop overrides the plan only when stopping beats the best continuation by more than `margin`
    (the adaptive policy's STOP_MARGIN, 10 %). The model's step times are good to about 10 % on a
    CPU; without a margin the stop acted on differences of 1-2 % (at b = 16 on the demo pair it cut
    48 of 55 planned k = 4 steps to 1-3 tokens, where a fixed k = 4 ran faster), and at 3 % it still
    cost more than at 10 % at b = 1-8 (runtime.adaptive: DRAFT_STOP, measured in lockstep).
  * the decision is one comparison per position: the rule is linear in E_{j-1}, so per (b, L, k) it
    is solved once into a gain threshold per position (`thresholds`).

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

from specbatch.perfmodel.acceptance import expected_tokens
from specbatch.perfmodel.strategy import StepModel

SIGNAL_BINS = 10  # bins of the draft's top probability
CACHE_ENTRIES = 4096  # a long-running server sees many (b, L) pairs: a per-(b, L) cache past this is emptied
SIGNAL_PRIOR_TRIALS = 4.0  # pseudo-trials per bin, prior mean = the bin's centre


def cached(cache: dict, key, make: Callable[[], object]):
    """cache[key], made by `make()` the first time it is asked for; emptied when it grows past CACHE_ENTRIES
    (the policy's and the stop's step-time figures per (b, L bucket), which a decision only looks up)."""
    found = cache.get(key)
    if found is None:
        if len(cache) > CACHE_ENTRIES:
            cache.clear()
        found = cache[key] = make()
    return found


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
                 calibration: SignalCalibration | None = None, max_k: int = 16, margin: float = 0.0):
        self.model, self.chain_step_ms, self.margin = model, chain_step_ms, margin
        self.calibration = calibration or SignalCalibration()
        # tail[j][m - j]: the tokens a token at j brings by depth m, itself counted, the later ones at the
        # calibrated conditional rates: 1 + alpha_{j+1} + alpha_{j+1} alpha_{j+2} + ... (j, m <= max_k), i.e.
        # E(m - j) of a chain whose alphas start at position j + 1 (0-based: alphas[j] is alpha_{j+1})
        alphas = model.acceptance.alphas(max_k)
        self.tail = [[expected_tokens(alphas[j:], depth) for depth in range(max_k - j + 1)] for j in range(max_k + 1)]
        self.decision_s = 0.0  # this step's time spent in `propose`
        # (b, L, k) -> per position j = 1..k the gain threshold c_j (index j - 1), from S_0..S_k
        self._thresholds: dict[tuple[int, int, int], list[float]] = {}
        self.plan(1, 1, 0)

    def plan(self, batch_size: int, context_len: int, k: int) -> None:
        """A new step of at most k draft tokens over `batch_size` rows at context `context_len`."""
        self.batch_size, self.context_len, self.k = batch_size, context_len, k
        self.signal_bins: list[list[int]] = []  # per proposed position: each row's bin
        self.reach = [1.0] * batch_size  # P(the row accepted every token proposed so far)
        self.expected_tokens = float(batch_size)
        self.decision_s = 0.0
        self._threshold = None if k == 0 else cached(
            self._thresholds, (batch_size, context_len, k),
            lambda: self.thresholds(self._step_ms_up_to(batch_size, context_len, k)))

    def _step_ms_up_to(self, batch_size: int, context_len: int, k: int) -> list[float]:
        """S_0..S_k from the step model."""
        self.model.prefetch(batch_size, context_len, k + 1)  # usually warm: the policy's choice asked first
        return [self.chain_step_ms(batch_size, context_len, m) for m in range(k + 1)]

    def thresholds(self, step_ms: list[float]) -> list[float]:
        """Per position j = 1..k, c_j such that token j is worth proposing iff its gain dE_j >= E_{j-1} c_j.

        The rule (module docstring), (1 + margin) (E_{j-1} + dE_j t_m) S_{j-1} >= E_{j-1} S_m for some
        m in j..k with t_m = tail[j][m - j] >= 1, is linear in E_{j-1}: dE_j >= E_{j-1} (S_m / ((1 + margin)
        S_{j-1}) - 1) / t_m for some m, i.e. dE_j >= E_{j-1} min_m of that. So a decision is one
        comparison, whatever the depth looked ahead to.
        """
        k = len(step_ms) - 1
        found = []
        for j in range(1, k + 1):
            stop_ms = step_ms[j - 1] * (1.0 + self.margin)
            tail = self.tail[j]
            depths = range(j, min(k, j + len(tail) - 1) + 1)
            found.append(min((step_ms[m] / stop_ms - 1.0) / tail[m - j] for m in depths))
        return found

    def propose(self, position: int, top_probabilities) -> bool:
        """Whether to propose draft token `position` (1-based), given each row's top probability of q_j."""
        started = time.perf_counter()
        bins, last, rate = self.calibration.bins, self.calibration.bins - 1, self.calibration.rate
        indices = [min(int(p * bins), last) for p in top_probabilities.tolist()]
        reach = [r * rate[i] for r, i in zip(self.reach, indices)]  # P(row reaches and accepts token j)
        gain = sum(reach)
        worth = gain >= self.expected_tokens * self._threshold[position - 1]  # `thresholds`
        if worth:
            self.signal_bins.append(indices)
            self.reach = reach
            self.expected_tokens += gain
        self.decision_s += time.perf_counter() - started
        return worth

    def observe(self, accepted) -> None:
        """After the step: row i accepted `accepted[i]` of the proposed tokens; teach the calibration."""
        accepted = list(accepted)
        if self.signal_bins and len(accepted) == len(self.signal_bins[0]):
            calibration = self.calibration
            hits, trials, rate = calibration.hits, calibration.trials, calibration.rate
            for position, bins in enumerate(self.signal_bins, start=1):
                for a, i in zip(accepted, bins):
                    if a >= position - 1:  # the row reached this token: every earlier one was accepted
                        trials[i] += 1.0  # SignalCalibration.update, inline (a step makes dozens)
                        hits[i] += a >= position
                        rate[i] = hits[i] / trials[i]
        self.signal_bins = []
