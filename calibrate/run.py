"""`calibrate()`: check the request, load the pair, measure every grid point, write the profile.

Order of work: every input is checked before anything heavy happens (bad input fails in a second,
not after minutes of measuring); then acceptance (its greedy value sets how many drafts the overhead
runs accept), forward-pass timings, and step overheads. The profile is written after every point.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from perfmodel.profile import AcceptanceEntry, Grid, OverheadRow, Profile
from runtime.checkpoint import CheckpointError, parse_dtype
from runtime.sampling import Sampling

from . import acceptance as acc
from .benchmarks import ForwardTimer, overhead_sampler, release_memory, time_point
from .environment import available_memory_bytes, device_info, resolve_device
from .errors import CalibrationError
from .grid import (DEFAULT_BATCH_SIZES, DEFAULT_CONTEXT_LENS, DEFAULT_MAX_K, QUICK_BATCH_SIZES, QUICK_CONTEXT_LENS,
                   OverheadPoint, check_grid_fits, make_grid, merge_grids, overhead_points, timing_points)
from .models import (LoadedPair, ModelSpec, check_memory, check_pair, display_path, load_pair, memory_need,
                     model_info, resolve_model)
from .store import (check_resumable, csv_path_for, load_for_resume, measured_overhead_points,
                    measured_timing_points, new_profile, overhead_row, with_row, write_profile)
from .timing import Clock, RepetitionRule, is_out_of_memory, repeat


@dataclass(frozen=True)
class Effort:
    """How hard to look at each point: the default and --quick differ only here and in the grid."""

    forward_rule: RepetitionRule
    overhead_rule: RepetitionRule
    overhead_steps: int  # generation steps per overhead sample: their mean is one sample
    prompt_count: int  # prompts used to measure acceptance (the first ones of the file)
    continuation_tokens: int  # target tokens generated per prompt; each is a start position for alpha


DEFAULT_EFFORT = Effort(RepetitionRule(budget_s=0.25), RepetitionRule(warmup_reps=1, min_reps=3, budget_s=0.3),
                        overhead_steps=4, prompt_count=64, continuation_tokens=48)
QUICK_EFFORT = Effort(RepetitionRule(warmup_reps=1, min_reps=3, budget_s=0.06),
                      RepetitionRule(warmup_reps=1, min_reps=3, budget_s=0.1),
                      overhead_steps=2, prompt_count=16, continuation_tokens=32)


@dataclass(frozen=True)
class CalibrationRequest:
    target: str  # model directory, preset name or config.json
    draft: str
    out: Path
    device: str | None = None  # None: cuda when available
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on CUDA
    batch_sizes: tuple[int, ...] | None = None  # None: the default (or --quick) grid
    context_lens: tuple[int, ...] | None = None
    max_k: int = DEFAULT_MAX_K
    prompts: Path | None = None  # one JSON string per line; needed to measure acceptance
    acceptance: str | None = None  # '0.8' or '0.9,0.85,...': given instead of measured
    samplings: tuple[str, ...] = ()  # 'T=0.8,top_p=0.95', ...: measured besides greedy
    resume: bool = False
    quick: bool = False


@dataclass(frozen=True)
class ProgressEvent:
    done: int
    total: int
    label: str  # what was just measured, e.g. 'target b=8 n=3 L=512'


@dataclass(frozen=True)
class PassSummary:
    model: str
    batch_size: int
    new_tokens: int
    context_len: int
    median_ms: float | None  # None: did not fit in memory


@dataclass(frozen=True)
class AcceptanceSummary:
    mode: str
    setting: str  # greedy | T=0.8,top_p=0.95 ...
    source: str
    per_position: tuple[float, ...]


@dataclass(frozen=True)
class CalibrationSummary:
    profile_path: str
    csv_path: str
    device: str
    dtype: str
    target: str
    draft: str
    passes: tuple[PassSummary, ...]
    acceptance: tuple[AcceptanceSummary, ...]
    points_measured: int  # in this run
    points_resumed: int  # already in the profile
    points_infeasible: int  # out of memory
    elapsed_s: float

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class _Plan:
    """A checked request: everything resolved, nothing loaded yet."""

    target: ModelSpec
    draft: ModelSpec
    grid: Grid
    device: str
    dtype: torch.dtype
    samplings: tuple[Sampling, ...]
    user_acceptance: tuple[float, ...] | None
    prompts: tuple[str, ...]
    effort: Effort


# ---------------------------------------------------------------- checking the request
def _samplings(texts: tuple[str, ...]) -> tuple[Sampling, ...]:
    settings = [Sampling()]  # greedy is always measured
    for text in texts:
        sampling = acc.parse_sampling(text)
        if sampling not in settings:
            settings.append(sampling)
    return tuple(settings)


def _plan(request: CalibrationRequest) -> _Plan:
    target, draft = resolve_model(request.target, "target"), resolve_model(request.draft, "draft")
    check_pair(target, draft)
    grid = make_grid(request.batch_sizes or (QUICK_BATCH_SIZES if request.quick else DEFAULT_BATCH_SIZES),
                     request.context_lens or (QUICK_CONTEXT_LENS if request.quick else DEFAULT_CONTEXT_LENS),
                     request.max_k)
    check_grid_fits(grid, target.config, draft.config)
    samplings = _samplings(request.samplings)
    user_acceptance, prompts = None, ()
    if request.acceptance is not None:
        user_acceptance = acc.parse_acceptance(request.acceptance, grid.max_k)
    else:
        random = [spec for spec in (target, draft) if spec.random_weights]
        if random:
            names = " and ".join(f"--{spec.role} {spec.source}" for spec in random)
            raise CalibrationError(f"{names}: random weights (a preset or config.json) say nothing about acceptance; "
                                   f"pass --acceptance 0.8 (or one value per draft position)")
        if not (target.directory / "tokenizer.json").is_file():
            raise CalibrationError(f"--target {target.source}: no tokenizer.json to encode the prompts with; "
                                   f"pass --acceptance instead")
        if request.prompts is None:
            raise CalibrationError("--prompts: a prompts file is needed to measure acceptance (or pass --acceptance)")
        prompts = tuple(acc.read_prompts(request.prompts))
    device = resolve_device(request.device)
    try:
        dtype = parse_dtype(request.dtype, device)
    except CheckpointError as error:
        raise CalibrationError(str(error)) from None
    effort = QUICK_EFFORT if request.quick else DEFAULT_EFFORT
    return _Plan(target, draft, grid, device, dtype, samplings, user_acceptance, prompts, effort)


def _start_profile(request: CalibrationRequest, plan: _Plan) -> Profile:
    device = device_info(plan.device, plan.dtype)
    target, draft = model_info(plan.target, plan.dtype), model_info(plan.draft, plan.dtype)
    grid = plan.grid
    check_memory(memory_need(target, draft, grid), available_memory_bytes(plan.device), plan.device)
    if request.resume and request.out.is_file():
        old = load_for_resume(request.out)
        check_resumable(old, request.out, device, target, draft)
        return replace(old, grid=merge_grids(old.grid, grid))
    return new_profile(device, target, draft, grid)


def _load(plan: _Plan) -> LoadedPair:
    """Load the pair; running out of memory here (the check above counts weights in the target dtype,
    not the transient copies of loading) is bad input too, not a crash."""
    try:
        return load_pair(plan.target, plan.draft, plan.device, plan.dtype)
    except Exception as error:  # noqa: BLE001 - only out-of-memory is turned into a message
        if not is_out_of_memory(error):
            raise
        message = str(error).split(". ")[0] or type(error).__name__
    raise CalibrationError(f"--target/--draft: the models do not fit on {plan.device} ({message})")


# ---------------------------------------------------------------- measuring
def _measure_acceptance(pair: LoadedPair, plan: _Plan, sampling: Sampling, max_k: int,
                        prompts_source: str | None) -> AcceptanceEntry:
    if plan.user_acceptance is not None:
        return acc.user_entry(sampling, plan.user_acceptance)
    limit = min(plan.target.config.max_position_embeddings, plan.draft.config.max_position_embeddings)
    tokens = plan.effort.continuation_tokens
    encoded = acc.encode_prompts(pair.tokenizer, list(plan.prompts[:plan.effort.prompt_count]), limit - tokens - 1)
    return acc.measure_acceptance(pair.target, pair.draft, encoded, sampling, max_k, tokens, pair.eos_token_ids,
                                  prompts_source)


def _overhead_row(pair: LoadedPair, plan: _Plan, point: OverheadPoint, acceptance: float,
                  clock: Clock) -> OverheadRow | None:
    """The step overhead at (b, k); None when its generation runs out of memory (an overhead row has
    no infeasible form, so the point stays unmeasured and a later --resume tries it again)."""
    try:
        sampler = overhead_sampler(pair.target, pair.draft, point.batch_size, point.k, acceptance,
                                   plan.effort.overhead_steps)
        return overhead_row(point, repeat(sampler, plan.effort.overhead_rule, clock))
    except Exception as error:  # noqa: BLE001 - only out-of-memory is survivable
        if not is_out_of_memory(error):
            raise
    release_memory(plan.device)
    return None


def _greedy_acceptance(profile: Profile, fallback: float = 0.8) -> float:
    """The mean greedy alpha, for the overhead runs' synthetic acceptance."""
    for entry in profile.acceptance:
        if entry.mode == "greedy":
            return sum(entry.per_position) / len(entry.per_position)
    return fallback


