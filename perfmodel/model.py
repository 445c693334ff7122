"""The `specbatch.model/1` file: everything fitted from one profile (`fit.fit_profile`), and what is
computed from it.

    save_model / load_model                          (JSON; parameters in named units, no pickles)
    choose_acceptance(fitted, override)             -> AcceptanceModel
    compute_table(fitted, acceptance, ...)          -> table.Table   (best strategy per batch size)
    query_strategies(fitted, acceptance, b, L, ...) -> strategy.StrategyChoice (every candidate, ranked;
                                                       strategies="chain": none and chains k = 1..max_k)
    evaluate_strategy(fitted, strategy, b, L, ...)  -> strategy.StrategyCandidate (one what-if)

The model carries what strategies need beyond chains, all optional so older model files still load:
the acceptance's `rank_acceptance` (trees), the profile's `stage2` (the n-gram second stage) and the
overhead rows of tree steps (`tree_overheads`).

A model file carries the measured points it was fitted to (each role's measured range, and what
`specbatch plot` draws), the step stage's report (`timing_source`) and its step correction.

A model fitted from an engine's profile (`calibrate --engine vllm`) has no pass latencies (`roles` is empty):
its `engine_steps` section is the engine's step model (perfmodel/engine_steps.py), which every strategy is
evaluated with; tables made from it say whose costs they carry (`costs`).
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from functools import partial
from typing import Sequence

import numpy as np

from . import latency as lat
from .acceptance import AcceptanceModel, acceptance_from_user
from .coverage import Coverage, describe_cells
from .engine_steps import EngineStepFit, engine_step_model
from .errors import PerfModelError
from .experts import routing_note, table_term
from .fields import at, boolean, duration_ms, get, int_list, integer, is_int, listed, number, record, string
from .jsonio import read_json, rounded, write_json_atomic
from .overhead import OverheadModel
from .profile import ROLES, DeviceInfo, Grid, ModelInfo, Stage2Info
from .profile.composition import Composition
from .profile.noise import NoiseFigure
from .staircase import Staircase
from .steps import SourceChoice, StepCorrection
from .strategy import MAX_TREE_NODES, StepModel, StrategyCandidate, StrategyChoice, candidate_strategies
from .table import ENGINE_FORMATS, MAX_TABLE_BATCH, Bucket, Table, TableEntry, check_max_k
from .token_curve import TokenCurve
from .tree import Strategy

MODEL_SCHEMA = "specbatch.model/1"
# A table's default buckets step by this factor over the profiled contexts: a nearest-bucket lookup is then
# never more than 21 % above a bucket or 15 % below one: a padded batch runs at its longest row's context,
# which grows with b, so one bucket at the middle context reads the wrong k at large batch.
TABLE_BUCKET_RATIO = 2 ** 0.5


@dataclass(frozen=True)
class RoleFit:
    """One role's latency model and how well it fits."""

    role: str
    model: lat.LatencyModel
    points: lat.Points  # the feasible measured rows it was fitted to
    infeasible_rows: int  # out-of-memory rows in the profile, not fitted
    in_sample_mape_pct: float
    cv_mape_pct: dict[str, float]  # per kind; empty when too few cells to cross-validate
    worst: tuple[lat.PointError, ...]  # in-sample
    holdout: lat.HoldoutReport | None
    memory_bound_share: float  # fraction of points where the roofline's memory term exceeds compute
    notes: tuple[str, ...]

    @property
    def kind(self) -> str:
        return self.model.kind


