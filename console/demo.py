"""`specbatch demo`: the whole loop on the bundled demo pair, one rule per stage.

quick calibration -> fit -> table (and its exports) -> generation with the table -> the table raced
against plain decoding; then the same loop with the demo EAGLE-3 head drafting instead of the draft model,
its acceptance per position beside the draft model's. Every stage is the same library call its own command
makes.
"""
from __future__ import annotations

from pathlib import Path

from rich.console import Console

from specbatch.runtime.assembly import DEMO_DRAFT, DEMO_HEAD, DEMO_PROMPTS, DEMO_TARGET

EXPORTS = {"table.json": "json", "table.csv": "csv", "vllm.json": "vllm", "trtllm.json": "trtllm"}
# the head's loop is the demo's second: a coarser grid than --quick's keeps the whole demo within minutes
HEAD_BATCH_SIZES, HEAD_MAX_K = (1, 4, 16), 6
# left in the demo's folder: a later run there replaces the demo's own outputs without --force (each still only
# over a file of its own kind: a user's other files are never replaced, --force or not)
DEMO_MARK = ".specbatch-demo"


def output_kinds() -> dict[str, str]:
    """The files the demo writes into its folder (its race's go to bench/), as jsonio.check_replace names kinds."""
    from specbatch.perfmodel.profile import PROFILE_KIND
    from specbatch.perfmodel.table import table_output_kind

    return {"profile.json": PROFILE_KIND, "model.json": "specbatch.model",
            **{name: table_output_kind(fmt) for name, fmt in EXPORTS.items()},
            "head-profile.json": PROFILE_KIND, "head-model.json": "specbatch.model",
            "head-table.json": table_output_kind("json")}


