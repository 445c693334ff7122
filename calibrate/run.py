"""`calibrate()`: check the request, load the pair, measure every grid point, write the profile.

Every input is checked before anything heavy runs. Then, in order: acceptance (it sets how many drafts
the overhead runs accept and grows the trees whose overheads are measured), the n-gram second stage,
forward-pass timings, chain step overheads, in-situ timing (calibrate/insitu.py) and tree step overheads
(trees need measured acceptance: with --acceptance the model falls back to chains). The profile is written
after every point, so an interrupted run resumes.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch

from specbatch.perfmodel.jsonio import check_replace, exclusive_lock, file_sha256, writable_path
from specbatch.perfmodel.profile import PROFILE_KIND, AcceptanceEntry, Grid, OverheadRow, Profile
from specbatch.perfmodel.tree import Strategy, expected_tree_tokens, grow_tree
from specbatch.runtime.checkpoint import parse_dtype
from specbatch.runtime.clock import DeviceClock
from specbatch.runtime.cuda_graphs import GraphedModel
from specbatch.runtime.devices import execution_on, graphs_by_default, host_bookkeeping_by_default
from specbatch.runtime.generator import SpeculativeGenerator
from specbatch.runtime.loading import LoadedPair, ModelSpec, display_path, load_pair, resolve_device, resolve_pair
from specbatch.runtime.sampling import Sampling

from . import acceptance as acc
from . import stage2 as st2
from .benchmarks import ForwardTimer, overhead_sampler, release_memory, time_point, tree_overhead_sampler
from .environment import attention_kernel, available_memory_bytes, device_info, open_nvml
from .errors import CalibrationError
from .grid import (DEFAULT_BATCH_SIZES, DEFAULT_CONTEXT_LENS, DEFAULT_MAX_K, QUICK_BATCH_SIZES, QUICK_CONTEXT_LENS,
                   OverheadPoint, TreeOverheadPoint, check_grid_fits, fit_wide_passes, make_grid,
                   merge_grids, overhead_points, timing_points, tree_overhead_points)
from .insitu import InSituPoint, insitu_groups, insitu_points, measure_insitu, random_prompts
from .routing import MAX_ROUTING_PROMPTS, TextWindows, expert_roles, measure_routing
from .memory import MemoryPlan, memory_budget, plan_memory, reference_bytes
from .models import model_info
from .noise import MachineWatch, NoiseMonitor, reference_sampler
from .refine import refinement_rounds
from .store import (TIMINGS_CSV_KIND, check_resumable, csv_path_for, load_for_resume, measured_insitu_points,
                    measured_overhead_points, measured_timing_points, measured_tree_overhead_points, new_profile,
                    overhead_row, tree_overhead_row, with_row, write_profile)
from .summary import CalibrationSummary, ProgressEvent, summarize
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
    # chain lengths generated with for in-situ timing (<= max_k): every one the table may choose, because the
    # verify pass of k + 1 tokens is not smooth in its width on CPUs, and a fit never shown a width cannot know
    # (docs/fidelity.md, "Sweeps, and every width")
    insitu_ks: tuple[int, ...] = tuple(range(9))
    insitu_tokens: int = 32  # new tokens per row of each in-situ generation
    insitu_sweeps: int = 3  # timed generations per in-situ point, one per sweep over all points (calibrate.insitu)
    insitu_every_other_batch_size: bool = False  # in-situ at the grid's 1st, 3rd, ... batch sizes (and its last)


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
                      tree_nodes=(12, 32), insitu_ks=(0, 2, 3, 4, 5, 6), insitu_tokens=24, insitu_sweeps=2,
                      insitu_every_other_batch_size=True)


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
    force: bool = False  # replace an existing --out (without --resume); it is kept until a point is measured
    max_seconds: float | None = None  # stop cleanly between points after this long; --resume continues
    refine: bool | None = None  # time more passes where the fit cannot place a kernel step; None: on CUDA only
    cuda_graphs: bool | None = None  # time graphed passes, as generation runs them: None, the device's default


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
    graphs: bool = False  # passes replay CUDA graphs (runtime.cuda_graphs), in every stage timed

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


def _check_out(request: CalibrationRequest) -> None:
    """Never destroy a profile: --out must be a file path, and an existing file is continued (--resume) or
    replaced on purpose (--force), never silently."""
    writable_path(request.out, "--out")
    if csv_path_for(request.out) == request.out:  # the timing CSV would overwrite the profile itself
        raise CalibrationError(f"--out {request.out}: the timing rows go to a .csv beside the profile; give the "
                               "profile a .json name")
    if request.max_seconds is not None and not request.max_seconds > 0:  # also refuses nan
        raise CalibrationError(f"--max-seconds must be a positive number of seconds, got {request.max_seconds}")
    if not request.resume:  # the profile and the timing CSV beside it: the one replace rule
        check_replace(request.out, PROFILE_KIND, request.force, "--out", "--resume to continue it")
        check_replace(csv_path_for(request.out), TIMINGS_CSV_KIND, request.force, "--out")


def _plan(request: CalibrationRequest) -> _Plan:
    _check_out(request)
    target, draft = resolve_pair(request.target, request.draft)
    grid = make_grid(request.batch_sizes or (QUICK_BATCH_SIZES if request.quick else DEFAULT_BATCH_SIZES),
                     request.context_lens or (QUICK_CONTEXT_LENS if request.quick else DEFAULT_CONTEXT_LENS),
                     request.max_k, head=draft.head is not None)
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
        if draft.head is not None:
            raise CalibrationError(f"--stage2 {request.stage2}: the second stage speeds up a draft model's trees; "
                                   f"--draft {draft.source} is a {draft.head.kind} head, which drafts without it")
        if user_acceptance is not None:
            raise CalibrationError(f"--stage2 {request.stage2}: the n-gram's guesses are measured against the draft "
                                   f"on the prompts, which --acceptance skips; drop one of the two")
        ngram = st2.load_stage2(request.stage2, target)
        # absolute: tables made from this profile load it from any directory (and check its sha256)
        sha256, file = file_sha256(request.stage2), str(Path(request.stage2).resolve())
    device = resolve_device(request.device)
    dtype = parse_dtype(request.dtype, device)
    effort = QUICK_EFFORT if request.quick else DEFAULT_EFFORT
    graphs = graphs_by_default(device, dtype) if request.cuda_graphs is None else request.cuda_graphs
    return _Plan(target, draft, grid, device, dtype, samplings, user_acceptance, prompts, effort, ngram, file, sha256,
                 graphs)


def _start_profile(request: CalibrationRequest, plan: _Plan) -> Profile:
    device = replace(device_info(plan.device, plan.dtype), execution=execution_on(plan.device, plan.dtype, plan.graphs))
    target, draft = model_info(plan.target, plan.dtype), model_info(plan.draft, plan.dtype)
    grid = plan.grid
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
                                   plan.effort.overhead_steps, cuda_graphs=plan.graphs)
        if plan.graphs:
            sampler()  # captures its graphs: never inside a timed sample
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
                                        clock=DeviceClock(plan.device), cuda_graphs=plan.graphs)
        if plan.graphs:
            sampler()  # captures its graphs: never inside a timed sample
        return tree_overhead_row(point, tree.depth, repeat(sampler, plan.effort.tree_rule, clock))
    except Exception as error:  # noqa: BLE001 - only out-of-memory is survivable
        if not is_out_of_memory(error):
            raise
    release_memory(plan.device)
    return None


def _insitu_room(plan: _Plan) -> int:
    """The longest in-situ prompt (tokens): the generation and the longest chain fit within the grid's
    largest context and both models' positions."""
    limit = min(plan.target.config.max_position_embeddings, plan.draft.config.max_position_embeddings)
    return max(1, min(limit - plan.grid.max_k - 2, max(plan.grid.context_lens)) - plan.effort.insitu_tokens)


