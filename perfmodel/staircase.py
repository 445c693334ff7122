"""Kernel steps: the roofline plus the steps real kernels take, found in the data (`roofline+staircase`).

GEMMs run whole tiles of token rows and decode attention whole waves of (row, head) blocks, so a pass's time
jumps at places no smooth curve follows; which tiles a library picks changes with the token count, so the
steps are learnt from the measurements by forward selection among the gaps between measured values, and
continued past the measured box by what quantizes each axis (`continued_ms`: the tile, the wave width, the
cost of a row). The model, its selection rule, its continuation and where it breaks: docs/model.md, "Pass
latency" (Kernel steps: the staircase).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .errors import PerfModelError
from .fields import at, boolean, json_object, listed, number, string
from .jsonio import rounded

TOKENS, ROWS, ROWS_CONTEXT = "tokens", "rows", "rows_context"  # what a step's coefficient multiplies
AXES = (TOKENS, ROWS, ROWS_CONTEXT)
# Neighbouring measured values this close resolve a step's place: a GEMM tile holds a multiple of 16
# token rows (tensor cores), and a batch size is a whole number.
RESOLUTION = {TOKENS: 16.0, ROWS: 1.0, ROWS_CONTEXT: 1.0}
CONTEXT_UNIT = 1000.0  # row steps grow per 1000 cached tokens: keeps the columns' scales comparable
MAX_STEP_SHARE = 0.5  # at most one step per two measured points: a staircase, not a lookup table
TILE_CANDIDATES = (16, 32, 64, 128, 256)
# A wave width is learnt when at least this many of its boundaries fall where neighbouring batch sizes are
# measured, at least this share of them holds an upward row step, and those steps hold at least half the
# upward row steps' height: a period seen three times, not a coincidence of two steps.
MIN_WAVES_SEEN, MIN_WAVE_HIT_SHARE = 3, 0.75
MIN_WAVE_ROWS = 2.0  # a "wave" of one row is every batch size, no staircase
ROW_COST_OCTAVES = 2  # the cost of a row past the grid is read over the measured b from b_max / 2**this up
Fitted = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]  # (b, n, L) -> ms, flat arrays


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
    wave_rows: float | None = None  # W: the rows one wave of attention blocks holds (None: not seen)
    row_cost_from: float | None = None  # past the grid a row costs what one cost from this measured b up

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
        """The largest candidate tile at whose multiples at least half the upward token steps' size sits, at two
        multiples at least (a period seen once is any step's place)."""
        ups = [(s.after, s.coefficient) for s in self.steps if s.axis == TOKENS and s.sharp and s.coefficient > 0]
        total = sum(size for _, size in ups)
        if not ups or total <= 0:
            return None
        tiles = [tile for tile in TILE_CANDIDATES
                 if sum(size for after, size in ups if after % tile == 0) >= 0.5 * total
                 and sum(after % tile == 0 for after, _ in ups) >= 2]
        return max(tiles) if tiles else None

    def row_step_ms(self, after: float, context) -> np.ndarray:
        """The height of the row steps right after `after` rows at `context` cached tokens (arrays)."""
        height = np.zeros(np.shape(context))
        for step in self.steps:
            if step.axis != TOKENS and step.sharp and step.after == after:
                height = height + step.coefficient * (context / CONTEXT_UNIT if step.axis == ROWS_CONTEXT else 1.0)
        return height

    def wave_places(self) -> list[float]:
        """Where the learnt waves' steps sit among the sharp row steps (empty without a wave width)."""
        if self.wave_rows is None:
            return []
        places = sorted({s.after for s in self.steps if s.axis != TOKENS and s.sharp})
        return [x for x in places if x == np.floor(np.ceil(x / self.wave_rows - 1e-9) * self.wave_rows + 1e-9)]

    def waves(self, rows) -> np.ndarray:
        """ceil(b / W): the waves of attention blocks b rows launch."""
        return np.ceil(np.asarray(rows, dtype=float) / self.wave_rows - 1e-9)

    def continued_ms(self, fitted: Fitted, gemm_ms: Callable[[np.ndarray], np.ndarray], roofline_ms: Fitted,
                     box: tuple, b, n, L) -> np.ndarray:
        """The fit inside its measured box ((b_lo, b_hi), (n_lo, n_hi), (L_lo, L_hi)) and continued past it
        (module docstring): `fitted` is the fit itself, `gemm_ms(t)` the roofline in padded token counts (or
        another role's token curve, `perfmodel.token_curve`), `roofline_ms` the roofline. Arrays in
        (broadcast), flat array out."""
        (b_lo, b_hi), (n_lo, n_hi), (L_lo, L_hi) = box
        b, n, L = (array.reshape(-1) for array in np.broadcast_arrays(*(np.asarray(v, dtype=float)
                                                                        for v in (b, n, L))))

        def in_context(rows, width, context):  # the fit's own context terms, monotone past the measured ones
            value, edge = fitted(rows, width, context), fitted(rows, width, np.clip(context, L_lo, L_hi))
            return np.where(context > L_hi, np.maximum(value, edge), np.where(context < L_lo, np.minimum(value, edge),
                                                                               value))

        rows = np.clip(b, b_lo, b_hi)
        tokens = b * n
        edge_tokens = np.clip(tokens, rows * n_lo, rows * n_hi)
        value = in_context(rows, edge_tokens / rows, L) + gemm_ms(tokens) - gemm_ms(edge_tokens)
        by_roofline = (b < b_lo) | ((b > b_hi) & (self.row_cost_from is None))
        if by_roofline.any():  # the roofline's change at equal tokens
            value = value + np.where(by_roofline, roofline_ms(b, edge_tokens / b, L)
                                     - roofline_ms(rows, edge_tokens / rows, L), 0.0)
        above = (b > b_hi) & (self.row_cost_from is not None)
        if above.any():
            start = self.row_cost_from
            reference = b_hi * n_lo  # tokens both ends of the stretch were measured with
            rise = in_context(np.full_like(L, b_hi), reference / b_hi, L) - in_context(np.full_like(L, start),
                                                                                        reference / start, L)
            per_row, extra = np.maximum(rise / (b_hi - start), 0.0), np.zeros_like(L)
            if self.wave_rows is not None:  # the same cost per row on average, in whole waves at their places
                places = self.wave_places()
                last = [x for x in places if start <= x < b_hi] or places
                height = np.minimum(np.maximum(np.mean([self.row_step_ms(x, L + 1) for x in last], axis=0), 0.0),
                                    per_row * self.wave_rows)
                per_row = per_row - height / self.wave_rows
                extra = height * (self.waves(b) - self.waves(b_hi))
            value = value + np.where(above, per_row * (b - b_hi) + extra, 0.0)
        return np.maximum(value, 1e-9)

    def to_json(self) -> dict:
        return {"base": {name: rounded(value, 12) for name, value in zip(BASE, self.base)},
                "tile_tokens": self.tile_tokens(), "wave_rows": rounded(self.wave_rows),
                "row_cost_from": rounded(self.row_cost_from), "steps": [step.to_json() for step in self.steps]}

    @classmethod
    def from_json(cls, obj: dict, where: str) -> "Staircase":
        """`where`: the section ('model.json: roles.target.staircase'); each field is named with its rule."""
        steps = []
        for index, item in enumerate(listed(obj, "steps", where)):
            at_step = f"{at(where, 'steps')}[{index}]"
            axis = string(item, "axis", at_step, AXES)
            after, until = number(item, "after", at_step), number(item, "until", at_step)
            if not after < until:
                raise PerfModelError(f"{at_step}: expected after < until, found {after!r} and {until!r}")
            steps.append(KernelStep(axis, after, until, number(item, "coefficient", at_step),
                                    boolean(item, "sharp", at_step)))
        base = json_object(obj, "base", where)
        if sorted(base) != sorted(BASE):
            raise PerfModelError(f"{at(where, 'base')}: expected the terms {', '.join(BASE)}, found "
                                 f"{', '.join(base) or 'none'}")
        # absent from a file written before the staircase was continued past its grid: the roofline's growth there
        rows = {name: number(obj, name, where, minimum=1.0, nullable=True) if name in obj else None
                for name in ("wave_rows", "row_cost_from")}
        return cls(tuple(number(base, name, at(where, "base")) for name in BASE), tuple(steps),
                   rows["wave_rows"], rows["row_cost_from"])


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
    steps show a tile, fit again with the unresolved gaps that hold one multiple of it made sharp there. Then
    what continues it past the grid: the wave width its row steps show, and where the cost of a row is read."""
    first = _fit(work_ms, compute_ms, b, n, L, latency_ms, None)
    tile = first.tile_tokens()
    fitted = first if tile is None else _fit(work_ms, compute_ms, b, n, L, latency_ms, tile)
    return Staircase(fitted.base, fitted.steps, learn_wave_rows(fitted.steps, b, float(L.max())),
                     row_cost_from(b, n))


def row_cost_from(b: np.ndarray, n: np.ndarray) -> float | None:
    """The smallest measured batch size in the last ROW_COST_OCTAVES octaves below the largest that shares a
    token count with it (b' n_hi >= b_max n_lo): the cost of a row past the grid is read from there up, at
    equal tokens. None where no measured b shares one (one width per pass): the roofline continues the rows."""
    measured = np.unique(b)
    largest, widths = measured[-1], (float(n.min()), float(n.max()))
    shared = [float(x) for x in measured[:-1]
              if x >= largest / 2 ** ROW_COST_OCTAVES and x * widths[1] >= largest * widths[0]]
    return shared[0] if shared else None


def learn_wave_rows(steps: Sequence[KernelStep], b: np.ndarray, context_len: float) -> float | None:
    """The wave width W whose boundaries (a step right after floor(k W) rows: ceil(b / W) waves) hold the row
    steps (module docstring). Candidates W = p / k for every place p of a sharp upward row step (height at
    `context_len`); a candidate counts where at least MIN_WAVES_SEEN of its boundaries lie between measured
    neighbours, MIN_WAVE_HIT_SHARE of those hold an upward step, and those steps hold half the upward height.
    The most height wins; among widths with the same boundaries, the smallest (b H / slots, the blocks of H heads
    on a GPU's slots, reaches its boundaries exactly at k slots / H)."""
    probe = Staircase((0.0,) * len(BASE), tuple(steps))
    places = sorted({s.after for s in steps if s.axis != TOKENS and s.sharp})
    heights = {x: float(probe.row_step_ms(x, np.array(context_len + 1.0))) for x in places}
    ups = {x: h for x, h in heights.items() if h > 0}
    total = sum(ups.values())
    measured = set(np.unique(b).tolist())
    resolved = sorted(x for x in measured if x + 1 in measured)  # a boundary after x is seen where x + 1 is measured
    if len(ups) < MIN_WAVES_SEEN or not resolved:
        return None
    best: tuple[float, float] | None = None  # (height held, -W)
    for place in ups:
        for k in range(1, int(place / MIN_WAVE_ROWS) + 1):
            width = place / k
            boundaries = {float(np.floor(j * width + 1e-9)) for j in range(1, int(resolved[-1] / width) + 2)}
            seen = [x for x in boundaries if x in resolved]
            hit = [x for x in seen if x in ups]
            height = sum(ups[x] for x in hit)
            if (len(seen) >= MIN_WAVES_SEEN and len(hit) >= MIN_WAVE_HIT_SHARE * len(seen)
                    and height >= 0.5 * total and (best is None or (height, -width) > best)):
                best = (height, -width)
    return None if best is None else -best[1]


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
