"""What `bench` shows: a progress bar, then measured vs predicted tokens/s per batch size and policy."""
from __future__ import annotations

from pathlib import Path

# `bench` with no options is a first look (about two minutes for the demo pair on 2 CPU cores, one thread);
# --full is the thorough run the README's results come from (about four times longer).
QUICK_RUN = {"batch_sizes": (1, 4, 16), "rounds": 3, "resolve_rounds": 10}
FULL_RUN = {"batch_sizes": (1, 2, 4, 8, 16, 32), "rounds": 5, "resolve_rounds": 30}


# Before a batch size is measured, its generation time is guessed from the nearest measured one as about
# proportional to 1 + b / 8 (the demo pair on a CPU: 0.35 s at b = 1, 2.1 s at b = 32); once two batch
# sizes are measured, from a line through them. It is an ETA, not a measurement.
UNMEASURED_BATCH_SCALE = 8
PROGRESS_LINE_EVERY_S = 10.0  # off a terminal: a progress line at most this often (and at every batch size)


class BenchClock:
    """The seconds each generation took per batch size, and the ETA of the planned generations left. Our
    policies run a round in lockstep and report it all at once, so the clock reads at the end of rounds:
    `observe` returns True when a record completes its round."""

    def __init__(self, contenders: dict[int, int], rounds: int, warmup_rounds: int, clock=None):
        import time

        self.clock = clock or time.monotonic
        self.contenders, self.rounds = dict(contenders), rounds
        self.planned = {b: n * (rounds + warmup_rounds) for b, n in contenders.items()}  # extra rounds not known
        self.started = self.last = self.clock()
        self.seconds = {b: 0.0 for b in contenders}
        self.done = {b: 0 for b in contenders}
        self._in_round: dict[tuple[int, int], int] = {}
        self._pending: dict[int, int] = {}  # generations reported since the last end of a round, per b

    def observe(self, batch_size: int, round_index: int) -> bool:
        key = (batch_size, round_index)
        self._in_round[key] = self._in_round.get(key, 0) + 1
        self._pending[batch_size] = self._pending.get(batch_size, 0) + 1
        expected = self.contenders.get(batch_size, 1) if round_index < self.rounds else 2  # extra: a pair
        if self._in_round[key] < expected:
            return False
        now = self.clock()
        self.seconds[batch_size] = self.seconds.get(batch_size, 0.0) + now - self.last
        self.done[batch_size] = self.done.get(batch_size, 0) + self._pending.pop(batch_size)
        self.last = now
        return True

    def elapsed_s(self) -> float:
        return self.clock() - self.started

    def per_generation_s(self, batch_size: int) -> float | None:
        measured = {b: self.seconds[b] / n for b, n in self.done.items() if n}
        if batch_size in measured:
            return measured[batch_size]
        if len(measured) >= 2:
            import numpy as np

            sizes = sorted(measured)
            slope, intercept = np.polyfit(np.array(sizes, dtype=float), [measured[b] for b in sizes], 1)
            return max(intercept + max(slope, 0.0) * batch_size, min(measured.values()))
        if measured:
            (b0, t0), = measured.items()
            return t0 * (1 + batch_size / UNMEASURED_BATCH_SCALE) / (1 + b0 / UNMEASURED_BATCH_SCALE)
        return None

    def eta_s(self) -> float | None:
        """Seconds the planned generations not yet done should take; None before the first round ends."""
        left = 0.0
        for b, planned in self.planned.items():
            if planned > self.done.get(b, 0):
                per = self.per_generation_s(b)
                if per is None:
                    return None
                left += (planned - self.done.get(b, 0)) * per
        return left


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def plan_line(plan) -> str:
    """The line said before measuring: what runs, how many generations, and how to run more or less."""
    config = plan.config
    policies = sorted({len(plan.contenders(b)) for b in config.batch_sizes})
    line = (f"bench: {plan.run_count()} generations of {config.max_new_tokens} new tokens per row at batch sizes "
            f"{', '.join(map(str, config.batch_sizes))} ({'-'.join(map(str, policies))} policies, "
            f"{config.rounds} rounds + {config.warmup_rounds} warm-up each)")
    if plan.table is not None and config.resolve_rounds:
        line += f", then up to {config.resolve_rounds} extra paired rounds per batch size while the regret is unsettled"
    quick = (tuple(config.batch_sizes) == QUICK_RUN["batch_sizes"] and config.rounds == QUICK_RUN["rounds"])
    return line + ("; the ETA follows the first generations" +
                   ("; --full for the thorough run" if quick else ""))