def run_demo(out: Path, race_sizes: tuple[int, ...], prompts_shown: int, max_new_tokens: int, rounds: int,
             max_batch: int, device: str | None, cuda_graphs: bool | None = None) -> None:
    from specbatch.bench.config import BenchConfig, BenchModels
    from specbatch.bench.outputs import write_outputs
    from specbatch.bench.results import compared_rate
    from specbatch.calibrate.acceptance import read_prompts
    from specbatch.calibrate.run import CalibrationRequest
    from specbatch.calibrate.stage2 import stage2_for_calibration
    from specbatch.perfmodel.errors import PerfModelError
    from specbatch.perfmodel.jsonio import make_dir, write_text_atomic
    from specbatch.perfmodel.fit import fit_profile
    from specbatch.perfmodel.model import choose_acceptance, compute_table, save_model
    from specbatch.perfmodel.profile import load_profile
    from specbatch.perfmodel.table import ENGINE_FORMATS, write_table
    from specbatch.runtime.assembly import (
        GenerationRequest,
        generate_texts,
        generations_jsonl,
        load_named_pair,
        second_stage_for,
    )
    from specbatch.runtime.policy import TableK

    from .bench import bench_with_progress
    from .calibration import calibrate_with_progress, render_calibration
    from .generation import render_generation
    from .model import render_fit, render_table

    console = Console()
    make_dir(out, "--out")
    profile_path, model_path, table_path = out / "profile.json", out / "model.json", out / "table.json"

    console.rule("[bold]1/6 calibrate (quick): time the demo pair's passes on this machine, measure acceptance")
    stage2 = stage2_for_calibration(None, False, None, None)  # the bundled n-gram: trees and staged drafting
    request = CalibrationRequest(target=str(DEMO_TARGET), draft=str(DEMO_DRAFT), out=profile_path, device=device,
                                 prompts=DEMO_PROMPTS, quick=True, stage2=stage2, force=True,
                                 cuda_graphs=cuda_graphs)  # the demo's own folder
    render_calibration(calibrate_with_progress(request, show=True))

    console.rule("[bold]2/6 fit the latency and acceptance model")
    fitted = fit_profile(load_profile(profile_path))
    save_model(model_path, fitted)
    render_fit(fitted, model_path)

    console.rule("[bold]3/6 the table: best strategy (none, chain of k, tree, +n-gram stage) for every batch size")
    acceptance = choose_acceptance(fitted, None, str(model_path))
    table = compute_table(fitted, acceptance, max_batch)
    engine_table = compute_table(fitted, acceptance, max_batch, fitted.table_context_lens("vllm"),  # one bucket
                                 strategies="chain")  # what the engines run: their exports rank chains only
    notes = fitted.extrapolation_notes(max_batch, [b.context_len for b in table.buckets], table.max_k)
    for name, fmt in EXPORTS.items():
        try:  # a rising k is capped for TensorRT-LLM; an export an engine cannot express is a note, not a stop
            notes += write_table(out / name, engine_table if fmt in ENGINE_FORMATS else table, fmt,
                                 clamp=fmt == "trtllm")
        except PerfModelError as error:
            notes.append(f"{name} not written: {error}")
    render_table(table, notes, table_path)

    console.rule("[bold]4/6 generate held-out prompts with the table")
    pair = load_named_pair(None, None, device, None)
    policy = TableK(table_path)
    texts = read_prompts(DEMO_PROMPTS)[:prompts_shown]
    generation = generate_texts(
        GenerationRequest(prompts=tuple(texts), table=table_path, max_new_tokens=max_new_tokens,
                          stage2=stage2 if policy.needs_stage2 else None, cuda_graphs=cuda_graphs), loaded_pair=pair)
    write_text_atomic(out / "generations.jsonl", generations_jsonl(generation))
    render_generation(generation.outputs, generation.stats, generation.policy, generation.sampling)

    console.rule(f"[bold]5/6 race the table against plain decoding (k = 0) at batch sizes {list(race_sizes)}")
    ngram = second_stage_for(policy, stage2 if policy.needs_stage2 else None, pair.target_spec)
    config = BenchConfig(batch_sizes=race_sizes, ks=(0,), max_new_tokens=max_new_tokens, rounds=rounds,
                         table_path=table_path, model_path=model_path,
                         stage2_path=stage2 if ngram is not None else None, cuda_graphs=cuda_graphs)
    models = BenchModels(target=pair.target, draft=pair.draft, target_source=str(DEMO_TARGET),
                         draft_source=str(DEMO_DRAFT), target_dir=DEMO_TARGET, draft_dir=DEMO_DRAFT,
                         random_weights=False, stage2=ngram)
    prompts = [pair.tokenizer.encode(text) for text in read_prompts(DEMO_PROMPTS)]
    race = bench_with_progress(config, models, prompts)
    written = write_outputs(race, out / "bench")
    for batch in race.batches:
        plain, tabled = batch.policy("k=0"), batch.policy("table")
        console.print(f"batch size {batch.batch_size}: table {tabled.strategy} {compared_rate(tabled):.0f} tok/s vs "
                      f"plain {compared_rate(plain):.0f} tok/s -> [bold]{batch.table_speedup:.2f}x[/] "
                      f"(steady-state goodput, median of {rounds} interleaved rounds)")
        contradiction = prediction_contradiction(tabled)
        if contradiction:
            console.print(contradiction, markup=False, highlight=False)
    run_head_demo(console, out, pair, prompts, race_sizes, max_new_tokens, rounds, max_batch, device, cuda_graphs)
    console.print(closing_line(out, written), markup=False, highlight=False)


def closing_line(out: Path, bench_files: list[Path]) -> str:
    """Where everything is: the bench files by their paths from the folder named (they are one folder down)."""
    names = ", ".join(str(path.relative_to(out)) for path in bench_files)
    return f"everything is in {out.resolve()} (bench files: {names}; the head's race's in head-bench/)"


def claim_folder(out: Path) -> None:
    """Mark `out` as the demo's own (DEMO_MARK), so that its next run replaces what this one writes there."""
    from specbatch.perfmodel.jsonio import make_dir, write_text_atomic

    make_dir(out, "--out")
    write_text_atomic(out / DEMO_MARK, "written by `specbatch demo`: its next run here replaces the demo's own files "
                                       "(never files of another kind)\n")


def is_demo_folder(out: Path) -> bool:
    """Whether an earlier demo run made `out` its own (README's first command, run twice, must not need --force)."""
    return (out / DEMO_MARK).is_file()


