"""`fit`: one pipeline from a profile to a `FittedModel`.

1. Latency per role: the roofline, refined by monotone terms or, on a GPU, by the kernel steps found in the
   data when grouped cross-validation prefers it (`latency.select_kind`), fitted to one timing source's rows.
2. The step stage, when the profile has in-situ steps (measured greedily, so judged with the greedy
   acceptance). Default, and the only rule:
   a. timing source: the grid of isolated passes, the passes timed inside real steps, or both; each is
      fitted as in 1. and predicts the measured steps with each batch size's rows held out; the lowest
      held-out step MAPE wins (in-sample when some source cannot be held out; ties keep isolated);
   b. the in-situ step correction (`steps.fit_step_correction`), kept only when it predicts held-out
      sweeps better than the model alone. It applies to every strategy, at its verified width.
   Without in-situ steps: the isolated fit, no correction.
3. Past its measured token counts the draft's staircase grows as the target's fit does, scaled, where the two
   have the same block (`token_curve`): the draft's rows never reach the token counts where the GEMMs step.
4. Overheads, acceptance, the second stage and the noise figure are carried from the profile.

An engine's profile (`calibrate --engine vllm`) has no passes of ours: its steps are fitted by
`engine_steps.fit_engine_steps` instead, and the model's `roles` stay empty.

Assumption: the steps at one batch size are independent of the rows at the others (separate
generations); the in-situ source shares the steps' generations, so it is held out across batch sizes
only, not across prompts.
"""
from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timezone
from typing import Callable, Sequence

import numpy as np

from . import latency as lat
from .acceptance import AcceptanceModel, acceptance_from_profile
from .coverage import Coverage, profile_coverage
from .experts import fit_routing
from .errors import PerfModelError
from .model import FittedModel, RoleFit
from .overhead import OverheadModel
from .profile import ROLES, Profile
from .steps import (INSITU, ISOLATED, SOURCES, BatchSizeError, SourceChoice, SourceReport, StepError,
                    fit_step_correction)
from .strategy import StepModel
from .token_curve import share_token_curve
from .tree import Strategy

MIN_REGIME_POINTS = 4  # the roofline's parameter count: fewer points in a regime leave its rate loose


# ---------------------------------------------------------------- timing sources

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


# ---------------------------------------------------------------- 1. latency per role

def _role_notes(memory_bound_points: int, total_points: int) -> tuple[str, ...]:
    """Flag parameters the data cannot pin down: a regime with fewer points than parameters."""
    notes = []
    if memory_bound_points < MIN_REGIME_POINTS:
        notes.append(f"only {memory_bound_points} memory-bound points: bandwidth_GBps is poorly determined")
    if total_points - memory_bound_points < MIN_REGIME_POINTS:
        notes.append(f"only {total_points - memory_bound_points} compute-bound points: "
                     "flops_TFLOPs is poorly determined")
    return tuple(notes)


def _role_holdout(shape: lat.RoleShape, points: lat.Points, role: str, source: str,
                  kinds: tuple[str, ...] = lat.KINDS) -> lat.HoldoutReport | None:
    """Every other interior batch size and context left out; the in-situ rows' many contexts may leave too
    few to fit (None then: their held-out errors per batch size are in the source report instead)."""
    try:
        return lat.evaluate_holdout(shape, points, role, kinds)
    except PerfModelError:
        if source == ISOLATED:
            raise
    return None


def role_shape(profile: Profile, role: str) -> lat.RoleShape:
    """A role's shape for its latency fit: a mixture of experts with its routing fitted to the profile's rows
    (the uniform prior without them)."""
    info = profile.model(role)
    if info.experts is None:
        return lat.RoleShape.from_model_info(info)
    rows = () if profile.routing is None else profile.routing.rows_of(role)
    random_weights = profile.routing is not None and profile.routing.source == "random_weights"
    return lat.RoleShape.from_model_info(info, fit_routing(info.experts, rows, random_weights))


def fit_role(profile: Profile, role: str, holdout: bool, source: str = ISOLATED) -> RoleFit:
    """Cross-validate the kinds offered for the profile's device (`latency.kinds_for`), fit the chosen one on every
    point of `source`, optionally evaluate a holdout."""
    rows = profile.timings_of(role, feasible_only=False)
    points = source_points(profile, role, source)
    if len(points) < lat.MIN_POINTS:
        raise PerfModelError(f"{role}: the latency fit needs at least {lat.MIN_POINTS} feasible timing rows, "
                             f"the profile has {len(points)} ({source})")
    shape = role_shape(profile, role)
    kinds = lat.kinds_for(profile.device.kind)
    cv = lat.cross_validate(shape, points, kinds=kinds)
    model = lat.fit_latency_model(shape, points, lat.select_kind(cv))
    b, n, L = points.batch_size, points.new_tokens, points.context_len
    predicted = model.latency_ms(b, n, L)
    roofline = model.roofline
    memory_bound = roofline.memory_ms(shape, b, n, L) > roofline.compute_ms(shape, b, n, L)
    memory_share = float(np.mean(memory_bound))
    notes = _role_notes(int(memory_bound.sum()), len(points))
    if not cv:
        notes += ("too few (batch size, context length) cells to cross-validate: roofline used",)
    return RoleFit(
        role=role, model=model, points=points, infeasible_rows=sum(not row.feasible for row in rows),
        in_sample_mape_pct=lat.mape_pct(predicted, points.latency_ms), cv_mape_pct=cv,
        worst=lat.worst_points(model, points),
        holdout=_role_holdout(shape, points, role, source, kinds) if holdout else None,
        memory_bound_share=memory_share, notes=notes,
    )