def _setting(entry: AcceptanceEntry) -> str:
    if entry.mode == "greedy":
        return "greedy"
    return Sampling(entry.temperature, entry.top_k or 0, entry.top_p or 1.0).describe()


def _summary(request: CalibrationRequest, profile: Profile, measured: int, resumed: int, started_s: float,
             clock: Clock) -> CalibrationSummary:
    grid = profile.grid
    rows = {(r.model, r.batch_size, r.new_tokens, r.context_len): r for r in profile.timings}
    context_len = min(grid.context_lens)
    passes = []
    for model, new_tokens in (("target", 1), ("target", grid.max_k + 1), ("draft", 1)):
        for batch_size in sorted({min(grid.batch_sizes), max(grid.batch_sizes)}):
            row = rows.get((model, batch_size, new_tokens, context_len))
            if row is not None:
                passes.append(PassSummary(model, batch_size, new_tokens, context_len, row.median_ms))
    acceptance = tuple(AcceptanceSummary(e.mode, _setting(e), e.source, e.per_position) for e in profile.acceptance)
    return CalibrationSummary(
        profile_path=str(request.out), csv_path=str(csv_path_for(request.out)), device=profile.device.name,
        dtype=profile.device.dtype, target=profile.target.source, draft=profile.draft.source, passes=tuple(passes),
        acceptance=acceptance, points_measured=measured, points_resumed=resumed,
        points_infeasible=sum(not r.feasible for r in profile.timings), elapsed_s=round(clock() - started_s, 3))


