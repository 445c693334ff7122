"""Kernel steps: the roofline plus the steps real kernels take, found in the data (`roofline+staircase`).

A GPU kernel runs whole tiles and whole waves: a GEMM over t = b*n token rows costs the same from one
multiple of its tile to the next and jumps past it; the decode-attention kernel launches a block per
(row, head) and jumps when a new wave of blocks is needed, by the time one wave takes to read its rows'
keys (so by an amount that grows with the context). Which tiles a library picks changes with t, so the
steps are neither regular nor monotone; they are learnt from the measurements:

    T(b, n, L) = w * R(b, n, L) + v * C(b, n, L) + fixed_ms + p * b + r * b * (L + n) / 1000
               + sum over token steps  j:  c_j * u(t, after_j, until_j)               t = b * n
               + sum over row steps    i:  (d_i + e_i * (L + n) / 1000) * u(b, after_i, until_i)

R is the work term of the roofline fitted through the data (its average slopes: the effective
bandwidth_GBps and flops_TFLOPs stay readable), C its compute time alone, b the rows and b (L + n) the
KV rows read: their weights let the smooth part bend where the steps pulled the roofline, so that the
steps are what the kernels do around it, not its curvature, and the row steps are waves on top of the
attention's linear growth in b.
u(x, a, z) is 0 up to the measured value a and 1 from the next measured value z on. Where the grid is
dense (z - a <= the axis's resolution) the step is sharp, right after a: tiles pad upwards, so a kernel
costs the same up to a multiple of its tile and jumps just past it. Where the grid is sparse the step's
place between a and z is unknown and u ramps linearly across the gap: there the model is interpolating
and says so (`interpolating_gap`).

The steps are chosen by forward selection among every gap between neighbouring measured values on each
axis: the candidate that removes the most squared relative error enters while its gain exceeds what the
best of that many candidates would reach on noise alone (2 ln(candidates) + ln(points) times the residual
variance); coefficients are then refit by least squares on relative error (the roofline's weight and the
per-row cost bounded at 0). On smooth data no step enters. The steps are signed: measured data are not
monotone (a library may switch to a faster kernel at larger t). The tile of the token steps, the spacing
most of their size sits at multiples of, is reported as `tile_tokens`; when there is one, the selection
runs again with every sparse token gap that holds exactly one multiple of the tile made a sharp step
right after it.

Assumes: steps in t (the GEMMs, the per-token operations) independent of b, and steps in b (attention
waves) whose size is affine in the context. Breaks where a step's place moves with the context (a
split-KV heuristic) or with n at fixed t, and beyond the measured range, where no step is known (the
latency model scales the edge by the roofline there).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .errors import PerfModelError
from .jsonio import rounded

TOKENS, ROWS, ROWS_CONTEXT = "tokens", "rows", "rows_context"  # what a step's coefficient multiplies
AXES = (TOKENS, ROWS, ROWS_CONTEXT)
# Neighbouring measured values this close resolve a step's place: a GEMM tile holds a multiple of 16
# token rows (tensor cores), and a batch size is a whole number.
RESOLUTION = {TOKENS: 16.0, ROWS: 1.0, ROWS_CONTEXT: 1.0}
CONTEXT_UNIT = 1000.0  # row steps grow per 1000 cached tokens: keeps the columns' scales comparable
MAX_STEP_SHARE = 0.5  # at most one step per two measured points: a staircase, not a lookup table
TILE_CANDIDATES = (16, 32, 64, 128, 256)


@dataclass(frozen=True)
class KernelStep:
    axis: str  # TOKENS: c_j in ms; ROWS: d_i in ms; ROWS_CONTEXT: e_i in ms per 1000 cached tokens
    after: float  # sharp: the step is right after this value; ramp: the last measured value below the gap
    until: float  # the first measured value at the step's full height
    coefficient: float
    sharp: bool  # False: a ramp across a gap no measurement resolves (the model interpolates there)

    def column(self, tokens, rows, context):
        x = tokens if self.axis == TOKENS else rows
        if self.sharp:
            u = (x > self.after).astype(float)
        else:
            u = np.clip((x - self.after) / (self.until - self.after), 0.0, 1.0)
        return u * (context / CONTEXT_UNIT) if self.axis == ROWS_CONTEXT else u

    def to_json(self) -> dict:
        return {"axis": self.axis, "after": rounded(self.after), "until": rounded(self.until),
                "sharp": self.sharp, "coefficient": rounded(self.coefficient, 12)}


BASE = ("roofline_work", "compute", "fixed_ms", "per_row", "kv_read")
# The roofline's weight and the per-row cost stay >= 0: on noisy data an unconstrained fit trades a negative
# roofline against a positive compute term, or a negative cost per row against the KV reads', and predicts
# passes that get cheaper with more rows. The compute, fixed and KV-read terms correct the roofline either
# way (it may over- or under-count the KV reads), and the steps are signed.
BASE_LOWER = (0.0, -np.inf, -np.inf, 0.0, -np.inf)


def _base_columns(work_ms, compute_ms, b, n, L) -> np.ndarray:
    return np.column_stack([work_ms, compute_ms, np.ones_like(work_ms), b, b * (L + n) / CONTEXT_UNIT])


def _columns(steps: Sequence[KernelStep], b, n, L) -> np.ndarray:
    tokens, context = b * n, L + n
    return np.column_stack([step.column(tokens, b, context) for step in steps]) if steps else np.zeros((len(b), 0))


@dataclass(frozen=True)
class Staircase:
    """The fitted form of the module docstring; plain numbers, saved as JSON."""

    base: tuple[float, ...]  # aligned with BASE: w, v, fixed_ms, p, r
    steps: tuple[KernelStep, ...]

    def latency_ms(self, work_ms, compute_ms, b, n, L):
        """Arrays in (broadcast), flat array out."""
        b, n, L, work_ms, compute_ms = (array.reshape(-1) for array in np.broadcast_arrays(
            *(np.asarray(v, dtype=float) for v in (b, n, L, work_ms, compute_ms))))
        value = _base_columns(work_ms, compute_ms, b, n, L) @ np.array(self.base) + self.steps_ms(b, n, L)
        return np.maximum(value, 1e-9)

    def steps_ms(self, b, n, L):
        """The steps' part alone (0 below every step)."""
        value = np.zeros(np.broadcast(b, n, L).size)
        if self.steps:
            b, n, L = (array.reshape(-1) for array in np.broadcast_arrays(*(np.asarray(v, dtype=float)
                                                                            for v in (b, n, L))))
            value = value + _columns(self.steps, b, n, L) @ np.array([s.coefficient for s in self.steps])
        return value

    def interpolating_gap(self, tokens: float, rows: float, axes: Sequence[str] = AXES) -> KernelStep | None:
        """A ramp (on one of `axes`) whose gap holds this pass strictly inside: no measurement says where its
        step lies."""
        for step in self.steps:
            x = tokens if step.axis == TOKENS else rows
            if step.axis in axes and not step.sharp and step.after < x < step.until:
                return step
        return None

    def tile_tokens(self) -> int | None:
        """The largest candidate tile at whose multiples at least half the upward token steps' size sits."""
        ups = [(s.after, s.coefficient) for s in self.steps if s.axis == TOKENS and s.sharp and s.coefficient > 0]
        total = sum(size for _, size in ups)
        if not ups or total <= 0:
            return None
        tiles = [tile for tile in TILE_CANDIDATES
                 if sum(size for after, size in ups if after % tile == 0) >= 0.5 * total]
        return max(tiles) if tiles else None

    def to_json(self) -> dict:
        return {"base": {name: rounded(value, 12) for name, value in zip(BASE, self.base)},
                "tile_tokens": self.tile_tokens(), "steps": [step.to_json() for step in self.steps]}

    @classmethod
    def from_json(cls, obj: dict, where: str) -> "Staircase":
        steps = []
        for index, item in enumerate(obj["steps"]):
            if item["axis"] not in AXES or not float(item["after"]) < float(item["until"]):
                raise PerfModelError(f"{where}: staircase.steps[{index}]: axis must be one of {', '.join(AXES)} "
                                     "and after < until")
            steps.append(KernelStep(item["axis"], float(item["after"]), float(item["until"]),
                                    float(item["coefficient"]), bool(item["sharp"])))
        if sorted(obj["base"]) != sorted(BASE):
            raise PerfModelError(f"{where}: staircase.base: expected the terms {', '.join(BASE)}")
        return cls(tuple(float(obj["base"][name]) for name in BASE), tuple(steps))