def overhead_model(profile: Profile) -> OverheadModel:
    """Chain rows by (b, k); tree rows, and chain rows measured with the second stage (a chain of k
    is a tree of k nodes), by (b, nodes, stage2)."""
    chain_rows = tuple((row.batch_size, row.k, row.median_ms) for row in profile.overheads
                       if row.tree_nodes is None and not row.stage2)
    tree_rows = tuple((row.batch_size, row.k if row.tree_nodes is None else row.tree_nodes, row.stage2, row.median_ms)
                      for row in profile.overheads if row.tree_nodes is not None or row.stage2)
    return OverheadModel(chain_rows, tree_rows)



# ---------------------------------------------------------------- 2. the step stage

LatencyByRole = Callable[[str, int, int, int], float]


def predict_steps(latency_ms: LatencyByRole, overhead: OverheadModel, acceptance: AcceptanceModel,
                  steps: Sequence, drafter: str = "draft_model") -> np.ndarray:
    """Predicted ms of each measured in-situ step row (a chain of its k at its batch size and context);
    `drafter`: the profile's (a head's steps have their own passes)."""
    model = StepModel(latency_ms, overhead, acceptance, drafter=drafter)
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
        predicted[at_b] = predict_steps(_latency_by_role(models), overhead, acceptance, [steps[i] for i in at_b],
                                        profile.draft.drafter)
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
                         overhead, acceptance, steps, profile.draft.drafter)
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


def _step_acceptance(acceptance: Sequence[AcceptanceModel]) -> AcceptanceModel | None:
    """The acceptance the in-situ steps ran with: greedy (calibrate generates greedily)."""
    return next((a for a in acceptance if a.mode == "greedy"), None)


def fit_sources(profile: Profile, holdout: bool, overhead: OverheadModel,
                acceptance: AcceptanceModel | None) -> tuple[dict[str, RoleFit], SourceChoice | None]:
    """2a. The isolated fit alone without in-situ steps to judge by; else every source that has enough
    rows, judged on the measured steps, and the chosen one's fits."""
    isolated = {role: fit_role(profile, role, holdout) for role in ROLES}
    if not profile.insitu_steps or acceptance is None:
        return isolated, None
    fits = {ISOLATED: isolated}
    for source in SOURCES[1:]:
        try:  # their held-out errors per batch size are in the source report; the role's own only if chosen
            fits[source] = {role: fit_role(profile, role, False, source) for role in ROLES}
        except PerfModelError:
            continue  # too few rows of that source: it is not a candidate
    choice = choose_source([source_report(profile, source, role_fits, overhead, acceptance)
                            for source, role_fits in fits.items()])
    chosen = fits[choice.chosen]
    if holdout and choice.chosen != ISOLATED:
        kinds = lat.kinds_for(profile.device.kind)
        chosen = {role: replace(fit, holdout=_role_holdout(fit.model.shape, fit.points, role, choice.chosen, kinds))
                  for role, fit in chosen.items()}
    return chosen, choice


def fit_profile(profile: Profile, holdout: bool = False) -> FittedModel:
    """The pipeline of the module docstring; `holdout` adds each role's held-out pass errors."""
    if profile.engine is not None:
        return _fit_engine_profile(profile)
    overhead = overhead_model(profile)
    acceptance = tuple(acceptance_from_profile(entry) for entry in profile.acceptance)
    greedy = _step_acceptance(acceptance)
    roles, choice = fit_sources(profile, holdout, overhead, greedy)
    roles = with_token_curve(roles, profile)
    fitted = FittedModel(
        created_utc=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        profile_created_utc=profile.created_utc,
        device=profile.device, target_info=profile.target, draft_info=profile.draft, grid=profile.grid,
        roles=roles, overhead=overhead, acceptance=acceptance, stage2=profile.stage2, timing_source=choice,
        noise=profile.noise, composition=profile.composition, coverage=_gaps(profile),
    )
    if not profile.insitu_steps or greedy is None:
        return fitted
    predicted_ms = predict_steps(fitted.latency_ms, overhead, greedy, profile.insitu_steps, profile.draft.drafter)
    return replace(fitted, step_correction=fit_step_correction(profile.insitu_steps, predicted_ms))


def _gaps(profile: Profile) -> Coverage | None:
    """What the grid planned and a profile that stopped early does not hold (perfmodel.coverage); None when it
    ran its plan (the points a plan leaves out for memory are no gap)."""
    if profile.stopped_early is None:
        return None
    coverage = profile_coverage(profile)
    return None if coverage.complete else coverage


def with_token_curve(roles: dict[str, RoleFit], profile: Profile) -> dict[str, RoleFit]:
    """3. The draft's staircase continued by the target's fit where token_curve.py's conditions hold."""
    draft = roles["draft"]
    model = share_token_curve(draft.model, profile.draft, roles["target"].model, profile.target)
    return roles if model is draft.model else {**roles, "draft": replace(draft, model=model)}


def _fit_engine_profile(profile: Profile) -> FittedModel:
    """An engine's profile: its step model (engine_steps) and the acceptance its counters measured."""
    from .engine_steps import fit_engine_steps

    return FittedModel(
        created_utc=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        profile_created_utc=profile.created_utc, device=profile.device, target_info=profile.target,
        draft_info=profile.draft, grid=profile.grid, roles={}, overhead=OverheadModel(()),
        acceptance=tuple(acceptance_from_profile(entry) for entry in profile.acceptance),
        engine=fit_engine_steps(profile.engine, profile.engine_steps))
