"""Adaptive speculation: the fitted step model in the loop, with acceptance learned online per request.

Every step `AdaptivePolicy` takes the candidate with the best predicted goodput G = b E_batch(s) / S(b, s, L):
no speculation, chains k = 1..max_k and, when the model measured the second stage, the same chains staged.
S is `perfmodel.strategy.StepModel`'s step time at the current batch size and longest context (rounded up
to `context_bucket` tokens, so a decision is a look-up); E_batch is the mean of the rows' own E_r(s).
Assumes a row's extra tokens per step scale by one factor rho_r at every depth k:
E_r(s) = min(k + 1, 1 + rho_r (E_cal(s) - 1)), E_cal the calibrated step-aligned expectation, so with
rho = 1 the policy predicts what the table did. Rows are stable request ids, told through the optional
hooks of `runtime.policy`; docs/adaptive.md describes the estimator, the hysteresis and the guess rate.
Every step is also a measurement of the model: the policy times it from its answer to its outcome (the step's
one read-back ends it) and records it beside the prediction (`runtime.fidelity`); with a `runtime.refit`
correction, the measured steps re-fit the step costs it chooses from.
"""
from __future__ import annotations

import time
from bisect import bisect_right
from dataclasses import replace
from itertools import accumulate
from pathlib import Path
from typing import Callable, Hashable, Sequence

import numpy as np

from specbatch.perfmodel.errors import UsageError
from specbatch.perfmodel.schedule import staged_rounds
from specbatch.perfmodel.strategy import StepModel
from specbatch.perfmodel.tree import Strategy, chain

from .fidelity import LiveFidelity, announce_noise, noise_band, noise_band_source
from .learning import LEARNING
from .refit import StepCostRefit, step_parts


ADAPTIVE = LEARNING.adaptive  # every knob of this module (runtime.learning)


def cached(cache: dict, key, make: Callable[[], object]):
    """cache[key], made by `make()` the first time it is asked for; emptied past `cache_entries` entries."""
    found = cache.get(key)
    if found is None:
        if len(cache) > ADAPTIVE.cache_entries:
            cache.clear()
        found = cache[key] = make()
    return found


class GuessRate:
    """How often the n-gram second stage guesses the draft's next token, learnt online from the rounds a staged chain
    step took. A staged chain of k drafts in rounds: each wrong guess costs one more draft pass, so a step's
    pass count R (1..k) is a direct, timing-free reading of the guess rate. The profile measured the rate on the
    calibration prompts (`Stage2Info.guess_accuracy`, per rank); on text the n-gram knows less, a staged step
    drafts as many passes as a plain chain, each one wider. Per observed step the rank-0 accuracy a for which
    the model's expected rounds (`perfmodel.schedule.staged_rounds`, at this batch size and candidate) equal R
    is read off a curve over `guess_levels` values of a, and averaged with the calibrated a (worth
    `guess_prior_steps` steps), every weight fading by (1 - 1/`guess_memory_steps`) per staged step, so the estimate
    follows a batch whose population changes. Ranks > 0 scale with rank 0."""

    def __init__(self, calibrated: Sequence[float], memory_steps: float = ADAPTIVE.guess_memory_steps,
                 prior_steps: float = ADAPTIVE.guess_prior_steps, levels: int = ADAPTIVE.guess_levels):
        self.calibrated = tuple(float(a) for a in calibrated)
        # plain lists: `observe` runs between forward passes, where numpy calls on a few numbers are slow
        self.levels = sorted({i / (levels - 1) for i in range(levels)} | {min(1.0, self.calibrated[0])})
        self.calibrated_level = self.levels.index(min(1.0, self.calibrated[0]))
        self.keep, self.prior_steps = 1.0 - 1.0 / memory_steps, prior_steps
        self._curves: dict[tuple[int, int], list[float]] = {}
        self.reset()

    def reset(self) -> None:
        self.evidence, self.weight, self.prior_weight = 0.0, 0.0, 1.0
        self.current = self.calibrated_level

    @property
    def rank0(self) -> float:
        """The current estimate of the rank-0 guess accuracy."""
        prior = self.prior_steps * self.prior_weight
        return (prior * self.calibrated[0] + self.evidence) / (prior + self.weight)

    def level(self) -> int:
        """The grid level the estimate sits at (moved in `observe`, with a quarter-step hysteresis; the
        calibrated rate is a level of its own, exactly)."""
        return self.current

    def accuracy(self, level: int) -> tuple[float, ...]:
        """Per-rank accuracies at a grid level: every rank scaled like rank 0, none above 1."""
        if self.calibrated[0] <= 0:
            return self.calibrated
        scale = self.levels[level] / self.calibrated[0]
        return tuple(min(1.0, a * scale) for a in self.calibrated)

    def observe(self, strategy: Strategy, batch_size: int, passes: int) -> None:
        """A staged chain `strategy` over `batch_size` rows took `passes` draft passes."""
        if self.calibrated[0] <= 0 or strategy.k < 2:  # nothing to guess below two draft tokens
            return
        rounds = cached(self._curves, (strategy.k, batch_size), lambda: [  # staged candidates are chains
            staged_rounds(strategy.tree, batch_size, self.accuracy(i)).expected_rounds
            for i in range(len(self.levels))])  # falling with the accuracy, from k to 1
        self.evidence = self.evidence * self.keep + _read_off(rounds, self.levels, float(passes))
        self.weight = self.weight * self.keep + 1.0
        self.prior_weight *= self.keep
        estimate, levels, current = self.rank0, self.levels, self.current
        # a new level (and the staged candidates' step times evaluated there) only when the estimate is
        # nearer to it than to the current one by a quarter of their distance: no flapping on a boundary
        above = min(bisect_right(levels, estimate), len(levels) - 1)
        nearest = above if above == 0 or levels[above] - estimate < estimate - levels[above - 1] else above - 1
        if nearest != current and abs(estimate - levels[current]) - abs(estimate - levels[nearest]) > \
                0.25 * abs(levels[current] - levels[nearest]):
            self.current = nearest


