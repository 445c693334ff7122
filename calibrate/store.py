"""The profile on disk: written after every grid point, resumed from after an interruption.

The JSON is `perfmodel.profile`'s contract (validated and written atomically by `save_profile`);
the timing rows are also written as a tidy CSV beside it (`profile.csv` for `profile.json`), one row
per (model, batch_size, new_tokens, context_len), times in milliseconds. Both files are rewritten
whole after each point: a crash or Ctrl-C leaves the last complete version, never a torn one.
"""
from __future__ import annotations

import csv
import io
from dataclasses import asdict, replace
from datetime import datetime, timezone
from pathlib import Path

from specbatch.perfmodel.errors import PerfModelError
from specbatch.perfmodel.jsonio import rounded, write_text_atomic
from specbatch.perfmodel.profile import (AcceptanceEntry, DeviceInfo, Grid, ModelInfo, OverheadRow, Profile, Stage2Info,
                               TimingRow, load_profile, save_profile)
from specbatch.perfmodel.profile.routing import RoutingSection

from .errors import CalibrationError
from .grid import OverheadPoint, TimingPoint, TreeOverheadPoint
from .insitu import InSituPoint, InSituResult
from .timing import Measurement

CSV_COLUMNS = ("model", "batch_size", "new_tokens", "context_len", "feasible", "median_ms", "p10_ms", "p90_ms", "reps")
TIMINGS_CSV_KIND = "csv:" + ",".join(CSV_COLUMNS)  # the CSV beside a profile, as jsonio.check_replace names kinds


def csv_path_for(json_path: Path) -> Path:
    return json_path.with_suffix(".csv")


def new_profile(device: DeviceInfo, target: ModelInfo, draft: ModelInfo, grid: Grid) -> Profile:
    created = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    return Profile(created_utc=created, device=device, target=target, draft=draft, grid=grid,
                   timings=(), overheads=(), acceptance=())


# ---------------------------------------------------------------- rows
def timing_row(point: TimingPoint, measurement: Measurement | None) -> TimingRow:
    """A measured row, or an infeasible one (out of memory) when `measurement` is None."""
    if measurement is None:
        return TimingRow(point.model, point.batch_size, point.new_tokens, point.context_len,
                         median_ms=None, p10_ms=None, p90_ms=None, reps=0, feasible=False)
    return TimingRow(point.model, point.batch_size, point.new_tokens, point.context_len,
                     median_ms=rounded(measurement.median_ms, 6), p10_ms=rounded(measurement.p10_ms, 6),
                     p90_ms=rounded(measurement.p90_ms, 6), reps=measurement.reps, feasible=True)


def overhead_row(point: OverheadPoint, measurement: Measurement) -> OverheadRow:
    return OverheadRow(point.batch_size, point.k, median_ms=rounded(measurement.median_ms, 6),
                       p10_ms=rounded(measurement.p10_ms, 6), p90_ms=rounded(measurement.p90_ms, 6),
                       reps=measurement.reps)


def tree_overhead_row(point: TreeOverheadPoint, depth: int, measurement: Measurement) -> OverheadRow:
    """A tree step's row: k is the tree's depth (what a chain-only reader would take as k)."""
    return OverheadRow(point.batch_size, depth, median_ms=rounded(measurement.median_ms, 6),
                       p10_ms=rounded(measurement.p10_ms, 6), p90_ms=rounded(measurement.p90_ms, 6),
                       reps=measurement.reps, tree_nodes=point.tree_nodes, stage2=point.stage2)


def measured_timing_points(profile: Profile) -> set[TimingPoint]:
    return {TimingPoint(r.model, r.batch_size, r.new_tokens, r.context_len) for r in profile.timings}


def measured_overhead_points(profile: Profile) -> set[OverheadPoint]:
    """The chain rows' points (tree and second-stage rows are not chain points)."""
    return {OverheadPoint(r.batch_size, r.k) for r in profile.overheads if r.tree_nodes is None and not r.stage2}


def measured_tree_overhead_points(profile: Profile) -> set[TreeOverheadPoint]:
    return {TreeOverheadPoint(r.batch_size, r.tree_nodes, r.stage2) for r in profile.overheads
            if r.tree_nodes is not None}


