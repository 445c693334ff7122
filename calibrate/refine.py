"""Refining the grid where kernel steps are: more target passes where the fit cannot place a step.

A grid of powers of two leaves gaps in the token count t = b * n; a GEMM tile step inside one is seen only
as a jump between the neighbours around it, and the fit (`perfmodel.staircase`) can only ramp across the
gap. The best k is decided exactly there (a verify pass of b (k + 1) tokens on one side or the other), so on
a device where passes are cheap calibration measures the gap instead of guessing: each round fits the
target's rows with the staircase kind, takes every step it ramped (up or down by at least MIN_SHARE of the
pass), and times one more pass in the middle of each gap, at the smallest context (the token steps do not
depend on it). A step in the batch size (attention waves) gets a new batch size in the middle of its gap,
one new token, at every context (its height grows with the context). Rounds go on until every step found
is placed or the budget of passes is spent; each round halves the gaps, so a 128-token gap takes three.

Everything here is torch-free: it proposes points; calibrate times them with its own timer.
"""
from __future__ import annotations

from typing import Callable, Iterator

import numpy as np

from specbatch.perfmodel import latency as lat
from specbatch.perfmodel.fit import role_shape
from specbatch.perfmodel.profile import Profile
from specbatch.perfmodel.staircase import ROWS, ROWS_CONTEXT, TOKENS, KernelStep

from .grid import TimingPoint

MIN_SHARE = 0.03  # a step of less than 3 % of the pass is within a calibration's noise: not worth a pass
DEFAULT_BUDGET = 64  # extra passes at most: about a quarter of the default grid's target passes
MAX_ROUNDS = 8


def unresolved_steps(profile: Profile, role: str = "target") -> list[KernelStep]:
    """The steps the staircase fit of `role`'s rows could only ramp across a gap, largest first."""
    points = lat.Points.from_rows(profile.timings_of(role))
    if len(points) < lat.MIN_POINTS:
        return []
    shape = role_shape(profile, role)
    model = lat.fit_latency_model(shape, points, lat.STAIRCASE)
    level = float(np.median(points.latency_ms))
    ramps = [step for step in model.staircase.steps if not step.sharp]
    scale = {TOKENS: 1.0, ROWS: 1.0, ROWS_CONTEXT: float(np.max(points.context_len + points.new_tokens)) / 1000.0}
    big = [step for step in ramps if abs(step.coefficient) * scale[step.axis] >= MIN_SHARE * level]
    return sorted(big, key=lambda step: -abs(step.coefficient) * scale[step.axis])


def _token_point(step: KernelStep, profile: Profile, widths: tuple[int, ...]) -> TimingPoint | None:
    """A pass of b rows and n in `widths` new tokens with b * n nearest the gap's middle, strictly inside it,
    at the smallest context; None when no integer b does that within the grid's batch sizes."""
    middle = (step.after + step.until) / 2
    low, high = min(profile.grid.batch_sizes), max(profile.grid.batch_sizes)
    best = None
    for n in widths:
        b = int(round(middle / n))
        if low <= b <= high and step.after < b * n < step.until:
            if best is None or abs(b * n - middle) < abs(best[0] * best[1] - middle):
                best = (b, n)
    if best is None:
        return None
    return TimingPoint("target", best[0], best[1], min(profile.grid.context_lens))


def refinement_points(profile: Profile) -> list[TimingPoint]:
    """The passes one round adds: one per unresolved token step, one batch size per unresolved row step
    (n = 1 at every context), none already in the profile."""
    measured = {(r.model, r.batch_size, r.new_tokens, r.context_len) for r in profile.timings}
    widths = tuple(n for n in profile.grid.target_new_tokens if n <= profile.grid.max_k + 1)
    points: list[TimingPoint] = []
    for step in unresolved_steps(profile):
        if step.axis == TOKENS:
            found = _token_point(step, profile, widths)
            candidates = [] if found is None else [found]
        else:
            b = int(round((step.after + step.until) / 2))
            candidates = [TimingPoint("target", b, 1, L) for L in profile.grid.context_lens]
        points += [p for p in candidates if (p.model, p.batch_size, p.new_tokens, p.context_len) not in measured
                   and p not in points]
    return points


def refinement_rounds(current: Callable[[], Profile], budget: int = DEFAULT_BUDGET,
                      max_rounds: int = MAX_ROUNDS) -> Iterator[TimingPoint]:
    """The passes to time, round after round: `current()` is the profile with every pass timed so far (the
    caller times and saves each point before asking for the next); stops when a round proposes nothing new
    or `budget` passes have been proposed."""
    proposed = 0
    for _ in range(max_rounds):
        points = refinement_points(current())
        if not points:
            return
        for point in points[:budget - proposed]:
            proposed += 1
            yield point
        if proposed >= budget:
            return
