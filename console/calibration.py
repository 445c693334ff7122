"""What `calibrate` shows: a progress bar while it measures, then the passes and acceptance."""
from __future__ import annotations

import time

import typer


def estimate_line(points: int, estimated_s: float, max_seconds: float | None, quick: bool = False) -> str:
    """The one line said before measuring: how many points and about how long, and what to do about it (a run
    already --quick is not told to add it)."""
    line = (f"calibrate: {points} points to measure, about {estimated_s:.0f} s by the repetition budgets "
            "(longer when passes are slow: large models, a busy machine; the ETA follows)")
    if max_seconds is not None and estimated_s > max_seconds:
        smaller = ("" if quick else "--quick, ") + "fewer --batch-sizes or --context-lens, a lower --max-k"
        line += (f"; --max-seconds {max_seconds:g} will stop it early with the profile saved (--resume continues), "
                 f"or try a smaller grid: {smaller}")
    return line


def progress_line(done: int, total: int, label: str, elapsed_s: float) -> str:
    """Off a terminal, where no bar is drawn: what the bar would say, the ETA by the pace so far."""
    from .bench import _duration

    eta = elapsed_s / done * (total - done) if done else None
    return f"calibrate: {done}/{total} points, {label}; {_duration(elapsed_s)} so far, ETA {_duration(eta)}"


