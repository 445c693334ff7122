"""What `generate` and the demo print: the texts, the step statistics, acceptance per position."""
from __future__ import annotations


def render_generation(outputs: list[dict], stats, policy_name: str, sampling_name: str) -> None:
    from collections import Counter

    from specbatch.console.output import report_console
    from rich.table import Table

    console = report_console()
    for i, out in enumerate(outputs):
        console.rule(f"[bold]prompt {i + 1}")
        console.print(out["prompt"], end="", style="dim", markup=False, highlight=False)
        console.print(out["text"], markup=False, highlight=False)
    summary = Table(title=f"generation stats ({policy_name}, {sampling_name})", show_header=False)
    summary.add_row("generated tokens", str(stats.generated_tokens))
    summary.add_row("steps", str(stats.steps))
    summary.add_row("mean tokens per row-step", f"{stats.tokens_per_step:.2f}")
    summary.add_row("tokens/s (wall, incl. prefill)", f"{stats.wall_tokens_per_s:.1f}")
    summary.add_row("time: prefill / total (s)", f"{stats.prefill_s:.3f} / {stats.total_s:.3f}")
    histogram = Counter(stats.k_per_step)
    summary.add_row("k histogram (k: steps)", ", ".join(f"{k}: {n}" for k, n in sorted(histogram.items())))
    console.print(summary)
    if stats.trials_per_position:
        acceptance = Table(title="acceptance per draft position")
        for column in ("position", "accepted", "trials", "rate"):
            acceptance.add_column(column, justify="right")
        for i, (a, t) in enumerate(zip(stats.accepted_per_position, stats.trials_per_position), start=1):
            acceptance.add_row(str(i), str(a), str(t), f"{a / t:.3f}" if t else "-")
        console.print(acceptance)
