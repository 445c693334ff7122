"""What a bench run leaves on disk: bench.json (`specbatch.bench/1`), bench.csv and two PNG plots.

Every file is written atomically (`perfmodel.jsonio.write_bytes_atomic`). The CSV holds numbers only
(an empty cell means not applicable); new columns are appended, so readers by position keep working.
"""
from __future__ import annotations

import csv
import io
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from specbatch.perfmodel.jsonio import make_dir, write_bytes_atomic

from .policies import STAGED_SUFFIX, TABLE_POLICY, TREE_PREFIX, fixed_policy_name, policy_family
from .results import BenchResult, PolicyResult, compared_rate

BENCH_SCHEMA = "specbatch.bench/1"
# columns are only ever appended: readers by position keep working
CSV_COLUMNS = ("batch_size", "policy", "k", "median_wall_tokens_per_s", "p10_wall_tokens_per_s",
               "p90_wall_tokens_per_s", "rounds", "acceptance", "median_steady_tokens_per_s", "predicted_tokens_per_s",
               "synthetic_acceptance", "strategy", "prediction_error")


def bench_json(result: BenchResult) -> dict[str, Any]:
    """The `specbatch.bench/1` document."""
    config = result.config
    config_json = {
        "batch_sizes": list(config.batch_sizes), "ks": list(config.fixed_ks), "max_new_tokens": config.max_new_tokens,
        "rounds": config.rounds, "warmup_rounds": config.warmup_rounds, "sampling": config.sampling.describe(),
        "synthetic_acceptance": config.synthetic_acceptance, "seed": config.seed,
        "table": str(config.table_path) if config.table_path else None,
        "model": str(config.model_path) if config.model_path else None, "peers": list(config.peers),
        "trees": list(config.trees), "stage2": str(config.stage2_path) if config.stage2_path else None,
        "adaptive": str(config.adaptive_path) if config.adaptive_path else None, "workload": config.workload,
        "second_prompts": str(config.second_prompts_path) if config.second_prompts_path else None,
        "interleave": config.interleave,
        "eos": "ignored: every row generates max_new_tokens",
        "wall_tokens_per_s": "generated tokens / wall seconds of one generate() call, prefill and overhead included",
    }
    batches = []
    for batch in result.batches:
        entry = asdict(batch)
        for policy, source in zip(entry["policies"], batch.policies):
            policy["rounds"] = source.rounds
        batches.append(entry)
    runs = [{"order": i, "batch_size": r.batch_size, "round": r.round, "warmup": r.warmup, "policy": r.policy,
             "generated_tokens": r.generated_tokens, "seconds": r.seconds, "wall_tokens_per_s": r.wall_tokens_per_s,
             "steady_tokens_per_s": r.steady_tokens_per_s, "context_len": r.context_len, "step_seconds": r.step_seconds,
             "decision_seconds": r.decision_seconds, "k_counts_full_batch": r.k_counts_full_batch}
            for i, r in enumerate(result.runs)]
    return {"schema": BENCH_SCHEMA, "synthetic": result.synthetic, "interrupted": result.interrupted,
            "config": config_json, "device": result.device,
            "models": result.models, "prompts": result.prompts, "batch_sizes": batches, "runs": runs,
            "notes": result.notes, "vllm": asdict(result.vllm) if result.vllm is not None else None}


def bench_csv(result: BenchResult) -> str:
    """One row per batch size x policy; numbers only (empty cell = not applicable)."""
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    alpha = result.config.synthetic_acceptance
    for batch in result.batches:
        for p in batch.policies:
            writer.writerow([batch.batch_size, p.policy, _cell(p.k), _cell(p.median_wall_tokens_per_s),
                             _cell(p.p10_wall_tokens_per_s), _cell(p.p90_wall_tokens_per_s), p.rounds,
                             _cell(p.acceptance),
                             _cell(p.median_steady_tokens_per_s), _cell(p.predicted_tokens_per_s), _cell(alpha),
                             _cell(p.strategy), _cell(p.prediction_error)])
    return buffer.getvalue()


def _cell(value) -> str:
    if value is None:
        return ""
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def output_kinds() -> dict[str, str]:
    """The files `write_outputs` writes, as perfmodel.jsonio.check_replace names kinds."""
    return {"bench.json": BENCH_SCHEMA.split("/")[0], "bench.csv": "csv:" + ",".join(CSV_COLUMNS),
            "goodput_vs_k.png": "image", "speedup_vs_batch.png": "image"}


def write_outputs(result: BenchResult, out_dir: str | os.PathLike) -> list[Path]:
    """bench.json, bench.csv and the PNG plots into `out_dir`; returns the paths written.

    Without matplotlib the plots are skipped and a note saying so is added to the result (and so to
    bench.json) before anything is written.
    """
    try:
        import matplotlib  # noqa: F401 - only to learn whether plots are possible
        plots = (("goodput_vs_k.png", plot_goodput_vs_k), ("speedup_vs_batch.png", plot_speedup_vs_batch))
    except ImportError:
        plots = ()
        result.notes.append("plots skipped: matplotlib is not installed (pip install matplotlib)")
    out = make_dir(Path(out_dir), "--out")
    written = [out / "bench.json", out / "bench.csv"]
    write_bytes_atomic(written[0], (json.dumps(bench_json(result), indent=1, allow_nan=False) + "\n").encode())
    write_bytes_atomic(written[1], bench_csv(result).encode())
    for name, plot in plots:
        write_bytes_atomic(out / name, plot(result))
        written.append(out / name)
    return written


def _figure_png(figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=120, bbox_inches="tight")
    return buffer.getvalue()


