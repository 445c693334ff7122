"""Latency of one forward pass, T(b, n, L), fitted per model role to the profile's timing rows.

Three model kinds, chosen per role by grouped k-fold cross-validation (`select_kind`):

- "roofline": T = overhead_ms + smooth_max(memory_ms, compute_ms), four parameters. Physically
  grounded, so it extrapolates sensibly to batch sizes beyond the measured grid.
- "roofline+monotone": the roofline's shape term plus nonnegative multiples of monotone basis
  functions (per-token, per-row, KV-read and attention terms, and saturating ramps in tokens per
  pass), refit by nonnegative least squares with scikit-learn. It follows the steps real hardware
  has (thread scheduling on CPUs, tile quantization on GPUs) and stays monotone in b, n and L by
  construction. Its coefficients are plain numbers: the model is saved as JSON, never pickled.
- "roofline+staircase": the roofline's work term plus the kernel steps found in the data, in tokens per
  pass (GEMM tiles) and in rows (attention waves), sharp where neighbouring measurements resolve them
  and ramped across gaps they do not (`perfmodel.staircase`). Signed: it follows data that are not
  monotone, and a measured step is kept, not smoothed over a grid gap. Past the measured range its
  learnt tile and wave width put the steps there (the roofline in padded token counts, waves of rows).

Why not gradient-boosted trees (even with monotonic constraints): trees are piecewise constant, so a
held-out batch size between two measured ones snaps to a neighbour's time, and batch sizes beyond
the grid get the last measured time, which is exactly where the table needs extrapolation.

Errors are relative (MAPE, in percent): timings span orders of magnitude and a 1 ms error means
nothing at 300 ms and everything at 2 ms.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from .errors import PerfModelError
from .experts import RoutingFit, routing_fit_from_json
from .fields import at, get, integer, json_object, number, number_list
from .jsonio import rounded
from .profile import ModelInfo, TimingRow
from .profile.routing import ExpertShape, expert_shape_from_json
from .staircase import Staircase, fit_staircase
from .token_curve import TokenCurve

ROOFLINE = "roofline"
MONOTONE = "roofline+monotone"
STAIRCASE = "roofline+staircase"
KINDS = (ROOFLINE, MONOTONE, STAIRCASE)
REFINED = (MONOTONE, STAIRCASE)
# The staircase is offered for GPU profiles: on a shared CPU, slow spells last a grid cell's points and look
# like steps to its selection (a 28 % "step" between 12 and 14 tokens per pass on a calibration of the demo
# pair whose reference pass moved 50 %), and the thread-partitioning steps CPUs have are smaller than that.
KINDS_BY_DEVICE = {"cuda": KINDS, "cpu": (ROOFLINE, MONOTONE)}


def kinds_for(device_kind: str) -> tuple[str, ...]:
    """The kinds cross-validation chooses among for a profile measured on `device_kind` (cpu | cuda)."""
    return KINDS_BY_DEVICE.get(device_kind, KINDS)
MIN_POINTS = 8  # twice the roofline's four parameters: fewer cannot tell fit from noise
CV_FOLDS = 5
# A data-driven kind must beat the roofline's cross-validated MAPE by this factor to be chosen:
# a 1% relative gain is noise, and the roofline extrapolates more safely.
REFINED_MIN_GAIN = 0.95
MAX_TOKEN_KNOTS = 10  # ramps in tokens per pass; more knots than this overfit small grids


@dataclass(frozen=True)
class RoleShape:
    """What the roofline needs to know about one model, taken from the profile."""

    parameters: int
    weight_bytes: int  # read once per pass, whatever the batch
    kv_bytes_per_token: int  # read per cached token per row, written per new token per row
    layers: int
    attention_width: int  # heads * head_dim: the width of q.k and p.v products
    # a mixture of experts: a pass reads the dense part and the experts its tokens touch (perfmodel.experts);
    # `weight_bytes` and `parameters` then count every expert
    experts: ExpertShape | None = None
    routing: RoutingFit | None = None  # D(b, n), with `experts`

    @classmethod
    def from_model_info(cls, info: ModelInfo, routing: RoutingFit | None = None) -> "RoleShape":
        return cls(info.parameters, info.weight_bytes, info.kv_bytes_per_token, info.layers,
                   info.heads * info.head_dim, info.experts,
                   (routing or RoutingFit()) if info.experts is not None else None)

    def weights_read_bytes(self, b, n):
        """Weight bytes one pass of b rows x n new tokens reads: all of them for a dense model; the dense part
        plus each routed layer's touched experts for a mixture of experts."""
        if self.experts is None:
            return self.weight_bytes
        experts = self.experts
        return (self.weight_bytes - experts.routed_bytes
                + experts.moe_layers * experts.expert_bytes * self.routing.distinct(experts, b, n))

    @property
    def active_parameters(self) -> int:
        """Parameters each token multiplies (a mixture of experts: r experts of N a routed layer)."""
        return self.parameters - (0 if self.experts is None else self.experts.idle_parameters)

    def to_json(self) -> dict:
        obj = {name: getattr(self, name) for name in ("parameters", "weight_bytes", "kv_bytes_per_token", "layers",
                                                      "attention_width")}
        if self.experts is not None:
            obj["experts"] = self.experts.to_json()
            obj["routing"] = self.routing.to_json()
        return obj

    @classmethod
    def from_json(cls, obj: dict, where: str) -> "RoleShape":
        """The inverse of `to_json`; a mixture of experts carries its experts and their fitted routing together."""
        sizes = {name: integer(obj, name, where, 1) for name in ("parameters", "weight_bytes", "kv_bytes_per_token",
                                                                 "layers", "attention_width")}
        if obj.get("experts") is None:
            return cls(**sizes)
        experts = expert_shape_from_json(obj["experts"], at(where, "experts"))
        if experts.routed_bytes >= sizes["weight_bytes"]:
            raise PerfModelError(f"{at(where, 'experts')}: {experts.moe_layers} x {experts.num_experts} experts of "
                                 f"{experts.expert_bytes} bytes exceed the {sizes['weight_bytes']} bytes of all "
                                 "weights")
        return cls(**sizes, experts=experts, routing=routing_fit_from_json(get(obj, "routing", where),
                                                                           at(where, "routing")))