def _insitu_prompts(pair: LoadedPair, plan: _Plan, largest_batch: int) -> list[list[int]]:
    """The prompts after the acceptance ones (all of them when there are no more), cut so that the contexts
    stay within the grid's largest (the steps the table is computed for, and little time spent beyond)
    and within both models' positions with room for the generation and the longest chain. Random weights:
    random token ids, twice the largest in-situ batch size that fits in memory of them, from the grid's
    smallest context up."""
    effort, room = plan.effort, _insitu_room(plan)
    if plan.user_acceptance is not None:
        vocab_size = min(plan.target.config.vocab_size, plan.draft.config.vocab_size)
        return random_prompts(vocab_size, 2 * largest_batch,
                              min(min(plan.grid.context_lens), room), room)
    texts = list(plan.prompts[effort.prompt_count:]) or list(plan.prompts)
    return acc.encode_prompts(pair.tokenizer, texts, room)


def _insitu_rows(plan: _Plan, generator, points: list[InSituPoint], prompts: list[list[int]]):
    """The rows of one in-situ generation per point (one batch size and sweep, in lockstep); a point's
    entry is None when it has no full-batch step, all of them when the group runs out of memory."""
    try:
        return measure_insitu(generator, points, prompts, plan.effort.insitu_tokens, plan.effort.insitu_sweeps,
                              synthetic_acceptance=plan.user_acceptance)
    except Exception as error:  # noqa: BLE001 - only out-of-memory is survivable
        if not is_out_of_memory(error):
            raise
    release_memory(plan.device)
    return [None] * len(points)