def run_head_demo(console: Console, out: Path, pair, prompts: list[list[int]], race_sizes: tuple[int, ...],
                  max_new_tokens: int, rounds: int, max_batch: int, device: str | None,
                  cuda_graphs: bool | None) -> None:
    """Stage 6: the demo EAGLE-3 head drafts instead of the draft model: its quick calibration, its acceptance per
    position beside the draft model's (both measured by drafting, on the same prompts), its table, and the table
    raced against plain decoding."""
    from specbatch.bench.config import BenchConfig, BenchModels
    from specbatch.bench.outputs import write_outputs
    from specbatch.bench.results import compared_rate
    from specbatch.calibrate.acceptance import drafted_acceptance
    from specbatch.calibrate.run import QUICK_EFFORT, CalibrationRequest
    from specbatch.perfmodel.fit import fit_profile
    from specbatch.perfmodel.model import choose_acceptance, compute_table, save_model
    from specbatch.perfmodel.profile import load_profile
    from specbatch.perfmodel.table import write_table
    from specbatch.runtime.heads import load_head
    from specbatch.runtime.sampling import Sampling

    from .bench import bench_with_progress
    from .calibration import calibrate_with_progress, render_calibration
    from .model import render_table

    profile_path, model_path, table_path = out / "head-profile.json", out / "head-model.json", out / "head-table.json"
    console.rule("[bold]6/6 the same loop with a head: the demo EAGLE-3 head drafts from the target's hidden states")
    request = CalibrationRequest(target=str(DEMO_TARGET), draft=str(DEMO_HEAD), out=profile_path, device=device,
                                 prompts=DEMO_PROMPTS, quick=True, force=True, cuda_graphs=cuda_graphs,
                                 batch_sizes=HEAD_BATCH_SIZES, max_k=HEAD_MAX_K)
    render_calibration(calibrate_with_progress(request, show=True))
    fitted = fit_profile(load_profile(profile_path))
    save_model(model_path, fitted)
    head = load_head(DEMO_HEAD, pair.target)
    measured = fitted.acceptance[0].per_position
    draft_model = drafted_acceptance(pair.target, pair.draft, prompts[:QUICK_EFFORT.prompt_count], Sampling(),
                                     len(measured), QUICK_EFFORT.continuation_tokens, pair.eos_token_ids).per_position
    console.print("acceptance per draft position (greedy, both drafted as the runtime drafts, the same prompts):",
                  markup=False, highlight=False)
    for name, values in (("  head       ", measured), ("  draft model", draft_model)):
        console.print(name + " " + " ".join(f"{value:.2f}" for value in values), markup=False, highlight=False)
    table = compute_table(fitted, choose_acceptance(fitted, None, str(model_path)), max_batch)
    write_table(table_path, table, "json")
    render_table(table, fitted.extrapolation_notes(max_batch, [b.context_len for b in table.buckets], table.max_k),
                 table_path)
    config = BenchConfig(batch_sizes=race_sizes, ks=(0,), max_new_tokens=max_new_tokens, rounds=rounds,
                         table_path=table_path, model_path=model_path, cuda_graphs=cuda_graphs)
    models = BenchModels(target=pair.target, draft=head, target_source=str(DEMO_TARGET), draft_source=str(DEMO_HEAD),
                         target_dir=DEMO_TARGET, draft_dir=DEMO_HEAD, random_weights=False)
    race = bench_with_progress(config, models, prompts)
    write_outputs(race, out / "head-bench")
    for batch in race.batches:
        plain, tabled = batch.policy("k=0"), batch.policy("table")
        console.print(f"batch size {batch.batch_size}: head table {tabled.strategy} {compared_rate(tabled):.0f} tok/s "
                      f"vs plain {compared_rate(plain):.0f} tok/s -> [bold]{batch.table_speedup:.2f}x[/]")


def prediction_contradiction(policy) -> str | None:
    """A line when the measured steady-state goodput contradicts the prediction by more than the noise
    (the p10-p90 spread of the interleaved rounds), with the usual reasons; None when they agree."""
    predicted, measured = policy.predicted_tokens_per_s, policy.median_steady_tokens_per_s
    low, high = policy.p10_steady_tokens_per_s, policy.p90_steady_tokens_per_s
    if predicted is None or measured is None or low is None or high is None or low <= predicted <= high:
        return None
    return (f"  note: predicted {predicted:.0f} tok/s, measured {measured:.0f} ({predicted / measured - 1:+.0%}), "
            f"outside the rounds' spread {low:.0f}-{high:.0f}: the quick profile was timed under other load than "
            "this race (a busy or throttled machine, other processes), or its few repetitions were noisy; "
            "calibrate without --quick, with --threads below the core count, when the machine is quiet")