@dataclass(frozen=True)
class FittedModel:
    created_utc: str
    profile_created_utc: str
    device: DeviceInfo
    target_info: ModelInfo
    draft_info: ModelInfo
    grid: Grid
    roles: dict[str, RoleFit]  # "target", "draft"
    overhead: OverheadModel
    acceptance: tuple[AcceptanceModel, ...]  # from the profile; the first is the default
    stage2: Stage2Info | None = None  # the n-gram second stage, when the profile measured one
    timing_source: SourceChoice | None = None  # which pass timings `roles` were fitted to, when there was a choice
    noise: NoiseFigure | None = None  # the profile's reference-pass checks: bench compares the machine's speed
    step_correction: StepCorrection | None = None  # chains' step ratios from lockstep in-situ steps
    composition: Composition | None = None  # the profile's pass times were composed from per-operation timings
    engine: EngineStepFit | None = None  # an engine's step model: then `roles` is empty
    coverage: Coverage | None = None  # what a cut-short profile did not measure (None: it measured its grid)

    def costs(self) -> dict:
        """Whose step costs the model holds, as a table records them: our runtime's, or an engine's (its
        name, version and the settings it was measured with)."""
        if self.engine is not None:
            return self.engine.engine.to_json()
        device = self.device
        return {"name": "specbatch", "version": device.git_revision,
                "settings": {"device": device.name, "dtype": device.dtype, "torch_threads": device.cpu_threads,
                             "torch_version": device.torch_version, "execution": device.execution}}

    def fingerprints(self) -> dict | None:
        """{"target", "draft"} content fingerprints of the pair (None when the profile predates them)."""
        if self.target_info.fingerprint is None and self.draft_info.fingerprint is None:
            return None
        return {"target": self.target_info.fingerprint, "draft": self.draft_info.fingerprint}

    def latency_ms(self, role: str, batch_size: int, new_tokens: int, context_len: int) -> float:
        """Predicted time of one forward pass; matches strategy.LatencyFn (arrays in, array out too)."""
        if self.engine is not None:
            raise PerfModelError(f"this model holds {self.engine.engine.describe()}'s whole steps, not pass latencies")
        return self.roles[role].model.latency_ms(batch_size, new_tokens, context_len)

    def expert_terms(self) -> dict | None:
        """Per role with experts, its expert shape and fitted routing (a table carries them); None when dense."""
        terms = {role: table_term(fit.model.shape.experts, fit.model.shape.routing)
                 for role, fit in self.roles.items() if fit.model.shape.experts is not None}
        return terms or None

    def experts_touched(self, role: str, batch_size: int, new_tokens: int) -> float | None:
        """A mixture of experts' expected distinct experts per routed layer in one pass (perfmodel.experts); None
        for a dense role."""
        shape = self.roles[role].model.shape if role in self.roles else None
        if shape is None or shape.experts is None:
            return None
        return float(shape.routing.distinct(shape.experts, batch_size, new_tokens))

    def max_context_len(self) -> int:
        """The longest context a step can run at: the pair's positions (the smaller max_position_embeddings)."""
        return min(self.target_info.max_position_embeddings, self.draft_info.max_position_embeddings)

    def check_context_len(self, context_len: int) -> None:
        """Refuse a context no step of this pair can run at (a table or query there ranks nothing real)."""
        limit = self.max_context_len()
        if not 0 <= context_len <= limit:
            raise PerfModelError(f"context length {context_len} is outside what the pair can hold: 0..{limit} cached "
                                 "tokens (the models' max_position_embeddings)")

    def default_context_len(self) -> int:
        """The context length used when none is given: the middle of the profiled context lengths."""
        lengths = sorted(self.grid.context_lens)
        return lengths[(len(lengths) - 1) // 2]

    def profiled_context_range(self) -> tuple[int, int]:
        """The contexts the fit saw: the grid's, and those real steps ran at when in-situ rows were fitted."""
        if self.engine is not None:
            return self.engine.context_range()
        return (int(min(fit.points.context_len.min() for fit in self.roles.values())),
                int(max(fit.points.context_len.max() for fit in self.roles.values())))

    def table_context_lens(self, fmt: str = "json") -> list[int]:
        """A table's default buckets: the profiled context range in steps of at most TABLE_BUCKET_RATIO,
        both ends included, so the runtime's nearest-bucket lookup reads the choice the model makes near
        the context each step runs at (a padded batch runs at its longest row's, which grows with b).
        An engine export (`fmt` vllm or trtllm) keys on batch size alone: one bucket, the middle context."""
        if fmt in ENGINE_FORMATS:
            return [self.default_context_len()]
        lo, hi = self.profiled_context_range()
        lo = max(lo, 1)
        steps = max(1, int(np.ceil(np.log(hi / lo) / np.log(TABLE_BUCKET_RATIO) - 1e-9))) if hi > lo else 0
        return sorted({int(round(lo * (hi / lo) ** (i / steps))) for i in range(steps + 1)} if steps else {lo})

    def extrapolation_notes(self, max_batch: int, context_lens: Sequence[int], max_k: int) -> list[str]:
        """Where a table or query asks the model beyond what the profile measured, and what its times leave out."""
        notes = []
        if max_batch > max(self.grid.batch_sizes):
            notes.append(f"extrapolating: batch sizes above {max(self.grid.batch_sizes)} were not measured; there the "
                         "fitted time at the grid's edge grows as the roofline alone; "
                         "calibrate --batch-sizes up to the largest served to measure them")
        lo, hi = self.profiled_context_range()
        outside = [L for L in context_lens if not lo <= L <= hi]
        if outside:
            notes.append(f"extrapolating: context lengths {outside} lie outside the profiled [{lo}, {hi}]; the "
                         "roofline alone scales the time from the nearest profiled length")
        if max_k > self.grid.max_k:
            notes.append(f"k above the profiled max_k={self.grid.max_k} is extrapolated")
        if not self.overhead.measured and self.engine is None:
            notes.append("the profile has no step-overhead rows: overhead taken as 0 ms")
        if self.composition is not None:
            notes.append(self.composition.summary())
        if self.coverage is not None:
            notes.append(self.coverage.describe())
        notes.extend(self.routing_notes())
        return notes

    def routing_notes(self) -> list[str]:
        """A mixture of experts' table rests on its routing: say so where it is not the model's own."""
        notes = (routing_note(role, fit.model.shape.routing) for role, fit in self.roles.items()
                 if fit.model.shape.routing is not None)
        return [note for note in notes if note]

    def timing_source_notes(self) -> list[str]:
        """Which pass timings the latency was fitted to, when the profile offered a choice (fit's step stage)."""
        choice = self.timing_source
        if choice is None:
            return []
        report = choice.report(choice.chosen)
        held = "" if report.heldout_step_mape_pct is None else f", {report.heldout_step_mape_pct:.1f} % held out"
        return [f"pass latency fitted to the {choice.chosen} timings (chosen by {choice.criterion}: "
                f"{report.step_mape_pct:.1f} % on the profile's measured steps{held})",
                *([] if self.step_correction is None else [self.step_correction.note()])]

    def strategy_notes(self, strategies: Sequence[Strategy]) -> list[str]:
        """Where trees and the second stage ask the model beyond what the profile measured."""
        notes = []
        shaped = [s for s in strategies if s.tree is not None and (s.kind == "tree" or s.stage2)]
        if not shaped:
            return notes
        widest_target = max(s.tree.num_nodes + 1 for s in shaped)
        if widest_target > max(self.grid.target_new_tokens):
            notes.append(f"tree steps verify up to {widest_target} tokens per row; the profile timed target passes "
                         f"of at most {max(self.grid.target_new_tokens)}: extrapolated by the latency model")
        staged = [s for s in shaped if s.stage2]
        if staged:
            widest_draft = max(2 + len(s.tree.inner_nodes) - 1 for s in staged)
            if widest_draft > max(self.grid.draft_new_tokens):
                notes.append(f"second-stage draft passes feed up to {widest_draft} tokens per row; the profile timed "
                             f"draft passes of at most {max(self.grid.draft_new_tokens)}: extrapolated")
        for stage2 in sorted({s.stage2 for s in shaped}):
            source = self.overhead.tree_source(stage2)
            label = "second-stage" if stage2 else "tree"
            if source == "chain":
                notes.append(f"no {label} step-overhead rows: the chain overhead at k = depth is used (a lower bound)")
            elif source == "tree, other stage-2 flag":
                notes.append(f"no {label} step-overhead rows: the tree rows measured with the other stage-2 flag "
                             "are used")
        return notes


# ---------------------------------------------------------------- what the model is used for

def choose_acceptance(fitted: FittedModel, override: Sequence[float] | None, source: str = "model") -> AcceptanceModel:
    """The user's what-if values if given, else the profile's first acceptance entry."""
    if override is not None:
        return acceptance_from_user(override)
    if not fitted.acceptance:
        raise PerfModelError(f"{source}: the profile has no acceptance measurements; pass --acceptance "
                             "(one alpha such as 0.8, or per position such as 0.9,0.85,0.8)")
    return fitted.acceptance[0]


def step_model(fitted: FittedModel, acceptance: AcceptanceModel, stage2: Stage2Info | None = None) -> StepModel:
    """What strategies are evaluated with; `stage2` replaces the profile's second-stage measurements."""
    if fitted.engine is not None:
        return engine_step_model(fitted.engine, acceptance)
    return StepModel(fitted.latency_ms, fitted.overhead, acceptance, fitted.stage2 if stage2 is None else stage2,
                     fitted.step_correction, vectorized_latency=True, drafter=fitted.draft_info.drafter)


def strategy_family(fitted: FittedModel, acceptance: AcceptanceModel, max_k: int | None = None,
                    strategies: str = "all", max_tree_nodes: int = MAX_TREE_NODES) -> tuple[Strategy, ...]:
    """The candidates: none, chains k = 1..max_k and, as `strategies` allows ("chain" | "tree" | "all")
    and the data permits, grown trees (need rank acceptance) and the second stage (needs the profile's
    stage2). "all" on a profile without either is the chain family."""
    max_k = fitted.grid.max_k if max_k is None else max_k
    if fitted.engine is not None:  # engines run chains only
        strategies = "chain"
    return candidate_strategies(max_k, acceptance.rank_acceptance, fitted.stage2 is not None, strategies,
                                max_tree_nodes)


def query_strategies(fitted: FittedModel, acceptance: AcceptanceModel, batch_size: int, context_len: int,
                     max_k: int | None = None, strategies: str = "all",
                     max_tree_nodes: int = MAX_TREE_NODES) -> StrategyChoice:
    """Every candidate strategy's step time, tokens per step and goodput at one batch size, ranked."""
    fitted.check_context_len(context_len)
    family = strategy_family(fitted, acceptance, max_k, strategies, max_tree_nodes)
    return step_model(fitted, acceptance).choose(family, batch_size, context_len)


def evaluate_strategy(fitted: FittedModel, strategy: Strategy, batch_size: int, context_len: int,
                      acceptance: AcceptanceModel | None = None, stage2: Stage2Info | None = None) -> StrategyCandidate:
    """One strategy's prediction (the `--tree SPEC --stage2 FILE` what-if). `acceptance` defaults to the
    profile's first entry; `stage2` to the profile's second-stage measurements."""
    fitted.check_context_len(context_len)
    chosen = choose_acceptance(fitted, None) if acceptance is None else acceptance
    return step_model(fitted, chosen, stage2).evaluate(strategy, batch_size, context_len)


def check_max_batch(max_batch: int) -> None:
    if not 1 <= max_batch <= MAX_TABLE_BATCH:
        raise PerfModelError(f"--max-batch must be in [1, {MAX_TABLE_BATCH}], found {max_batch} (a table holds an "
                             "entry per batch size)")


def compute_table(fitted: FittedModel, acceptance: AcceptanceModel, max_batch: int,
                  context_lens: Sequence[int] | None = None, max_k: int | None = None, *,
                  strategies: str = "all", max_tree_nodes: int = MAX_TREE_NODES) -> Table:
    """The best strategy for b = 1..max_batch in one bucket per context length (default: the profiled
    context range in steps of TABLE_BUCKET_RATIO, `FittedModel.table_context_lens`). `strategies`
    restricts the family ("chain" gives the chain-only table of old); each entry's k is its strategy's k
    (a tree's depth). The table's max_k covers every entry's k."""
    if max_k is not None:  # the profile's own max_k (the default) is what its calibration chose to time
        check_max_k(max_k)
    max_k = fitted.grid.max_k if max_k is None else max_k
    check_max_batch(max_batch)
    lengths = sorted(set(context_lens)) if context_lens else fitted.table_context_lens()
    for context_len in lengths:
        fitted.check_context_len(context_len)
    family = strategy_family(fitted, acceptance, max_k, strategies, max_tree_nodes)
    model = step_model(fitted, acceptance)
    widest_pass = max([s.tree.num_nodes for s in family if s.tree is not None], default=0) + 2
    buckets = []
    for context_len in lengths:
        entries = []
        for b in range(1, max_batch + 1):
            model.prefetch(b, context_len, widest_pass)  # every pass width at (b, L) in one call per role
            c = model.choose(family, b, context_len)
            runner_up = c.runner_up
            strategy = c.best.strategy
            verify_width = 1 if strategy.tree is None else strategy.tree.num_nodes + 1
            entries.append(TableEntry(b, c.best.k, c.best.tokens_per_s, c.speedup,
                                      None if runner_up is None else runner_up.k, c.margin, strategy,
                                      None if runner_up is None else runner_up.strategy,
                                      fitted.experts_touched("target", b, verify_width)))
        buckets.append(Bucket(context_len, tuple(entries)))
    uses_stage2 = any(e.strategy.stage2 for bucket in buckets for e in bucket.entries)
    return Table(target=fitted.target_info.source, draft=fitted.draft_info.source, device=fitted.device.name,
                 created_utc=datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
                 max_k=max([max_k] + [e.k for bucket in buckets for e in bucket.entries]),
                 acceptance=acceptance.to_json(), buckets=tuple(buckets),
                 stage2={"file": fitted.stage2.file, "sha256": fitted.stage2.sha256} if uses_stage2 else None,
                 fingerprints=fitted.fingerprints(), costs=fitted.costs(), drafter=fitted.draft_info.drafter,
                 experts=fitted.expert_terms())


# ---------------------------------------------------------------- JSON

def _point_error_json(point: lat.PointError) -> dict:
    return {key: rounded(value) if isinstance(value, float) else value for key, value in asdict(point).items()}


def _holdout_json(report: lat.HoldoutReport | None) -> dict | None:
    if report is None:
        return None
    return {
        "held_out_batch_sizes": list(report.held_out_batch_sizes),
        "held_out_context_lens": list(report.held_out_context_lens),
        "train_points": report.train_points, "test_points": report.test_points, "kind": report.kind,
        "mape_pct": rounded(report.mape_pct), "max_error_pct": rounded(report.max_error_pct),
        "mape_pct_by_kind": {kind: rounded(value) for kind, value in report.mape_pct_by_kind.items()},
        "worst": [_point_error_json(point) for point in report.worst],
    }


def _role_json(fit: RoleFit) -> dict:
    model = fit.model
    p = fit.points
    return {
        "kind": model.kind,
        "shape": model.shape.to_json(),
        "roofline": model.roofline.to_json(model.shape),
        "monotone": None if model.correction is None else model.correction.to_json(model.shape, model.roofline),
        **({} if model.staircase is None else {"staircase": model.staircase.to_json()}),
        **({} if model.token_curve is None else {"token_curve": model.token_curve.to_json()}),
        "validation": {
            "in_sample_mape_pct": rounded(fit.in_sample_mape_pct),
            "cv_mape_pct": {kind: rounded(value) for kind, value in fit.cv_mape_pct.items()},
            "holdout": _holdout_json(fit.holdout),
            "worst": [_point_error_json(point) for point in fit.worst],
        },
        "memory_bound_share": rounded(fit.memory_bound_share),
        "notes": list(fit.notes),
        "infeasible_rows": fit.infeasible_rows,
        "points": {"columns": ["batch_size", "new_tokens", "context_len", "median_ms"],
                   "rows": [[int(b), int(n), int(L), rounded(t)] for b, n, L, t in
                            zip(p.batch_size, p.new_tokens, p.context_len, p.latency_ms)]},
    }


def model_to_json(fitted: FittedModel) -> dict:
    return {
        "schema": MODEL_SCHEMA,
        "created_utc": fitted.created_utc,
        "profile": {"created_utc": fitted.profile_created_utc, "device": asdict(fitted.device),
                    "models": {"target": asdict(fitted.target_info), "draft": asdict(fitted.draft_info)},
                    "grid": {key: list(value) if isinstance(value, tuple) else value
                             for key, value in asdict(fitted.grid).items()},
                    **({} if fitted.noise is None else {"noise": fitted.noise.to_json()}),
                    **({} if fitted.composition is None else {"composition": fitted.composition.to_json()})},
        "roles": {role: _role_json(fit) for role, fit in fitted.roles.items()},
        "overheads": [{"batch_size": b, "k": k, "median_ms": rounded(ms)} for b, k, ms in fitted.overhead.rows],
        "tree_overheads": [{"batch_size": b, "tree_nodes": nodes, "stage2": stage2, "median_ms": rounded(ms)}
                           for b, nodes, stage2, ms in fitted.overhead.tree_rows],
        "acceptance": [model.to_json() for model in fitted.acceptance],
        "stage2": None if fitted.stage2 is None else fitted.stage2.to_json(),
        **({} if fitted.timing_source is None else {"timing_source": fitted.timing_source.to_json()}),
        **({} if fitted.step_correction is None else {"step_correction": fitted.step_correction.to_json()}),
        **({} if fitted.engine is None else {"engine_steps": fitted.engine.to_json()}),
        **({} if fitted.coverage is None else {"coverage": fitted.coverage.to_json()}),
    }


def _holdout_from_json(obj: dict | None, where: str) -> lat.HoldoutReport | None:
    if obj is None:
        return None
    by_kind = get(obj, "mape_pct_by_kind", where)
    if not isinstance(by_kind, dict):
        raise PerfModelError(f"{at(where, 'mape_pct_by_kind')}: expected a JSON object, found {by_kind!r}")
    return lat.HoldoutReport(
        int_list(obj, "held_out_batch_sizes", where, 1), int_list(obj, "held_out_context_lens", where, 0),
        integer(obj, "train_points", where, 0), integer(obj, "test_points", where, 0), string(obj, "kind", where),
        number(obj, "mape_pct", where, 0.0), number(obj, "max_error_pct", where, 0.0),
        {name: number(by_kind, name, at(where, "mape_pct_by_kind")) for name in by_kind},
        _point_errors(obj, "worst", where))


# The roofline's parameters and the rule each must follow to describe a machine (perfmodel.latency.RooflineParams)
ROOFLINE_RULES = (("overhead_ms", 0.0, "> 0"), ("bandwidth_GBps", 0.0, "> 0"), ("flops_TFLOPs", 0.0, "> 0"),
                  ("overlap_exponent", 1.0, ">= 1"))


def _roofline_from_json(obj: dict, where: str) -> lat.RooflineParams:
    """Each parameter named with its own rule when it breaks it."""
    values = {}
    for key, bound, rule in ROOFLINE_RULES:
        value = number(obj, key, where)
        if not (value > bound if rule == "> 0" else value >= bound):
            raise PerfModelError(f"{at(where, key)}: must be {rule}, found {value!r}")
        values[key] = value
    return lat.RooflineParams(**values)


def _point_errors(obj: dict, key: str, where: str) -> tuple[lat.PointError, ...]:
    return tuple(record(lat.PointError, point, f"{at(where, key)}[{index}]")
                 for index, point in enumerate(listed(obj, key, where)))


def _points_from_json(obj: dict, where: str) -> lat.Points:
    """The fitted rows: [batch_size, new_tokens, context_len, median_ms] each."""
    rows = listed(get(obj, "points", where), "rows", at(where, "points"))
    for index, row in enumerate(rows):
        if not (isinstance(row, list) and len(row) == 4 and all(is_int(v) or isinstance(v, float) for v in row)):
            raise PerfModelError(f"{at(where, 'points.rows')}[{index}]: expected [batch_size, new_tokens, "
                                 f"context_len, median_ms], found {row!r}")
    table = np.array(rows, dtype=float).reshape(-1, 4)
    if not len(table):
        raise PerfModelError(f"{at(where, 'points.rows')}: expected at least one fitted row, found none")
    return lat.Points(table[:, 0], table[:, 1], table[:, 2], table[:, 3])


def _role_from_json(role: str, obj: dict, where: str) -> RoleFit:
    """One role's fit, every field read by the profile's rules (perfmodel.fields): a hand-edited file is told
    which field breaks which rule."""
    where = f"{where}: roles.{role}"
    shape_obj = get(obj, "shape", where)
    shape = lat.RoleShape.from_json(shape_obj, at(where, "shape"))
    roofline = _roofline_from_json(get(obj, "roofline", where), at(where, "roofline"))
    kind = string(obj, "kind", where, lat.KINDS)
    correction = staircase = None
    if kind == lat.MONOTONE:
        correction = lat.MonotoneCorrection.from_json(get(obj, "monotone", where), shape, roofline,
                                                      at(where, "monotone"))
    if kind == lat.STAIRCASE:
        staircase = Staircase.from_json(get(obj, "staircase", where), at(where, "staircase"))
    points = _points_from_json(obj, where)
    validation = get(obj, "validation", where)
    at_validation = at(where, "validation")
    cv = get(validation, "cv_mape_pct", at_validation)
    if not isinstance(cv, dict):
        raise PerfModelError(f"{at(at_validation, 'cv_mape_pct')}: expected a JSON object, found {cv!r}")
    notes = listed(obj, "notes", where)
    if not all(isinstance(note, str) for note in notes):
        raise PerfModelError(f"{at(where, 'notes')}: expected a list of strings, found {notes!r}")
    return RoleFit(
        role=role, model=lat.LatencyModel(kind, shape, roofline, correction, lat.Box.of(points), staircase),
        points=points,
        infeasible_rows=integer(obj, "infeasible_rows", where, 0),
        in_sample_mape_pct=number(validation, "in_sample_mape_pct", at_validation, 0.0),
        cv_mape_pct={name: number(cv, name, at(at_validation, "cv_mape_pct"), nullable=True) for name in cv},
        worst=_point_errors(validation, "worst", at_validation),
        holdout=_holdout_from_json(get(validation, "holdout", at_validation), at(at_validation, "holdout")),
        memory_bound_share=number(obj, "memory_bound_share", where, 0.0), notes=tuple(notes),
    )


def _with_token_curves(roles: dict[str, RoleFit], obj: dict, where: str) -> dict[str, RoleFit]:
    """Each role's `token_curve`, read from the other role's model (perfmodel/token_curve.py)."""
    for role in list(roles):
        curve = obj[role].get("token_curve")
        if curve is None:
            continue
        at_curve = f"{where}: roles.{role}.token_curve"
        origin, fit = string(curve, "from_role", at_curve), roles[role]
        scale, rows, context = (number(curve, key, at_curve) for key in ("scale", "batch_size", "context_len"))
        if origin not in roles or origin == role or fit.model.staircase is None or not (
                scale > 0 and rows >= 1 and context >= 0):
            raise PerfModelError(f"{where}: roles.{role}.token_curve: from_role must name the other role, the role "
                                 "must be a staircase, scale > 0, batch_size >= 1 and context_len >= 0")
        curve = TokenCurve(roles[origin].model, origin, scale, rows, context)
        roles[role] = replace(fit, model=replace(fit.model, token_curve=curve))
    return roles


# acceptance fields a profile entry has and a model file may lack (older files, or never written): read as null
OPTIONAL_ACCEPTANCE_FIELDS = {"top_k": None, "top_p": None, "prompts": None, "prompt_count": None, "trials": None,
                              "temperature": None}


def _overhead_from_json(obj: dict, source: str) -> OverheadModel:
    """The overhead rows, by the profile's rules: integer sizes, measured times (0 allowed)."""
    chain, tree = [], []
    for index, row in enumerate(listed(obj, "overheads", f"{source}:")):
        where = f"{source}: overheads[{index}]"
        chain.append((integer(row, "batch_size", where, 1), integer(row, "k", where, 0),
                      duration_ms(row, "median_ms", where, allow_zero=True)))
    for index, row in enumerate(listed({"tree_overheads": obj.get("tree_overheads", [])}, "tree_overheads",
                                       f"{source}:")):
        where = f"{source}: tree_overheads[{index}]"
        tree.append((integer(row, "batch_size", where, 1), integer(row, "tree_nodes", where, 1),
                     boolean(row, "stage2", where), duration_ms(row, "median_ms", where, allow_zero=True)))
    return OverheadModel(tuple(chain), tuple(tree))


def _acceptance_from_json(obj: dict, source: str) -> tuple[AcceptanceModel, ...]:
    from .profile import acceptance_entry_from_json  # the profile's strict reader

    for index, entry in enumerate(listed(obj, "acceptance", f"{source}:")):
        if not isinstance(entry, dict):
            raise PerfModelError(f"{source}: acceptance[{index}]: expected a JSON object, found {entry!r}")
        # the profile's rules for every measured figure; `source` and `mode` here say where the figures
        # came from ("profile" or "user", a user's what-if has no mode) and AcceptanceModel checks them
        checked = {**OPTIONAL_ACCEPTANCE_FIELDS, **entry, "source": "measured", "mode": entry.get("mode") or "greedy"}
        acceptance_entry_from_json(checked, f"{source}: acceptance[{index}]")
    return tuple(AcceptanceModel.from_json(entry, f"{source}: acceptance[{index}]")
                 for index, entry in enumerate(obj["acceptance"]))


def _read_section(source: str, name: str, read):
    """`read()` of one section of a model file. Its readers name each field with its rule; a value none of them
    foresaw still gets one line naming the file and the section, not a Python exception's name."""
    try:
        return read()
    except PerfModelError:
        raise
    except (KeyError, TypeError, ValueError, IndexError, AttributeError):
        raise PerfModelError(f"{source}: {name}: not in the form `specbatch fit` writes; fit the profile "
                             f"again") from None


def model_from_json(obj: dict, source: str = "model") -> FittedModel:
    """Rebuild a FittedModel; any structural problem is a one-line PerfModelError naming `source`."""
    from .profile import profile_from_json, stage2_from_json  # the strict readers

    meta = obj.get("profile")
    if not isinstance(meta, dict):
        raise PerfModelError(f"{source}: profile: missing")
    # The profile readers want a whole profile; metadata plus empty measurement lists is one.
    stub = profile_from_json({"created_utc": meta.get("created_utc"), "device": meta.get("device"),
                              "models": meta.get("models"), "grid": meta.get("grid"),
                              "timings": [], "overheads": [], "acceptance": [], "noise": meta.get("noise"),
                              "composition": meta.get("composition")},
                             f"{source}: profile")
    stage2 = None
    if obj.get("stage2") is not None:
        stage2 = stage2_from_json(obj["stage2"], f"{source}: stage2")
    section = partial(_read_section, source)
    engine = None if obj.get("engine_steps") is None else \
        section("engine_steps", lambda: EngineStepFit.from_json(obj["engine_steps"], f"{source}: engine_steps"))
    roles_obj = None if engine is not None else get(obj, "roles", f"{source}:")
    roles = {} if engine is not None else section("roles", lambda: _with_token_curves(
        {role: _role_from_json(role, get(roles_obj, role, f"{source}: roles"), source) for role in ROLES},
        roles_obj, source))
    overhead = section("overheads", lambda: _overhead_from_json(obj, source))
    acceptance = section("acceptance", lambda: _acceptance_from_json(obj, source))
    created = string(obj, "created_utc", f"{source}:")
    timing_source = None if obj.get("timing_source") is None else section(
        "timing_source", lambda: SourceChoice.from_json(obj["timing_source"], f"{source}: timing_source"))
    correction = None if obj.get("step_correction") is None else section(
        "step_correction", lambda: StepCorrection.from_json(obj["step_correction"], f"{source}: step_correction"))
    coverage = None if obj.get("coverage") is None else \
        section("coverage", lambda: Coverage.from_json(obj["coverage"], f"{source}: coverage"))
    return FittedModel(created, stub.created_utc, stub.device, stub.target, stub.draft, stub.grid, roles,
                       overhead, acceptance, stage2, timing_source, stub.noise, correction, stub.composition,
                       engine, coverage)


def check_coverage(fitted: FittedModel, source: str | os.PathLike, max_batch: int, force: bool) -> None:
    """A table over b = 1..max_batch must not rest on grid cells the profile never measured (a calibration cut
    short) unless `force`: the fitted time there is a guess nobody checked."""
    if fitted.coverage is None:
        return
    cells = fitted.coverage.cells_within(max_batch, fitted.grid.batch_sizes)
    if cells and not force:
        raise PerfModelError(f"{source}: {fitted.coverage.describe()}; a table up to b = {max_batch} would "
                             f"extrapolate over {describe_cells(cells)}: pass --force to compute it anyway")


def save_model(path: str | os.PathLike, fitted: FittedModel) -> None:
    write_json_atomic(path, model_to_json(fitted))


def load_model(path: str | os.PathLike) -> FittedModel:
    return model_from_json(read_json(path, MODEL_SCHEMA), str(path))
