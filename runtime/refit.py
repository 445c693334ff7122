"""Step costs re-fitted online: a multiplicative correction per (role, width bucket), learnt from served steps.

The step model's time of a step is a sum of parts (`step_parts`): each forward pass it schedules, by role and
width bucket (tokens fed per row), and the host's part (the step overhead and the n-gram's queries). The
corrected time is sum_j c_j x_j. Every served step measured m against the calibrated prediction p = sum_j x_j,
so with shares u_j = x_j / p and ratio y = m / p it is one linear equation in c, y = sum_j u_j c_j + noise: a
ridge regression with the calibration as its prior (`StepCostRefit`; docs/adaptive.md has the statement).
"""
from __future__ import annotations

import math
from bisect import bisect_left
from typing import Sequence

import numpy as np

from specbatch.perfmodel.errors import UsageError
from specbatch.perfmodel.strategy import StepModel
from specbatch.perfmodel.tree import Strategy

from .learning import LEARNING

WIDTH_BOUNDS = (1, 2, 4, 8, 16, 32, 64)  # a pass of n tokens per row falls in the first bucket with n <= bound
WIDTH_LABELS = ("1", "2", "3-4", "5-8", "9-16", "17-32", "33-64", "65+")
PASS_ROLES = ("draft", "target")
HOST = "host"  # the step overhead and the n-gram's queries: one part, whatever the width
# the parts of a step, in order: (role, width label); the last one is the host's
PARTS = tuple((role, width) for role in PASS_ROLES for width in WIDTH_LABELS) + ((HOST, "all"),)
HOST_PART = len(PARTS) - 1
ROLES = len(PASS_ROLES) + 1  # the parameters begin with one factor per role, the host's last

REFIT = LEARNING.refit  # every knob of this module (runtime.learning)


def width_bucket(new_tokens: int) -> int:
    """Index of the width bucket of a pass feeding `new_tokens` tokens per row.

    >>> [WIDTH_LABELS[width_bucket(n)] for n in (1, 2, 3, 8, 9, 100)]
    ['1', '2', '3-4', '5-8', '9-16', '65+']
    """
    return bisect_left(WIDTH_BOUNDS, new_tokens)


def part_index(role: str, new_tokens: int) -> int:
    return PASS_ROLES.index(role) * len(WIDTH_LABELS) + width_bucket(new_tokens)


def step_parts(model: StepModel, strategy: Strategy, batch_size: int, context_len: int) -> np.ndarray:
    """The model's step time of `strategy` at (b, L) split into PARTS (ms); they sum to `evaluate(...).step_ms`
    (the in-situ step correction scales every part alike)."""
    candidate = model.evaluate(strategy, batch_size, context_len)
    parts = np.zeros(len(PARTS))
    for p in model.schedule(strategy, batch_size).passes:
        parts[part_index(p.role, p.new_tokens)] += p.weight * model._latency(p.role, batch_size, p.new_tokens,
                                                                            context_len)
    parts[HOST_PART] = candidate.ngram_ms + candidate.overhead_ms
    uncorrected = candidate.step_ms - candidate.correction_ms
    return parts * (candidate.step_ms / uncorrected) if uncorrected > 0 else parts


def _design() -> np.ndarray:
    """M (parts x parameters): c = M theta, theta = (one factor per role: draft, target, host; one departure per
    pass part). The host part has its role's factor alone."""
    roles = PASS_ROLES + (HOST,)
    design = np.zeros((len(PARTS), ROLES + HOST_PART))
    for j, (role, _width) in enumerate(PARTS):
        design[j, roles.index(role)] = 1.0
        if j < HOST_PART:
            design[j, ROLES + j] = 1.0
    return design


