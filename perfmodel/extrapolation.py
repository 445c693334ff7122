"""Beyond the measured grid, a pass's time grows only as the roofline says.

The monotone refinement (`latency.MonotoneCorrection`) follows the steps real hardware has, which is
right between measured points and has no ground outside them: past the largest measured batch size its
ramps are flat and its linear terms extrapolate with slopes fitted to other regimes, so a table can turn
(a larger k winning again at large batch) on structure no measurement shows. Outside the measured box
(batch size, tokens per pass, context length, per role) the time is therefore

    T(b, n, L) = T_fit(b', n', L') * R(b, n, L) / R(b', n', L'),   (b', n', L') = the point clipped to the box,

the fitted time at the box's edge, scaled by the roofline R alone: continuous at the edge (no jump to
flip a choice), equal to the fit inside, and, beyond, as monotone and as structure-free as the roofline.
For a role fitted with the roofline alone this is the roofline itself.

Assumption: the roofline's growth (memory-bound, then compute-bound) holds past the grid; a regime the
grid never reached (e.g. a cache level spilled at batch 64) is not predicted, only not invented.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import latency as lat


@dataclass(frozen=True)
class Box:
    """The measured ranges of one role's timing rows."""

    batch_size: tuple[float, float]
    new_tokens: tuple[float, float]
    context_len: tuple[float, float]

    @classmethod
    def of(cls, points: lat.Points) -> "Box":
        return cls((float(points.batch_size.min()), float(points.batch_size.max())),
                   (float(points.new_tokens.min()), float(points.new_tokens.max())),
                   (float(points.context_len.min()), float(points.context_len.max())))

    def clip(self, b: float, n: float, L: float) -> tuple[float, float, float]:
        return (float(np.clip(b, *self.batch_size)), float(np.clip(n, *self.new_tokens)),
                float(np.clip(L, *self.context_len)))

    def contains(self, b: float, n: float, L: float) -> bool:
        return self.clip(b, n, L) == (float(b), float(n), float(L))


def bounded_latency_ms(model: lat.LatencyModel, points: lat.Points, b, n, L):
    """One pass's time: the fit inside the measured box, the roofline's growth from its edge outside.
    Scalars in, float out; arrays in (broadcast together), array out: an online policy evaluates many
    pass widths at a new (b, L) in one call (perfmodel.strategy.StepModel.prefetch)."""
    if model.correction is None:
        return model.latency_ms(b, n, L)
    box = Box.of(points)
    if np.ndim(b) == np.ndim(n) == np.ndim(L) == 0:
        if box.contains(b, n, L):
            return model.latency_ms(b, n, L)
        edge = box.clip(b, n, L)
        roofline = model.roofline
        scale = roofline.latency_ms(model.shape, b, n, L) / roofline.latency_ms(model.shape, *edge)
        return float(model.latency_ms(*edge) * scale)
    b, n, L = np.broadcast_arrays(*(np.asarray(v, dtype=float) for v in (b, n, L)))
    edge = (np.clip(b, *box.batch_size), np.clip(n, *box.new_tokens), np.clip(L, *box.context_len))
    inside = (edge[0] == b) & (edge[1] == n) & (edge[2] == L)
    roofline = model.roofline
    # inside the box the scale is exactly 1 (the point is its own edge), as in the scalar branch
    scale = np.where(inside, 1.0, roofline.latency_ms(model.shape, b, n, L)
                     / roofline.latency_ms(model.shape, *edge))
    return np.asarray(model.latency_ms(*edge), dtype=float) * scale