def _greedy_entry(profile: Profile) -> AcceptanceEntry | None:
    return next((entry for entry in profile.acceptance if entry.mode == "greedy"), None)


def _greedy_acceptance(profile: Profile, fallback: float = 0.8) -> float:
    """The mean greedy alpha, for the overhead runs' synthetic acceptance."""
    for entry in profile.acceptance:
        if entry.mode == "greedy":
            return sum(entry.per_position) / len(entry.per_position)
    return fallback


def _acceptance_done(entry: AcceptanceEntry, trees: bool) -> bool:
    """An entry of an older profile measured before rank acceptance existed is measured again."""
    return entry.source == "user" or not trees or entry.rank_acceptance is not None


INSITU_POINT_S = 0.5  # one in-situ generation of --quick on the demo pair on a 2-core CPU: about (b = 16: 1.2 s)


def estimate_seconds(effort: Effort, acceptance_runs: int, timings: int, overheads: int, trees: int,
                     insitu: int = 0) -> float:
    """A first estimate of a run, before anything is measured: the repetition budgets of its points, plus
    about a second per acceptance prompt and INSITU_POINT_S per in-situ generation. A lower bound where one pass
    is slower than its point's budget (large models, a busy machine): the progress bar's ETA takes over
    once points are timed."""
    return (acceptance_runs * effort.prompt_count * 1.0 + timings * effort.forward_rule.budget_s
            + overheads * effort.overhead_rule.budget_s + trees * effort.tree_rule.budget_s
            + insitu * INSITU_POINT_S)


class _OutOfTime(Exception):
    """--max-seconds ran out between two points (everything measured is already on disk)."""


def calibrate(request: CalibrationRequest, on_progress: Callable[[ProgressEvent], None] | None = None,
              clock: Clock | None = None,
              on_estimate: Callable[[int, float], None] | None = None,
              on_notice: Callable[[str], None] | None = None) -> CalibrationSummary:
    """Measure the pair on the device and write the profile (and its CSV) after every point.

    `on_estimate(points, seconds)` is called once the models are loaded, before measuring (see
    `estimate_seconds`), and `on_notice(line)` for each thing said before measuring (points skipped because
    they cannot fit in memory, in-situ ks split into smaller lockstep groups); `on_progress` is called after
    each point is on disk; an exception it raises
    (Ctrl-C) stops the run with everything measured so far saved, and `resume=True` continues from there. An existing
    --out is not touched until the first point is measured; a lock beside it keeps a second run out.
    `clock` (tests: a fake one) defaults to the device's (runtime.clock.DeviceClock).
    """
    started_s = (clock or time.perf_counter)()
    plan = _plan(request)
    clock = clock or DeviceClock(plan.device)
    with exclusive_lock(request.out, "--out", "calibration"):
        return _calibrate(request, plan, on_progress, on_estimate, on_notice, clock, started_s)


