"""Which pass timings the latency model is fitted to: the one that predicts measured steps better.

A profile with in-situ rows (`perfmodel.insitu`) offers three sources for each role's `T(b, n, L)`:

    isolated           the grid of passes timed alone (`timings`): every width, every grid batch size;
    in-situ            the passes timed inside real speculative steps (`insitu_timings`): the passes the
                       runtime runs, at the in-situ batch sizes, chain widths and the contexts met;
    isolated+in-situ   both sets of rows together.

Each source is fitted as `model.fit_role` fits any rows (kind chosen by cross-validation), and judged on
the profile's measured steps (`insitu_steps`) through the one prediction path, `strategy.StepModel`
(the runtime's pass schedule at the fitted latencies, plus the overhead model): for every batch size b
with measured steps, each role is refitted (same kind) WITHOUT that source's rows at b, and the steps
at b are predicted from that fit. The mean absolute percentage error of those held-out step predictions
decides; a source that cannot be refitted at some b (too few rows left) is judged in-sample with the
others, and ties keep the earlier source (isolated first: today's behaviour). The same refits give the
held-out pass MAPE per batch size, on the source's own rows at b and on the in-situ rows at b (the
passes the runtime really ran: the ground truth every source is aiming at).

Assumption: the steps at one batch size are independent of the rows at the others (they are measured
in separate generations); the steps share the in-situ passes' generations, so the in-situ source is
only held out across batch sizes, not across prompts.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable, Sequence

import numpy as np

from . import latency as lat
from .acceptance import AcceptanceModel
from .errors import PerfModelError
from .insitu import InSituStepRow
from .jsonio import rounded
from .overhead import OverheadModel
from .profile import ROLES, Profile
from .strategy import StepModel
from .tree import Strategy

ISOLATED, INSITU, COMBINED = "isolated", "in-situ", "isolated+in-situ"
SOURCES = (ISOLATED, INSITU, COMBINED)


def insitu_points(profile: Profile, role: str) -> lat.Points:
    rows = [r for r in profile.insitu_timings if r.model == role]
    column = lambda name: np.array([float(getattr(r, name)) for r in rows])  # noqa: E731
    return lat.Points(column("batch_size"), column("new_tokens"), column("context_len"), column("median_ms"))


def _joined(a: lat.Points, b: lat.Points) -> lat.Points:
    return lat.Points(*(np.concatenate([getattr(a, f), getattr(b, f)])
                        for f in ("batch_size", "new_tokens", "context_len", "latency_ms")))


def source_points(profile: Profile, role: str, source: str) -> lat.Points:
    """The feasible rows of one role that `source` fits to."""
    if source not in SOURCES:
        raise PerfModelError(f"timing source {source!r} is not one of {', '.join(SOURCES)}")
    isolated = lat.Points.from_rows(profile.timings_of(role))
    if source == ISOLATED:
        return isolated
    in_situ = insitu_points(profile, role)
    return in_situ if source == INSITU else _joined(isolated, in_situ)


@dataclass(frozen=True)
class BatchSizeError:
    """Held-out errors at one batch size: each role refitted without the source's rows at b."""

    batch_size: int
    steps: int  # measured step rows (one per k) at b
    step_mape_pct: float | None  # None: too few rows left to refit without b
    pass_mape_pct: float | None  # the source's own rows at b (None: it has none there)
    insitu_pass_mape_pct: float | None  # the in-situ rows at b


@dataclass(frozen=True)
class StepError:
    batch_size: int
    k: int
    context_len: int
    measured_ms: float
    predicted_ms: float  # by the source's full fit

    @property
    def error_pct(self) -> float:
        return 100.0 * (self.predicted_ms - self.measured_ms) / self.measured_ms


@dataclass(frozen=True)
class SourceReport:
    source: str
    points: dict[str, int]  # rows fitted, per role
    kinds: dict[str, str]  # the latency model's kind per role
    step_mape_pct: float  # in-sample: the full fit against every measured step
    heldout_step_mape_pct: float | None  # over every step, each predicted without its batch size's rows
    by_batch_size: tuple[BatchSizeError, ...]
    steps: tuple[StepError, ...]

    def to_json(self) -> dict:
        def clean(obj: dict) -> dict:
            return {key: rounded(value) if isinstance(value, float) else value for key, value in obj.items()}
        return {"source": self.source, "points": dict(self.points), "kinds": dict(self.kinds),
                "step_mape_pct": rounded(self.step_mape_pct),
                "heldout_step_mape_pct": None if self.heldout_step_mape_pct is None
                else rounded(self.heldout_step_mape_pct),
                "by_batch_size": [clean(asdict(e)) for e in self.by_batch_size],
                "steps": [clean(asdict(s)) for s in self.steps]}

    @classmethod
    def from_json(cls, obj: dict) -> "SourceReport":
        return cls(obj["source"], dict(obj["points"]), dict(obj["kinds"]), float(obj["step_mape_pct"]),
                   obj["heldout_step_mape_pct"], tuple(BatchSizeError(**e) for e in obj["by_batch_size"]),
                   tuple(StepError(**s) for s in obj["steps"]))