@dataclass(frozen=True, eq=False)
class Points:
    """Timing rows as columns; the arrays are float for arithmetic."""

    batch_size: np.ndarray  # (N,)
    new_tokens: np.ndarray  # (N,)
    context_len: np.ndarray  # (N,)
    latency_ms: np.ndarray  # (N,) measured median

    def __len__(self) -> int:
        return len(self.latency_ms)

    def subset(self, mask: np.ndarray) -> "Points":
        return Points(self.batch_size[mask], self.new_tokens[mask], self.context_len[mask], self.latency_ms[mask])

    @classmethod
    def from_rows(cls, rows: Sequence[TimingRow]) -> "Points":
        feasible = [row for row in rows if row.feasible]
        column = lambda name: np.array([float(getattr(row, name)) for row in feasible])  # noqa: E731
        return cls(column("batch_size"), column("new_tokens"), column("context_len"), column("median_ms"))


# ---------------------------------------------------------------- roofline

def memory_bytes(shape: RoleShape, b, n, L):
    """Bytes moved by one pass: the weights it reads once (a mixture of experts: the touched experts only), the
    b*L cached KV entries read, b*n new ones written."""
    return shape.weights_read_bytes(b, n) + shape.kv_bytes_per_token * b * (L + n)


def pass_flops(shape: RoleShape, b, n, L):
    """FLOPs of one pass: 2 per active parameter per token, plus q.k and p.v over L + n keys per layer.

    L + n, not L + n/2: the runtime computes the full masked score matrix, as most kernels do.
    """
    return 2.0 * shape.active_parameters * b * n + 4.0 * shape.layers * shape.attention_width * b * n * (L + n)