def _read_off(falling: list[float], levels: list[float], value: float) -> float:
    """The level at which the falling curve (one value per level) passes `value`, linearly between levels;
    the end levels beyond the curve's range."""
    if value >= falling[0]:
        return levels[0]
    for i in range(1, len(falling)):
        if value >= falling[i]:
            span = falling[i - 1] - falling[i]
            share = (falling[i - 1] - value) / span if span > 0 else 1.0
            return levels[i - 1] + share * (levels[i] - levels[i - 1])
    return levels[-1]


class RequestAcceptance:
    """Per request, rho = accepted draft tokens / the calibrated E_cal(k) - 1 per step at the k run, as a Gamma
    posterior: prior Gamma(n_0, n_0) (rho = 1 worth n_0 = `prior_tokens` expected tokens); a step of k proposed
    and a accepted adds a to the shape and E_cal(k) - 1 to the rate, after both sums and the prior's weight
    fade by (1 - 1/`memory_tokens`) per draft token (acceptance drifts along a sequence). A step without
    speculation ages the evidence but not the prior's weight: the estimate drifts back toward the prior."""

    def __init__(self, expected_accepted: Sequence[float], prior_tokens: float = ADAPTIVE.prior_tokens,
                 memory_tokens: float = ADAPTIVE.memory_tokens):
        """`expected_accepted[k]` = E_cal(k) - 1, the calibrated accepted tokens of a chain step of k."""
        if prior_tokens <= 0 or memory_tokens < 1 or not expected_accepted:
            raise UsageError(f"adaptive: need a positive prior strength, a memory >= 1 token and E(k) values, got "
                             f"{prior_tokens}, {memory_tokens}")
        self.expected_accepted = tuple(float(x) for x in expected_accepted)
        self.prior_tokens = prior_tokens
        self.keep_per_token = 1.0 - 1.0 / memory_tokens
        # request id -> [accepted tokens A, expected tokens X, the prior's remaining weight w], forgotten alike
        self.counts: dict[Hashable, list[float]] = {}

    def observe(self, request_ids: Sequence[Hashable], proposed: int, accepted: Sequence[int]) -> None:
        if proposed <= 0:  # a step without speculation: no evidence, and the old evidence ages by its token
            keep = self.keep_per_token
            for request_id in request_ids:
                counts = self.counts.get(request_id)
                if counts is not None:
                    counts[0] *= keep
                    counts[1] *= keep  # not the prior's weight: the estimate drifts back toward it
            return
        expected = self.expected_accepted[min(proposed, len(self.expected_accepted) - 1)]
        for request_id, a in zip(request_ids, accepted):
            counts = self.counts.setdefault(request_id, [0.0, 0.0, 1.0])
            keep = self.keep_per_token ** (a + (a < proposed))
            counts[0] = counts[0] * keep + a
            counts[1] = counts[1] * keep + expected
            counts[2] *= keep

    def release(self, request_ids: Sequence[Hashable]) -> None:
        for request_id in request_ids:
            self.counts.pop(request_id, None)

    def means(self, request_ids: Sequence[Hashable]) -> list[float]:
        """Posterior mean of rho per request (1 for a request never observed); plain Python, as the policy
        asks every step."""
        n0, unseen = self.prior_tokens, (0.0, 0.0, 1.0)
        get = self.counts.get
        return [(n0 * w + a) / (n0 * w + x) for a, x, w in (get(r, unseen) for r in request_ids)]

    def interval(self, request_id: Hashable, level: float = 0.95) -> tuple[float, float]:
        """The central `level` Gamma credible interval of a request's rho."""
        from scipy.stats import gamma

        accepted, expected, weight = self.counts.get(request_id, (0.0, 0.0, 1.0))
        shape, rate = self.prior_tokens * weight + accepted, self.prior_tokens * weight + expected
        return (float(gamma.ppf((1 - level) / 2, shape, scale=1 / rate)),
                float(gamma.ppf((1 + level) / 2, shape, scale=1 / rate)))


