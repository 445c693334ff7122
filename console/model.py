"""What `fit`, `table` and `query` print: fitted parameters and errors, the table's runs, one point's trade-off."""
from __future__ import annotations

from pathlib import Path


def render_sources(console, choice, holdout: bool) -> None:
    """Every timing source's step error (perfmodel.sources), and with --holdout its held-out pass and step
    MAPE per batch size."""
    from rich.table import Table

    view = Table(title=f"timing source: {choice.chosen} (lowest {choice.criterion}; measured steps)")
    for column in ("source", "rows (target, draft)", "step MAPE", "held-out step MAPE"):
        view.add_column(column, justify="right")
    for r in choice.reports:
        held = "-" if r.heldout_step_mape_pct is None else f"{r.heldout_step_mape_pct:.1f}%"
        view.add_row(r.source, f"{r.points['target']}, {r.points['draft']}", f"{r.step_mape_pct:.1f}%", held,
                     style="bold green" if r.source == choice.chosen else None)
    console.print(view)
    if not holdout:
        return
    pct = lambda value: "-" if value is None else f"{value:.1f}%"  # noqa: E731
    per_b = Table(title="held-out MAPE per batch size (refitted without the source's rows at b)")
    for column in ("source", "b", "steps", "step MAPE", "pass MAPE", "pass MAPE, in-situ rows"):
        per_b.add_column(column, justify="right")
    for r in choice.reports:
        for e in r.by_batch_size:
            per_b.add_row(r.source, str(e.batch_size), str(e.steps), pct(e.step_mape_pct), pct(e.pass_mape_pct),
                          pct(e.insitu_pass_mape_pct))
    console.print(per_b)


def fit_json(fitted, output: Path) -> dict:
    """What `fit --json` prints: each role's fitted parameters and errors (not its points), the timing source
    chosen and the step correction."""
    from specbatch.perfmodel.model import model_to_json

    roles = {role: {key: value for key, value in obj.items() if key != "points"}
             for role, obj in model_to_json(fitted)["roles"].items()}
    source = None if fitted.timing_source is None else fitted.timing_source.to_json()
    correction = None if fitted.step_correction is None else fitted.step_correction.to_json()
    engine = None if fitted.engine is None else {k: v for k, v in fitted.engine.to_json().items() if k != "points"}
    return {"model": str(output), "roles": roles, "timing_source": source, "step_correction": correction,
            "coverage": None if fitted.coverage is None else fitted.coverage.to_json(),
            "engine_steps": engine}