def calibrate(request: CalibrationRequest, on_progress: Callable[[ProgressEvent], None] | None = None,
              clock: Clock = time.perf_counter) -> CalibrationSummary:
    """Measure the pair on the device and write the profile (and its CSV) after every point.

    `on_progress` is called after each point is on disk; an exception it raises (Ctrl-C) stops the
    run with everything measured so far saved, and `resume=True` continues from there.
    """
    started_s = clock()
    plan = _plan(request)
    profile = _start_profile(request, plan)
    grid = profile.grid  # on resume, the union of the old grid and the requested one
    write_profile(request.out, profile)
    pair = _load(plan)

    done_acceptance = {acc.entry_key(e) for e in profile.acceptance}
    todo_acceptance = [s for s in plan.samplings if acc.sampling_key(s) not in done_acceptance]
    done_timings, done_overheads = measured_timing_points(profile), measured_overhead_points(profile)
    todo_timings = [p for p in timing_points(grid) if p not in done_timings]
    todo_overheads = [p for p in overhead_points(grid) if p not in done_overheads]
    total = len(plan.samplings) + len(timing_points(grid)) + len(overhead_points(grid))
    resumed = total - len(todo_acceptance) - len(todo_timings) - len(todo_overheads)
    done = resumed

    def advance(label: str, row=None) -> None:
        """Save the row (if any), then report: a point counts as done only once it is on disk."""
        nonlocal profile, done
        if row is not None:
            profile = with_row(profile, row)
            write_profile(request.out, profile)
        done += 1
        if on_progress is not None:
            on_progress(ProgressEvent(done, total, label))

    prompts_source = display_path(request.prompts) if request.prompts is not None else None
    for sampling in todo_acceptance:
        entry = _measure_acceptance(pair, plan, sampling, grid.max_k, prompts_source)
        advance(f"acceptance {sampling.describe()}", entry)

    timer = ForwardTimer({"target": pair.target, "draft": pair.draft}, grid, plan.device,
                         plan.effort.forward_rule, clock)
    for point in todo_timings:
        advance(f"{point.model} b={point.batch_size} n={point.new_tokens} L={point.context_len}",
                time_point(timer, point))
    timer.forget()

    synthetic = _greedy_acceptance(profile)
    for point in todo_overheads:
        row = _overhead_row(pair, plan, point, synthetic, clock)
        label = f"overhead b={point.batch_size} k={point.k}"
        advance(label if row is not None else label + " (out of memory, not recorded)", row)
    return _summary(request, profile, done - resumed, resumed, started_s, clock)