def _calibrate(request: CalibrationRequest, plan: _Plan, on_progress, on_estimate, on_notice, clock: Clock,
               started_s: float) -> CalibrationSummary:
    profile = replace(_start_profile(request, plan), stopped_early="an interruption")  # until it finishes
    grid = profile.grid  # on resume, the union of the old grid and the requested one
    done_acceptance = {acc.entry_key(e) for e in profile.acceptance if _acceptance_done(e, plan.trees)}
    done_timings, done_overheads = measured_timing_points(profile), measured_overhead_points(profile)
    all_trees = tree_overhead_points(grid, plan.effort.tree_nodes, plan.stage2 is not None) if plan.trees else []
    done_trees = measured_tree_overhead_points(profile)
    effort = plan.effort
    all_insitu = insitu_points(grid, effort.insitu_ks, effort.insitu_every_other_batch_size, effort.insitu_sweeps)
    done_insitu = measured_insitu_points(profile, effort.insitu_sweeps)
    todo = _Todo(acceptance=[s for s in plan.samplings if acc.sampling_key(s) not in done_acceptance],
                 stage2=plan.stage2 is not None and profile.stage2 is None,
                 timings=[p for p in timing_points(grid) if p not in done_timings],
                 overheads=[p for p in overhead_points(grid) if p not in done_overheads],
                 trees=[p for p in all_trees if p not in done_trees],
                 insitu=[p for p in all_insitu if p not in done_insitu],
                 routing=bool(expert_roles(profile)) and profile.routing is None)
    memory = _memory_plan(plan, profile, todo)
    todo = todo.without(memory.skipped)
    for note in memory.notes:
        if on_notice is not None:
            on_notice(note)
    total = (len(plan.samplings) + int(plan.stage2 is not None) + int(bool(expert_roles(profile)))
             + len(timing_points(grid)) + len(overhead_points(grid)) + len(all_trees) + len(all_insitu)
             - len(memory.skipped))
    resumed = done = total - todo.count
    pair = _load(plan)
    if on_estimate is not None and todo.count:
        on_estimate(todo.count, estimate_seconds(plan.effort, len(todo.acceptance) * (plan.user_acceptance is None),
                                                 len(todo.timings), len(todo.overheads), len(todo.trees),
                                                 len(todo.insitu)))
    watch = _machine_watch(pair, grid, plan.device, clock, memory, plan.graphs)
    watch.start(lambda: clock() - started_s)

    def out_of_time() -> None:
        if request.max_seconds is not None and clock() - started_s > request.max_seconds and done < total:
            raise _OutOfTime

    def advance(label: str, row=None) -> None:
        """Save the row (if any), then report: a point counts as done only once it is on disk."""
        nonlocal profile, done
        if row is not None:
            profile = with_row(profile, row)
            write_profile(request.out, profile)
        done += 1
        if on_progress is not None:
            on_progress(ProgressEvent(done, total, label))
        watch.check()  # between points, when its interval has passed
        out_of_time()

    def propose() -> None:
        """A refinement point joins the run: it counts in `total`, and --max-seconds guards it as any other."""
        nonlocal total
        total += 1
        out_of_time()

    stopped = False
    stopped_early = None
    try:
        insitu_batch = max((p.batch_size for p in all_insitu if p not in memory.skipped), default=0)
        _measure(pair, plan, grid, todo, request, clock, advance, propose, lambda: profile, memory, insitu_batch)
    except _OutOfTime:
        stopped = True
        stopped_early = f"--max-seconds {request.max_seconds:g}"  # fit and table say what this left out
    noise, noise_large_batch, device_state = watch.finish(lambda: clock() - started_s)
    profile = replace(profile, noise=noise, noise_large_batch=noise_large_batch, device_state=device_state,
                      stopped_early=stopped_early)
    write_profile(request.out, profile)  # with the noise figures (and, after a finished --resume, the merged grid)
    summary = summarize(request.out, profile, done - resumed, resumed, started_s, clock)
    return replace(summary, points_left=total - done, max_seconds=request.max_seconds, stopped_by_max_seconds=stopped,
                   points_skipped=len(memory.skipped), memory_notes=memory.notes)


