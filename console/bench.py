"""What `bench` shows: a progress bar, then measured vs predicted tokens/s per batch size and policy."""
from __future__ import annotations

from pathlib import Path


def bench_with_progress(config, models, token_prompts):
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
    )

    from specbatch.bench.harness import run_bench

    columns = (TextColumn("[bold]bench"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
               TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("", total=None)

        def on_run(record, done, total):
            phase = ("warm-up" if record.warmup else f"round {record.round + 1}/{config.rounds}"
                     if record.round < config.rounds else f"extra paired round {record.round + 1 - config.rounds}")
            progress.update(task, completed=done, total=total,
                            description=f"b={record.batch_size} {phase} {record.policy}: "
                                        f"{record.wall_tokens_per_s:.0f} tok/s")

        return run_bench(config, models, token_prompts, on_run=on_run)


def _rate(rate: float | None) -> str:
    """Tokens/s for a narrow column: no decimals once the integer part says enough."""
    if rate is None:
        return "-"
    return f"{rate:.0f}" if rate >= 100 else f"{rate:.1f}"


def _relative(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.1f}%"


def render_bench(result, written: list[Path]) -> None:
    from rich.console import Console
    from rich.table import Table

    from specbatch.bench.policies import TABLE_POLICY, fixed_policy_name
    from specbatch.bench.results import compared_rate

    console = Console()
    config = result.config
    has_table, has_model = config.table_path is not None, config.model_path is not None
    # the label and the settings are lines of their own: a table title or caption wraps to the table's width
    if result.synthetic:
        console.print(result.synthetic, style="bold red", markup=False, highlight=False)
    console.print(f"bench: {result.models['target']['source']} + {result.models['draft']['source']} on "
                  f"{result.device['kind']} ({result.device['name']}), {config.sampling.describe()}, "
                  f"{config.max_new_tokens} new tokens per row; tokens/s: steady-state goodput "
                  f"(steps with the full batch: "
                  f"all passes and overhead, no prefill), median of {config.rounds} interleaved rounds, each on the "
                  f"next prompts; wall tokens/s in bench.csv; regret = 1 - table / best fixed k",
                  markup=False, highlight=False)
    summary = Table()
    peer_columns = list(dict.fromkeys(f"{r.ours} / {r.theirs}" for batch in result.batches for r in batch.peer_ratios))
    headers = ["b", "k=0 tok/s", "best k: tok/s"]
    if has_table:
        headers += ["table k: tok/s", "regret", "speedup"]
    if has_model:
        headers += ["predicted vs steady (table k)" if has_table else "predicted vs steady (best k)", "error"]
    for header in headers + peer_columns:
        summary.add_column(header, justify="right")
    for batch in result.batches:
        plain = batch.policy(fixed_policy_name(0))
        shown = batch.policy(fixed_policy_name(batch.best_k))
        row = [str(batch.batch_size), _rate(compared_rate(plain)), f"{batch.best_k}: {_rate(compared_rate(shown))}"]
        if has_table:
            shown = batch.policy(TABLE_POLICY)
            wall_speedup = shown.median_wall_tokens_per_s / plain.median_wall_tokens_per_s
            row += [f"{shown.k}: {_rate(compared_rate(shown))}", f"{100 * batch.table_regret:.1f}%",
                    f"{batch.table_speedup:.2f}x (wall {wall_speedup:.2f}x)"]
        if has_model:
            predicted, steady = shown.predicted_tokens_per_s, shown.median_steady_tokens_per_s
            row += [f"{_rate(predicted)} vs {_rate(steady)}", _relative(shown.prediction_error)]
        ratios = {f"{r.ours} / {r.theirs}": r.ratio for r in batch.peer_ratios}
        row += [f"{ratios[c]:.2f}x" if c in ratios else "-" for c in peer_columns]
        summary.add_row(*row)
    console.print(summary)
    if has_model:
        checked = any(batch.machine_speed for batch in result.batches)
        speed_note = "; the reference pass's time during the rounds / during calibration (bench.speed)"
        errors = Table(title="prediction error: predicted / measured - 1 (steady-state tokens/s: full-batch steps; "
                             "each round predicted at its own context, geometric mean over rounds)"
                             + (speed_note if checked else ""))
        names = [p.policy for p in result.batches[0].policies if p.predicted_tokens_per_s is not None]
        for header in ["b", *(["reference pass vs calibration"] if checked else []), *names]:
            errors.add_column(header, justify="right")
        for batch in result.batches:
            cells = []
            for name in names:
                policy = batch.policy(name)
                cells.append(_relative(policy.prediction_error if policy else None))
            speed = batch.machine_speed
            slowdown = [] if not checked else ["-" if not speed else f"{speed['slowdown']:.2f}x"]
            errors.add_row(str(batch.batch_size), *slowdown, *cells)
        console.print(errors)
    comparisons = [batch for batch in result.batches
                   if batch.strategy_comparison and (batch.strategy_comparison.get("best_tree")
                                                     or batch.strategy_comparison.get("best_staged"))]
    if comparisons:
        side = Table(title="chain vs tree vs staged: steady tokens/s (x plain decoding, x best chain)")
        for header in ("b", "best chain", "best tree", "best staged"):
            side.add_column(header, justify="right")
        for batch in comparisons:
            cells = []
            for key in ("best_chain", "best_tree", "best_staged"):
                best = batch.strategy_comparison.get(key)
                cells.append("-" if best is None else
                             f"{_short_policy(best['policy'])}: {_rate(best['steady_tokens_per_s'])} "
                             f"({best['vs_plain']:.2f}x, {best['vs_best_chain']:.2f}x)")
            side.add_row(str(batch.batch_size), *cells)
        console.print(side)
    _render_adaptive(console, result.batches)
    from specbatch.console.explain import render_bench_fidelity

    render_bench_fidelity(console, result.batches)
    if result.vllm is not None:
        from specbatch.bench.vllm.compare import render

        console.print(render(result.vllm), markup=False, highlight=False, soft_wrap=True)
    for note in result.notes:
        console.print(f"note: {note}", markup=False, highlight=False)
    console.print(f"wrote {', '.join(str(path) for path in written)}", markup=False, highlight=False)


def _short_policy(name: str, width: int = 28) -> str:
    return name if len(name) <= width else name[:width - 3] + "..."


def _ratio_cell(found) -> str:
    """A paired ratio with its interval ('1.04x [0.99, 1.09]'), '-' when absent."""
    if not found or "ratio" not in found:
        return "-"
    return f"{found['ratio']:.3f}x [{found['ci95'][0]:.3f}, {found['ci95'][1]:.3f}]"


def _render_adaptive(console, batches) -> None:
    """The adaptive policy against the table and the best fixed k, paired per round (bench.regret)."""
    from rich.table import Table

    compared = [b for b in batches if b.adaptive]
    if not compared:
        return
    phases = any("vs_table_by_phase" in b.adaptive for b in compared)
    table = Table(title="adaptive, paired per round (geometric mean of adaptive / other, steady state), bootstrap "
                        "95 %; its decisions' share of its steps' time")
    headers = ["b", "rounds", "/ table", *(["/ table, first phase", "/ table, second phase"] if phases else []),
               "/ best fixed k", "decisions, median [max]"]
    for header in headers:
        table.add_column(header, justify="right")
    for batch in compared:
        found = batch.adaptive
        share = found.get("decision_share")
        by_phase = found.get("vs_table_by_phase") or {}
        best = found["vs_best_fixed"]
        table.add_row(str(batch.batch_size), str(best.get("rounds", "-")), _ratio_cell(found.get("vs_table")),
                      *([_ratio_cell(by_phase.get("first")), _ratio_cell(by_phase.get("second"))] if phases else []),
                      f"{_ratio_cell(best)} ({best['against']})",
                      "-" if not share else f"{100 * share['median']:.1f}% [{100 * share['max']:.1f}%]")
    console.print(table)