def candidate_steps(b: np.ndarray, n: np.ndarray, tile_tokens: int | None = None,
                    contexts: bool = True) -> list[KernelStep]:
    """Every gap between neighbouring measured values of t = b * n and of b (two row columns per gap, one
    without `contexts`): sharp when the gap is within the axis's resolution; a token gap [lo, hi) holding one
    multiple m of `tile_tokens` is a sharp step right after m (tiles pad upwards); any other gap is a ramp."""
    candidates = []
    axes = ((TOKENS, b * n), (ROWS, b)) + (((ROWS_CONTEXT, b),) if contexts else ())
    for axis, values in axes:
        distinct = np.unique(values)
        for lo, hi in zip(distinct[:-1].tolist(), distinct[1:].tolist()):
            if hi - lo <= RESOLUTION[axis]:
                candidates.append(KernelStep(axis, lo, hi, 0.0, True))
                continue
            multiples = [] if axis != TOKENS or not tile_tokens else \
                list(range(int(np.ceil(lo / tile_tokens)) * tile_tokens, int(np.ceil(hi)), tile_tokens))
            after = float(multiples[0]) if len(multiples) == 1 else lo
            candidates.append(KernelStep(axis, after, hi, 0.0, len(multiples) == 1))
    return candidates


class _Candidates:
    """The candidate steps' columns on the measured points, never built: on measured data every candidate is
    m * 1[x > lo] (x its axis, lo the measured value below its gap, m the row weight, times the context for
    ROWS_CONTEXT): no point lies inside a gap, so a ramp or a step snapped to a tile reads the same there.
    Dot products with all of them at once are suffix sums over the points sorted by x."""

    def __init__(self, candidates: Sequence[KernelStep], b, n, L, weight):
        tokens, context = b * n, (L + n) / CONTEXT_UNIT
        self.axes = []  # (sort order, index of each candidate's first point above its gap, multiplier)
        for axis, x, multiplier in ((TOKENS, tokens, weight), (ROWS, b, weight), (ROWS_CONTEXT, b, weight * context)):
            order = np.argsort(x, kind="stable")
            lows = np.array([c.until for c in candidates if c.axis == axis])  # the first value above the gap
            self.axes.append((order, np.searchsorted(x[order], lows, side="left"), multiplier))
        self.x = {TOKENS: tokens, ROWS: b, ROWS_CONTEXT: b}
        self.candidates = candidates
        self.weight, self.context = weight, context

    def dots(self, vector: np.ndarray) -> np.ndarray:
        """(count,) every candidate column's dot product with `vector`."""
        parts = []
        for order, first, multiplier in self.axes:
            suffix = np.concatenate([np.cumsum((multiplier * vector)[order][::-1])[::-1], [0.0]])
            parts.append(suffix[first])
        return np.concatenate(parts)

    def norms(self) -> np.ndarray:
        """(count,) every candidate column's squared norm."""
        return np.concatenate([np.concatenate([np.cumsum((m * m)[order][::-1])[::-1], [0.0]])[first]
                               for order, first, m in self.axes])

    def column(self, index: int) -> np.ndarray:
        step = self.candidates[index]
        above = (self.x[step.axis] >= step.until).astype(float) * self.weight
        return above * self.context if step.axis == ROWS_CONTEXT else above


