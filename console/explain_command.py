"""`specbatch explain`: a thin command (options, then one library call, then what it prints); cli.py
registers it. The decomposition is perfmodel/explain.py; the timed run is bench/explain_steps.py."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from specbatch.perfmodel.errors import UsageError

from .explain import render_explanation
from .options import (DeviceOpt, DraftOpt, DtypeOpt, ForceOpt, JsonOpt, ModelFileArg, Stage2Opt, TargetOpt,
                      ThreadsOpt, check_counts, set_threads)


def explain(
    model: ModelFileArg,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Sequences in the batch.")],
    k: Annotated[Optional[int], typer.Option("--k", help="Fixed speculation length (default 4).")] = None,
    table: Annotated[Optional[Path], typer.Option("--table", help="specbatch.table/1 file: its strategy at b.")] = None,
    tree: Annotated[Optional[str], typer.Option(
        "--tree", help="A draft tree: rank paths like 0,1,0.0 or chain:K.")] = None,
    stage2: Stage2Opt = None,
    target: TargetOpt = None,
    draft: DraftOpt = None,
    prompts: Annotated[Optional[Path], typer.Option(
        "--prompts", help="One JSON string (or plain line) per line (default: bundled held-out prompts).")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Per row; EOS is ignored.")] = 64,
    rounds: Annotated[int, typer.Option("--rounds", help="Timed generations, pooled.")] = 3,
    synthetic_acceptance: Annotated[Optional[float], typer.Option("--synthetic-acceptance", help=(
        "Accept each draft token with probability α instead of verifying (SYNTHETIC; for presets)."))] = None,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    threads: ThreadsOpt = None,
    force: ForceOpt = False,
    json_output: JsonOpt = False,
):
    """Predicted vs measured step at one batch size, term by term (tokens per step, draft passes by width,
    verify pass, overhead): which term carries the prediction error."""
    check_counts(batch_size=batch_size)
    if k is not None and k < 0:
        raise UsageError(f"--k must be >= 0, got {k}")
    if sum(option is not None for option in (k, table, tree)) > 1:
        raise UsageError("give one of --k, --table and --tree")
    from specbatch.bench.assembly import check_input_files, load_bench_inputs
    from specbatch.bench.config import BenchConfig
    from specbatch.bench.explain_steps import run_explain

    config = BenchConfig(batch_sizes=(batch_size,), ks=(4 if k is None else k,), max_new_tokens=max_new_tokens,
                         rounds=rounds, synthetic_acceptance=synthetic_acceptance, seed=seed, table_path=table,
                         model_path=model, trees=(tree,) if tree else (), stage2_path=stage2)
    check_input_files(model=model, table=table, prompts=prompts, stage2=stage2)
    set_threads(threads)  # after the checks: a note must not come before a one-line error
    inputs = load_bench_inputs(config, target, draft, prompts, device, dtype, force)
    explained, notes, machine_speed = run_explain(config, inputs.models, inputs.token_prompts, 4 if k is None else k)
    if json_output:
        typer.echo(json.dumps({**explained.to_json(), "machine_speed": machine_speed, "notes": inputs.notes + notes}))
        return
    render_explanation(explained.to_json(), inputs.notes + notes)