@dataclass(frozen=True)
class _Todo:
    """The points a run still has to measure, in the order it measures them."""

    acceptance: list[Sampling]
    stage2: bool
    timings: list
    overheads: list[OverheadPoint]
    trees: list[TreeOverheadPoint]
    insitu: list[InSituPoint]

    routing: bool = False  # a mixture of experts' routing is still to measure

    @property
    def count(self) -> int:
        return (len(self.acceptance) + int(self.stage2) + int(self.routing) + len(self.timings) + len(self.overheads)
                + len(self.trees) + len(self.insitu))

    def without(self, skipped) -> _Todo:
        """The same lists less the points in `skipped`."""
        keep = lambda points: [p for p in points if p not in skipped]  # noqa: E731
        return replace(self, timings=keep(self.timings), overheads=keep(self.overheads), trees=keep(self.trees),
                       insitu=keep(self.insitu))


def _memory_plan(plan: _Plan, profile: Profile, todo: _Todo) -> MemoryPlan:
    """Which of the points still to measure fit in the memory free now (calibrate.memory), before loading."""
    target, draft, grid = profile.target, profile.draft, profile.grid
    math_attention = any(attention_kernel(plan.device, plan.dtype, info.heads, info.kv_heads, info.head_dim) == "MATH"
                         for info in (target, draft))
    budget = memory_budget(target, draft, available_memory_bytes(plan.device), plan.device)
    L, small, large = min(grid.context_lens), min(grid.batch_sizes), max(grid.batch_sizes)
    budget = budget.reserve(reference_bytes(target, small, L, math_attention))  # the references' caches stay
    large_bytes = reference_bytes(target, large, L, math_attention) if large > small else 0
    large_reference = large > small and budget.fits(large_bytes)
    budget = budget.reserve(large_bytes if large_reference else 0)
    effort = plan.effort
    memory = plan_memory(target, draft, grid, budget, math_attention, todo.timings, todo.overheads, todo.trees,
                         todo.insitu, effort.overhead_steps, effort.tree_steps, _insitu_room(plan),
                         effort.insitu_tokens, plan.graphs)
    return replace(memory, large_reference=large_reference)


def _measure(pair: LoadedPair, plan: _Plan, grid: Grid, todo: _Todo, request: CalibrationRequest, clock: Clock,
             advance: Callable, propose: Callable[[], None], current: Callable[[], Profile], memory: MemoryPlan,
             insitu_batch: int) -> None:
    """Every point still to measure, in order; `advance` saves each row; `propose()` counts a refinement point
    in the run's total before it is timed; `current()` is the profile so far;
    `insitu_batch`: the largest in-situ batch size of the whole run (the random prompts' count follows it)."""
    prompts_source = display_path(request.prompts) if request.prompts is not None else None
    greedy_rows = None  # kept for the second stage's guesses: the same continuations
    for sampling in todo.acceptance:
        if plan.user_acceptance is not None:
            entry = acc.user_entry(sampling, plan.user_acceptance)
        elif plan.draft.head is not None:  # a head drafts from its own outputs: measured by drafting
            encoded = _encoded_prompts(pair, plan)
            entry = acc.drafted_acceptance(pair.target, pair.draft, encoded, sampling, grid.max_k,
                                           plan.effort.continuation_tokens, pair.eos_token_ids, prompts_source)
        else:
            rows, prompt_count = _scored_rows(pair, plan, sampling)
            greedy_rows = rows if sampling.greedy else greedy_rows
            entry = acc.entry_from_rows(rows, sampling, grid.max_k, prompt_count, prompts_source)
        advance(f"acceptance {sampling.describe()}", entry)

    if todo.stage2:
        rows = greedy_rows if greedy_rows is not None else _scored_rows(pair, plan, Sampling())[0]
        on_device = None if host_bookkeeping_by_default(plan.device) else torch.device(plan.device)
        info = st2.measure_stage2(plan.stage2, plan.stage2_file, plan.stage2_sha256, rows, plan.effort.forward_rule,
                                  clock, on_device)
        advance("second stage: n-gram guesses and query time", info)

    text_windows = _routing(pair, plan, grid, current(), todo.routing, prompts_source, advance)
    timer = ForwardTimer({"target": pair.target, "draft": pair.draft}, grid, plan.device,
                         plan.effort.forward_rule, clock, graphs=plan.graphs, text_windows=text_windows)
    for point in todo.timings:
        advance(f"{point.model} b={point.batch_size} n={point.new_tokens} L={point.context_len}",
                time_point(timer, point))
    if request.refine or (request.refine is None and plan.device.startswith("cuda")):  # CPU passes are not cheap
        for point in refinement_rounds(current):  # calibrate/refine.py: where the fit cannot place a step
            propose()
            advance(f"refine: {point.model} b={point.batch_size} n={point.new_tokens} L={point.context_len}",
                    time_point(timer, point))
    timer.forget()
    release_memory(plan.device)  # the timer's caches were of every size: let the next stages start from free memory

    synthetic = _greedy_acceptance(current())
    for point in todo.overheads:
        row = _overhead_row(pair, plan, point, synthetic, clock)
        label = f"overhead b={point.batch_size} k={point.k}"
        advance(label if row is not None else label + " (out of memory, not recorded)", row)

    generator = SpeculativeGenerator(pair.target, pair.draft, eos_token_ids=(), cuda_graphs=plan.graphs) \
        if todo.insitu else None
    insitu_prompts = _insitu_prompts(pair, plan, insitu_batch) if todo.insitu else []
    for group in insitu_groups(todo.insitu, memory.lockstep_ks):  # ks of one batch size and sweep, in lockstep
        for point, row in zip(group, _insitu_rows(plan, generator, group, insitu_prompts)):
            label = f"in-situ b={point.batch_size} k={point.k} sweep {point.sweep}"
            advance(label if row is not None else label + " (out of memory or no full-batch step, not recorded)", row)

    greedy = _greedy_entry(current())
    rank_table = greedy.rank_acceptance if greedy is not None else None
    encoded = _encoded_prompts(pair, plan) if todo.trees else []
    for point in todo.trees:
        label = f"tree overhead b={point.batch_size} nodes={point.tree_nodes}" + (" +ngram" if point.stage2 else "")
        if rank_table is None:
            advance(label + " (no rank acceptance: continuations too short, not recorded)")
            continue
        row = _tree_overhead_row(pair, plan, point, rank_table, grid.max_k, encoded, clock)
        advance(label if row is not None else label + " (out of memory, not recorded)", row)