def smooth_max(x, y, exponent: float):
    """The p-norm (x^p + y^p)^(1/p): p = 1 adds (no overlap), p -> infinity is max (perfect overlap)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    top = np.maximum(np.maximum(x, y), 1e-300)
    return top * ((x / top) ** exponent + (y / top) ** exponent) ** (1.0 / exponent)


@dataclass(frozen=True)
class RooflineParams:
    """T(b, n, L) = overhead_ms + smooth_max(memory_bytes / bandwidth, flops / flop rate).

    Assumes: a fixed per-pass cost independent of the work (kernel launches, Python dispatch,
    thread wake-up); one effective bandwidth for weights and KV cache; one effective FLOP rate for
    matmuls and attention; memory and compute overlapping to the degree `overlap_exponent` says.
    Breaks where those fail: attention kernels far less efficient than matmuls (CPUs, long
    context), discrete steps (GPU tile quantization, CPU thread partitioning), caches that hold
    small models' weights (bandwidth then means cache bandwidth), and memory-allocation effects.
    """

    overhead_ms: float
    bandwidth_GBps: float
    flops_TFLOPs: float
    overlap_exponent: float  # p of the smooth max, in [1, 64]

    def memory_ms(self, shape: RoleShape, b, n, L):
        return memory_bytes(shape, b, n, L) / (self.bandwidth_GBps * 1e9) * 1e3

    def compute_ms(self, shape: RoleShape, b, n, L):
        return pass_flops(shape, b, n, L) / (self.flops_TFLOPs * 1e12) * 1e3

    def work_ms(self, shape: RoleShape, b, n, L):
        """The roofline term without the fixed overhead."""
        return smooth_max(self.memory_ms(shape, b, n, L), self.compute_ms(shape, b, n, L), self.overlap_exponent)

    def gemm_ms(self, shape: RoleShape, tokens, tile_tokens: int | None):
        """The roofline in padded token counts: the weights read against the GEMMs' FLOPs over `tokens` rounded
        up to whole tiles (a GEMM runs whole tiles of token rows); no KV cache, no attention."""
        tokens = np.asarray(tokens, dtype=float)
        padded = tokens if tile_tokens is None else np.ceil(tokens / tile_tokens) * tile_tokens
        # a mixture of experts: the experts `tokens` one-token rows touch (the most a pass of that many reads)
        weights_ms = shape.weights_read_bytes(tokens, 1) / (self.bandwidth_GBps * 1e9) * 1e3
        return smooth_max(weights_ms, 2.0 * shape.active_parameters * padded / (self.flops_TFLOPs * 1e12) * 1e3,
                          self.overlap_exponent)

    def latency_ms(self, shape: RoleShape, b, n, L):
        return self.overhead_ms + self.work_ms(shape, b, n, L)

    def ridge_tokens(self, shape: RoleShape) -> float:
        """Tokens per pass (b*n) where weight reads and matmul FLOPs take equal time, at short
        context (KV and attention terms left out): below it the pass is memory-bound. A mixture of experts reads
        more experts as tokens grow: the crossing is found along one-token rows."""
        per_token_s = 2.0 * shape.active_parameters / (self.flops_TFLOPs * 1e12)
        if shape.experts is None:
            return shape.weight_bytes / (self.bandwidth_GBps * 1e9) / per_token_s
        from scipy.optimize import brentq

        def excess_s(tokens: float) -> float:  # compute minus weight reads; grows with tokens
            return tokens * per_token_s - float(shape.weights_read_bytes(tokens, 1)) / (self.bandwidth_GBps * 1e9)

        high = 1.0
        while excess_s(high) < 0 and high < 1e12:
            high *= 2.0
        return high if excess_s(high) < 0 or high == 1.0 else brentq(excess_s, high / 2.0, high)

    def to_json(self, shape: RoleShape) -> dict:
        return {"overhead_ms": rounded(self.overhead_ms), "bandwidth_GBps": rounded(self.bandwidth_GBps),
                "flops_TFLOPs": rounded(self.flops_TFLOPs), "overlap_exponent": rounded(self.overlap_exponent),
                "ridge_tokens": rounded(self.ridge_tokens(shape))}


# Fitting happens in log space: parameters stay positive and the optimizer sees relative steps.
_LOWER = np.log([1e-6, 1e-3, 1e-6, 1e-3])  # overhead_ms, bandwidth_GBps, flops_TFLOPs, exponent - 1
_UPPER = np.log([1e5, 1e6, 1e5, 63.0])


def _params_from_log(theta: np.ndarray) -> RooflineParams:
    overhead, bandwidth, flops, exponent_minus_one = np.exp(theta)
    return RooflineParams(float(overhead), float(bandwidth), float(flops), 1.0 + float(exponent_minus_one))


def _log_params(params: RooflineParams) -> np.ndarray:
    theta = np.log([params.overhead_ms, params.bandwidth_GBps, params.flops_TFLOPs, params.overlap_exponent - 1.0])
    return np.clip(theta, _LOWER + 1e-9, _UPPER - 1e-9)


def _initial_guesses(shape: RoleShape, points: Points) -> list[np.ndarray]:
    """A few starting points from the data's extremes: the cheapest pass bounds overhead and
    memory time, the pass with the most tokens bounds the FLOP rate."""
    b, n, L, t = points.batch_size, points.new_tokens, points.context_len, points.latency_ms
    cheapest, biggest = int(np.argmin(t)), int(np.argmax(b * n))
    starts = []
    for overhead_share in (0.3, 0.8):
        overhead = overhead_share * t[cheapest]
        memory_ms = max(t[cheapest] - overhead, 1e-3 * t[cheapest])
        bandwidth = memory_bytes(shape, b[cheapest], n[cheapest], L[cheapest]) / memory_ms / 1e6
        compute_ms = max(t[biggest] - overhead, 1e-3 * t[biggest])
        flop_rate = pass_flops(shape, b[biggest], n[biggest], L[biggest]) / compute_ms / 1e9
        for exponent in (2.0, 8.0):
            theta = np.log([overhead, bandwidth, flop_rate, exponent - 1.0])
            starts.append(np.clip(theta, _LOWER + 1e-9, _UPPER - 1e-9))
    return starts


def fit_roofline(shape: RoleShape, points: Points, start: RooflineParams | None = None) -> RooflineParams:
    """Least squares on log(predicted / measured), from several starts; the best fit wins. `start` (a fit
    of nearly the same points, e.g. before one batch size was left out) replaces the starts with one."""
    from scipy.optimize import least_squares

    require_points(points, MIN_POINTS, "the roofline fit")
    b, n, L, log_measured = points.batch_size, points.new_tokens, points.context_len, np.log(points.latency_ms)

    def residuals(theta: np.ndarray) -> np.ndarray:
        return np.log(_params_from_log(theta).latency_ms(shape, b, n, L)) - log_measured

    starts = _initial_guesses(shape, points) if start is None else [_log_params(start)]
    fits = [least_squares(residuals, theta, bounds=(_LOWER, _UPPER), x_scale=1.0, max_nfev=400) for theta in starts]
    return _params_from_log(min(fits, key=lambda fit: fit.cost).x)


# ---------------------------------------------------------------- monotone correction

def token_knots(points: Points, max_knots: int = MAX_TOKEN_KNOTS) -> tuple[float, ...]:
    """Knots for the token ramps: the distinct tokens-per-pass values, thinned evenly by rank (on a
    geometric grid of batch sizes that is roughly even in log tokens)."""
    tokens = np.unique(points.batch_size * points.new_tokens)
    if len(tokens) <= max_knots:
        return tuple(float(t) for t in tokens)
    picks = np.unique(np.round(np.linspace(0, len(tokens) - 1, max_knots)).astype(int))
    return tuple(float(t) for t in tokens[picks])


def monotone_basis(shape: RoleShape, roofline: RooflineParams, knots: Sequence[float], b, n,
                   L) -> tuple[list[str], np.ndarray]:
    """Columns that are >= 0 and nondecreasing in each of b, n and L; any nonnegative combination
    of them is therefore monotone too. Returns (names, matrix of shape (N, columns)), N being the
    size of b, n and L broadcast together and flattened."""
    b, n, L = (array.reshape(-1) for array in np.broadcast_arrays(*(np.asarray(v, dtype=float) for v in (b, n, L))))
    tokens = b * n
    columns = {
        "fixed_ms": np.ones_like(tokens),  # per-pass overhead
        "roofline_work": roofline.work_ms(shape, b, n, L),  # ms of the fitted roofline's work term
        "per_token": tokens,  # per-token work the FLOP count misses (norms, activations, embedding)
        "per_row": b,  # per-sequence bookkeeping (masks, cache indexing)
        "per_kv_read": b * (L + n),  # KV traffic at a bandwidth other than the weights'
        "per_attention": tokens * (L + n),  # attention at an efficiency other than the matmuls'
    }
    for low, high in zip(knots[:-1], knots[1:]):
        # saturating ramp from 0 at `low` to 1 at `high` tokens: a step smoothed over one grid gap
        columns[f"ramp_{low:g}_{high:g}"] = np.clip((tokens - low) / (high - low), 0.0, 1.0)
    return list(columns), np.column_stack(list(columns.values()))


@dataclass(frozen=True)
class MonotoneCorrection:
    """T(b, n, L) = sum_j c_j * basis_j(b, n, L) with every c_j >= 0 (see `monotone_basis`).

    Assumes the time is a sum of nondecreasing effects, each linear in its own work measure, plus
    steps located at the measured token counts. Breaks when a step falls between grid points (it
    is smoothed over the gap), and beyond the largest measured tokens per pass, where the ramps
    are flat and only the linear terms extrapolate.
    """

    token_knots: tuple[float, ...]
    coefficients: tuple[float, ...]  # aligned with the names `monotone_basis` returns

    def latency_ms(self, shape: RoleShape, roofline: RooflineParams, b, n, L):
        _, basis = monotone_basis(shape, roofline, self.token_knots, b, n, L)
        latency = np.maximum(basis @ np.asarray(self.coefficients), 1e-9)
        return latency.reshape(np.broadcast(b, n, L).shape)

    def to_json(self, shape: RoleShape, roofline: RooflineParams) -> dict:
        names, _ = monotone_basis(shape, roofline, self.token_knots, 1, 1, 0)
        return {"token_knots": list(self.token_knots),
                "coefficients": {name: rounded(value, 12) for name, value in zip(names, self.coefficients)}}

    @classmethod
    def from_json(cls, obj: dict, shape: RoleShape, roofline: RooflineParams, where: str) -> "MonotoneCorrection":
        knots = number_list(obj, "token_knots", where)
        names, _ = monotone_basis(shape, roofline, knots, 1, 1, 0)
        given = json_object(obj, "coefficients", where)
        if sorted(given) != sorted(names):
            raise PerfModelError(f"{where}.coefficients: {sorted(given)} do not match the basis "
                                 f"{sorted(names)}")
        coefficients = tuple(number(given, name, f"{where}.coefficients") for name in names)
        if min(coefficients) < 0:
            raise PerfModelError(f"{where}.coefficients: must be >= 0")
        return cls(knots, coefficients)


def fit_monotone(shape: RoleShape, roofline: RooflineParams, points: Points) -> MonotoneCorrection:
    """Nonnegative least squares on relative error (rows weighted by 1 / measured^2)."""
    from sklearn.linear_model import LinearRegression

    require_points(points, MIN_POINTS, "the monotone fit")
    knots = token_knots(points)
    _, basis = monotone_basis(shape, roofline, knots, points.batch_size, points.new_tokens, points.context_len)
    scale = np.maximum(basis.max(axis=0), 1e-300)  # unit-range columns keep the NNLS well conditioned
    regression = LinearRegression(positive=True, fit_intercept=False)
    # relative errors: weights 1 / T^2, scaled by the median (the same fit; finite for any measured range)
    weights = (points.latency_ms / np.median(points.latency_ms)) ** -2.0
    regression.fit(basis / scale, points.latency_ms, sample_weight=weights)
    return MonotoneCorrection(knots, tuple(float(c) for c in regression.coef_ / scale))


# ---------------------------------------------------------------- one role's model

@dataclass(frozen=True)
class Box:
    """The measured ranges of one role's timing rows: (low, high) of b, n and L."""

    batch_size: tuple[float, float]
    new_tokens: tuple[float, float]
    context_len: tuple[float, float]

    @classmethod
    def of(cls, points: Points) -> "Box":
        return cls((float(points.batch_size.min()), float(points.batch_size.max())),
                   (float(points.new_tokens.min()), float(points.new_tokens.max())),
                   (float(points.context_len.min()), float(points.context_len.max())))

    def clip(self, b, n, L):
        return np.clip(b, *self.batch_size), np.clip(n, *self.new_tokens), np.clip(L, *self.context_len)