class AdaptivePolicy:
    """A policy (`runtime.policy`) that evaluates the step model every step with online acceptance.

    The current strategy is kept unless a challenger's predicted goodput beats it by more than
    `switch_margin` on `persist_steps` consecutive steps at one batch size (after a change of batch size the
    margin alone decides). The KV margin is allocated once for max_k, so a switch costs nothing there; after
    steps at k = 0 every chain candidate pays a draft model's wider catch-up pass, spread over `horizon_steps` (a
    head has none: its step model, `perfmodel.schedule.head_step_passes`, runs its pass at k = 0 too).
    The state resets when the last request is released (the fidelity and the re-fit, about the machine, stay).
    `fidelity` records every step's measured time (by `clock`, from `choose` to `observe`) beside the
    prediction; with `refit` the step times are the model's parts times its re-fitted factors."""

    def __init__(self, model: StepModel, max_k: int = 8, *, staged: bool = False,
                 prior_tokens: float = ADAPTIVE.prior_tokens, memory_tokens: float = ADAPTIVE.memory_tokens,
                 switch_margin: float = ADAPTIVE.switch_margin, persist_steps: int = ADAPTIVE.persist_steps,
                 horizon_steps: int = ADAPTIVE.horizon_steps, context_bucket: int = ADAPTIVE.context_bucket,
                 name: str = "adaptive",
                 fidelity: LiveFidelity | None = None, refit: StepCostRefit | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        if max_k < 0 or switch_margin < 0 or persist_steps < 1 or horizon_steps < 1 or context_bucket < 1:
            raise UsageError("adaptive: need max_k >= 0, switch_margin >= 0, persist_steps, horizon_steps and "
                             "context_bucket >= 1")
        self.model, self.name = model, name
        self.candidates = [Strategy(None)] + [Strategy(chain(k)) for k in range(1, max_k + 1)]
        if staged:
            if model.stage2 is None:
                raise UsageError("adaptive: the second stage was asked for but the model has no stage2 measurements")
            self.candidates += [Strategy(chain(k), stage2=True) for k in range(1, max_k + 1)]
        self.max_k = max_k
        self.needs_stage2 = staged
        chains = [Strategy(chain(k)) if k else Strategy(None) for k in range(max_k + 1)]
        self.acceptance = RequestAcceptance([model.tokens_per_step(s) - 1.0 for s in chains], prior_tokens,
                                            memory_tokens)
        self.switch_margin, self.persist_steps, self.horizon_steps = switch_margin, persist_steps, horizon_steps
        self.context_bucket = context_bucket
        self._depths = [s.k for s in self.candidates]
        self._prior_extra = np.array([model.tokens_per_step(s) - 1.0 for s in self.candidates])  # E_cal(s) - 1
        # the second stage's guess rate, learnt online; the step times of its staged candidates per grid level
        self.guess = GuessRate(model.stage2.guess_accuracy) if staged else None
        self._staged_models: dict[int, StepModel] = {}
        self._step_ms: dict[tuple[int, int, int], np.ndarray] = {}  # (b, L bucket, guess level)
        # the candidates' step times split into runtime.refit.PARTS (ms, calibrated), per (b, L bucket, level)
        self._parts: dict[tuple[int, int, int], np.ndarray] = {}
        self._calibrated_ms: dict[tuple[int, int, int], list[float]] = {}  # their sums: the model's step times
        self._plain_parts: dict[tuple[int, int], list] = {}  # (b, L bucket): the unstaged candidates' (None: staged)
        self.refit = refit
        self.fidelity = fidelity if fidelity is not None else LiveFidelity(refit=refit)
        self._clock = clock
        self._labels = [s.describe(60) for s in self.candidates]  # as the engine's metrics name them
        self._in_flight = None  # (candidate, b, L bucket, guess level, clock at the answer) of the step running
        self._line_cache: dict[tuple[int, int, int], list[tuple[float, float]]] = {}
        self._catch_up_cache: dict[tuple[int, int, int], float] = {}
        # what `choose` returns per candidate: a Strategy only where the generator needs more than k
        self._answers = [s if s.stage2 else s.k for s in self.candidates]
        # per candidate, the rho above which E_r = 1 + rho (E_cal - 1) passes its k + 1 cap (`predicted_goodput`)
        self._caps = [k / x if k > 0 and x > 0 else float("inf") for k, x in zip(self._depths, self._prior_extra)]
        self._rho_cap = min(self._caps)
        # rows a pass of b rows costs: b, or with CUDA graphs the bucket that runs (serve sets it)
        self.cost_rows: Callable[[int], int] | None = None
        self.execution = None  # the execution its model's costs were measured in (adaptive_policy sets it)
        self._reset()

    # ------------------------------------------------------------------ the policy protocol
    def __call__(self, batch_size: int, context_len: int):
        """Without request ids (a caller that does not use the hooks): every row at the prior."""
        return self.choose([("anonymous", i) for i in range(batch_size)], context_len)

    def describe(self) -> str:
        return (f"{self.name} (per-request acceptance vs the calibrated E(k), prior {self.acceptance.prior_tokens:g} "
                f"tokens, margin {self.switch_margin:.0%})")

    def choose(self, request_ids: Sequence[Hashable], context_len: int):
        b = len(request_ids)
        goodput = self.predicted_goodput(request_ids, context_len)
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
        # a draft model lags behind the steps at k = 0; a head does not (it reads the verified position then too)
        self._lag_steps = self._lag_steps + 1 if self._depths[current] == 0 and not self.model.head else 0
        self._in_flight = (current, b, self._bucket(context_len), self._guess_level(), self._clock())
        return self._answers[current]

    def observe(self, request_ids: Sequence[Hashable], proposed: int, accepted: Sequence[int]) -> None:
        """After a chain step: each row was shown `proposed` draft tokens and accepted `accepted[i]`."""
        ended = self._clock()  # the step ended with its read-back, just before the caller reports it
        self.acceptance.observe(request_ids, proposed, accepted)
        if self._in_flight is not None:
            self._measured(ended)

    def _measured(self, ended: float) -> None:
        """The step answered in `choose` took until `ended`: record it beside the prediction; re-fit."""
        current, b, bucket, level, started = self._in_flight
        self._in_flight = None
        table = self._parts_at(b, bucket, level)
        predicted_ms = cached(self._calibrated_ms, (b, bucket, level), lambda: table.sum(axis=1).tolist())[current]
        parts = table[current]
        measured_ms, refit_ms = (ended - started) * 1e3, None
        if self.refit is not None:
            refit_ms = float(self._step_times(b, bucket)[current])  # what the choice was made with
            if self.refit.observe(parts, measured_ms):  # new factors: every step time is evaluated again
                self._step_ms.clear()
                self._line_cache.clear()
        self.fidelity.observe(self._labels[current], b, predicted_ms / 1e3, measured_ms / 1e3,
                              None if refit_ms is None else refit_ms / 1e3)

    def observe_draft_passes(self, batch_size: int, passes: int) -> None:
        """After a chain step: the draft passes it took (a staged chain's rounds teach the guess rate)."""
        if self.guess is not None and self._current is not None and self.candidates[self._current].stage2:
            self.guess.observe(self.candidates[self._current], batch_size, passes)

    def release(self, request_ids: Sequence[Hashable]) -> None:
        self.acceptance.release(request_ids)
        if not self.acceptance.counts:
            self._reset()

    # ------------------------------------------------------------------ the prediction
    def predicted_goodput(self, request_ids: Sequence[Hashable], context_len: int) -> list[float]:
        """Predicted tokens/s of every candidate for these rows (the hysteresis aside): b mean_r E_r(s) / S_s
        with E_r(s) = min(k_s + 1, 1 + rho_r (E_cal(s) - 1)). It runs every step, between forward passes that
        evict the CPU's caches, where numpy calls on a few numbers are slow: so plain Python. With
        A_s = b 1e3 / S_s and B_s = A_s (E_cal(s) - 1), computed once per (b, L bucket),
            G_s = A_s (1 + mean_r min(k_s, rho_r (E_cal(s) - 1)))
                = A_s + (B_s sum_{rho_r <= c_s} rho_r + A_s k_s #{rho_r > c_s}) / b,   c_s = k_s / (E_cal(s) - 1),
        with the rows' rho sorted once and a bisection per candidate; when every rho_r is below the smallest
        c_s (the usual case) it is A_s + mean(rho) B_s. While the draft lags after k = 0, every chain's S_s
        grows by the catch-up cost c (once per (b, L bucket, lag)): A_s and B_s scale by S_s / (S_s + c)."""
        ratios = self.acceptance.means(request_ids)
        b, bucket = len(ratios), self._bucket(context_len)
        lines = self._lines(b, bucket)
        if self._lag_steps > 0 and self._depths[self._current] == 0:
            catch_up_ms = self._catch_up_ms(b, bucket, self._lag_steps)
            per_ms = catch_up_ms / (b * 1e3)  # A_s = b 1e3 / S_s, so S_s / (S_s + c) = 1 / (1 + c A_s / (b 1e3))
            lines = [(a / (1.0 + per_ms * a), slope / (1.0 + per_ms * a)) if depth else (a, slope)
                     for (a, slope), depth in zip(lines, self._depths)]
        if max(ratios) <= self._rho_cap:
            rho = sum(ratios) / b
            return [a + rho * slope for a, slope in lines]
        ratios.sort()
        prefix = list(accumulate(ratios))
        goodput = []
        for (a, slope), cap, depth in zip(lines, self._caps, self._depths):
            below = bisect_right(ratios, cap)  # rows whose E_r is not capped for this candidate
            goodput.append(a + (slope * (prefix[below - 1] if below else 0.0) + a * depth * (b - below)) / b)
        return goodput

    def _catch_up_ms(self, batch_size: int, bucket: int, lag_steps: int) -> float:
        """The draft's extra first-pass time after `lag_steps` steps at k = 0, spread over `horizon_steps`."""
        return cached(self._catch_up_cache, (batch_size, bucket, lag_steps),
                      lambda: (self._latency("draft", batch_size, lag_steps + 1, bucket)
                               - self._latency("draft", batch_size, 1, bucket)) / self.horizon_steps)

    def _lines(self, batch_size: int, bucket: int) -> list[tuple[float, float]]:
        """(A_s, B_s) of every candidate at (b, L bucket): G_s = A_s + mean(rho) B_s (`predicted_goodput`)."""
        def make():
            scale = batch_size * 1e3 / self._step_times(batch_size, bucket)
            return list(zip(scale.tolist(), (scale * self._prior_extra).tolist()))
        return cached(self._line_cache, (batch_size, bucket, self._guess_level()), make)

    def _step_times(self, batch_size: int, bucket: int) -> np.ndarray:
        """Every candidate's step time (ms): the model's, or its parts times the re-fitted factors."""
        level = self._guess_level()

        def make():
            parts = self._parts_at(batch_size, bucket, level)
            return parts.sum(axis=1) if self.refit is None else parts @ self.refit.factors
        return cached(self._step_ms, (batch_size, bucket, level), make)

    def _parts_at(self, batch_size: int, bucket: int, level: int) -> np.ndarray:
        """(candidates, parts) ms: the model's step times split by role and width (runtime.refit.step_parts),
        at the rows the passes of b rows cost (`cost_rows`)."""
        rows = batch_size if self.cost_rows is None else self.cost_rows(batch_size)

        def plain():
            self.model.prefetch(rows, bucket, self.max_k + 2)  # every pass width a candidate runs, at once
            return [step_parts(self.model, s, rows, bucket) if not s.stage2 else None for s in self.candidates]

        def make():  # at a new guess level only the staged candidates are evaluated again
            staged = self._staged_model(level)
            return np.array([parts if parts is not None else step_parts(staged, s, rows, bucket)
                             for s, parts in zip(self.candidates, cached(self._plain_parts, (batch_size, bucket),
                                                                         plain))])
        return cached(self._parts, (batch_size, bucket, level), make)

    def _guess_level(self) -> int:
        return 0 if self.guess is None else self.guess.level()

    def _staged_model(self, level: int) -> StepModel:
        """The step model with the second stage's guess rate at `level` (the calibrated one: the model itself);
        pass latencies are shared, the staged schedules are its own."""
        if self.guess is None or level == self.guess.calibrated_level:
            return self.model
        return cached(self._staged_models, level, lambda: replace(
            self.model, stage2=replace(self.model.stage2, guess_accuracy=self.guess.accuracy(level)),
            _schedule_cache={}))

    def _latency(self, role: str, batch_size: int, new_tokens: int, bucket: int) -> float:
        return self.model._latency(role, batch_size, new_tokens, bucket)

    def _bucket(self, context_len: int) -> int:
        return -(-context_len // self.context_bucket) * self.context_bucket or self.context_bucket

    def _reset(self) -> None:
        self._current, self._batch_size, self._streak, self._lag_steps = None, 0, 0, 0
        if self.guess is not None:
            self.guess.reset()


def adaptive_policy(model_file: Path, max_k: int | None = None, staged: bool = False,
                    mode: str = "greedy", refit: bool = False) -> AdaptivePolicy:
    """The adaptive policy from a specbatch.model/1 file: its latency fit, its overhead and, as the prior,
    its acceptance measured in `mode` (greedy | sampling; else its first entry). `max_k` defaults to the
    profile's; `staged` adds the second-stage chains (needs the profile's stage2 measurements); `refit`
    re-fits the step costs from the served steps. Its fidelity's band is the profile's noise figure."""
    from specbatch.perfmodel.model import choose_acceptance, load_model, step_model

    fitted = load_model(model_file)
    acceptance = next((a for a in fitted.acceptance if a.mode == mode), None) or \
        choose_acceptance(fitted, None, str(model_file))
    correction = StepCostRefit() if refit else None
    fidelity = LiveFidelity(band=noise_band(fitted.noise), model_error=model_step_error(fitted), refit=correction,
                            band_source=noise_band_source(fitted.noise))
    announce_noise(fitted.noise, str(model_file))  # at start, before any step is judged
    policy = AdaptivePolicy(step_model(fitted, acceptance), fitted.grid.max_k if max_k is None else max_k,
                            staged=staged and fitted.stage2 is not None,
                            name=f"adaptive {Path(model_file).name}" + (" --refit" if refit else ""),
                            fidelity=fidelity, refit=correction)
    policy.execution = fitted.device.execution
    policy.stage2_record = {"file": fitted.stage2.file, "sha256": fitted.stage2.sha256} \
        if policy.needs_stage2 else None
    return policy


def model_step_error(fitted) -> float:
    """The model's own relative error on calibrate's measured steps (the chosen timing source's in-sample step
    MAPE), 0 when the model has no measured steps."""
    source = fitted.timing_source
    return 0.0 if source is None else source.report(source.chosen).step_mape_pct / 100.0