def _routing(pair: LoadedPair, plan: _Plan, grid: Grid, profile: Profile, measure: bool, prompts_source: str | None,
             advance: Callable) -> dict[str, TextWindows]:
    """A mixture of experts' routing (calibrate.routing), measured when `measure`; and, where the weights are a
    model's, the text windows its timed passes are fed. Random weights (a preset) route random token ids, and
    the section says so: no trained router's routing is in it."""
    roles = expert_roles(profile)
    if not roles:
        return {}
    models = {"target": pair.target, "draft": pair.draft}
    random_weights = any((plan.target if role == "target" else plan.draft).random_weights for role in roles)
    if random_weights:
        vocab_size = min(model.config.vocab_size for model in models.values())
        prompts = random_prompts(vocab_size, MAX_ROUTING_PROMPTS, 32, 128)
    else:
        limit = min(plan.target.config.max_position_embeddings, plan.draft.config.max_position_embeddings)
        prompts = acc.encode_prompts(pair.tokenizer, list(plan.prompts[:MAX_ROUTING_PROMPTS]), limit - 1)
    if measure:
        section = measure_routing({role: models[role] for role in roles}, prompts, grid, random_weights, prompts_source)
        advance(f"routing: distinct experts per layer over {len(prompts)} prompts", section)
    return {} if random_weights else {role: TextWindows(prompts) for role in roles}


def _machine_watch(pair: LoadedPair, grid: Grid, device: str, clock: Clock, memory: MemoryPlan,
                   graphs: bool = False) -> MachineWatch:
    """The reference passes: the target at the smallest context, one new token, at the smallest batch size
    (cheap) and at the largest one when its pass fits in memory; NVML on CUDA when it answers."""
    L = min(grid.context_lens)

    target = GraphedModel(pair.target) if graphs else pair.target  # its first check's warm-up pass captures

    def monitor(b: int) -> NoiseMonitor:
        sampler = reference_sampler(target, b, L, device, DeviceClock(device))
        return NoiseMonitor(sampler, f"target b={b} n=1 L={L}", clock)

    small, large = min(grid.batch_sizes), max(grid.batch_sizes)
    return MachineWatch(monitor(small), monitor(large) if memory.large_reference else None, open_nvml(device),
                        on_cuda=device.startswith("cuda"))