@dataclass(frozen=True)
class LatencyModel:
    """One role's T(b, n, L), over the whole (b, n, L) space.

    Inside the measured box the fit itself. Outside it the monotone kind takes the fitted time at the box's
    edge, scaled by the roofline alone:

        T(b, n, L) = T_fit(b', n', L') * R(b, n, L) / R(b', n', L'),   (b', n', L') = the point clipped to the box.

    The refinement's ramps have no ground beyond the points they were fitted to (flat past the largest
    batch size, slopes borrowed from other regimes), so a table could turn on structure no measurement
    shows; the scaled edge is continuous there and as structure-free as the roofline. Assumption: the
    roofline's growth holds past the grid; a regime the grid never reached is not predicted, only not
    invented. The roofline kind is the roofline everywhere.

    The staircase knows what quantizes a pass (GEMM tiles in tokens, attention waves in rows) and is continued
    past its box by them (`Staircase.continued_ms`): the token steps it measured at the pass's own token count,
    the roofline in padded token counts past the measured ones, and past the largest batch size the cost of a
    row read over the last measured octaves, in whole waves where the steps show their width. With a
    `token_curve` (a draft whose GEMMs are the target's, `perfmodel.token_curve`) the growth past the measured
    token counts is the other role's fit along its tokens, scaled, instead of the padded roofline.
    """

    kind: str  # one of KINDS
    shape: RoleShape
    roofline: RooflineParams
    correction: MonotoneCorrection | None  # present for "roofline+monotone"
    box: Box | None = None  # the measured range the refinement holds in; None: the fit everywhere
    staircase: Staircase | None = None  # present for "roofline+staircase"
    token_curve: TokenCurve | None = None  # the staircase's growth past its token counts, from another role

    def fitted_ms(self, b, n, L):
        """The fit itself, with no regard to the measured range (arrays in, array out)."""
        if self.staircase is not None:
            work, compute = self.roofline.work_ms(self.shape, b, n, L), self.roofline.compute_ms(self.shape, b, n, L)
            return self.staircase.latency_ms(work, compute, b, n, L).reshape(np.broadcast(b, n, L).shape)
        if self.correction is None:
            return np.asarray(self.roofline.latency_ms(self.shape, b, n, L), dtype=float)
        return np.asarray(self.correction.latency_ms(self.shape, self.roofline, b, n, L), dtype=float)

    def latency_ms(self, b, n, L):
        """Predicted milliseconds of one pass; scalars in, float out; arrays in (broadcast), array out."""
        scalar = np.ndim(b) == np.ndim(n) == np.ndim(L) == 0
        if self.kind == ROOFLINE or self.box is None:
            value = self.fitted_ms(b, n, L)
        elif self.kind == STAIRCASE:
            shape = np.broadcast(b, n, L).shape
            tile = self.staircase.tile_tokens()
            grows = self.token_curve.tokens_ms if self.token_curve is not None else \
                (lambda tokens: self.roofline.gemm_ms(self.shape, tokens, tile))
            value = self.staircase.continued_ms(
                self.fitted_ms, grows,
                lambda *point: self.roofline.latency_ms(self.shape, *point),
                (self.box.batch_size, self.box.new_tokens, self.box.context_len), b, n, L).reshape(shape)
        else:
            b, n, L = np.broadcast_arrays(*(np.asarray(v, dtype=float) for v in (b, n, L)))
            edge = self.box.clip(b, n, L)
            inside = (edge[0] == b) & (edge[1] == n) & (edge[2] == L)
            # inside the box the scale is exactly 1: the point is its own edge
            at_edge, roofline = self.fitted_ms(*edge), self.roofline.latency_ms(self.shape, b, n, L)
            value = np.where(inside, at_edge, at_edge * roofline / self.roofline.latency_ms(self.shape, *edge))
        return float(np.reshape(value, -1)[0]) if scalar else value


