"""`specbatch`: calibrate a machine, fit the performance model, tabulate the best speculation length
per batch size, and generate with the table.

Commands only: each parses its options and makes one library call; what the terminal shows lives in
`console/`, the wiring of models, policies and second stages in `runtime/assembly.py`. Heavy modules
(torch, scipy, scikit-learn) are imported inside the commands so `--help` is instant.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from specbatch.calibrate import grid as _grid  # plain data: --help's defaults
from specbatch.console import bench as _bench
from specbatch.console.explain_command import explain
from specbatch.console.options import (
    AcceptanceOpt,
    AdaptiveOpt,
    AnyDraftOpt,
    AnyTargetOpt,
    App,
    DeviceOpt,
    DraftOpt,
    DtypeOpt,
    EagerOpt,
    AllowModeMismatchOpt,
    check_costs_here,
    ForceOpt,
    JsonOpt,
    MaxBatchOpt,
    MaxKOpt,
    ModelFileArg,
    RefitOpt,
    ReplaceOpt,
    Stage2Opt,
    TargetOpt,
    ThreadsOpt,
    TreeOpt,
    acceptance_override,
    check_counts,
    check_query_options,
    graphs_option,
    ints_text,
    one_line_errors,
    parse_int_list,
    read_prompts_file,
    set_threads,
)
from specbatch.console.serve_commands import loadtest_command, serve_command
from specbatch.perfmodel.errors import UsageError
from specbatch.perfmodel.jsonio import REPLACE_RULE_HELP
from specbatch.runtime.assembly import (  # imports runtime: OpenMP default first
    DEMO_PROMPTS,
)

app = App(
    add_completion=False,
    no_args_is_help=True,
    help="Optimal speculation length per batch size: calibrate, fit, table, query, generate, bench, demo.",
)


@app.callback()
def main() -> None:
    """Optimal speculation length per batch size: calibrate, fit, table, query, generate, bench, demo."""


@app.command()
@one_line_errors
def generate(
    prompt: Annotated[Optional[list[str]], typer.Option("--prompt", help="Prompt text (repeatable).")] = None,
    prompts_file: Annotated[Optional[Path], typer.Option(
        "--prompts-file", help="One JSON string (or plain line) per line.")] = None,
    target: TargetOpt = None,
    draft: DraftOpt = None,
    k: Annotated[Optional[int], typer.Option(
        "--k", help="Fixed speculation length (default 4 with a draft, 0 without).")] = None,
    table: Annotated[Optional[Path], typer.Option("--table", help="specbatch.table/1 file: k per batch size.")] = None,
    tree: TreeOpt = None,
    stage2: Stage2Opt = None,
    model: Annotated[Optional[Path], typer.Option("--model", help="specbatch.model/1 file, for --tree auto.")] = None,
    adaptive: AdaptiveOpt = None,
    refit: RefitOpt = False,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens")] = 64,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy.")] = 0.0,
    top_k: Annotated[int, typer.Option("--top-k", help="0 = no top-k filter.")] = 0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus mass in (0, 1].")] = 1.0,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    threads: ThreadsOpt = None,
    force: ForceOpt = False,
    eager: EagerOpt = False,
    allow_mode_mismatch: AllowModeMismatchOpt = False,
    json_output: JsonOpt = False,
):
    """Generate text with batched speculative decoding (all prompts in one batch).

    --draft may also be an n-gram file (.safetensors from data/train_ngram.py): the n-gram alone drafts.

    A head (EAGLE-3, MTP) as --draft drafts chains and trees, as a draft model does (not --stage2)."""
    from specbatch.runtime.assembly import GenerationRequest, generate_texts

    texts = list(prompt or []) + (read_prompts_file(prompts_file) if prompts_file is not None else [])
    request = GenerationRequest(
        prompts=tuple(texts), target=target, draft=draft, k=k, table=table, tree=tree, stage2=stage2, model=model,
        adaptive=adaptive, refit=refit, max_new_tokens=max_new_tokens, temperature=temperature,
        top_k=top_k, top_p=top_p, seed=seed, device=device, dtype=dtype, force=force, cuda_graphs=graphs_option(eager))
    check_costs_here(device, dtype, eager, allow_mode_mismatch, table=table, adaptive=adaptive,
                     model=model if tree is not None else None)  # --model serves --tree auto only
    set_threads(threads)
    generation = generate_texts(request)
    if json_output:
        typer.echo(json.dumps(generation.to_json()))
        return
    from specbatch.console.generation import render_generation

    render_generation(generation.outputs, generation.stats, generation.policy, generation.sampling)


@app.command("calibrate")
@one_line_errors
def calibrate_command(
    target: AnyTargetOpt = None,
    draft: AnyDraftOpt = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    batch_sizes: Annotated[Optional[str], typer.Option("--batch-sizes", help=(
        f"Batch sizes to time (default {ints_text(_grid.DEFAULT_BATCH_SIZES)}; "
        f"--quick {ints_text(_grid.QUICK_BATCH_SIZES)})."))] = None,
    max_k: Annotated[int, typer.Option(
        "--max-k", help="Longest speculation: target passes of 1..max_k+1 tokens are timed.")] = _grid.DEFAULT_MAX_K,
    context_lens: Annotated[Optional[str], typer.Option("--context-lens", help=(
        f"Cached tokens per row (default {ints_text(_grid.DEFAULT_CONTEXT_LENS)}; "
        f"--quick {ints_text(_grid.QUICK_CONTEXT_LENS)})."))] = None,
    prompts: Annotated[Optional[Path], typer.Option("--prompts", help=(
        "Prompts for acceptance, one JSON string per line (default: bundled held-out prompts)."))] = None,
    acceptance: Annotated[Optional[str], typer.Option("--acceptance", help=(
        "Give acceptance instead of measuring it: 0.8, or per position 0.9,0.85,0.8 (required with random "
        "weights)."))] = None,
    sampling: Annotated[Optional[list[str]], typer.Option("--sampling", help=(
        "Also measure acceptance for T=0.8[,top_k=50][,top_p=0.95] (repeatable); greedy is always "
        "measured."))] = None,
    out: Annotated[Path, typer.Option(
        "-o", "--out", help="Profile to write (its timing rows also go to the .csv beside it).",
    )] = Path("profile.json"),
    resume: Annotated[bool, typer.Option(
        "--resume", help="Keep the points already in --out and measure only the rest.")] = False,
    quick: Annotated[bool, typer.Option(
        "--quick", help="Coarser grid, fewer repetitions and prompts: a first look in seconds.")] = False,
    stage2: Annotated[Optional[Path], typer.Option("--stage2", help=(
        "n-gram file to measure as the draft's second stage (default: the bundled n-gram with the bundled "
        "draft)."))] = None,
    no_stage2: Annotated[bool, typer.Option("--no-stage2", help="Measure no second stage.")] = False,
    force: Annotated[bool, typer.Option("--force", help=f"{REPLACE_RULE_HELP} --resume continues a profile instead; "
                                                         "a replaced one is kept until the new run has measured a "
                                                         "point.")] = False,
    max_seconds: Annotated[Optional[float], typer.Option("--max-seconds", help=(
        "Stop cleanly between points after this many seconds; the profile keeps what was measured and "
        "--resume continues."))] = None,
    threads: ThreadsOpt = None,
    refine: Annotated[Optional[bool], typer.Option("--refine/--no-refine", help=(
        "After the grid, time more target passes where the fit finds a kernel step between two measured token "
        "counts it cannot place (default: on CUDA, where passes are cheap; off on CPU)."))] = None,
    eager: EagerOpt = False,
    from_vidur: Annotated[Optional[Path], typer.Option("--from-vidur", help=(
        "Time nothing: compose the target's passes from vidur's per-operation GPU timings in this folder "
        "(mlp.csv, attention.csv) for the --target/--draft shapes (presets or config.json); needs "
        "--acceptance. The draft reads the same folder unless --draft-from-vidur."))] = None,
    draft_from_vidur: Annotated[Optional[Path], typer.Option(
        "--draft-from-vidur", help="With --from-vidur: the draft's own vidur folder.")] = None,
    engine: Annotated[str, typer.Option("--engine", help=(
        "specbatch: time our runtime | vllm: time vLLM's own steps (its CPU build; bash bench/vllm/setup.sh "
        "first), for the table an export to vLLM carries."))] = "specbatch",
    json_output: JsonOpt = False,
):
    """Time the pair's forward passes over (batch size, new tokens, context) and measure acceptance (per
    position, and per depth and rank for trees) and the n-gram second stage: a profile. With --engine vllm,
    vLLM's steps over (batch size, K, context) and the acceptance its counters saw: vLLM's profile."""
    if from_vidur is not None or draft_from_vidur is not None:
        from specbatch.console.calibration import calibrate_from_vidur

        given = {"--device": device, "--dtype": dtype, "--prompts": prompts, "--sampling": sampling,
                 "--resume": resume, "--quick": quick, "--stage2": stage2, "--no-stage2": no_stage2,
                 "--max-seconds": max_seconds, "--threads": threads, "--refine": refine is not None,
                 "--engine": engine != "specbatch"}
        calibrate_from_vidur(from_vidur, draft_from_vidur, target, draft, acceptance, batch_sizes, context_lens,
                             max_k, out, force, [option for option, value in given.items() if value], json_output)
        return
    if engine not in ("specbatch", "vllm"):
        raise UsageError(f"--engine: {engine!r} is not one of specbatch, vllm")
    from specbatch.calibrate.models import named_pair

    if engine == "vllm":
        from specbatch.console.calibration import calibrate_vllm

        given = [name for name, value in (("--device", device), ("--dtype", dtype), ("--acceptance", acceptance),
                                          ("--sampling", sampling), ("--stage2", stage2)) if value]
        if given:
            raise UsageError(f"--engine vllm: {', '.join(given)} do not apply (vLLM runs float32 on this CPU and "
                             "its acceptance is measured on the prompts)")
        calibrate_vllm(*named_pair(target, draft, "calibrate"), out,
                       prompts or DEMO_PROMPTS,
                       parse_int_list("--batch-sizes", batch_sizes), parse_int_list("--context-lens", context_lens),
                       max_k, quick, threads, resume, force, max_seconds, json_output)
        return
    from specbatch.calibrate.run import CalibrationRequest
    from specbatch.calibrate.stage2 import stage2_for_calibration
    from specbatch.console.calibration import calibrate_with_progress, render_calibration

    target, draft = named_pair(target, draft, "calibrate")
    request = CalibrationRequest(
        target=target, draft=draft, out=out, device=device, dtype=dtype,
        batch_sizes=tuple(parse_int_list("--batch-sizes", batch_sizes) or ()) or None,
        context_lens=tuple(parse_int_list("--context-lens", context_lens) or ()) or None,
        max_k=max_k, prompts=prompts or DEMO_PROMPTS, acceptance=acceptance, samplings=tuple(sampling or ()),
        resume=resume, quick=quick, stage2=stage2_for_calibration(stage2, no_stage2, draft, acceptance),
        force=force, max_seconds=max_seconds, refine=refine, cuda_graphs=graphs_option(eager),
    )
    set_threads(threads, resumed_profile=out if resume else None)  # the profile records torch's thread count
    summary = calibrate_with_progress(request, show=not json_output)
    if json_output:
        typer.echo(json.dumps(summary.to_json()))
        return
    render_calibration(summary)


@app.command()
@one_line_errors
def bench(
    target: AnyTargetOpt = None,
    draft: AnyDraftOpt = None,
    table: Annotated[Optional[Path], typer.Option(
        "--table", help="specbatch.table/1 file: adds the table policy.")] = None,
    model: Annotated[Optional[Path], typer.Option(
        "--model", help="specbatch.model/1 file: adds predicted tokens/s.")] = None,
    tree: Annotated[Optional[list[str]], typer.Option(
        "--tree", help="Also run this draft tree (repeatable): rank paths like 0,1,0.0, chain:K, or auto (the "
                       "model's best tree at batch size 1; needs --model).")] = None,
    stage2: Annotated[Optional[Path], typer.Option(
        "--stage2", help="n-gram file: also run every k > 0 and every --tree with the second stage.")] = None,
    adaptive: Annotated[Optional[Path], typer.Option(
        "--adaptive", help="specbatch.model/1 file: also run the adaptive policy (online acceptance per "
                           "request).")] = None,
    refit: RefitOpt = False,
    workload: Annotated[str, typer.Option(
        "--workload", help="heldout (--prompts alone) | mixed (half --prompts, half --second-prompts in every "
                           "batch) | switch (the second population from half-way through the rounds).")] = "heldout",
    second_prompts: Annotated[Optional[Path], typer.Option(
        "--second-prompts", help="The other population of mixed/switch (default: data/prompts/base64.jsonl, on "
                                 "which the demo draft agrees much less).")] = None,
    batch_sizes: Annotated[Optional[str], typer.Option("--batch-sizes", help=(
        f"Default {ints_text(_bench.QUICK_RUN['batch_sizes'])}; --full "
        f"{ints_text(_bench.FULL_RUN['batch_sizes'])}."))] = None,
    ks: Annotated[str, typer.Option("--ks", help="Fixed k to compare; k = 0 is always run.")] = "0,1,2,3,4,5,6,7,8",
    prompts: Annotated[Optional[Path], typer.Option(
        "--prompts", help="One JSON string (or plain line) per line (default: bundled held-out prompts).")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Per row; EOS is ignored.")] = 64,
    rounds: Annotated[Optional[int], typer.Option("--rounds", help=(
        f"Timed interleaved rounds per batch size (default {_bench.QUICK_RUN['rounds']}; --full "
        f"{_bench.FULL_RUN['rounds']})."))] = None,
    resolve_rounds: Annotated[Optional[int], typer.Option(
        "--resolve-rounds", help="At most this many extra rounds of the table and the best fixed k alone while "
                                 "the table's paired regret straddles the 3 % goal or its interval is wider than "
                                 "±3 % (0: none); above b = 8 no more than the batch size's own rounds' "
                                 f"generations (default {_bench.QUICK_RUN['resolve_rounds']}; --full "
                                 f"{_bench.FULL_RUN['resolve_rounds']}).")] = None,
    full: Annotated[bool, typer.Option(
        "--full", help="The thorough run: every batch size of the Su et al. grid, more rounds (about four times "
                       "longer than the default first look).")] = False,
    interleave: Annotated[str, typer.Option(
        "--interleave", help="steps: a round's policies advance together, one step of each in turn, so they meet "
                             "the same moments of the machine | runs: one whole generation after another.")] = "steps",
    sampling: Annotated[str, typer.Option("--sampling", help="greedy | T=0.8[,top_k=50][,top_p=0.9]")] = "greedy",
    synthetic_acceptance: Annotated[Optional[float], typer.Option("--synthetic-acceptance", help=(
        "Accept each draft token with probability α in (0, 1] instead of verifying (SYNTHETIC; for "
        "presets)."))] = None,
    peers: Annotated[Optional[str], typer.Option(
        "--peers", help="Comma list: transformers (its generate, plain and assisted at batch size 1), vllm (vLLM "
                        "plain and with the exported --table, interleaved with ours; bash bench/vllm/setup.sh "
                        "first).")] = None,
    out: Annotated[Path, typer.Option(
        "-o", "--out", help="Output folder for bench.json, bench.csv and plots.")] = Path("specbatch-bench"),
    seed: Annotated[int, typer.Option("--seed")] = 0,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    threads: ThreadsOpt = None,
    force: Annotated[bool, typer.Option("--force", help=f"{REPLACE_RULE_HELP} Also: use a --table or --model made "
                                                         "for another target/draft pair anyway.")] = False,
    eager: EagerOpt = False,
    allow_mode_mismatch: AllowModeMismatchOpt = False,
    json_output: JsonOpt = False,
):
    """Measure k = 0, every fixed k, trees, staged drafting and the table at every batch size, interleaved;
    regret, speedup, and chain vs tree vs staged side by side."""
    from specbatch.bench.assembly import check_input_files, load_bench_inputs
    from specbatch.bench.config import BenchConfig
    from specbatch.perfmodel.jsonio import writable_dir
    from specbatch.runtime.sampling import parse_sampling

    defaults = _bench.FULL_RUN if full else _bench.QUICK_RUN
    config = BenchConfig(  # every option is checked before a model is loaded
        batch_sizes=tuple(parse_int_list("--batch-sizes", batch_sizes) or defaults["batch_sizes"]),
        ks=tuple(parse_int_list("--ks", ks, 0)), max_new_tokens=max_new_tokens,
        rounds=defaults["rounds"] if rounds is None else rounds,
        resolve_rounds=defaults["resolve_rounds"] if resolve_rounds is None else resolve_rounds,
        sampling=parse_sampling(sampling),
        synthetic_acceptance=synthetic_acceptance, seed=seed, table_path=table, model_path=model,
        peers=tuple(name.strip() for name in peers.split(",") if name.strip()) if peers else (),
        trees=tuple(tree or ()), stage2_path=stage2, adaptive_path=adaptive, adaptive_refit=refit, workload=workload,
        second_prompts_path=second_prompts, interleave=interleave, cuda_graphs=graphs_option(eager),
        allow_mode_mismatch=allow_mode_mismatch)
    check_input_files(table=table, model=model, prompts=prompts, stage2=stage2, adaptive=adaptive,
                      second_prompts=second_prompts)
    writable_dir(out, "--out")  # before measuring: a file in the way would lose every measurement
    from specbatch.bench.outputs import output_kinds
    from specbatch.perfmodel.jsonio import check_replace_in

    check_replace_in(out, output_kinds(), force, "--out")
    set_threads(threads)  # after the checks: a note must not come before a one-line error
    inputs = load_bench_inputs(config, target, draft, prompts, device, dtype, force)
    config = inputs.config  # with the table's own n-gram when it names one
    from specbatch.bench.harness import run_bench
    from specbatch.bench.outputs import bench_json, write_outputs
    from specbatch.console.bench import bench_with_progress, render_bench

    run = run_bench if json_output else bench_with_progress
    result = run(config, inputs.models, inputs.token_prompts)
    result.notes[:0] = inputs.notes
    written = write_outputs(result, out)
    if json_output:
        typer.echo(json.dumps({**bench_json(result), "outputs": [str(path) for path in written]}))
    else:
        render_bench(result, written)
    if result.interrupted:  # what was measured is written; the exit status still says Ctrl-C
        typer.echo(f"interrupted: the finished rounds are in {out}", err=True)
        raise typer.Exit(130)


@app.command()
@one_line_errors
def fit(
    profile: Annotated[Path, typer.Argument(help="specbatch.profile/1 file written by `specbatch calibrate`.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the specbatch.model/1 file.")],
    holdout: Annotated[bool, typer.Option(
        "--holdout", help="Also fit without every other interior batch size and context length and report the "
                          "error on those.")] = False,
    force: ReplaceOpt = False,
    json_output: JsonOpt = False,
):
    """Fit each role's pass latency T(b, n, L) from a profile; report parameters and errors. With in-situ
    rows in the profile, from the timing source (isolated, in-situ, both) that predicts measured steps best."""
    from specbatch.perfmodel.fit import fit_profile
    from specbatch.perfmodel.jsonio import check_not_input, check_replace
    from specbatch.perfmodel.model import MODEL_SCHEMA, save_model
    from specbatch.perfmodel.profile import load_profile

    check_not_input(output, [profile], "--output")
    check_replace(output, MODEL_SCHEMA.split("/")[0], force, "--output")  # before the fit: fails in a second
    loaded = load_profile(profile)
    from specbatch.perfmodel.execution import execution_note, model_execution
    from specbatch.runtime.devices import execution_on

    execution = execution_note(f"profile {profile}", loaded.device, model_execution(loaded),
                               execution_on(loaded.device.kind, loaded.device.dtype))
    fitted = fit_profile(loaded, holdout=holdout)
    save_model(output, fitted)
    from specbatch.console.model import fit_json, render_fit

    if json_output:
        typer.echo(json.dumps(fit_json(fitted, output)))
        if execution:
            typer.echo(f"note: {execution}", err=True)
        return
    render_fit(fitted, output, holdout, loaded.noise)
    for note in filter(None, (execution, fitted.coverage and fitted.coverage.describe())):
        typer.echo(f"note: {note}")


@app.command()
@one_line_errors
def table(
    model: ModelFileArg,
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the table (or its export).")],
    max_batch: MaxBatchOpt = 64,
    context_lens: Annotated[Optional[str], typer.Option(
        "--context-lens", help="One table bucket per context length, e.g. 512,2048,8192 (default: the profiled "
                               "context range in steps of at most 1.41x; vllm/trtllm: one bucket at the "
                               "profile's middle context length).")] = None,
    acceptance: AcceptanceOpt = None,
    max_k: MaxKOpt = None,
    strategies: Annotated[str, typer.Option(
        "--strategies", help="chain (chains only) | tree (chains and trees) | all (and the n-gram second stage, "
                             "when the profile measured one).")] = "all",
    max_tree_nodes: Annotated[int, typer.Option("--max-tree-nodes", help="Largest tree considered.")] = 64,
    fmt: Annotated[str, typer.Option(
        "--format", help="json (specbatch.table/1) | csv | vllm (a complete speculative_config) | trtllm (the "
                         "decoding config with draft_len_schedule) | sglang (an adaptive config, one step per batch "
                         "size slot, and the server flags that read it; EAGLE-3 and MTP heads only). Engine exports "
                         "run the model's drafter (a draft model, an EAGLE-3 head or MTP heads) and know batch sizes "
                         "only: one --context-lens value; --max-batch should cover the engine's max batch.")] = "json",
    draft: Annotated[Optional[Path], typer.Option(
        "--draft", help="vllm/trtllm/sglang: the checkpoint the engine loads, the draft model or the head's "
                        "directory (default: the table's draft, resolved from the current directory).")] = None,
    clamp: Annotated[bool, typer.Option(
        "--clamp", help="trtllm: cap every k at batch size 1's k (TensorRT-LLM needs the smallest batch size's k "
                        "to be the largest) instead of refusing; the entries changed are listed.")] = False,
    cuda_graph_bs: Annotated[Optional[str], typer.Option(
        "--cuda-graph-bs", help="sglang: the decode CUDA-graph batch sizes the server will capture, e.g. 1,2,4,8 "
                                "(default: SGLang's own up to --max-batch plus the last batch size of each run of "
                                "equal k, which the export passes as --cuda-graph-bs-decode); refused where SGLang's "
                                "padding would run two different k in one slot.")] = None,
    force: Annotated[bool, typer.Option("--force", help=f"{REPLACE_RULE_HELP} Also: compute the table over grid "
                                                         "regions a cut-short profile did not measure.")] = False,
):
    """Best strategy (none, a chain of k, a tree, with or without the second stage) for every batch size
    1..max-batch, with its predicted gain. vllm/trtllm/sglang exports express chains only (a tree's depth as k)."""
    check_counts(max_batch=max_batch, max_k=max_k)
    from specbatch.perfmodel.table import (ENGINE_FORMATS, check_table_format, engine_family_note, table_output_kind,
                                           write_table)

    graph_bs = parse_int_list("--cuda-graph-bs", cuda_graph_bs)
    check_table_format(fmt, draft, clamp, graph_bs)
    if max_tree_nodes < 1:
        raise UsageError(f"--max-tree-nodes must be >= 1, got {max_tree_nodes}")
    lengths = parse_int_list("--context-lens", context_lens)
    from specbatch.perfmodel.jsonio import check_not_input, check_replace
    from specbatch.perfmodel.model import check_coverage, choose_acceptance, compute_table, load_model

    check_not_input(output, [model], "--output")
    check_replace(output, table_output_kind(fmt), force, "--output")
    fitted = load_model(model)
    from specbatch.perfmodel.execution import execution_note, model_execution
    from specbatch.runtime.devices import execution_on

    execution = execution_note(f"model {model}", fitted.device, model_execution(fitted),
                               execution_on(fitted.device.kind, fitted.device.dtype))
    check_coverage(fitted, model, max_batch, force)
    lengths = lengths or fitted.table_context_lens(fmt)
    chosen = choose_acceptance(fitted, acceptance_override(acceptance), str(model))
    engine = fmt in ENGINE_FORMATS  # an engine runs chains only: rank those, and show their predictions
    result = compute_table(fitted, chosen, max_batch, lengths, max_k, strategies="chain" if engine else strategies,
                           max_tree_nodes=max_tree_nodes)
    export_notes = write_table(output, result, fmt, draft=draft, clamp=clamp, graph_bs=graph_bs)
    if engine and strategies != "chain":
        export_notes.insert(0, engine_family_note(fmt, model, result.buckets[0].context_len))
    from specbatch.console.model import render_table
    from specbatch.perfmodel.kernel_notes import row_gap_notes, table_step_notes
    from specbatch.perfmodel.model import step_model
    from specbatch.perfmodel.uncertainty import table_tie_notes

    notes = [execution] if execution else []
    notes += fitted.extrapolation_notes(max_batch, [b.context_len for b in result.buckets], result.max_k)
    notes += table_tie_notes(result, chosen) + table_step_notes(fitted, result, step_model(fitted, chosen))
    notes += row_gap_notes(fitted)
    render_table(result, notes + export_notes, output)


@app.command()
@one_line_errors
def query(
    batch_size: Annotated[int, typer.Option("--batch-size", help="Sequences in the batch.")],
    model: Annotated[Optional[Path], typer.Argument(help="specbatch.model/1 file (or use --table).")] = None,
    table_path: Annotated[Optional[Path], typer.Option(
        "--table", help="specbatch.table/1 file instead of a model.")] = None,
    context_len: Annotated[Optional[int], typer.Option("--context-len", help=(
        "Mean context length (default: the profile's middle one / the table's middle bucket)."))] = None,
    acceptance: AcceptanceOpt = None,
    max_k: MaxKOpt = None,
    tree: TreeOpt = None,
    stage2: Stage2Opt = None,
    strategies: Annotated[str, typer.Option("--strategies", help=(
        "all | tree | chain: the family ranked, as `table --strategies` (default all: the best is the table's "
        "choice at this point)."))] = "all",
    json_output: JsonOpt = False,
):
    """Step time, tokens per step and goodput of every strategy at one batch size, and the best one.

    --strategies chain lists every k in order; --tree SPEC [--stage2 FILE] predicts that one tree (a
    what-if); --tree auto is --strategies all."""
    check_counts(batch_size=batch_size, context_len=context_len, max_k=max_k)
    check_query_options(model, table_path, acceptance, max_k, tree, stage2, strategies)
    if model is not None:
        from specbatch.perfmodel.model import choose_acceptance, load_model
        from specbatch.perfmodel.query import chain_answer, strategy_answer

        fitted = load_model(model)
        chosen = choose_acceptance(fitted, acceptance_override(acceptance), str(model))
        if tree is None and strategies == "chain":
            answer = chain_answer(fitted, chosen, batch_size, context_len, max_k)
        else:
            answer = strategy_answer(fitted, chosen, batch_size, tree or "auto", context_len, max_k, stage2,
                                     str(model), strategies)
    else:
        from specbatch.perfmodel.query import table_answer
        from specbatch.perfmodel.table import load_table

        answer = table_answer(load_table(table_path), batch_size, context_len)
    if json_output:
        typer.echo(json.dumps(answer.to_json()))
        return
    from specbatch.console.model import render_query

    render_query(answer.to_json(), list(answer.notes))


@app.command()
@one_line_errors
def plot(
    model: ModelFileArg,
    output: Annotated[Path, typer.Option("-o", "--output", help="Image file to write (png, pdf, svg).")],
    max_batch: MaxBatchOpt = 64,
    context_len: Annotated[Optional[int], typer.Option("--context-len", help="Context length of the heatmap.")] = None,
    acceptance: AcceptanceOpt = None,
    max_k: MaxKOpt = None,
    force: ReplaceOpt = False,
):
    """Goodput heatmap over (b, k) with the k*(b) curve, and fitted vs measured latency per role."""
    check_counts(max_batch=max_batch, max_k=max_k, context_len=context_len)
    from specbatch.perfmodel.model import choose_acceptance, load_model
    from specbatch.perfmodel.plot import plot_model

    from specbatch.perfmodel.jsonio import check_replace

    check_replace(output, "image", force, "--output")
    fitted = load_model(model)
    chosen = choose_acceptance(fitted, acceptance_override(acceptance), str(model))
    plot_model(fitted, chosen, output, max_batch, context_len, max_k)
    typer.echo(f"wrote {output}")


@app.command()
@one_line_errors
def demo(
    out: Annotated[Path, typer.Option("--out", help="Folder for everything the demo writes.")] = Path("specbatch-demo"),
    batch_sizes: Annotated[str, typer.Option(
        "--batch-sizes", help="Batch sizes at which the table is raced against plain decoding.")] = "1,8",
    prompts_shown: Annotated[int, typer.Option("--prompts-shown", help="Held-out prompts generated and printed.")] = 3,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens")] = 48,
    rounds: Annotated[int, typer.Option("--rounds", help="Interleaved timed rounds per batch size.")] = 3,
    max_batch: Annotated[int, typer.Option("--max-batch", help="Largest batch size in the table.")] = 32,
    device: DeviceOpt = None,
    threads: ThreadsOpt = None,
    eager: EagerOpt = False,
    force: ReplaceOpt = False,
):
    """The whole loop on the bundled demo pair: quick calibration, fit, table, generation, measured speedup; then
    the same with the demo EAGLE-3 head drafting. Run again into its folder, it replaces its own outputs there."""
    race_sizes = parse_int_list("--batch-sizes", batch_sizes)
    if prompts_shown <= 0 or max_new_tokens <= 0 or rounds <= 0:
        raise UsageError("--prompts-shown, --max-new-tokens and --rounds must be positive")
    check_counts(max_batch=max_batch)
    from specbatch.perfmodel.jsonio import writable_dir

    writable_dir(out, "--out")  # before the first measurement
    writable_dir(out / "bench", "--out")  # where the race's files go
    writable_dir(out / "head-bench", "--out")  # and the head's race's
    from specbatch.bench.outputs import output_kinds
    from specbatch.console.demo import claim_folder, is_demo_folder
    from specbatch.console.demo import output_kinds as demo_kinds
    from specbatch.perfmodel.jsonio import check_replace_in

    replace_own = force or is_demo_folder(out)  # an earlier demo's outputs: README's first command reruns as written
    check_replace_in(out, demo_kinds(), replace_own, "--out")
    check_replace_in(out / "bench", output_kinds(), replace_own, "--out")
    check_replace_in(out / "head-bench", output_kinds(), replace_own, "--out")
    set_threads(threads)
    from specbatch.console.demo import run_demo

    claim_folder(out)
    run_demo(out, tuple(race_sizes), prompts_shown, max_new_tokens, rounds, max_batch, device, graphs_option(eager))


app.command()(one_line_errors(explain))  # commands kept in their own console/ files, listed after these

app.command("serve")(one_line_errors(serve_command))
app.command("loadtest")(one_line_errors(loadtest_command))


if __name__ == "__main__":
    app()