def render_fit(fitted, output: Path, holdout: bool = False, noise=None) -> None:
    """`noise`: the profile's perfmodel.profile.noise.NoiseFigure, when it has one: its floor is printed beside the
    errors."""
    from specbatch.console.output import report_console
    from rich.table import Table

    console = report_console()
    console.print(f"[bold]{fitted.device.name}[/] ({fitted.device.kind}, {fitted.device.dtype}): "
                  f"target {fitted.target_info.source}, draft {fitted.draft_info.source}")
    for role, fit in fitted.roles.items():
        model, shape = fit.model, fit.model.shape
        params = Table(title=f"{role}: {fit.kind} ({len(fit.points)} points)", show_header=False)
        params.add_row("overhead_ms", f"{model.roofline.overhead_ms:.4g}")
        params.add_row("bandwidth_GBps", f"{model.roofline.bandwidth_GBps:.4g}")
        params.add_row("flops_TFLOPs", f"{model.roofline.flops_TFLOPs:.4g}")
        params.add_row("overlap_exponent", f"{model.roofline.overlap_exponent:.3g}")
        params.add_row("ridge_tokens (b*n)", f"{model.roofline.ridge_tokens(shape):.4g}")
        params.add_row("memory-bound share of points", f"{fit.memory_bound_share:.0%}")
        if shape.experts is not None:  # a mixture of experts: what its passes read (perfmodel.experts)
            experts, routing = shape.experts, shape.routing
            params.add_row("experts (routed layers x experts, top-k)",
                           f"{experts.moe_layers} x {experts.num_experts}, top-{experts.experts_per_token}")
            params.add_row("routing", routing.describe()
                           + ("" if routing.cv_mape_pct is None else f", cross-validated {routing.cv_mape_pct:.1f} %"))
            params.add_row("experts touched a layer at b*n = 1, 4, 32, 256",
                           ", ".join(f"{float(routing.distinct(experts, t, 1)):.1f}" for t in (1, 4, 32, 256)))
        if model.staircase is not None:  # the kernel steps found (perfmodel.staircase)
            steps = model.staircase.steps
            tokens = sum(s.axis == "tokens" for s in steps)
            params.add_row("kernel steps: in tokens, in rows", f"{tokens}, {len(steps) - tokens} "
                           f"({sum(not s.sharp for s in steps)} across unresolved gaps)")
            params.add_row("tile_tokens", str(model.staircase.tile_tokens() or "-"))
        for kind, value in fit.cv_mape_pct.items():
            params.add_row(f"cross-validated MAPE, {kind}", f"{value:.2f}%")
        params.add_row("in-sample MAPE (chosen)", f"{fit.in_sample_mape_pct:.2f}%")
        if fit.holdout is not None:
            h = fit.holdout
            left_out = f"b in {list(h.held_out_batch_sizes)}, L in {list(h.held_out_context_lens)}"
            params.add_row("held-out MAPE", f"{h.mape_pct:.2f}% (max {h.max_error_pct:.1f}%; {h.test_points} points "
                                            f"with {left_out}; {h.kind} chosen on the rest)")
        if fit.infeasible_rows:
            params.add_row("out-of-memory rows (not fitted)", str(fit.infeasible_rows))
        console.print(params)
        worst = fit.holdout.worst if fit.holdout is not None else fit.worst
        points = Table(title=f"{role}: worst {'held-out' if fit.holdout is not None else 'in-sample'} points")
        for column in ("b", "n", "L", "measured ms", "predicted ms", "error"):
            points.add_column(column, justify="right")
        for p in worst:
            points.add_row(str(p.batch_size), str(p.new_tokens), str(p.context_len), f"{p.measured_ms:.4g}",
                           f"{p.predicted_ms:.4g}", f"{p.error_pct:+.1f}%")
        console.print(points)
        for note in fit.notes:
            console.print(f"[yellow]note:[/] {role}: {note}")
    for line in [] if fitted.engine is None else fitted.engine.report_lines():
        console.print(line, markup=False, highlight=False)
    if fitted.timing_source is not None:
        render_sources(console, fitted.timing_source, holdout)
    if fitted.step_correction is not None:
        console.print(f"[yellow]note:[/] {fitted.step_correction.note()}")
    if noise is not None:
        console.print(f"noise floor: the reference pass ({noise.reference}), timed {len(noise.checks)} times during "
                      f"calibration, lay {100 * noise.floor_mape:.1f} % from its own median on average: a MAPE "
                      f"near that is the machine's, not the model's")
    if not fitted.overhead.measured and fitted.engine is None:
        console.print("[yellow]note:[/] the profile has no step-overhead rows: overhead taken as 0 ms")
    if fitted.composition is not None:
        from rich.markup import escape

        console.print(f"[yellow]note:[/] {escape(fitted.composition.summary())}", highlight=False)
    if not fitted.acceptance:
        console.print("[yellow]note:[/] the profile has no acceptance: `table` and `query` will need --acceptance")
    console.print(f"wrote {output}")