def measured_insitu_points(profile: Profile, sweeps: int) -> set[InSituPoint]:
    """A generation is measured once its step row is there (its pass rows were written with it); a row
    without a sweep (measured point by point, before sweeps) stands for every sweep of its point."""
    return {InSituPoint(r.batch_size, r.k, sweep) for r in profile.insitu_steps
            for sweep in ((r.sweep,) if r.sweep is not None else range(1, sweeps + 1))}


def _same_setting(a: AcceptanceEntry, b: AcceptanceEntry) -> bool:
    return (a.mode, a.temperature, a.top_k, a.top_p) == (b.mode, b.temperature, b.top_k, b.top_p)


def with_row(profile: Profile,
             row: TimingRow | OverheadRow | AcceptanceEntry | Stage2Info | InSituResult | RoutingSection) -> Profile:
    """The profile with `row` added; an acceptance entry replaces one of the same setting (an older
    profile's entry measured again with rank acceptance keeps its place); an in-situ point adds its pass
    rows and its step row together."""
    if isinstance(row, InSituResult):
        return replace(profile, insitu_timings=profile.insitu_timings + row.passes,
                       insitu_steps=profile.insitu_steps + row.steps)
    if isinstance(row, TimingRow):
        return replace(profile, timings=profile.timings + (row,))
    if isinstance(row, OverheadRow):
        return replace(profile, overheads=profile.overheads + (row,))
    if isinstance(row, Stage2Info):
        return replace(profile, stage2=row)
    if isinstance(row, RoutingSection):
        return replace(profile, routing=row)
    if any(_same_setting(entry, row) for entry in profile.acceptance):
        return replace(profile, acceptance=tuple(row if _same_setting(entry, row) else entry
                                                 for entry in profile.acceptance))
    return replace(profile, acceptance=profile.acceptance + (row,))


# ---------------------------------------------------------------- resume
def _differences(old, new, names) -> list[str]:
    return [f"{name} {getattr(old, name)!r} there, {getattr(new, name)!r} now"
            for name in names if getattr(old, name) != getattr(new, name)]


def check_resumable(old: Profile, path: Path, device: DeviceInfo, target: ModelInfo, draft: ModelInfo) -> None:
    """Refuse to extend a profile of another pair, device or dtype; the message says what differs."""
    device_fields = ["kind", "name", "dtype", "execution"] + (["cpu_threads"] if device.kind == "cpu" else [])
    problems = _differences(old.device, device, device_fields)
    if problems:
        raise CalibrationError(f"--resume: {path} was measured on a different device ({'; '.join(problems)})")
    # parameters, weight_bytes and kv_bytes_per_token follow from these (and the dtype, compared above)
    shape_fields = ["model_type", "random_weights", "layers", "hidden_size", "heads", "kv_heads",
                    "head_dim", "intermediate_size", "vocab_size", "max_position_embeddings"]
    for role, old_info, new_info in (("target", old.target, target), ("draft", old.draft, draft)):
        # by content when both carry a fingerprint (the same model under another path spelling, from another
        # directory, is the same model); older profiles have only the path to go by
        identity = ["fingerprint"] if old_info.fingerprint and new_info.fingerprint else ["source"]
        problems = _differences(old_info, new_info, shape_fields)
        if identity == ["fingerprint"] and old_info.fingerprint != new_info.fingerprint:
            problems.insert(0, f"config or weights differ: {old_info.source} there (fingerprint "
                               f"{old_info.fingerprint[:12]}), {new_info.source} now ({new_info.fingerprint[:12]})")
        elif identity == ["source"]:
            problems = _differences(old_info, new_info, identity) + problems
        if problems:
            raise CalibrationError(f"--resume: {path} is for a different {role} ({'; '.join(problems)})")


def load_for_resume(path: Path) -> Profile:
    try:
        return load_profile(path)
    except PerfModelError as error:
        raise CalibrationError(f"--resume: {error}") from None


# ---------------------------------------------------------------- writing
def timings_csv(profile: Profile) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in profile.timings:
        values = asdict(row)
        writer.writerow({column: "" if values[column] is None else values[column] for column in CSV_COLUMNS})
    return buffer.getvalue()


def write_profile(path: Path, profile: Profile) -> None:
    """The JSON first (it is what --resume reads), then the CSV derived from it."""
    if not path.parent.is_dir():
        raise CalibrationError(f"--out {path}: directory {path.parent} does not exist")
    save_profile(path, profile)
    write_text_atomic(csv_path_for(path), timings_csv(profile))