def bench_with_progress(config, models, token_prompts):
    """run_bench with its plan said up front, then a progress bar with the ETA on a terminal, or a progress
    line every PROGRESS_LINE_EVERY_S seconds (and at every batch size) off one."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    from specbatch.bench.harness import run_bench

    console = Console(stderr=True)
    columns = (TextColumn("[bold]bench"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"))
    state = {"clock": None, "said_s": None, "said_b": None}
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task("", total=None)

        def on_plan(plan):
            console.print(plan_line(plan), markup=False, highlight=False, soft_wrap=True)
            state["clock"] = BenchClock({b: len(plan.contenders(b)) for b in config.batch_sizes}, config.rounds,
                                        config.warmup_rounds)

        def on_run(record, done, total):
            clock = state["clock"]
            round_ended = clock.observe(record.batch_size, record.round)
            phase = ("warm-up" if record.warmup else f"round {record.round + 1}/{config.rounds}"
                     if record.round < config.rounds else f"extra paired round {record.round + 1 - config.rounds}")
            description = (f"b={record.batch_size} {phase} {record.policy}: {record.wall_tokens_per_s:.0f} tok/s; "
                           f"{_duration(clock.elapsed_s())} so far, ETA {_duration(clock.eta_s())}")
            progress.update(task, completed=done, total=total, description=description)
            now = clock.elapsed_s()
            if round_ended and not console.is_terminal and (
                    state["said_b"] != record.batch_size or now - state["said_s"] >= PROGRESS_LINE_EVERY_S):
                state["said_s"], state["said_b"] = now, record.batch_size
                console.print(f"bench: {done}/{total} generations, {description}", markup=False, highlight=False,
                              soft_wrap=True)

        return run_bench(config, models, token_prompts, on_run=on_run, on_plan=on_plan)


def _rate(rate: float | None) -> str:
    """Tokens/s for a narrow column: no decimals once the integer part says enough."""
    if rate is None:
        return "-"
    return f"{rate:.0f}" if rate >= 100 else f"{rate:.1f}"


def _relative(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.1f}%"


def render_bench(result, written: list[Path]) -> None:
    from specbatch.console.output import note_line, report_console
    from rich.table import Table

    from specbatch.bench.policies import TABLE_POLICY, fixed_policy_name
    from specbatch.bench.results import compared_rate

    console = report_console()
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
                  f"next prompts; wall tokens/s in bench.csv"
                  + ("; regret: the table against the best fixed k, paired per round, with its 95 % interval "
                     "(details below); speedup: the table over k = 0 in the steady state, and in brackets over whole "
                     "generate() calls (wall: prefill and the tail where rows that finished early leave the batch "
                     "included)" if has_table else ""),
                  markup=False, highlight=False)
    summary = Table()
    peer_columns = list(dict.fromkeys(f"{r.ours} / {r.theirs}" for batch in result.batches for r in batch.peer_ratios))
    headers = ["b", "k=0 tok/s", "best k: tok/s"]
    if has_table:
        headers += ["table k: tok/s", "regret [95 %]", "speedup (wall)"]
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
            row += [f"{shown.k}: {_rate(compared_rate(shown))}", _regret_cell(batch),
                    f"{batch.table_speedup:.2f}x ({wall_speedup:.2f}x)"]
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
                             f"{_policy_text(best['policy'])}: {_rate(best['steady_tokens_per_s'])} "
                             f"({best['vs_plain']:.2f}x, {best['vs_best_chain']:.2f}x)")
            side.add_row(str(batch.batch_size), *cells)
        console.print(side)
    if any("tree" in (p.strategy or "") for batch in result.batches for p in batch.policies):
        from specbatch.console.explain import TREE_LEGEND

        console.print(TREE_LEGEND, markup=False, highlight=False)
    _render_adaptive(console, result.batches)
    from specbatch.console.explain import render_bench_fidelity

    render_bench_fidelity(console, result.batches)
    if result.vllm is not None:
        from specbatch.bench.vllm.compare import render

        console.print(render(result.vllm), markup=False, highlight=False, soft_wrap=True)
    for note in result.notes:
        console.print(note_line(note), markup=False, highlight=False)
    console.print(f"wrote {', '.join(str(path) for path in written)}", markup=False, highlight=False)


def _regret_cell(batch) -> str:
    """The paired regret with its interval (the figure bench settles on); the medians' regret only where
    no round paired the table with a fixed k."""
    paired = batch.paired_regret
    if paired:
        low, high = paired["ci95"]
        return f"{100 * paired['regret']:.1f}% [{100 * low:.1f}, {100 * high:.1f}]"
    return f"{100 * batch.table_regret:.1f}% (medians)"


def _policy_text(name: str, width: int = 28) -> str:
    """A policy name for a narrow cell: a tree as its size and depth ('tree:8 nodes, 7 deep+ngram')."""
    from specbatch.bench.policies import STAGED_SUFFIX, TREE_PREFIX

    if name.startswith(TREE_PREFIX) and not name.startswith(TREE_PREFIX + "chain:"):
        from specbatch.perfmodel.tree import parse_tree

        spec = name.removeprefix(TREE_PREFIX).removesuffix(STAGED_SUFFIX)
        if "..." not in spec:
            tree = parse_tree(spec)
            name = f"{TREE_PREFIX}{tree.num_nodes} nodes, {tree.depth} deep" + (
                STAGED_SUFFIX if name.endswith(STAGED_SUFFIX) else "")
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