def calibrate_with_progress(request, show: bool, run=None, quick: bool | None = None, clock=time.monotonic):
    """`run(request, on_progress, on_estimate=, on_notice=)`: calibrate.run.calibrate unless given. A progress
    bar with the ETA on a terminal, else a progress line every PROGRESS_LINE_EVERY_S seconds (and the last), as
    bench's. `quick`: whether the grid is --quick's (default: the request's own `quick`)."""
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from .bench import PROGRESS_LINE_EVERY_S

    if run is None:
        from specbatch.calibrate.run import calibrate as run
    if not show:
        return run(request, on_notice=lambda line: typer.echo(line, err=True))
    quick = getattr(request, "quick", False) if quick is None else quick
    console = Console(stderr=True)
    columns = (TextColumn("[bold]calibrate"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.description}"))
    started_s, said_s = clock(), None
    # a long speed window: points can take minutes each, and a short window leaves the ETA at -:--:--
    with Progress(*columns, console=console, transient=True, speed_estimate_period=3600,
                  disable=not console.is_terminal) as progress:
        task = progress.add_task("checking inputs, loading models", total=None)

        def on_progress(event):
            nonlocal said_s
            progress.update(task, completed=event.done, total=event.total, description=event.label)
            now = clock()
            if not console.is_terminal and (said_s is None or now - said_s >= PROGRESS_LINE_EVERY_S
                                            or event.done == event.total):
                said_s = now
                console.print(progress_line(event.done, event.total, event.label, now - started_s), markup=False,
                              highlight=False, soft_wrap=True)

        def on_estimate(points: int, estimated_s: float):
            console.print(estimate_line(points, estimated_s, request.max_seconds, quick), markup=False,
                          highlight=False, soft_wrap=True)

        def on_notice(line: str):
            console.print(line, markup=False, highlight=False, soft_wrap=True)

        try:
            return run(request, on_progress, on_estimate=on_estimate, on_notice=on_notice)
        except KeyboardInterrupt:
            progress.stop()
            typer.echo(f"interrupted: every point measured so far is in {request.out}; "
                       f"rerun with --resume to measure the rest", err=True)
            raise typer.Exit(130)


def calibrate_vllm(target: str, draft: str, out, prompts, batch_sizes, context_lens, max_k: int, quick: bool,
                   threads, resume: bool, force: bool, max_seconds, json_output: bool) -> None:
    """`calibrate --engine vllm`: vLLM's workers (bench.vllm.worker) handed to calibrate.vllm_steps."""
    import json
    import tempfile
    from functools import partial
    from pathlib import Path

    from specbatch.bench.vllm.worker import VllmWorker, vllm_missing
    from specbatch.calibrate import grid
    from specbatch.calibrate.vllm_steps import DEFAULT_SWEEPS, EngineCalibrationRequest, calibrate_engine

    from specbatch.perfmodel.errors import UsageError

    if threads is not None and threads < 1:
        raise UsageError(f"--threads must be >= 1, got {threads}")
    request = EngineCalibrationRequest(
        target=target, draft=draft, out=Path(out), prompts=Path(prompts),
        batch_sizes=tuple(batch_sizes or (grid.QUICK_BATCH_SIZES if quick else grid.DEFAULT_BATCH_SIZES)),
        context_lens=tuple(context_lens or (grid.QUICK_CONTEXT_LENS if quick else grid.DEFAULT_CONTEXT_LENS)),
        max_k=max_k, threads=threads, sweeps=2 if quick else DEFAULT_SWEEPS, resume=resume, force=force,
        max_seconds=max_seconds)
    logs = Path(tempfile.mkdtemp(prefix="specbatch-vllm-"))  # kept: an error names the worker's log in it

    def start_worker(name: str, speculative_config):
        return VllmWorker(name, Path(target), max(request.batch_sizes), speculative_config, logs, threads)

    engine_run = partial(calibrate_engine, start_worker=start_worker, engine_missing=vllm_missing)
    summary = calibrate_with_progress(request, show=not json_output, quick=quick, run=engine_run)
    if json_output:
        typer.echo(json.dumps(summary.to_json()))
        return
    render_calibration(summary)


def render_calibration(summary) -> None:
    from specbatch.console.output import report_console
    from rich.markup import escape
    from rich.table import Table

    console = report_console()
    console.print(f"[bold]{escape(summary.target)}[/] + [bold]{escape(summary.draft)}[/] on "
                  f"{escape(summary.device)} ({summary.dtype})")
    passes = Table(title="one forward pass, median ms")
    for column in ("model", "batch size", "new tokens", "context", "ms"):
        passes.add_column(column, justify="right")
    for row in summary.passes:
        ms = "out of memory" if row.median_ms is None else f"{row.median_ms:.3g}"
        passes.add_row(row.model, str(row.batch_size), str(row.new_tokens), str(row.context_len), ms)
    if summary.passes:
        console.print(passes)
    for entry in summary.acceptance:
        alphas = ", ".join(f"{alpha:.3f}" for alpha in entry.per_position)
        console.print(f"acceptance per draft position ({entry.setting}, {entry.source}): {alphas}")
    counts = f"{summary.points_measured} points measured in {summary.elapsed_s:.1f} s"
    if summary.points_resumed:
        counts += f", {summary.points_resumed} kept from the previous run"
    if summary.points_infeasible:
        counts += f", {summary.points_infeasible} out of memory"
    if summary.points_skipped:
        counts += f", {summary.points_skipped} skipped before measuring (they cannot fit in memory)"
    if summary.noise is not None:
        counts += (f"; noise (reference pass): drift ±{100 * summary.noise['drift']:.1f} %, "
                   f"jitter ±{100 * summary.noise['jitter']:.1f} %")
    console.print(counts)
    if summary.engine_steps:
        console.print(f"{summary.engine}: {summary.engine_steps} step rows (each configuration's decode steps over "
                      "the full batch, per sweep); `specbatch fit` fits its step model", markup=False, highlight=False)
    if summary.insitu_steps:
        console.print(f"in-situ: {summary.insitu_passes} pass rows and {summary.insitu_steps} step rows timed inside "
                      "real speculative steps (`specbatch fit` chooses between them and the isolated passes)",
                      markup=False, highlight=False)
    if summary.stopped_by_max_seconds:
        console.print(f"stopped after --max-seconds {summary.max_seconds:g}: {summary.points_left} points left; "
                      f"rerun with --resume to measure them", markup=False, highlight=False)
    for warning in summary.warnings:
        console.print(warning, style="bold yellow", markup=False, highlight=False)
    console.print(f"wrote {summary.profile_path} and {summary.csv_path}", markup=False, highlight=False)


def calibrate_from_vidur(folder, draft_folder, target, draft, acceptance, batch_sizes, context_lens, max_k, out,
                         force, ignored: list[str], json_output: bool) -> None:
    """`calibrate --from-vidur`: check what does not apply to composing (nothing is timed), compose, report."""
    import json

    from specbatch.calibrate.vidur import VidurRequest, import_vidur
    from specbatch.console.options import parse_int_list
    from specbatch.perfmodel.errors import UsageError

    if folder is None:
        raise UsageError("--draft-from-vidur needs --from-vidur (the target's folder)")
    if ignored:
        raise UsageError(f"--from-vidur times nothing: {', '.join(ignored)} do(es) not apply")
    if target is None or draft is None or acceptance is None:
        raise UsageError("--from-vidur needs --target and --draft (presets or config.json: the shapes vidur's "
                         "block times are composed for) and --acceptance (nothing measures it)")
    request = VidurRequest(folder=folder, target=target, draft=draft, acceptance=acceptance, out=out,
                           draft_folder=draft_folder,
                           batch_sizes=tuple(parse_int_list("--batch-sizes", batch_sizes) or ()) or None,
                           context_lens=tuple(parse_int_list("--context-lens", context_lens) or ()) or None,
                           max_k=max_k, force=force)
    result = import_vidur(request)
    grid = result.profile.grid
    summary = {"profile_path": str(out), "rows": result.rows, "padded_rows": result.padded_rows,
               "missing_rows": result.missing_rows, "batch_sizes": [min(grid.batch_sizes), max(grid.batch_sizes)],
               "context_lens": list(grid.context_lens), "composition": result.profile.composition.to_json()}
    if json_output:
        typer.echo(json.dumps(summary))
        return
    composition = result.profile.composition
    files = ", ".join(f.path for f in composition.files)
    typer.echo(f"composed {result.rows} passes from {composition.source} ({files}): batch sizes "
               f"{grid.batch_sizes[0]}-{grid.batch_sizes[-1]}, contexts "
               f"{', '.join(map(str, grid.context_lens))}")
    if result.padded_rows:
        typer.echo(f"{result.padded_rows} of them at a token count vidur did not profile: linear operations read at "
                   "the next profiled count")
    if result.missing_rows:
        typer.echo(f"{result.missing_rows} (b, n, L) points have no vidur data (not in the profile)")
    typer.echo(f"left out: {'; '.join(composition.left_out)}")
    typer.echo(f"wrote {out} and {out.with_suffix('.csv')}")