def _title(result: BenchResult, text: str) -> str:
    label = result.synthetic
    return f"{text}\n{label}" if label else text


def _band(policy: PolicyResult) -> tuple[float, float]:
    """p10 and p90 of the figure `compared_rate` reports."""
    if policy.median_steady_tokens_per_s is not None:
        return policy.p10_steady_tokens_per_s, policy.p90_steady_tokens_per_s
    return policy.p10_wall_tokens_per_s, policy.p90_wall_tokens_per_s


def plot_goodput_vs_k(result: BenchResult) -> bytes:
    """Measured steady-state tokens/s vs fixed k (median, p10-p90 bars) per batch size; prediction and
    table overlaid; staged chains (k=K+ngram) as a second line, trees (plain and staged) as points at
    their depth."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    batches = result.batches
    columns = min(3, len(batches))
    rows = -(-len(batches) // columns)
    figure = Figure(figsize=(4.2 * columns, 3.2 * rows), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False).ravel()
    for ax, batch in zip(axes, batches):
        fixed = [p for p in batch.policies if policy_family(p.policy) == "chain"]
        ks = [p.k for p in fixed]
        # the figure policies are ranked by (steady state when measured), with its own p10-p90 band
        medians = np.array([compared_rate(p) for p in fixed])
        low = medians - np.array([_band(p)[0] for p in fixed])
        high = np.array([_band(p)[1] for p in fixed]) - medians
        ax.errorbar(ks, medians, yerr=[low, high], marker="o", capsize=3, label="measured (p10-p90)")
        predicted = [(p.k, p.predicted_tokens_per_s) for p in fixed if p.predicted_tokens_per_s is not None]
        if predicted:
            ax.plot(*zip(*predicted), linestyle="--", marker="x", label="predicted")
        staged_chains = [p for p in batch.policies if policy_family(p.policy) == "staged"
                         and not p.policy.startswith(TREE_PREFIX)]
        if staged_chains:
            ax.plot([p.k for p in staged_chains], [compared_rate(p) for p in staged_chains], marker="s",
                    color="C2", label="k + n-gram stage")
        for family, marker, color, label in (("tree", "^", "C4", "trees (at depth)"),
                                             ("staged", "v", "C5", "trees + n-gram (at depth)")):
            trees = [p for p in batch.policies
                     if policy_family(p.policy) == family and p.policy.startswith(TREE_PREFIX)]
            if trees:
                ax.scatter([p.k for p in trees], [compared_rate(p) for p in trees], marker=marker, s=60, color=color,
                           zorder=3, label=label)
                ks += [p.k for p in trees]
        table = batch.policy(TABLE_POLICY)
        if table is not None and table.k is not None:
            ax.scatter([table.k], [compared_rate(table)], marker="*", s=160, color="C3", zorder=3,
                       label=f"table (k={table.k})")
        ax.set_title(f"batch size {batch.batch_size}")
        ax.set_xlabel("k (draft tokens per step; a tree's depth)")
        ax.set_ylabel("steady-state tokens/s")
        ax.set_xticks(sorted(set(ks)))
        ax.grid(alpha=0.3)
    for ax in axes[len(batches):]:
        ax.set_visible(False)
    axes[0].legend(fontsize=8)
    figure.suptitle(_title(result, "goodput vs k"))
    return _figure_png(figure)


def _legend_label(name: str, max_chars: int = 32) -> str:
    """A policy name short enough for a legend, keeping the +ngram suffix that tells staged from plain.

    >>> _legend_label("tree:0,1,2,0.0,0.1,0.2,1.0,1.1,...(12 nodes)+ngram", 24)
    'tree:0,1,2,0.0,...+ngram'
    """
    if len(name) <= max_chars:
        return name
    tail = STAGED_SUFFIX if name.endswith(STAGED_SUFFIX) else ""
    return name[:max_chars - len(tail) - 3] + "..." + tail


def plot_speedup_vs_batch(result: BenchResult) -> bytes:
    """Speedup over k = 0 vs batch size, one line per fixed k, a bold one for the table and a dashed one
    per tree and staged policy."""
    from matplotlib.figure import Figure

    figure = Figure(figsize=(6.4, 4.2), layout="constrained")
    ax = figure.subplots()
    sizes = [batch.batch_size for batch in result.batches]

    def speedups(name: str) -> list[float]:
        values = []
        for batch in result.batches:
            policy, plain = batch.policy(name), batch.policy(fixed_policy_name(0))
            values.append(compared_rate(policy) / compared_rate(plain) if policy else float("nan"))
        return values

    for k in result.config.fixed_ks:
        if k > 0:
            ax.plot(sizes, speedups(fixed_policy_name(k)), marker=".", linewidth=1, alpha=0.7, label=f"k={k}")
    if result.config.table_path is not None:
        ax.plot(sizes, speedups(TABLE_POLICY), marker="*", markersize=10, linewidth=2.5, color="black",
                label="table")
    shaped = dict.fromkeys(p.policy for batch in result.batches for p in batch.policies
                           if policy_family(p.policy) in ("tree", "staged"))
    for name in shaped:
        ax.plot(sizes, speedups(name), marker="^" if policy_family(name) == "tree" else "v", linestyle="--",
                linewidth=1.5, label=_legend_label(name))
    ax.axhline(1.0, color="grey", linestyle=":", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set_xlabel("batch size")
    ax.set_ylabel("speedup over k = 0 (steady-state tokens/s)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # k = 0 alone draws no line of its own
        ax.legend(fontsize=8, ncol=2)
    ax.set_title(_title(result, "speedup over plain decoding"))
    return _figure_png(figure)