def _select(base: np.ndarray, candidates: _Candidates, target: np.ndarray, max_steps: int) -> list[int]:
    """Forward selection on least squares (module docstring), by classical Gram-Schmidt: each candidate's
    squared norm left after projecting out the chosen directions is its norm minus its projections."""
    points = len(target)
    basis, _ = np.linalg.qr(base)
    found = basis.shape[1]
    directions = np.zeros((points, found + max_steps))  # orthonormal columns: the base's, then each chosen step's
    directions[:, :found] = basis
    residual = target - basis @ (basis.T @ target)
    norms = candidates.norms()
    left = norms - sum(candidates.dots(basis[:, i]) ** 2 for i in range(found))
    threshold = 2.0 * np.log(max(len(norms), 2)) + np.log(points)
    chosen: list[int] = []
    while len(chosen) < max_steps:
        usable = left > 1e-9 * max(float(norms.max()), 1e-300)
        usable[chosen] = False
        if not usable.any():
            break
        gains = np.where(usable, candidates.dots(residual) ** 2 / np.where(usable, left, 1.0), -1.0)
        best = int(np.argmax(gains))
        dof = points - found - 1
        variance = (residual @ residual - gains[best]) / max(dof, 1)
        if dof < 1 or gains[best] <= threshold * variance:
            break
        direction = candidates.column(best)
        for _ in range(2):  # twice: Gram-Schmidt in floating point loses orthogonality over hundreds of steps
            direction = direction - directions[:, :found] @ (directions[:, :found].T @ direction)
        direction /= np.linalg.norm(direction)
        directions[:, found] = direction
        found += 1
        left = left - candidates.dots(direction) ** 2
        residual = residual - direction * (direction @ residual)
        chosen.append(best)
    return chosen


