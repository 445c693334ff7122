"""What a calibration reports: progress events while it runs, and the summary of the profile it wrote."""
from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from specbatch.perfmodel.profile import AcceptanceEntry, Profile
from specbatch.runtime.sampling import Sampling

from .store import csv_path_for
from .timing import Clock


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
    points_left: int = 0  # not measured because --max-seconds ran out; --resume measures them
    max_seconds: float | None = None
    stopped_by_max_seconds: bool = False  # --max-seconds ran out before every point (refinement's too) was timed
    noise: dict | None = None  # perfmodel.profile.noise.NoiseFigure.to_json(): the reference pass's drift and jitter
    warnings: tuple[str, ...] = ()  # one line each, e.g. a machine too noisy for the ±3 % rule
    insitu_passes: int = 0  # in-situ pass rows in the profile (passes timed inside real steps)
    insitu_steps: int = 0  # in-situ step rows
    points_skipped: int = 0  # not measured: they cannot fit in the device's free memory (calibrate.memory)
    memory_notes: tuple[str, ...] = ()  # what calibrate said about memory before measuring
    engine: str | None = None  # `calibrate --engine`: the engine whose steps were measured ('vllm 0.32.0')
    engine_steps: int = 0  # its step rows in the profile

    def to_json(self) -> dict:
        return asdict(self)


def setting(entry: AcceptanceEntry) -> str:
    if entry.mode == "greedy":
        return "greedy"
    return Sampling(entry.temperature, entry.top_k or 0, entry.top_p or 1.0).describe()


def summarize(out: Path, profile: Profile, measured: int, resumed: int, started_s: float,
              clock: Clock) -> CalibrationSummary:
    """What the run measured and the profile it left at `out` (passes at the grid's edges, acceptance)."""
    grid = profile.grid
    rows = {(r.model, r.batch_size, r.new_tokens, r.context_len): r for r in profile.timings}
    context_len = min(grid.context_lens)
    passes = []
    for model, new_tokens in (("target", 1), ("target", grid.max_k + 1), ("draft", 1)):
        for batch_size in sorted({min(grid.batch_sizes), max(grid.batch_sizes)}):
            row = rows.get((model, batch_size, new_tokens, context_len))
            if row is not None:
                passes.append(PassSummary(model, batch_size, new_tokens, context_len, row.median_ms))
    acceptance = tuple(AcceptanceSummary(e.mode, setting(e), e.source, e.per_position, e.rank_acceptance)
                       for e in profile.acceptance)
    stage2 = profile.stage2
    return CalibrationSummary(
        profile_path=str(out), csv_path=str(csv_path_for(out)), device=profile.device.name,
        dtype=profile.device.dtype, target=profile.target.source, draft=profile.draft.source, passes=tuple(passes),
        acceptance=acceptance, points_measured=measured, points_resumed=resumed,
        points_infeasible=sum(not r.feasible for r in profile.timings), elapsed_s=round(clock() - started_s, 3),
        stage2=None if stage2 is None else Stage2Summary(stage2.file, stage2.guess_accuracy, stage2.query_overhead_ms,
                                                         stage2.query_ms_per_context),
        tree_overheads=sum(row.tree_nodes is not None for row in profile.overheads),
        noise=None if profile.noise is None else profile.noise.to_json(),
        insitu_passes=len(profile.insitu_timings), insitu_steps=len(profile.insitu_steps),
        warnings=profile.warnings())
