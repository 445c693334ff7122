"""Adaptive speculation: the fitted step model in the loop, with acceptance learned online per request.

`AdaptivePolicy` chooses, at every step, the strategy with the best predicted goodput
G = b * E_batch(s) / S(b, s, L) among its candidates (no speculation, chains k = 1..max_k, and the same
chains with the n-gram second stage when the model measured one and the generator has it), where
  * S(b, s, L) is `perfmodel.strategy.StepModel`'s step time at the current batch size b and the longest
    row's context L (rounded up to `context_bucket` tokens, so the step times of a (b, L) bucket are
    computed once and every later decision is a table look-up plus a few vector operations);
  * E_batch(s) is the mean over the batch's rows of each row's own E_r(s), from its acceptance estimate.

The estimator (`RequestAcceptance`). Each request r has a Beta posterior on its per-token acceptance
alpha_r: prior Beta(alpha_0 * n_0, (1 - alpha_0) * n_0), i.e. the calibrated alpha_0 worth n_0 = 8
pseudo-trials by default (`PRIOR_TRIALS`); a step in which the row was shown k draft tokens and accepted
a of them adds a successes and, when a < k, one failure (the geometric likelihood of i.i.d. tokens).
Acceptance drifts along a sequence (code, then a comment), so older evidence is forgotten: before a
step's t = a + [a < k] trials are added, the counts AND the prior's weight are multiplied by
(1 - 1 / m)^t with a memory of m = 64 tokens (`MEMORY_TOKENS`). The point estimate is the posterior mean
(alpha_0 n_0 w + s) / (n_0 w + s + f), w the prior's remaining weight (1 at the start): a new request
starts at the calibrated value, after ~n_0 observed tokens its own history weighs as much as the prior
(a base64 request at alpha ~ 0.2 is recognised after two or three k = 4 steps), and a long request is
judged on its last ~m tokens alone, without a lasting pull toward alpha_0. `interval` is the central
Beta credible interval of that posterior: for a stationary alpha its half-width settles near
1.96 * sqrt(alpha (1 - alpha) / m) (+-0.12 at alpha = 0.35), the floor that forgetting buys tracking with.
alpha_0 is the constant alpha whose E(k) = (1 - alpha^(k+1)) / (1 - alpha) best fits the profile's
measured step-aligned E(k) (`matching_alpha`): the same per-token rate the runtime observes.

From alpha_r to E_r. The calibrated E_cal(k) has a position shape that a constant alpha lacks (the first
token after a disagreement is harder), so a row's E is the calibrated one with its extra tokens scaled:
    E_r(k) = 1 + (E_cal(k) - 1) * sum_{i<=k} alpha_r^i / sum_{i<=k} alpha_0^i
which equals E_cal(k) when alpha_r = alpha_0: with nothing to adapt to the policy predicts what the
table predicted (up to the context, which the table fixes at one bucket and the policy reads each step).

Hysteresis. The current strategy is kept unless a challenger's predicted goodput beats it by more than
`switch_margin` (3 %: about the acceptance uncertainty of a calibrated E(k)) on `persist_steps`
consecutive steps at the same batch size; a change of batch size (rows joined or left) lets the margin
alone decide, as the table would switch at once. Switching costs it accounts for:
  * the KV margin: allocated ONCE for max_k (every slot has room for the longest candidate), so a switch
    allocates nothing and costs nothing there;
  * wider passes: a larger k verifies k + 1 tokens and drafts k - 1 more passes, all inside S;
  * draft catch-up: after n steps at k = 0 the draft lags n tokens and the next chain's first draft pass
    is n + 1 tokens wide; the extra time T_d(b, n + 1, L) - T_d(b, 1, L) is spread over `horizon_steps`
    steps and added to every chain candidate's S while the current strategy is k = 0.
The state resets when the last live request is released (an idle engine, the end of a `generate`).

Rows are identified by stable request ids, never batch indices (rows leave and join): the generator and
the engine call `choose(request_ids, L)` before a step, `observe(request_ids, proposed, accepted)` after
it and `release(request_ids)` when requests end (the optional hooks of `runtime.policy`).
Draft-side early stop (`runtime.draft_stop.DraftStop`) runs inside plain chain steps when `early_stop`.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Hashable, Sequence

import numpy as np

from perfmodel.errors import UsageError
from perfmodel.strategy import StepModel
from perfmodel.tree import Strategy, chain

from .draft_stop import DraftStop

PRIOR_TRIALS = 8.0  # pseudo-trials of the calibrated alpha: ~2 steps of k = 4 weigh as much as the prior
MEMORY_TOKENS = 64.0  # a request's evidence saturates at this many draft tokens (older ones are forgotten)
SWITCH_MARGIN = 0.03  # relative predicted gain a challenger needs
PERSIST_STEPS = 2  # consecutive steps it needs it for, at an unchanged batch size
HORIZON_STEPS = 8  # steps a one-time catch-up cost is spread over
CONTEXT_BUCKET = 64  # context lengths are rounded up to this many tokens for the step-time cache


def matching_alpha(tokens_per_step: Sequence[float]) -> float:
    """The constant alpha whose (1 - alpha^(k+1)) / (1 - alpha) best fits E(k), k = 1..K (least squares).

    >>> round(matching_alpha([1.0, 1.5, 1.75, 1.875]), 3)
    0.5
    """
    measured = np.asarray(tokens_per_step[1:], dtype=float)
    if measured.size == 0:
        raise UsageError("adaptive: the acceptance has no E(k) for k >= 1 to derive alpha_0 from")
    alphas = np.linspace(0.0, 0.999, 1999)[:, None]
    ks = np.arange(1, measured.size + 1)[None, :]
    curves = (1.0 - alphas ** (ks + 1)) / (1.0 - alphas)
    return float(alphas[np.argmin(((curves - measured) ** 2).sum(1)), 0])


class RequestAcceptance:
    """Per-request Beta posteriors of the per-token acceptance (see the module docstring)."""

    def __init__(self, prior_alpha: float, prior_trials: float = PRIOR_TRIALS, memory_tokens: float = MEMORY_TOKENS):
        if not 0.0 <= prior_alpha <= 1.0 or prior_trials <= 0 or memory_tokens < 1:
            raise UsageError(f"adaptive: need a prior alpha in [0, 1], a positive strength and a memory >= 1 token, "
                             f"got {prior_alpha}, {prior_trials}, {memory_tokens}")
        self.prior_alpha, self.prior_trials = prior_alpha, prior_trials
        self.keep_per_trial = 1.0 - 1.0 / memory_tokens
        # request id -> [accepted tokens, rejected tokens, the prior's remaining weight], all forgotten alike
        self.counts: dict[Hashable, list[float]] = {}

    def observe(self, request_ids: Sequence[Hashable], proposed: int, accepted: Sequence[int]) -> None:
        if proposed <= 0:
            return
        for request_id, a in zip(request_ids, accepted):
            counts = self.counts.setdefault(request_id, [0.0, 0.0, 1.0])
            missed = a < proposed
            keep = self.keep_per_trial ** (a + missed)
            counts[0] = counts[0] * keep + a
            counts[1] = counts[1] * keep + missed
            counts[2] *= keep

    def release(self, request_ids: Sequence[Hashable]) -> None:
        for request_id in request_ids:
            self.counts.pop(request_id, None)

    def _beta(self, request_id: Hashable) -> tuple[float, float]:
        hits, misses, weight = self.counts.get(request_id, (0.0, 0.0, 1.0))
        prior = self.prior_trials * weight
        return self.prior_alpha * prior + hits, (1.0 - self.prior_alpha) * prior + misses

    def means(self, request_ids: Sequence[Hashable]) -> np.ndarray:
        """Posterior mean per request (the prior's alpha_0 for a request never observed)."""
        alpha0, n0, unseen = self.prior_alpha, self.prior_trials, (0.0, 0.0, 1.0)
        get = self.counts.get
        return np.array([(alpha0 * n0 * w + h) / (n0 * w + h + m) for h, m, w in (get(r, unseen) for r in request_ids)])

    def interval(self, request_id: Hashable, level: float = 0.95) -> tuple[float, float]:
        """The central `level` Beta credible interval of a request's alpha."""
        from scipy.stats import beta

        a, b = self._beta(request_id)
        return float(beta.ppf((1 - level) / 2, a, b)), float(beta.ppf((1 + level) / 2, a, b))


class AdaptivePolicy:
    """A policy (`runtime.policy`) that evaluates the step model every step with online acceptance."""

    def __init__(self, model: StepModel, max_k: int = 8, *, staged: bool = False,
                 prior_trials: float = PRIOR_TRIALS, switch_margin: float = SWITCH_MARGIN,
                 persist_steps: int = PERSIST_STEPS, horizon_steps: int = HORIZON_STEPS,
                 context_bucket: int = CONTEXT_BUCKET, early_stop: bool = True, name: str = "adaptive"):
        if max_k < 0 or switch_margin < 0 or persist_steps < 1 or horizon_steps < 1 or context_bucket < 1:
            raise UsageError("adaptive: need max_k >= 0, switch_margin >= 0, persist_steps, horizon_steps and "
                             "context_bucket >= 1")
        if model.acceptance.tokens_per_step is not None and len(model.acceptance.tokens_per_step) > 1:
            prior_alpha = matching_alpha(model.acceptance.tokens_per_step)
        else:
            prior_alpha = model.acceptance.constant.alpha
        self.model, self.name = model, name
        self.candidates = [Strategy(None)] + [Strategy(chain(k)) for k in range(1, max_k + 1)]
        if staged:
            if model.stage2 is None:
                raise UsageError("adaptive: the second stage was asked for but the model has no stage2 measurements")
            self.candidates += [Strategy(chain(k), stage2=True) for k in range(1, max_k + 1)]
        self.max_k = max_k
        self.needs_stage2 = staged
        self.acceptance = RequestAcceptance(prior_alpha, prior_trials)
        self.switch_margin, self.persist_steps, self.horizon_steps = switch_margin, persist_steps, horizon_steps
        self.context_bucket = context_bucket
        depth = np.array([s.k for s in self.candidates])
        self._depth = depth
        self._exponents = np.arange(1, max_k + 1, dtype=float)
        self._sums = np.zeros(max_k + 1)  # scratch: mean over rows of sum_{i<=k} alpha_r^i, k = 0..max_k
        self._is_chain = depth > 0
        prior_extra = np.array([model.tokens_per_step(s) - 1.0 for s in self.candidates])
        prior_sum = np.array([sum(prior_alpha ** i for i in range(1, d + 1)) for d in depth])
        # E_r(s) - 1 = scale[s] * sum_{i<=k} alpha_r^i  (0 for no speculation)
        self._scale = np.where(prior_sum > 0, prior_extra / np.maximum(prior_sum, 1e-12), 0.0)
        self._step_ms: dict[tuple[int, int], np.ndarray] = {}
        self.draft_stop = DraftStop(model, self._chain_step_ms) if early_stop else None
        self._reset()

    # ------------------------------------------------------------------ the policy protocol
    def __call__(self, batch_size: int, context_len: int):
        """Without request ids (a caller that does not use the hooks): every row at the prior."""
        return self.choose([("anonymous", i) for i in range(batch_size)], context_len)

    def describe(self) -> str:
        stop = ", draft early stop" if self.draft_stop is not None else ""
        return (f"{self.name} (prior alpha {self.acceptance.prior_alpha:.3f} x {self.acceptance.prior_trials:g} "
                f"trials, margin {self.switch_margin:.0%}{stop})")

    def choose(self, request_ids: Sequence[Hashable], context_len: int):
        started = time.perf_counter()
        b = len(request_ids)
        goodput = self.predicted_goodput(request_ids, context_len).tolist()
        best = goodput.index(max(goodput))  # the first of equals: the simpler strategy
        current = self._current
        if current is None or b != self._batch_size:
            self._streak = 0
            if current is None or goodput[best] > goodput[current] * (1 + self.switch_margin):
                current = best
        elif best != current and goodput[best] > goodput[current] * (1 + self.switch_margin):
            self._streak += 1
            if self._streak >= self.persist_steps:
                current, self._streak = best, 0
        else:
            self._streak = 0
        self._current, self._batch_size = current, b
        strategy = self.candidates[current]
        self._lag_steps = self._lag_steps + 1 if strategy.tree is None else 0
        self.last_decision_s = time.perf_counter() - started
        if self.draft_stop is not None:
            self.draft_stop.plan(b, self._bucket(context_len), strategy.k if strategy.kind == "chain"
                                 and not strategy.stage2 else 0)
        return strategy if strategy.stage2 else strategy.k

    def observe(self, request_ids: Sequence[Hashable], proposed: int, accepted: Sequence[int]) -> None:
        """After a chain step: each row was shown `proposed` draft tokens and accepted `accepted[i]`."""
        self.acceptance.observe(request_ids, proposed, accepted)
        if self.draft_stop is not None:
            self.draft_stop.observe(accepted)

    def release(self, request_ids: Sequence[Hashable]) -> None:
        self.acceptance.release(request_ids)
        if not self.acceptance.counts:
            self._reset()

    # ------------------------------------------------------------------ the prediction
    def predicted_goodput(self, request_ids: Sequence[Hashable], context_len: int) -> np.ndarray:
        """Predicted tokens/s of every candidate for these rows (the hysteresis aside)."""
        b, bucket = len(request_ids), self._bucket(context_len)
        alphas = self.acceptance.means(request_ids)
        # mean over rows of sum_{i<=k} alpha_r^i for k = 1..max_k, then per candidate by its depth
        self._sums[1:] = np.power.outer(alphas, self._exponents).cumsum(1).mean(0)
        tokens = 1.0 + self._scale * self._sums[self._depth]
        step_ms = self._step_times(b, bucket)
        if self._lag_steps > 0 and self.candidates[self._current].tree is None:
            catch_up_ms = (self._latency("draft", b, self._lag_steps + 1, bucket)
                           - self._latency("draft", b, 1, bucket)) / self.horizon_steps
            step_ms = step_ms + self._is_chain * catch_up_ms
        return b * tokens / step_ms * 1e3

    def _step_times(self, batch_size: int, bucket: int) -> np.ndarray:
        key = (batch_size, bucket)
        if key not in self._step_ms:
            if len(self._step_ms) > 4096:  # a long-running server sees many (b, L) pairs
                self._step_ms.clear()
            self._step_ms[key] = np.array([self.model.evaluate(s, batch_size, bucket).step_ms
                                           for s in self.candidates])
        return self._step_ms[key]

    def _chain_step_ms(self, batch_size: int, bucket: int, k: int) -> float:
        """Predicted step time of a plain chain of k (the draft stop's threshold)."""
        return float(self._step_times(batch_size, bucket)[k])

    def _latency(self, role: str, batch_size: int, new_tokens: int, bucket: int) -> float:
        return self.model._latency(role, batch_size, new_tokens, bucket)

    def _bucket(self, context_len: int) -> int:
        return -(-context_len // self.context_bucket) * self.context_bucket or self.context_bucket

    def _reset(self) -> None:
        self._current, self._batch_size, self._streak, self._lag_steps = None, 0, 0, 0
        self.last_decision_s = 0.0


def adaptive_policy(model_file: Path, max_k: int | None = None, staged: bool = False, mode: str = "greedy",
                    early_stop: bool = True) -> AdaptivePolicy:
    """The adaptive policy from a specbatch.model/1 file: its latency fit, its overhead and, as the prior,
    its acceptance measured in `mode` (greedy | sampling; else its first entry). `max_k` defaults to the
    profile's; `staged` adds the second-stage chains (needs the profile's stage2 measurements)."""
    from perfmodel.model import choose_acceptance, load_model, step_model

    fitted = load_model(model_file)
    acceptance = next((a for a in fitted.acceptance if a.mode == mode), None) or \
        choose_acceptance(fitted, None, str(model_file))
    policy = AdaptivePolicy(step_model(fitted, acceptance), fitted.grid.max_k if max_k is None else max_k,
                            staged=staged and fitted.stage2 is not None, early_stop=early_stop,
                            name=f"adaptive {Path(model_file).name}")
    policy.stage2_record = {"file": fitted.stage2.file, "sha256": fitted.stage2.sha256} \
        if policy.needs_stage2 else None
    policy.made_for = {"target": (fitted.target_info.source, fitted.target_info.fingerprint),
                       "draft": (fitted.draft_info.source, fitted.draft_info.fingerprint)}
    return policy