@dataclass(frozen=True)
class SourceChoice:
    chosen: str
    criterion: str  # "held-out step MAPE" | "in-sample step MAPE"
    reports: tuple[SourceReport, ...]

    def report(self, source: str) -> SourceReport:
        return next(r for r in self.reports if r.source == source)

    def to_json(self) -> dict:
        return {"chosen": self.chosen, "criterion": self.criterion, "sources": [r.to_json() for r in self.reports]}

    @classmethod
    def from_json(cls, obj: dict) -> "SourceChoice":
        return cls(str(obj["chosen"]), str(obj["criterion"]), tuple(SourceReport.from_json(r) for r in obj["sources"]))


# ---------------------------------------------------------------- predicting steps

LatencyByRole = Callable[[str, int, int, int], float]


def predict_steps(latency_ms: LatencyByRole, overhead: OverheadModel, acceptance: AcceptanceModel,
                  steps: Sequence[InSituStepRow]) -> np.ndarray:
    """Predicted ms of each measured step (a chain of its k at its batch size and context)."""
    model = StepModel(latency_ms, overhead, acceptance)
    return np.array([model.evaluate(Strategy.from_k(s.k), s.batch_size, s.context_len).step_ms for s in steps])


def _latency_by_role(models: dict[str, lat.LatencyModel]) -> LatencyByRole:
    return lambda role, b, n, L: models[role].latency_ms(b, n, L)


def _mape(predicted: np.ndarray, measured: np.ndarray) -> float | None:
    return lat.mape_pct(predicted, measured) if len(measured) else None


def _rows_at(points: lat.Points, b: int) -> lat.Points:
    return points.subset(points.batch_size == b)


def _pass_mape(models, train, points_at_b: dict[str, lat.Points]) -> float | None:
    """MAPE over both roles' rows at one batch size, each predicted by its role's refit."""
    predicted, measured = [], []
    for role, at_b in points_at_b.items():
        for b, n, L, ms in zip(at_b.batch_size, at_b.new_tokens, at_b.context_len, at_b.latency_ms):
            predicted.append(models[role].latency_ms(b, n, L))
            measured.append(ms)
    return _mape(np.array(predicted), np.array(measured))


def held_out_by_batch_size(profile: Profile, source: str, full: dict[str, lat.LatencyModel], overhead: OverheadModel,
                           acceptance: AcceptanceModel) -> tuple[tuple[BatchSizeError, ...], np.ndarray]:
    """Per batch size with measured steps: refit each role (the kind of its `full` fit, starting from that
    fit's roofline: the optimum moves little when one batch size leaves) without the source's rows at b,
    predict the steps at b and the rows at b. Returns the errors and the held-out prediction of every step
    (nan where a refit was impossible), aligned with `profile.insitu_steps`."""
    steps = profile.insitu_steps
    predicted = np.full(len(steps), np.nan)
    measured = np.array([s.median_ms for s in steps])
    errors = []
    for b in sorted({s.batch_size for s in steps}):
        points = {role: source_points(profile, role, source) for role in ROLES}
        train = {role: p.subset(p.batch_size != b) for role, p in points.items()}
        at_b = [i for i, s in enumerate(steps) if s.batch_size == b]
        if min(len(p) for p in train.values()) < lat.MIN_POINTS:
            errors.append(BatchSizeError(b, len(at_b), None, None, None))
            continue
        models = {role: lat.fit_latency_model(full[role].shape, train[role], full[role].kind, full[role].roofline)
                  for role in ROLES}
        predicted[at_b] = predict_steps(_latency_by_role(models), overhead, acceptance, [steps[i] for i in at_b])
        own = {role: _rows_at(p, b) for role, p in points.items()}
        in_situ = {role: _rows_at(insitu_points(profile, role), b) for role in ROLES}
        errors.append(BatchSizeError(b, len(at_b), _mape(predicted[at_b], measured[at_b]),
                                     _pass_mape(models, train, own), _pass_mape(models, train, in_situ)))
    return tuple(errors), predicted


def source_report(profile: Profile, source: str, fits: dict, overhead: OverheadModel,
                  acceptance: AcceptanceModel) -> SourceReport:
    """`fits`: role -> the source's full fit (anything with `.model` and `.points`, e.g. model.RoleFit)."""
    steps = profile.insitu_steps
    full = predict_steps(_latency_by_role({r: f.model for r, f in fits.items()}),
                         overhead, acceptance, steps)
    measured = np.array([s.median_ms for s in steps])
    kinds = {role: fit.model.kind for role, fit in fits.items()}
    by_b, held = held_out_by_batch_size(profile, source, {r: f.model for r, f in fits.items()}, overhead, acceptance)
    heldout = None if np.isnan(held).any() else lat.mape_pct(held, measured)
    return SourceReport(source, {role: len(fit.points) for role, fit in fits.items()}, kinds,
                        lat.mape_pct(full, measured), heldout, by_b,
                        tuple(StepError(s.batch_size, s.k, s.context_len, s.median_ms, float(p))
                              for s, p in zip(steps, full)))


def choose_source(reports: Sequence[SourceReport]) -> SourceChoice:
    """The lowest held-out step MAPE when every source has one, else the lowest in-sample step MAPE;
    ties keep the earlier source."""
    held = all(r.heldout_step_mape_pct is not None for r in reports)
    criterion = "held-out step MAPE" if held else "in-sample step MAPE"
    score = (lambda r: r.heldout_step_mape_pct) if held else (lambda r: r.step_mape_pct)
    best = min(reports, key=lambda r: (score(r), SOURCES.index(r.source)))
    return SourceChoice(best.source, criterion, tuple(reports))