def fit_latency_model(shape: RoleShape, points: Points, kind: str, start: RooflineParams | None = None) -> LatencyModel:
    if kind not in KINDS:
        raise PerfModelError(f"unknown latency model kind {kind!r}; valid kinds: {', '.join(KINDS)}")
    roofline = fit_roofline(shape, points, start)
    correction = fit_monotone(shape, roofline, points) if kind == MONOTONE else None
    staircase = None
    if kind == STAIRCASE:  # the steps around the roofline fitted through them: it keeps the average slopes
        require_points(points, MIN_POINTS, "the staircase fit")
        b, n, L = points.batch_size, points.new_tokens, points.context_len
        staircase = fit_staircase(roofline.work_ms(shape, b, n, L), roofline.compute_ms(shape, b, n, L), b, n, L,
                                  points.latency_ms)
    return LatencyModel(kind, shape, roofline, correction, Box.of(points), staircase)


def require_points(points: Points, needed: int, purpose: str) -> None:
    if len(points) < needed:
        raise PerfModelError(f"{purpose} needs at least {needed} feasible timing rows, found {len(points)}")


# ---------------------------------------------------------------- errors and selection

def percent_errors(predicted_ms, measured_ms) -> np.ndarray:
    """Signed relative errors in percent: positive means the model is slower than measured."""
    return 100.0 * (np.asarray(predicted_ms) - np.asarray(measured_ms)) / np.asarray(measured_ms)


