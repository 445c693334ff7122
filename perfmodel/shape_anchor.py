"""Shape anchoring: each role's fitted pass time held to the isolated grid's own timings at the shapes
the grid measured, when calibrate's in-situ steps say that predicts better.

Why. A forward pass's time is not a smooth function of its shape. gpt2-large on one thread of this CPU
(float32, context 96, `calibrate --quick`, 2026-12-01): the target at b = 1 took 330 ms for 3 tokens and
578 ms for 4; at b = 4, 996 ms for 3 tokens and 728 ms for 4; at b = 8, 688 ms for 1 token and 601 ms
for 2. The in-situ passes of that calibration repeat it (b = 4: 866 ms for 3 tokens, 589-609 ms for
4), so it is the matrix kernels' blocking, not the machine's noise; GPUs have the same in tile and wave
quantization. The roofline with monotone terms (perfmodel.latency) cannot bend down where the time does,
and the table decides between ks by exactly these ratios: at b = 4 the in-situ steps made k = 3 the
cheapest per token and the fit put it behind k = 4.

What. For each role, the shapes (b, n, L) of the isolated grid's full product (every batch size and
context at each such n: the chains' verify widths 1..max_k + 1 and the draft's 1 and 2; wide passes are
measured at some batch sizes only and keep the fit alone), r = log(measured / fitted), less the role's
mean r: the fit, chosen by its timing source (perfmodel.sources), keeps the level, the anchor moves the
ratios between shapes. A pass of width n in that set is predicted fitted * exp(r(b, n, L)), r linear in
log b between measured batch sizes and linear in L between measured contexts, the edge's value held
beyond (perfmodel.extrapolation then grows the edge value as the roofline). One measurement per shape,
so r carries that measurement's noise too; hence:

When. Only when it predicts the in-situ steps' ratios better than the fit alone: the paired step error
(perfmodel.step_correction.paired_error_pct: each step's log error less the mean of its batch size and
sweep, the machine's speed cancelled) with the anchor below the one without. The in-situ steps are
measurements the anchor was not learned from. On the same day: gpt2-large 6.50 % -> 3.62 % (applied);
three demo-pair calibrations 5.45 -> 7.59, 2.99 -> 9.20, 3.00 -> 5.08 % (not applied: there the
residuals are the machine's spells, not the kernels'). Profiles without in-situ steps get none.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from .errors import PerfModelError
from .step_correction import paired_error_pct

LatencyByRole = Callable[[str, Any, Any, Any], Any]  # (role, b, n, L) -> ms; arrays in, array out


@dataclass(frozen=True)
class RoleAnchor:
    batch_sizes: tuple[int, ...]
    new_tokens: tuple[int, ...]  # the widths anchored; others take the fit alone
    context_lens: tuple[int, ...]
    log_residual: np.ndarray  # (batch sizes, new tokens, contexts), the role's mean removed

    def log_factor(self, b, n, L) -> np.ndarray:
        b_arr, n_arr, L_arr = np.broadcast_arrays(np.asarray(b, dtype=float), np.asarray(n), np.asarray(L, dtype=float))
        out = np.zeros(b_arr.shape)
        log_b = np.log(np.asarray(self.batch_sizes, dtype=float))
        contexts = np.asarray(self.context_lens, dtype=float)
        for j, width in enumerate(self.new_tokens):
            at = n_arr == width
            if not at.any():
                continue
            # linear in log b for each measured context (np.interp holds the edge beyond), then in L
            by_context = np.stack([np.interp(np.log(b_arr[at]), log_b, self.log_residual[:, j, c])
                                   for c in range(len(contexts))], axis=-1)
            if len(contexts) == 1:
                out[at] = by_context[:, 0]
                continue
            L_at = np.clip(L_arr[at], contexts[0], contexts[-1])
            i = np.clip(np.searchsorted(contexts, L_at, side="right") - 1, 0, len(contexts) - 2)
            w = (L_at - contexts[i]) / (contexts[i + 1] - contexts[i])
            rows = np.arange(len(i))
            out[at] = by_context[rows, i] * (1 - w) + by_context[rows, i + 1] * w
        return out


@dataclass(frozen=True)
class ShapeAnchor:
    roles: dict[str, RoleAnchor]
    paired_error_pct: float  # the in-situ steps' paired error with the anchor
    unanchored_paired_error_pct: float  # ... and with the fit alone
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def applied(self) -> bool:
        return self.paired_error_pct < self.unanchored_paired_error_pct

    def factor(self, role: str, b, n, L):
        """exp(r) at (b, n, L): a float for scalars (remembered: the table asks the same shapes again and
        again), an array for arrays; 1 for a role or width without an anchor, or when not applied."""
        anchor = self.roles.get(role) if self.applied else None
        scalar = np.ndim(b) == 0 and np.ndim(n) == 0 and np.ndim(L) == 0
        if anchor is None:
            return 1.0 if scalar else np.ones(np.broadcast(np.asarray(b), np.asarray(n), np.asarray(L)).shape)
        if not scalar:
            return np.exp(anchor.log_factor(b, n, L))
        key = (role, float(b), int(n), float(L))
        if key not in self._cache:
            self._cache[key] = float(np.exp(anchor.log_factor(b, n, L)))
        return self._cache[key]

    def note(self) -> str:
        verdict = "applied" if self.applied else "not applied (it did not predict the in-situ steps better)"
        widths = ", ".join(f"{role} n = {', '.join(map(str, a.new_tokens))}" for role, a in self.roles.items())
        largest = max(((role, a) for role, a in self.roles.items()), key=lambda ra: float(np.abs(ra[1].log_residual).max()))
        return (f"shape anchor to the isolated grid's timings {verdict} ({widths}): in-situ steps' paired error "
                f"{self.unanchored_paired_error_pct:.2f} % by the fit alone, {self.paired_error_pct:.2f} % anchored; "
                f"largest: {largest[0]} x{math.exp(float(np.abs(largest[1].log_residual).max())):.3f}")

    def to_json(self) -> dict[str, Any]:
        return {"paired_error_pct": self.paired_error_pct,
                "unanchored_paired_error_pct": self.unanchored_paired_error_pct,
                "roles": {role: {"batch_sizes": list(a.batch_sizes), "new_tokens": list(a.new_tokens),
                                 "context_lens": list(a.context_lens), "log_residual": a.log_residual.tolist()}
                          for role, a in self.roles.items()}}

    @classmethod
    def from_json(cls, obj: Any, where: str) -> "ShapeAnchor":
        try:
            roles = {}
            for role, a in obj["roles"].items():
                anchor = RoleAnchor(tuple(int(b) for b in a["batch_sizes"]), tuple(int(n) for n in a["new_tokens"]),
                                    tuple(int(L) for L in a["context_lens"]), np.asarray(a["log_residual"], dtype=float))
                if anchor.log_residual.shape != (len(anchor.batch_sizes), len(anchor.new_tokens),
                                                 len(anchor.context_lens)):
                    raise ValueError(f"log_residual of {role} is not batch sizes x new tokens x contexts")
                roles[role] = anchor
            return cls(roles, float(obj["paired_error_pct"]), float(obj["unanchored_paired_error_pct"]))
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise PerfModelError(f"{where}: shape_anchor is malformed ({error})") from None


def role_anchor(timings: Sequence, role: str, latency_ms: LatencyByRole) -> RoleAnchor | None:
    """The role's anchor from the isolated rows (`perfmodel.profile.TimingRow`) at the widths measured at
    every batch size and context; None when there are fewer than two such shapes."""
    rows = [t for t in timings if t.model == role and t.feasible]
    batch_sizes = sorted({t.batch_size for t in rows})
    contexts = sorted({t.context_len for t in rows})
    measured: dict[tuple[int, int, int], float] = {}
    for t in rows:
        measured.setdefault((t.batch_size, t.new_tokens, t.context_len), t.median_ms)
    widths = sorted(n for n in {t.new_tokens for t in rows}
                    if all((b, n, L) in measured for b in batch_sizes for L in contexts))
    if len(widths) * len(batch_sizes) * len(contexts) < 2:
        return None
    residual = np.empty((len(batch_sizes), len(widths), len(contexts)))
    for i, b in enumerate(batch_sizes):
        for j, n in enumerate(widths):
            for c, L in enumerate(contexts):
                residual[i, j, c] = math.log(measured[(b, n, L)] / float(latency_ms(role, b, n, L)))
    return RoleAnchor(tuple(batch_sizes), tuple(widths), tuple(contexts), residual - residual.mean())


def fit_shape_anchor(timings: Sequence, latency_ms: LatencyByRole, steps: Sequence,
                     predict_steps: Callable[[LatencyByRole], Sequence[float]]) -> ShapeAnchor | None:
    """The anchor of both roles, with the in-situ steps' paired error with and without it (`predict_steps`:
    a latency function -> the predicted ms of each of `steps`); None without lockstep steps to judge by."""
    roles = {role: anchor for role in ("target", "draft")
             if (anchor := role_anchor(timings, role, latency_ms)) is not None}
    if not roles:
        return None
    unanchored = paired_error_pct(steps, predict_steps(latency_ms))
    if unanchored is None:
        return None
    candidate = ShapeAnchor(roles, -math.inf, unanchored)  # applied, to predict with it

    def anchored(role, b, n, L):
        return latency_ms(role, b, n, L) * candidate.factor(role, b, n, L)

    return ShapeAnchor(roles, paired_error_pct(steps, predict_steps(anchored)), unanchored)
