"""`calibrate()`: check the request, load the pair, measure every grid point, write the profile.

Order of work: every input is checked before anything heavy happens (bad input fails in a second,
not after minutes of measuring); then acceptance (its greedy value sets how many drafts the chain
overhead runs accept, its rank acceptance grows the trees whose overheads are measured), the n-gram
second stage when one is given (guess accuracy on the greedy continuations, query cost), forward-pass
timings, chain step overheads, and tree step overheads. The profile is written after every point.

Tree overheads are measured at every batch size for trees grown from the measured rank acceptance
(`perfmodel.tree.grow_tree`, depth up to max_k) at the Effort's `tree_nodes` sizes, with and without
the second stage when there is one, on the prompts' real text (real acceptance: synthetic acceptance
is for chains only). They need measured acceptance: with --acceptance there is no rank table, hence
no tree to grow, and the performance model falls back to the chain rows.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from perfmodel.jsonio import file_sha256
from perfmodel.profile import AcceptanceEntry, Grid, OverheadRow, Profile
from perfmodel.tree import Strategy, expected_tree_tokens, grow_tree
from runtime.checkpoint import CheckpointError, parse_dtype
from runtime.sampling import Sampling

from . import acceptance as acc
from . import stage2 as st2
from .benchmarks import ForwardTimer, overhead_sampler, release_memory, time_point, tree_overhead_sampler
from .environment import available_memory_bytes, device_info, resolve_device, synchronizer
from .errors import CalibrationError
from .grid import (DEFAULT_BATCH_SIZES, DEFAULT_CONTEXT_LENS, DEFAULT_MAX_K, QUICK_BATCH_SIZES, QUICK_CONTEXT_LENS,
                   OverheadPoint, TreeOverheadPoint, check_grid_fits, fit_wide_passes, make_grid, merge_grids,
                   overhead_points, timing_points, tree_overhead_points)
from .models import (LoadedPair, ModelSpec, check_memory, check_pair, display_path, load_pair, memory_need,
                     model_info, resolve_model)
from .noise import NoiseMonitor, reference_sampler
from .store import (check_resumable, csv_path_for, load_for_resume, measured_overhead_points,
                    measured_timing_points, measured_tree_overhead_points, new_profile, overhead_row,
                    tree_overhead_row, with_row, write_profile)
from .timing import Clock, RepetitionRule, is_out_of_memory, repeat

TREE_PROMPT_TOKENS = 8  # the last tokens of a real prompt per row: real text, and little prefill per sample


@dataclass(frozen=True)
class Effort:
    """How hard to look at each point: the default and --quick differ only here and in the grid."""

    forward_rule: RepetitionRule
    overhead_rule: RepetitionRule
    overhead_steps: int  # generation steps per overhead sample: their mean is one sample
    prompt_count: int  # prompts used to measure acceptance (the first ones of the file)
    continuation_tokens: int  # target tokens generated per prompt; each is a start position for alpha
    tree_rule: RepetitionRule  # tree step overheads: their samples run the widest passes of the run
    tree_steps: int  # generation steps per tree overhead sample
    tree_nodes: tuple[int, ...]  # sizes of the grown trees whose overheads are measured


# Tree sizes above the default max_k (8): a grown tree of at most max_k nodes may be a plain chain.
# Tree rows skip the warm-up (their samples are the run's slowest): the chain rows before them warmed
# the allocator, and a first sample slowed by building the tree's index tensors is one of at least
# three, which the median ignores.
DEFAULT_EFFORT = Effort(RepetitionRule(budget_s=0.25), RepetitionRule(warmup_reps=1, min_reps=3, budget_s=0.3),
                        overhead_steps=4, prompt_count=64, continuation_tokens=48,
                        tree_rule=RepetitionRule(warmup_reps=0, min_reps=3, budget_s=0.2), tree_steps=2,
                        tree_nodes=(12, 32))
QUICK_EFFORT = Effort(RepetitionRule(warmup_reps=1, min_reps=3, budget_s=0.06),
                      RepetitionRule(warmup_reps=1, min_reps=3, budget_s=0.1),
                      overhead_steps=2, prompt_count=16, continuation_tokens=32,
                      tree_rule=RepetitionRule(warmup_reps=0, min_reps=3, budget_s=0.06), tree_steps=2,
                      tree_nodes=(12, 32))


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
    stage2: Path | None = None  # an n-gram file (specbatch.ngram/1): measure the second stage with it


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
    rank_acceptance: tuple[tuple[float, ...], ...] | None = None  # depth x rank, for trees


@dataclass(frozen=True)
class Stage2Summary:
    file: str
    guess_accuracy: tuple[float, ...]  # per rank
    query_overhead_ms: float
    query_ms_per_context: float


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
    stage2: Stage2Summary | None = None
    tree_overheads: int = 0  # tree step-overhead rows in the profile
    noise: dict | None = None  # perfmodel.noise.NoiseFigure.to_json(): the reference pass's drift and jitter
    warnings: tuple[str, ...] = ()  # one line each, e.g. a machine too noisy for the ±3 % rule

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
    stage2: object | None  # the loaded runtime.ngram.NGramModel
    stage2_file: str | None  # as given: what the profile records, and what a table will ask to load
    stage2_sha256: str | None

    @property
    def trees(self) -> bool:
        """Whether tree overheads are measured: they need a measured rank acceptance."""
        return self.user_acceptance is None


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
    grid = fit_wide_passes(grid, target.config, draft.config)
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
    ngram = sha256 = file = None
    if request.stage2 is not None:
        if user_acceptance is not None:
            raise CalibrationError(f"--stage2 {request.stage2}: the n-gram's guesses are measured against the draft "
                                   f"on the prompts, which --acceptance skips; drop one of the two")
        ngram = st2.load_stage2(request.stage2, target)
        sha256, file = file_sha256(request.stage2), str(request.stage2)  # as given: the runtime loads it
    device = resolve_device(request.device)
    try:
        dtype = parse_dtype(request.dtype, device)
    except CheckpointError as error:
        raise CalibrationError(str(error)) from None
    effort = QUICK_EFFORT if request.quick else DEFAULT_EFFORT
    return _Plan(target, draft, grid, device, dtype, samplings, user_acceptance, prompts, effort, ngram, file, sha256)


def _start_profile(request: CalibrationRequest, plan: _Plan) -> Profile:
    device = device_info(plan.device, plan.dtype)
    target, draft = model_info(plan.target, plan.dtype), model_info(plan.draft, plan.dtype)
    grid = plan.grid
    tree_nodes = max(plan.effort.tree_nodes) if plan.trees else 0
    check_memory(memory_need(target, draft, grid, tree_nodes), available_memory_bytes(plan.device), plan.device)
    if request.resume and request.out.is_file():
        old = load_for_resume(request.out)
        check_resumable(old, request.out, device, target, draft)
        if old.stage2 is not None and plan.stage2_sha256 is not None and old.stage2.sha256 != plan.stage2_sha256:
            raise CalibrationError(f"--resume: {request.out} measured the second stage with {old.stage2.file} (sha256 "
                                   f"{old.stage2.sha256[:12]}), not --stage2 {request.stage2} "
                                   f"({plan.stage2_sha256[:12]}); write a new profile")
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
def _encoded_prompts(pair: LoadedPair, plan: _Plan) -> list[list[int]]:
    limit = min(plan.target.config.max_position_embeddings, plan.draft.config.max_position_embeddings)
    tokens = plan.effort.continuation_tokens
    return acc.encode_prompts(pair.tokenizer, list(plan.prompts[:plan.effort.prompt_count]), limit - tokens - 1)


def _scored_rows(pair: LoadedPair, plan: _Plan, sampling: Sampling) -> tuple[list[acc.ScoredRow], int]:
    """The scored continuations of the acceptance prompts, and how many prompts there were."""
    encoded = _encoded_prompts(pair, plan)
    return acc.score(pair.target, pair.draft, encoded, sampling, plan.effort.continuation_tokens,
                     pair.eos_token_ids), len(encoded)


def _tree_prompts(encoded: list[list[int]], batch_size: int) -> list[list[int]]:
    """One real prompt per row (the acceptance prompts, cycled), its last TREE_PROMPT_TOKENS tokens."""
    return [encoded[row % len(encoded)][-TREE_PROMPT_TOKENS:] for row in range(batch_size)]


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


def _tree_overhead_row(pair: LoadedPair, plan: _Plan, point: TreeOverheadPoint, rank_acceptance, max_k: int,
                       encoded: list[list[int]], clock: Clock) -> OverheadRow | None:
    """The step overhead of the grown tree of `point.tree_nodes` nodes at batch size b, with the second
    stage or not, on the `encoded` prompts; None when its generation runs out of memory (as for chain rows)."""
    tree = grow_tree(rank_acceptance, point.tree_nodes, max_k)
    try:
        sampler = tree_overhead_sampler(pair.target, pair.draft, _tree_prompts(encoded, point.batch_size),
                                        Strategy(tree, point.stage2), expected_tree_tokens(tree, rank_acceptance),
                                        plan.effort.tree_steps, stage2=plan.stage2 if point.stage2 else None,
                                        synchronize=synchronizer(plan.device))
        return tree_overhead_row(point, tree.depth, repeat(sampler, plan.effort.tree_rule, clock))
    except Exception as error:  # noqa: BLE001 - only out-of-memory is survivable
        if not is_out_of_memory(error):
            raise
    release_memory(plan.device)
    return None


def _greedy_entry(profile: Profile) -> AcceptanceEntry | None:
    return next((entry for entry in profile.acceptance if entry.mode == "greedy"), None)


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
    acceptance = tuple(AcceptanceSummary(e.mode, _setting(e), e.source, e.per_position, e.rank_acceptance)
                       for e in profile.acceptance)
    stage2 = profile.stage2
    return CalibrationSummary(
        profile_path=str(request.out), csv_path=str(csv_path_for(request.out)), device=profile.device.name,
        dtype=profile.device.dtype, target=profile.target.source, draft=profile.draft.source, passes=tuple(passes),
        acceptance=acceptance, points_measured=measured, points_resumed=resumed,
        points_infeasible=sum(not r.feasible for r in profile.timings), elapsed_s=round(clock() - started_s, 3),
        stage2=None if stage2 is None else Stage2Summary(stage2.file, stage2.guess_accuracy, stage2.query_overhead_ms,
                                                         stage2.query_ms_per_context),
        tree_overheads=sum(row.tree_nodes is not None for row in profile.overheads),
        noise=None if profile.noise is None else profile.noise.to_json(),
        warnings=tuple(w for w in [None if profile.noise is None else profile.noise.warning()] if w))


def _acceptance_done(entry: AcceptanceEntry, trees: bool) -> bool:
    """An entry of an older profile measured before rank acceptance existed is measured again."""
    return entry.source == "user" or not trees or entry.rank_acceptance is not None


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
    monitor = _noise_monitor(pair, grid, plan.device, clock)
    monitor.check(force=True)

    done_acceptance = {acc.entry_key(e) for e in profile.acceptance if _acceptance_done(e, plan.trees)}
    todo_acceptance = [s for s in plan.samplings if acc.sampling_key(s) not in done_acceptance]
    todo_stage2 = plan.stage2 is not None and profile.stage2 is None
    done_timings, done_overheads = measured_timing_points(profile), measured_overhead_points(profile)
    todo_timings = [p for p in timing_points(grid) if p not in done_timings]
    todo_overheads = [p for p in overhead_points(grid) if p not in done_overheads]
    all_trees = tree_overhead_points(grid, plan.effort.tree_nodes, plan.stage2 is not None) if plan.trees else []
    done_trees = measured_tree_overhead_points(profile)
    todo_trees = [p for p in all_trees if p not in done_trees]
    total = (len(plan.samplings) + int(plan.stage2 is not None) + len(timing_points(grid)) + len(overhead_points(grid))
             + len(all_trees))
    todo = len(todo_acceptance) + int(todo_stage2) + len(todo_timings) + len(todo_overheads) + len(todo_trees)
    resumed = done = total - todo

    def advance(label: str, row=None) -> None:
        """Save the row (if any), then report: a point counts as done only once it is on disk."""
        nonlocal profile, done
        if row is not None:
            profile = with_row(profile, row)
            write_profile(request.out, profile)
        done += 1
        if on_progress is not None:
            on_progress(ProgressEvent(done, total, label))
        monitor.check()  # between points, when its interval has passed

    prompts_source = display_path(request.prompts) if request.prompts is not None else None
    greedy_rows = None  # kept for the second stage's guesses: the same continuations
    for sampling in todo_acceptance:
        if plan.user_acceptance is not None:
            entry = acc.user_entry(sampling, plan.user_acceptance)
        else:
            rows, prompt_count = _scored_rows(pair, plan, sampling)
            greedy_rows = rows if sampling.greedy else greedy_rows
            entry = acc.entry_from_rows(rows, sampling, grid.max_k, prompt_count, prompts_source)
        advance(f"acceptance {sampling.describe()}", entry)

    if todo_stage2:
        rows = greedy_rows if greedy_rows is not None else _scored_rows(pair, plan, Sampling())[0]
        info = st2.measure_stage2(plan.stage2, plan.stage2_file, plan.stage2_sha256, rows, plan.effort.forward_rule,
                                  clock)
        advance("second stage: n-gram guesses and query time", info)

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

    greedy = _greedy_entry(profile)
    rank_table = greedy.rank_acceptance if greedy is not None else None
    encoded = _encoded_prompts(pair, plan) if todo_trees else []
    for point in todo_trees:
        label = f"tree overhead b={point.batch_size} nodes={point.tree_nodes}" + (" +ngram" if point.stage2 else "")
        if rank_table is None:
            advance(label + " (no rank acceptance: continuations too short, not recorded)")
            continue
        row = _tree_overhead_row(pair, plan, point, rank_table, grid.max_k, encoded, clock)
        advance(label if row is not None else label + " (out of memory, not recorded)", row)
    monitor.check(force=True)
    profile = replace(profile, noise=monitor.figure())
    write_profile(request.out, profile)
    return _summary(request, profile, done - resumed, resumed, started_s, clock)


def _noise_monitor(pair: LoadedPair, grid: Grid, device: str, clock: Clock) -> NoiseMonitor:
    """The reference pass: the target at the smallest batch size and context, one new token (cheap)."""
    b, L = min(grid.batch_sizes), min(grid.context_lens)
    return NoiseMonitor(reference_sampler(pair.target, b, L, device, clock), f"target b={b} n=1 L={L}", clock)