def mape_pct(predicted_ms, measured_ms) -> float:
    return float(np.mean(np.abs(percent_errors(predicted_ms, measured_ms))))


def _cells(points: Points) -> np.ndarray:
    """One group per (batch size, context length): a fold leaves out whole cells, not single rows,
    because neighbouring n at the same (b, L) would make a held-out row trivially easy."""
    _, groups = np.unique(np.column_stack([points.batch_size, points.context_len]), axis=0, return_inverse=True)
    return groups.reshape(-1)


def has_steps(shape: RoleShape, points: Points) -> bool:
    """Whether the staircase fitted to all `points` finds a step: without one it is a linear refinement with
    signed terms, which the monotone kind does safely, and it is no candidate."""
    return bool(fit_latency_model(shape, points, STAIRCASE).staircase.steps)


def cross_validate(shape: RoleShape, points: Points, folds: int = CV_FOLDS,
                   kinds: Sequence[str] = KINDS) -> dict[str, float]:
    """Out-of-fold MAPE (percent) of each of `kinds`, grouped k-fold over (b, L) cells; deterministic. The
    staircase only where it finds a step (`has_steps`)."""
    from sklearn.model_selection import GroupKFold

    groups = _cells(points)
    splits = min(folds, len(np.unique(groups)))
    if splits < 2 or len(points) < MIN_POINTS:
        return {}
    if STAIRCASE in kinds and not has_steps(shape, points):
        kinds = tuple(k for k in kinds if k != STAIRCASE)
    predicted = {kind: np.empty(len(points)) for kind in kinds}
    for train, test in GroupKFold(n_splits=splits).split(points.latency_ms, groups=groups):
        part = points.subset(train)
        if len(part) < MIN_POINTS:
            return {}
        for kind in kinds:
            model = fit_latency_model(shape, part, kind)
            held = points.subset(test)
            predicted[kind][test] = model.latency_ms(held.batch_size, held.new_tokens, held.context_len)
    return {kind: mape_pct(predicted[kind], points.latency_ms) for kind in kinds}