class StepCostRefit:
    """c per part, from (parts x, measured ms) pairs: a ridge regression in ratio space with fading evidence.

    Parameters theta (`_design`): a factor g_r per role (draft, target, host) with prior mean 1, and a departure
    h_j per pass part with prior mean 0, so c_j = g_role(j) + h_j and a width never served takes its role's
    factor. A step with shares u and ratio y adds z z^T to the precision A and z y to the evidence b,
    z = M^T u (each role's share of the step, then each part's). The roles' prior precision is n times their
    mean share of the served steps (n = `role_prior_steps`): where the steps cannot tell the roles apart a change
    is shared alike by every role (the machine got slower), and a step's total is held by n steps' worth
    (sum_r z_r^2 / (n z_r) = 1 / n). A departure's prior precision is `width_prior_steps` steps made only of
    that width: widths move with their role unless the evidence is specific. Evidence fades by
    (1 - 1/`memory_steps`) per step, the priors' weights alike down to `prior_floor` of their start (the
    calibration keeps a say only where the served steps are silent). theta = (A + P)^{-1} (b + P theta_0); the
    interval of c_j is the Gaussian 95 % one with the residual variance of the steps (prequential: each step's
    residual against the factors before it). Chains confound a step's draft passes with its target width; steps
    of one k at several batch sizes are what tells them apart."""

    def __init__(self, role_prior_steps: float = REFIT.role_prior_steps,
                 width_prior_steps: float = REFIT.width_prior_steps, memory_steps: float = REFIT.memory_steps,
                 prior_floor: float = REFIT.prior_floor, solve_every: int = REFIT.solve_every):
        if min(role_prior_steps, width_prior_steps) <= 0 or memory_steps < 1 or not 0 < prior_floor <= 1 \
                or solve_every < 1:
            raise UsageError("refit: need positive prior weights, memory_steps >= 1, 0 < prior_floor <= 1 and "
                             "solve_every >= 1")
        self.role_prior_steps, self.width_prior_steps = role_prior_steps, width_prior_steps
        self.memory_steps, self.prior_floor, self.solve_every = memory_steps, prior_floor, solve_every
        self.design = _design()
        self._prior_weight = np.array([role_prior_steps] * ROLES + [width_prior_steps] * (len(PARTS) - 1))
        self._prior_mean = np.array([1.0] * ROLES + [0.0] * (len(PARTS) - 1))
        self._keep = 1.0 - 1.0 / memory_steps
        self._fade = 1.0  # the priors' weights now, relative to their start
        self._steps_weight = 0.0  # the fading count of steps in the evidence
        size = self.design.shape[1]
        self._share_sum = np.zeros(ROLES)  # the fading sum of each role's share of a step
        self._precision, self._evidence = np.zeros((size, size)), np.zeros(size)
        weight, spread = REFIT.residual_prior
        self._residual = [weight, weight * spread ** 2]  # fading [steps, sum of squared residuals]
        self.steps = 0
        self.factors = np.ones(len(PARTS))  # what the policy uses: published at a solve that moved them
        self.version = 0  # bumped whenever `factors` change
        self._theta = self._prior_mean.copy()
        # (theta, its covariance per unit residual variance, the residual spread) at the last solve, replaced
        # whole, so another thread's `snapshot` reads one consistent state
        self._solved = (self._theta, np.diag(1.0 / (self._prior_weight * REFIT.share_floor)), self.residual_spread)

    def observe(self, parts: np.ndarray, measured_ms: float) -> bool:
        """One served step: the model's parts (ms, calibrated) and the measured time. True when the
        published factors changed (the caller re-evaluates its step times)."""
        predicted_ms = float(parts.sum())
        if not predicted_ms > 0 or not measured_ms > 0:
            return False
        ratio = min(max(measured_ms / predicted_ms, 1.0 / REFIT.ratio_clip), REFIT.ratio_clip)
        z = self.design.T @ (parts / predicted_ms)
        residual = ratio - float(z @ self._theta)
        keep = self._keep
        self._residual[0] = self._residual[0] * keep + 1.0
        self._residual[1] = self._residual[1] * keep + residual * residual
        self._precision *= keep
        self._precision += np.outer(z, z)
        self._evidence *= keep
        self._evidence += z * ratio
        self._steps_weight = self._steps_weight * keep + 1.0
        self._share_sum *= keep
        self._share_sum += z[:ROLES]
        self._fade = max(self.prior_floor, self._fade * keep)
        self.steps += 1
        return self.steps % self.solve_every == 0 and self._solve()

    def _prior_precision(self) -> np.ndarray:
        """Roles: n times their mean share of the served steps; departures: n_j; times the prior's remaining weight."""
        scale = np.ones(len(self._prior_weight))
        if self._steps_weight:
            scale[:ROLES] = np.maximum(self._share_sum / self._steps_weight, REFIT.share_floor)
        return self._prior_weight * self._fade * scale

    def _solve(self) -> bool:
        prior = self._prior_precision()
        covariance = np.linalg.inv(self._precision + np.diag(prior))
        self._theta = covariance @ (self._evidence + prior * self._prior_mean)
        self._solved = (self._theta, covariance, self.residual_spread)
        factors = np.clip(self.design @ self._theta, 1.0 / REFIT.ratio_clip, REFIT.ratio_clip)
        if np.max(np.abs(factors / self.factors - 1.0)) <= REFIT.move_tolerance:
            return False
        self.factors = factors
        self.version += 1
        return True

    @property
    def residual_spread(self) -> float:
        """The steps' ratio residual, standard deviation (relative to a step's prediction)."""
        weight, squares = self._residual
        return math.sqrt(squares / weight)

    def interval(self, part: int, level_sigmas: float = 1.96) -> tuple[float, float]:
        """The ~95 % interval of c for one part, at the last solve (the prior's alone before one)."""
        return self._interval(self.design[part], level_sigmas)

    def step_interval(self, parts: np.ndarray, level_sigmas: float = 1.96) -> tuple[float, float]:
        """The ~95 % interval of a step's corrected time (ms), sum_j c_j x_j, at the last solve."""
        return self._interval(self.design.T @ parts, level_sigmas)

    def _interval(self, row: np.ndarray, level_sigmas: float) -> tuple[float, float]:
        theta, covariance, spread = self._solved
        half = level_sigmas * spread * math.sqrt(float(row @ covariance @ row))
        centre = float(row @ theta)
        return centre - half, centre + half

    def corrected_ms(self, parts: np.ndarray) -> float:
        return float(parts @ self.factors)

    def snapshot(self) -> dict:
        """The factors with their intervals, for /metrics and /health."""
        rows = []
        for j, (role, width) in enumerate(PARTS):
            low, high = self.interval(j)
            rows.append({"role": role, "width": width, "factor": float(self.factors[j]), "low": low, "high": high})
        return {"steps": self.steps, "residual_spread": self.residual_spread, "factors": rows,
                "role_prior_steps": self.role_prior_steps, "width_prior_steps": self.width_prior_steps,
                "memory_steps": self.memory_steps}


def describe_factors(snapshot: dict, parts: Sequence[int] | None = None) -> str:
    """'target 3-4 x1.49 [1.45, 1.53], host x1.02 [0.97, 1.07]': the factors away from 1."""
    rows = snapshot["factors"] if parts is None else [snapshot["factors"][j] for j in parts]
    moved = [r for r in rows if abs(r["factor"] - 1.0) > REFIT.move_tolerance]
    return ", ".join(f"{r['role']} {r['width']} x{r['factor']:.2f} [{r['low']:.2f}, {r['high']:.2f}]"
                     if r["role"] != HOST else f"host x{r['factor']:.2f} [{r['low']:.2f}, {r['high']:.2f}]"
                     for r in moved) or "all 1"