def render_table(result, notes: list[str], output: Path) -> None:
    from specbatch.console.output import report_console
    from rich.table import Table

    console = report_console()
    acc = result.acceptance
    console.print(f"acceptance ({acc['source']}): per position {acc['per_position']}, "
                  f"constant-alpha fit {acc['constant_alpha']:.3f} (rmse {acc['constant_alpha_rmse']:.3f})")
    if len(result.buckets) > 1:
        console.print(_bucket_matrix(result))
    for bucket in result.buckets if len(result.buckets) == 1 else ():
        view = Table(title=f"best strategy per batch size, context {bucket.context_len} (runs collapsed)")
        experts = bucket.entries[0].experts_touched is not None  # a mixture of experts: its verify pass's experts
        for column in ("b", "strategy", "k*", "tokens/s", "speedup vs k=0", "runner-up", "min margin") + (
                ("experts/layer (verify)",) if experts else ()):
            view.add_column(column, justify="right")
        runs: list[list] = []
        for entry in bucket.entries:  # consecutive batch sizes with the same strategy form one row
            if runs and runs[-1][-1].chosen() == entry.chosen():
                runs[-1].append(entry)
            else:
                runs.append([entry])
        for run in runs:
            start, end, strategy = run[0].batch_size, run[-1].batch_size, run[0].chosen()
            margins = [e.margin for e in run if e.margin is not None]
            runner_ups = list(dict.fromkeys(e.runner_up_strategy.describe(24) if e.runner_up_strategy is not None
                                            else f"k={e.runner_up_k}" for e in run if e.runner_up_k is not None))
            view.add_row(str(start) if start == end else f"{start}-{end}", strategy.describe(40), str(strategy.k),
                         _span(run[0].predicted_tokens_per_s, run[-1].predicted_tokens_per_s, "{:.0f}"),
                         _span(run[0].predicted_speedup, run[-1].predicted_speedup, "{:.2f}x"),
                         "; ".join(runner_ups[:2]) or "-", f"{min(margins):.1%}" if margins else "-",
                         *((_span(run[0].experts_touched, run[-1].experts_touched, "{:.1f}"),) if experts else ()))
        console.print(view)
    for note in notes:
        console.print(f"[yellow]note:[/] {note}")
    console.print(f"wrote {output}")


def _bucket_matrix(result):
    """A table of several context buckets: one row per run of batch sizes over which no bucket's choice
    changes, one column per bucket (predicted goodputs are in the JSON and CSV, and `query --table`)."""
    from rich.table import Table

    columns = [[entry.chosen() for entry in bucket.entries] for bucket in result.buckets]
    view = Table(title="best k per batch size (rows, b) and context length (columns), runs collapsed; "
                       "+ng: the n-gram second stage, tN: a tree of N nodes")
    view.add_column("b", justify="right")
    for bucket in result.buckets:
        view.add_column(str(bucket.context_len), justify="right")
    max_batch = min(len(column) for column in columns)
    start = 1
    for b in range(1, max_batch + 1):
        if b == max_batch or any(column[b] != column[b - 1] for column in columns):
            view.add_row(str(start) if start == b else f"{start}-{b}",
                         *(_short_name(column[b - 1]) for column in columns))
            start = b + 1
    return view


def _short_name(strategy) -> str:
    """'0', '4', '7+ng', 't5+ng' (a tree's node count): a matrix cell."""
    if strategy.kind == "none":
        return "0"
    text = str(strategy.k) if strategy.kind == "chain" else f"t{strategy.tree.num_nodes}"
    return text + ("+ng" if strategy.stage2 else "")


def _span(first: float, last: float, fmt: str) -> str:
    return fmt.format(first) if fmt.format(first) == fmt.format(last) else f"{fmt.format(first)}-{fmt.format(last)}"


def render_query(answer: dict, notes: list[str]) -> None:
    from specbatch.console.output import report_console
    from rich.table import Table

    with_strategies = "strategy" in answer["candidates"][0]
    title = f"batch size {answer['batch_size']}, context {answer['context_len']}: best k = {answer['best_k']}"
    if with_strategies:
        ranked = sorted(answer["candidates"], key=lambda c: -(c["tokens_per_s"] or 0))
        title = f"batch size {answer['batch_size']}, context {answer['context_len']}: best {ranked[0]['strategy']}"
    view = Table(title=title)
    first = "strategy" if with_strategies else "k"
    for column in (first, "step ms", "tokens per step (per sequence)", "tokens/s (batch)"):
        view.add_column(column, justify="right")
    for i, c in enumerate(answer["candidates"]):
        cells = [f"{c[key]:.4g}" if c[key] is not None else "-"
                 for key in ("step_ms", "tokens_per_step", "tokens_per_s")]
        is_best = (c["strategy"] == ranked[0]["strategy"]) if with_strategies else c["k"] == answer["best_k"]
        view.add_row(c["strategy"] if with_strategies else str(c["k"]), *cells, style="bold green" if is_best else None)
    console = report_console()
    console.print(view)
    for note in notes:
        console.print(f"[yellow]note:[/] {note}")