def select_kind(cv_mape: dict[str, float]) -> str:
    """The roofline unless a refined kind's cross-validated MAPE is clearly lower: then the lowest of them
    (ties keep the earlier in REFINED)."""
    if not cv_mape:
        return ROOFLINE
    best = min((kind for kind in REFINED if kind in cv_mape), key=lambda kind: cv_mape[kind], default=None)
    return best if best is not None and cv_mape[best] < REFINED_MIN_GAIN * cv_mape[ROOFLINE] else ROOFLINE


# ---------------------------------------------------------------- held-out evaluation

@dataclass(frozen=True)
class PointError:
    batch_size: int
    new_tokens: int
    context_len: int
    measured_ms: float
    predicted_ms: float
    error_pct: float  # signed: positive means predicted slower than measured


def worst_points(model: LatencyModel, points: Points, count: int = 5) -> tuple[PointError, ...]:
    predicted = np.asarray(model.latency_ms(points.batch_size, points.new_tokens, points.context_len))
    errors = percent_errors(predicted, points.latency_ms)
    order = np.argsort(-np.abs(errors))[:count]
    return tuple(PointError(int(points.batch_size[i]), int(points.new_tokens[i]), int(points.context_len[i]),
                            float(points.latency_ms[i]), float(predicted[i]), float(errors[i])) for i in order)