def _bounded_least_squares(design: np.ndarray, target: np.ndarray, base_lower: np.ndarray) -> np.ndarray:
    """Least squares with the base's lower bounds (its first columns), the steps free; columns scaled to unit
    range."""
    from scipy.optimize import lsq_linear

    scale = np.maximum(np.abs(design).max(axis=0), 1e-300)
    lower = np.concatenate([base_lower, np.full(design.shape[1] - len(base_lower), -np.inf)])
    found = lsq_linear(design / scale, target, bounds=(lower, np.inf), method="bvls")
    return found.x / scale


def fit_staircase(work_ms: np.ndarray, compute_ms: np.ndarray, b: np.ndarray, n: np.ndarray, L: np.ndarray,
                  latency_ms: np.ndarray) -> Staircase:
    """Select the steps and fit every coefficient by least squares on relative error; where the resolved token
    steps show a tile, fit again with the unresolved gaps that hold one multiple of it made sharp there."""
    first = _fit(work_ms, compute_ms, b, n, L, latency_ms, None)
    tile = first.tile_tokens()
    return first if tile is None else _fit(work_ms, compute_ms, b, n, L, latency_ms, tile)


def _fit(work_ms, compute_ms, b, n, L, latency_ms, tile_tokens: int | None) -> Staircase:
    # one context: b (L + n) is b times nearly a constant, and a fit trading the two terms would make both any
    # size; then the KV-read term stays 0 and the row steps have no context part
    contexts = len(np.unique(L)) > 1
    used = np.array([contexts or name != "kv_read" for name in BASE])
    candidates = candidate_steps(b, n, tile_tokens, contexts)
    weight = 1.0 / latency_ms  # relative errors
    base = _base_columns(work_ms, compute_ms, b, n, L)[:, used] * weight[:, None]
    target = latency_ms * weight
    chosen = _select(base, _Candidates(candidates, b, n, L, weight), target, int(MAX_STEP_SHARE * len(latency_ms)))
    design = np.column_stack([base, _columns([candidates[i] for i in chosen], b, n, L) * weight[:, None]])
    coefficients = _bounded_least_squares(design, target, np.array(BASE_LOWER)[used])
    base_coefficients = np.zeros(len(BASE))
    base_coefficients[used] = coefficients[:used.sum()]
    steps = tuple(KernelStep(candidates[i].axis, candidates[i].after, candidates[i].until, float(c),
                             candidates[i].sharp) for i, c in zip(chosen, coefficients[used.sum():]))
    return Staircase(tuple(float(c) for c in base_coefficients), steps)