def every_other_interior(values: Sequence[float]) -> tuple[int, ...]:
    """[1, 2, 4, 8, 16, 32] -> (2, 8): the 2nd, 4th, ... values, never an edge of the grid, so the
    held-out points test interpolation, which is what the table relies on inside the grid."""
    ordered = sorted(set(int(value) for value in values))
    return tuple(ordered[1:-1][::2])


@dataclass(frozen=True)
class HoldoutReport:
    held_out_batch_sizes: tuple[int, ...]
    held_out_context_lens: tuple[int, ...]
    train_points: int
    test_points: int
    kind: str  # chosen by cross-validation on the training part alone
    mape_pct: float
    max_error_pct: float
    mape_pct_by_kind: dict[str, float]
    worst: tuple[PointError, ...]


def evaluate_holdout(shape: RoleShape, points: Points, role: str, kinds: Sequence[str] = KINDS) -> HoldoutReport:
    """Leave out every other interior batch size and context length (all their rows), select and fit
    on the rest, and measure the error on what was left out."""
    held_b = every_other_interior(points.batch_size)
    held_L = every_other_interior(points.context_len)
    if not held_b and not held_L:
        raise PerfModelError(f"--holdout: the {role} rows need at least 3 batch sizes or 3 context lengths "
                             "to leave interior ones out")
    test = np.isin(points.batch_size, held_b) | np.isin(points.context_len, held_L)
    train_points, test_points = points.subset(~test), points.subset(test)
    if len(train_points) < MIN_POINTS:
        raise PerfModelError(f"--holdout: the {role} fit needs at least {MIN_POINTS} timing rows outside the "
                             f"held-out batch sizes and context lengths, found {len(train_points)}")
    return held_out_report(shape, train_points, test_points, kinds, held_b, held_L)


def held_out_report(shape: RoleShape, train: Points, test: Points, kinds: Sequence[str] = KINDS,
                    held_batch_sizes: Sequence[int] = (), held_context_lens: Sequence[int] = (),
                    adapt: Callable[[LatencyModel], LatencyModel] | None = None) -> HoldoutReport:
    """Fit each of `kinds` on `train`, choose among them by cross-validation on `train` alone (`fit`'s rule)
    and measure each on `test`. `adapt` turns a fitted model into the one `fit` uses (the draft's token curve)."""
    models = {kind: fit_latency_model(shape, train, kind) for kind in kinds}
    if adapt is not None:
        models = {kind: adapt(model) for kind, model in models.items()}
    by_kind = {kind: mape_pct(model.latency_ms(test.batch_size, test.new_tokens, test.context_len), test.latency_ms)
               for kind, model in models.items()}
    kind = select_kind(cross_validate(shape, train, kinds=kinds))
    worst = worst_points(models[kind], test)
    return HoldoutReport(tuple(held_batch_sizes), tuple(held_context_lens), len(train), len(test), kind,
                         by_kind[kind], abs(worst[0].error_pct), by_kind, worst)
