"""`specbatch`: calibrate a machine, fit the performance model, tabulate the best speculation length
per batch size, and generate with the table.

Commands are thin: they parse options, call library functions that return dataclasses, and render.
Heavy modules (torch, scipy, scikit-learn) are imported inside the commands so `--help` is instant.
"""
from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from perfmodel.errors import SpecbatchError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Optimal speculation length per batch size: calibrate, fit, table, query, generate, bench, demo.",
)



@app.callback()
def main() -> None:
    """Optimal speculation length per batch size: calibrate, fit, table, query, generate, bench, demo."""


DATA_DIR = Path(__file__).resolve().parent / "data"
DEMO_TARGET = DATA_DIR / "models" / "demo-target"
DEMO_DRAFT = DATA_DIR / "models" / "demo-draft"
DEMO_PROMPTS = DATA_DIR / "prompts" / "heldout.jsonl"


class UsageError(SpecbatchError):
    """Bad input found by the CLI itself; printed as one line."""


def one_line_errors(command):
    """Turn the library's input errors into `error: <message>` on stderr and exit code 2."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(130)
        except Exception as error:  # noqa: BLE001 - filtered just below
            if isinstance(error, (SpecbatchError, FileNotFoundError, json.JSONDecodeError)):
                typer.echo(f"error: {error}", err=True)
                raise typer.Exit(2)
            raise

    return wrapper


def parse_int_list(option: str, text: str | None) -> list[int] | None:
    """'1,2,4' -> [1, 2, 4]; every value must be a positive integer."""
    if text is None:
        return None
    values = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or int(part) <= 0:
            raise UsageError(f"{option}: {part!r} is not a positive integer (expected e.g. 1,2,4)")
        values.append(int(part))
    return values


# Shared options, defined once.
TargetOpt = Annotated[Optional[str], typer.Option("--target", help="Target model directory (default: bundled demo target).")]
DraftOpt = Annotated[Optional[str], typer.Option("--draft", help="Draft model directory (default: bundled demo draft).")]
DeviceOpt = Annotated[Optional[str], typer.Option("--device", help="cpu or cuda (default: cuda if available).")]
DtypeOpt = Annotated[Optional[str], typer.Option("--dtype", help="float32 | bfloat16 | float16 (default: float32 on CPU, bfloat16 on CUDA).")]
ModelFileArg = Annotated[Path, typer.Argument(help="specbatch.model/1 file written by `specbatch fit`.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout and nothing else.")]


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def read_prompts_file(path: Path, option: str = "--prompts-file") -> list[str]:
    """One prompt per line: a JSON string, or the plain line itself (calibrate's reader, shared)."""
    from calibrate.acceptance import read_prompts

    return read_prompts(path, option)


def load_pair(target: str | None, draft: str | None, device: str | None, dtype: str | None, need_draft: bool = True):
    """Load target (and draft) model directories; defaults are the bundled demo pair."""
    from runtime.checkpoint import load_checkpoint, parse_dtype

    device = device or default_device()
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise UsageError(f"--device {device!r}: expected cpu or cuda")
    if device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is available on this machine")
    torch_dtype = parse_dtype(dtype, device)
    target_model = load_checkpoint(target or DEMO_TARGET, device, torch_dtype)
    draft_model = None
    if need_draft and (draft is not None or target is None):
        draft_model = load_checkpoint(draft or DEMO_DRAFT, device, torch_dtype)
        if draft_model.config.vocab_size != target_model.config.vocab_size:
            raise UsageError(
                f"draft vocabulary ({draft_model.config.vocab_size} tokens, {draft_model.path}) differs from the "
                f"target's ({target_model.config.vocab_size} tokens, {target_model.path}): the tokenizers must agree"
            )
    return target_model, draft_model


TreeOpt = Annotated[Optional[str], typer.Option(
    "--tree", help="Draft tree: rank paths like 0,1,0.0,0.1 (rank 0 = the draft's top token), chain:K, a JSON "
                   "list of paths, or auto (the tree the performance model in --model picks per batch size).")]
Stage2Opt = Annotated[Optional[Path], typer.Option(
    "--stage2", help="n-gram file (specbatch.ngram/1) that speeds up the draft model's own drafting.")]


def is_ngram_file(path: str | None) -> bool:
    return path is not None and path.endswith(".safetensors") and Path(path).is_file()


def load_ngram(path: Path | str, option: str, target_model=None, *, vocab_size: int | None = None,
               model_dir: Path | None = None):
    """An n-gram file checked against the target's vocabulary and tokenizer (one-line errors); the
    target is a loaded checkpoint, or its vocabulary size and directory (None for shape presets)."""
    from runtime.ngram import NGramModel, tokenizer_fingerprint

    if target_model is not None:
        vocab_size, model_dir = target_model.config.vocab_size, Path(target_model.path)
    ngram = NGramModel.load(path)
    tokenizer_file = Path(model_dir) / "tokenizer.json" if model_dir is not None else None
    fingerprint = tokenizer_fingerprint(tokenizer_file) if tokenizer_file and tokenizer_file.is_file() else None
    ngram.check_compatible(vocab_size, fingerprint, f"{option} {path}")
    return ngram


def strategy_policy(tree: str, stage2: Path | None, model_file: Path | None, max_batch: int):
    """The policy for --tree SPEC (the same tree every step) or --tree auto: the strategy the performance
    model in `model_file` predicts best at each batch size up to `max_batch` (trees and chains, and with
    the second stage when --stage2 is given), computed here as an in-memory table."""
    from perfmodel.tree import Strategy, parse_tree
    from runtime.policy import FixedStrategy, TableK

    if tree != "auto":
        return FixedStrategy(Strategy(parse_tree(tree), stage2=stage2 is not None))
    if model_file is None:
        raise UsageError("--tree auto needs --model FILE (a specbatch.model/1 file from `specbatch fit`)")
    from perfmodel.model import choose_acceptance, compute_table, load_model

    fitted = load_model(model_file)
    if stage2 is not None and fitted.stage2 is None:
        raise UsageError(f"--stage2 with --tree auto: {model_file} has no second-stage measurements; "
                         "calibrate with --stage2 first")
    table = compute_table(fitted, choose_acceptance(fitted, None, str(model_file)), max_batch,
                          strategies="all" if stage2 is not None else "tree")
    return TableK(table)


def second_stage_for(policy, stage2: Path | None, target_model):
    """The n-gram model a policy needs: --stage2, else the file a table names (checked by sha256)."""
    table = getattr(policy, "table", None)
    if stage2 is None and getattr(policy, "needs_stage2", False):
        named = table.stage2["file"] if table is not None and table.stage2 else None
        if named is None or not Path(named).is_file():
            raise UsageError(f"{policy.describe()} uses the n-gram second stage; pass --stage2 FILE")
        stage2 = Path(named)
    if stage2 is None:
        return None
    if table is not None and table.stage2 and getattr(policy, "needs_stage2", False):
        from perfmodel.jsonio import file_sha256

        digest = file_sha256(Path(stage2))
        if digest != table.stage2["sha256"]:
            raise UsageError(f"--stage2 {stage2}: not the n-gram file the table was computed for "
                             f"(sha256 {digest[:12]}, the table names {table.stage2['sha256'][:12]})")
    return load_ngram(stage2, "--stage2", target_model)


@app.command()
@one_line_errors
def generate(
    prompt: Annotated[Optional[list[str]], typer.Option("--prompt", help="Prompt text (repeatable).")] = None,
    prompts_file: Annotated[Optional[Path], typer.Option("--prompts-file", help="One JSON string (or plain line) per line.")] = None,
    target: TargetOpt = None,
    draft: DraftOpt = None,
    k: Annotated[Optional[int], typer.Option("--k", help="Fixed speculation length (default 4 with a draft, 0 without).")] = None,
    table: Annotated[Optional[Path], typer.Option("--table", help="specbatch.table/1 file: k per batch size.")] = None,
    tree: TreeOpt = None,
    stage2: Stage2Opt = None,
    model: Annotated[Optional[Path], typer.Option("--model", help="specbatch.model/1 file, for --tree auto.")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens")] = 64,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy.")] = 0.0,
    top_k: Annotated[int, typer.Option("--top-k", help="0 = no top-k filter.")] = 0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus mass in (0, 1].")] = 1.0,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    json_output: JsonOpt = False,
):
    """Generate text with batched speculative decoding (all prompts in one batch).

    --draft may also be an n-gram file (.safetensors from data/train_ngram.py): the n-gram alone drafts."""
    if k is not None and k < 0:
        raise UsageError(f"--k must be >= 0, got {k}")
    if sum(x is not None for x in (k, table, tree)) > 1:
        raise UsageError("--k, --table and --tree are mutually exclusive")
    if not 0.0 < top_p <= 1.0:
        raise UsageError(f"--top-p must be in (0, 1], got {top_p}")
    if temperature < 0 or top_k < 0:
        raise UsageError("--temperature and --top-k must be >= 0")
    texts = list(prompt or [])
    if prompts_file is not None:
        texts += read_prompts_file(prompts_file)
    if not texts:
        raise UsageError("give at least one --prompt or a --prompts-file")
    if table is not None and not table.is_file():
        raise UsageError(f"--table {table}: no such file")

    from runtime.generator import SpeculativeGenerator
    from runtime.policy import FixedK, TableK
    from runtime.sampling import Sampling

    ngram_draft = is_ngram_file(draft)
    target_model, draft_model = load_pair(target, None if ngram_draft else draft, device, dtype,
                                          need_draft=k != 0 and not ngram_draft)
    if target_model.tokenizer is None:
        raise UsageError(f"{target_model.path}: no tokenizer.json, cannot encode text prompts")
    draft_runner = draft_model.model if draft_model else None
    if ngram_draft:
        if stage2 is not None:
            raise UsageError("--stage2 speeds up a draft MODEL; with an n-gram --draft there is nothing to stage")
        draft_runner = load_ngram(draft, "--draft", target_model)
    if tree is not None:
        policy = strategy_policy(tree, stage2, model, len(texts))
    elif stage2 is not None and table is None:
        raise UsageError("--stage2 needs --tree or --table (a chain is --tree chain:K)")
    else:
        policy = TableK(table) if table is not None else FixedK(k if k is not None else (4 if draft_runner else 0))
    second_stage = second_stage_for(policy, stage2, target_model)
    if draft_runner is None and policy.max_k > 0:
        raise UsageError("k > 0 needs a draft model (--draft)")
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
    encoded = [target_model.tokenizer.encode(t) for t in texts]
    generator = SpeculativeGenerator(target_model.model, draft_runner, target_model.eos_token_ids, stage2=second_stage)
    result = generator.generate(encoded, max_new_tokens, policy, sampling, seed)
    decode = target_model.tokenizer.decode
    outputs = [{"prompt": t, "text": decode(ids), "token_ids": ids} for t, ids in zip(texts, result.token_ids)]
    if json_output:
        typer.echo(json.dumps({"outputs": outputs, "stats": result.stats.to_dict(), "policy": policy.describe(),
                               "sampling": sampling.describe()}))
        return
    render_generation(outputs, result.stats, policy.describe(), sampling.describe())


def render_generation(outputs: list[dict], stats, policy_name: str, sampling_name: str) -> None:
    from collections import Counter

    from rich.console import Console
    from rich.table import Table

    console = Console()
    for i, out in enumerate(outputs):
        console.rule(f"[bold]prompt {i + 1}")
        console.print(out["prompt"], end="", style="dim", markup=False, highlight=False)
        console.print(out["text"], markup=False, highlight=False)
    summary = Table(title=f"generation stats ({policy_name}, {sampling_name})", show_header=False)
    summary.add_row("generated tokens", str(stats.generated_tokens))
    summary.add_row("steps", str(stats.steps))
    summary.add_row("mean tokens per row-step", f"{stats.tokens_per_step:.2f}")
    summary.add_row("tokens/s (wall, incl. prefill)", f"{stats.tokens_per_s:.1f}")
    summary.add_row("time: prefill / draft / verify / other (s)",
                    f"{stats.prefill_s:.3f} / {stats.draft_s:.3f} / {stats.verify_s:.3f} / {stats.other_s:.3f}")
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


# ---------------------------------------------------------------------------------------------- calibrate
# Light modules (plain dicts and dataclasses, no torch): they give --help its preset names and defaults.
from calibrate import grid as _grid, presets as _presets  # noqa: E402


def _ints(values) -> str:
    return ",".join(map(str, values))


_CALIBRATE_MODEL_HELP = ("Model directory (real weights), config.json or shape preset (random weights: "
                         f"{', '.join(_presets.PRESET_NAMES)})")


@app.command("calibrate")
@one_line_errors
def calibrate_command(
    target: Annotated[Optional[str], typer.Option("--target", help=f"{_CALIBRATE_MODEL_HELP}. Default: bundled demo target.")] = None,
    draft: Annotated[Optional[str], typer.Option("--draft", help="Same forms as --target. Default: bundled demo draft.")] = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    batch_sizes: Annotated[Optional[str], typer.Option("--batch-sizes", help=f"Batch sizes to time (default {_ints(_grid.DEFAULT_BATCH_SIZES)}; --quick {_ints(_grid.QUICK_BATCH_SIZES)}).")] = None,
    max_k: Annotated[int, typer.Option("--max-k", help="Longest speculation: target passes of 1..max_k+1 tokens are timed.")] = _grid.DEFAULT_MAX_K,
    context_lens: Annotated[Optional[str], typer.Option("--context-lens", help=f"Cached tokens per row (default {_ints(_grid.DEFAULT_CONTEXT_LENS)}; --quick {_ints(_grid.QUICK_CONTEXT_LENS)}).")] = None,
    prompts: Annotated[Optional[Path], typer.Option("--prompts", help="Prompts for acceptance, one JSON string per line (default: bundled held-out prompts).")] = None,
    acceptance: Annotated[Optional[str], typer.Option("--acceptance", help="Give acceptance instead of measuring it: 0.8, or per position 0.9,0.85,0.8 (required with random weights).")] = None,
    sampling: Annotated[Optional[list[str]], typer.Option("--sampling", help="Also measure acceptance for T=0.8[,top_k=50][,top_p=0.95] (repeatable); greedy is always measured.")] = None,
    out: Annotated[Path, typer.Option("-o", "--out", help="Profile to write (its timing rows also go to the .csv beside it).")] = Path("profile.json"),
    resume: Annotated[bool, typer.Option("--resume", help="Keep the points already in --out and measure only the rest.")] = False,
    quick: Annotated[bool, typer.Option("--quick", help="Coarser grid, fewer repetitions and prompts: a first look in seconds.")] = False,
    stage2: Annotated[Optional[Path], typer.Option(
        "--stage2", help="n-gram file to measure as the draft's second stage (default: the bundled n-gram with the "
                         "bundled draft).")] = None,
    no_stage2: Annotated[bool, typer.Option("--no-stage2", help="Measure no second stage.")] = False,
    json_output: JsonOpt = False,
):
    """Time the pair's forward passes over (batch size, new tokens, context) and measure acceptance (per
    position, and per depth and rank for trees) and the n-gram second stage: a profile."""
    from calibrate.run import CalibrationRequest

    request = CalibrationRequest(
        target=target or str(DEMO_TARGET), draft=draft or str(DEMO_DRAFT), out=out, device=device, dtype=dtype,
        batch_sizes=tuple(parse_int_list("--batch-sizes", batch_sizes) or ()) or None,
        context_lens=tuple(parse_int_list("--context-lens", context_lens) or ()) or None,
        max_k=max_k, prompts=prompts or DEMO_PROMPTS, acceptance=acceptance, samplings=tuple(sampling or ()),
        resume=resume, quick=quick, stage2=_stage2_for_calibration(stage2, no_stage2, draft, acceptance),
    )
    summary = _calibrate_with_progress(request, show=not json_output)
    if json_output:
        typer.echo(json.dumps(summary.to_json()))
        return
    render_calibration(summary)


def _stage2_for_calibration(stage2: Path | None, no_stage2: bool, draft: str | None, acceptance: str | None):
    """--stage2, or the bundled n-gram for the bundled draft (recorded relative to the working directory when
    it lies below it, so a profile and its tables stay valid in another clone)."""
    from calibrate.stage2 import default_stage2

    if no_stage2:
        if stage2 is not None:
            raise UsageError("--stage2 and --no-stage2 are mutually exclusive")
        return None
    if stage2 is not None:
        return stage2
    bundled = default_stage2(draft or str(DEMO_DRAFT), acceptance)
    if bundled is None:
        return None
    relative = Path(os.path.relpath(bundled))
    return relative if not str(relative).startswith("..") else bundled


def _calibrate_with_progress(request, show: bool):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from calibrate.run import calibrate

    if not show:
        return calibrate(request)
    columns = (TextColumn("[bold]calibrate"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.description}"))
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("checking inputs, loading models", total=None)

        def on_progress(event):
            progress.update(task, completed=event.done, total=event.total, description=event.label)

        try:
            return calibrate(request, on_progress)
        except KeyboardInterrupt:
            progress.stop()
            typer.echo(f"interrupted: every point measured so far is in {request.out}; "
                       f"rerun with --resume to measure the rest", err=True)
            raise typer.Exit(130)


def render_calibration(summary) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    console.print(f"[bold]{escape(summary.target)}[/] + [bold]{escape(summary.draft)}[/] on "
                  f"{escape(summary.device)} ({summary.dtype})")
    passes = Table(title="one forward pass, median ms")
    for column in ("model", "batch size", "new tokens", "context", "ms"):
        passes.add_column(column, justify="right")
    for row in summary.passes:
        ms = "out of memory" if row.median_ms is None else f"{row.median_ms:.3g}"
        passes.add_row(row.model, str(row.batch_size), str(row.new_tokens), str(row.context_len), ms)
    console.print(passes)
    for entry in summary.acceptance:
        alphas = ", ".join(f"{alpha:.3f}" for alpha in entry.per_position)
        console.print(f"acceptance per draft position ({entry.setting}, {entry.source}): {alphas}")
    counts = f"{summary.points_measured} points measured in {summary.elapsed_s:.1f} s"
    if summary.points_resumed:
        counts += f", {summary.points_resumed} kept from the previous run"
    if summary.points_infeasible:
        counts += f", {summary.points_infeasible} out of memory"
    console.print(counts)
    console.print(f"wrote {summary.profile_path} and {summary.csv_path}", markup=False, highlight=False)


# ---------------------------------------------------------------------------------------------- bench
_BENCH_MODEL_HELP = "Model directory, shape preset (random weights) or config.json path"


def parse_ks(text: str) -> list[int]:
    """'0,1,2,4' -> [0, 1, 2, 4]: non-negative integers, at least one."""
    values = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if not part.isdigit():
            raise UsageError(f"--ks: {part!r} is not an integer >= 0 (expected e.g. 0,1,2,4)")
        values.append(int(part))
    if not values:
        raise UsageError("--ks: give at least one k (e.g. 0,1,2,4)")
    return values


@app.command()
@one_line_errors
def bench(
    target: Annotated[Optional[str], typer.Option("--target", help=f"{_BENCH_MODEL_HELP} (default: bundled demo target).")] = None,
    draft: Annotated[Optional[str], typer.Option("--draft", help=f"{_BENCH_MODEL_HELP} (default: bundled demo draft).")] = None,
    table: Annotated[Optional[Path], typer.Option("--table", help="specbatch.table/1 file: adds the table policy.")] = None,
    model: Annotated[Optional[Path], typer.Option("--model", help="specbatch.model/1 file: adds predicted tokens/s.")] = None,
    tree: Annotated[Optional[list[str]], typer.Option(
        "--tree", help="Also run this draft tree (repeatable): rank paths like 0,1,0.0, chain:K, or auto (the "
                       "model's best tree at batch size 1; needs --model).")] = None,
    stage2: Annotated[Optional[Path], typer.Option(
        "--stage2", help="n-gram file: also run every k > 0 and every --tree with the second stage.")] = None,
    batch_sizes: Annotated[str, typer.Option("--batch-sizes")] = "1,2,4,8,16,32",
    ks: Annotated[str, typer.Option("--ks", help="Fixed k to compare; k = 0 is always run.")] = "0,1,2,3,4,5,6,7,8",
    prompts: Annotated[Optional[Path], typer.Option("--prompts", help="One JSON string (or plain line) per line (default: bundled held-out prompts).")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Per row; EOS is ignored.")] = 64,
    rounds: Annotated[int, typer.Option("--rounds", help="Timed interleaved rounds per batch size.")] = 5,
    sampling: Annotated[str, typer.Option("--sampling", help="greedy | T=0.8[,top_k=50][,top_p=0.9]")] = "greedy",
    synthetic_acceptance: Annotated[Optional[float], typer.Option("--synthetic-acceptance", help="Accept each draft token with probability α in (0, 1] instead of verifying (SYNTHETIC; for presets).")] = None,
    peers: Annotated[bool, typer.Option("--peers", help="Also time transformers generate (plain, and assisted at batch size 1).")] = False,
    out: Annotated[Path, typer.Option("--out", help="Output folder for bench.json, bench.csv and plots.")] = Path("specbatch-bench"),
    seed: Annotated[int, typer.Option("--seed")] = 0,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    json_output: JsonOpt = False,
):
    """Measure k = 0, every fixed k, trees, staged drafting and the table at every batch size, interleaved;
    regret, speedup, and chain vs tree vs staged side by side."""
    from calibrate.bench import BenchError

    try:
        _bench(target, draft, table, model, tuple(tree or ()), stage2, batch_sizes, ks, prompts, max_new_tokens,
               rounds, sampling, synthetic_acceptance, peers, out, seed, device, dtype, json_output)
    except BenchError as error:
        raise UsageError(str(error)) from None


def _bench(target, draft, table, model, trees, stage2, batch_sizes, ks, prompts, max_new_tokens, rounds, sampling,
           synthetic_acceptance, peers, out, seed, device, dtype, json_output) -> None:
    from calibrate.bench import BenchConfig, parse_sampling

    # every option is checked before a model is loaded
    config = BenchConfig(
        batch_sizes=tuple(parse_int_list("--batch-sizes", batch_sizes) or ()), ks=tuple(parse_ks(ks)),
        max_new_tokens=max_new_tokens, rounds=rounds, sampling=parse_sampling(sampling),
        synthetic_acceptance=synthetic_acceptance, seed=seed, table_path=table, model_path=model, peers=peers,
        trees=trees, stage2_path=stage2,
    )
    for option, path in (("--table", table), ("--model", model), ("--prompts", prompts), ("--stage2", stage2)):
        if path is not None and not path.is_file():
            raise UsageError(f"{option} {path}: no such file")

    from calibrate.environment import resolve_device
    from calibrate.models import check_pair, load_pair as load_specs, resolve_model
    from calibrate.bench import RANDOM_PROMPT_TOKENS, BenchModels, random_prompts, run_bench, write_outputs
    from runtime.checkpoint import parse_dtype

    target_spec = resolve_model(target or str(DEMO_TARGET), "target")
    draft_spec = resolve_model(draft or str(DEMO_DRAFT), "draft")
    check_pair(target_spec, draft_spec)
    random_weights = target_spec.random_weights or draft_spec.random_weights
    if random_weights and synthetic_acceptance is None:
        raise UsageError("random weights (a preset or config.json) never agree with a target: pass "
                         "--synthetic-acceptance α to benchmark the shape")
    device = resolve_device(device)
    pair = load_specs(target_spec, draft_spec, device, parse_dtype(dtype, device))
    # each round of batch size b takes the next b prompts (cycling), so small batches see many prompts
    needed = max(config.batch_sizes) * (config.rounds + config.warmup_rounds)
    if pair.tokenizer is not None:
        texts = read_prompts_file(prompts or DEMO_PROMPTS, "--prompts")[:needed]  # fewer are cycled
        token_prompts = [pair.tokenizer.encode(text) for text in texts]
    elif prompts is not None:
        raise UsageError(f"--prompts: {target_spec.source} has no tokenizer.json to encode text; leave --prompts "
                         "out to benchmark with random token prompts")
    else:
        token_prompts = random_prompts(needed, RANDOM_PROMPT_TOKENS, target_spec.config.vocab_size, seed)
    ngram = None if stage2 is None else load_ngram(stage2, "--stage2", vocab_size=target_spec.config.vocab_size,
                                                   model_dir=target_spec.directory)
    models = BenchModels(target=pair.target, draft=pair.draft, target_source=target_spec.source,
                         draft_source=draft_spec.source, target_dir=target_spec.directory,
                         draft_dir=draft_spec.directory, random_weights=random_weights, stage2=ngram)

    result = run_bench(config, models, token_prompts) if json_output else \
        _bench_with_progress(config, models, token_prompts)
    if pair.tokenizer is None:
        result.notes.insert(0, f"prompts: {needed} random sequences of {RANDOM_PROMPT_TOKENS} tokens (no tokenizer)")
    written = write_outputs(result, out)
    if json_output:
        from calibrate.bench import bench_json

        typer.echo(json.dumps({**bench_json(result), "outputs": [str(path) for path in written]}))
        return
    render_bench(result, written)


def _bench_with_progress(config, models, token_prompts):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from calibrate.bench import run_bench

    columns = (TextColumn("[bold]bench"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
               TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("", total=None)

        def on_run(record, done, total):
            phase = "warm-up" if record.warmup else f"round {record.round + 1}/{config.rounds}"
            progress.update(task, completed=done, total=total,
                            description=f"b={record.batch_size} {phase} {record.policy}: {record.tokens_per_s:.0f} tok/s")

        return run_bench(config, models, token_prompts, on_run=on_run)


def _rate(tokens_per_s: float | None) -> str:
    """Tokens/s for a narrow column: no decimals once the integer part says enough."""
    if tokens_per_s is None:
        return "-"
    return f"{tokens_per_s:.0f}" if tokens_per_s >= 100 else f"{tokens_per_s:.1f}"


def _relative(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:+.1f}%"


def render_bench(result, written: list[Path]) -> None:
    from rich.console import Console
    from rich.table import Table

    from calibrate.bench import TABLE_POLICY, compared_rate, fixed_policy_name

    console = Console()
    config = result.config
    has_table, has_model = config.table_path is not None, config.model_path is not None
    # the label and the settings are lines of their own: a table title or caption wraps to the table's width
    if result.synthetic:
        console.print(result.synthetic, style="bold red", markup=False, highlight=False)
    console.print(f"bench: {result.models['target']['source']} + {result.models['draft']['source']} on "
                  f"{result.device['kind']} ({result.device['name']}), {config.sampling.describe()}, "
                  f"{config.max_new_tokens} new tokens per row; tokens/s: steady-state goodput (steps with the full batch: "
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
            wall_speedup = shown.median_tokens_per_s / plain.median_tokens_per_s
            row += [f"{shown.k}: {_rate(compared_rate(shown))}", f"{100 * batch.table_regret:.1f}%",
                    f"{batch.table_speedup:.2f}x (wall {wall_speedup:.2f}x)"]
        if has_model:
            predicted, steady = shown.predicted_tokens_per_s, shown.median_steady_tokens_per_s
            row += [f"{_rate(predicted)} vs {_rate(steady)}",
                    _relative(None if predicted is None or not steady else predicted / steady - 1)]
        ratios = {f"{r.ours} / {r.theirs}": r.ratio for r in batch.peer_ratios}
        row += [f"{ratios[c]:.2f}x" if c in ratios else "-" for c in peer_columns]
        summary.add_row(*row)
    console.print(summary)
    if has_model:
        errors = Table(title="prediction error: predicted / measured - 1 (median steady-state tokens/s: full-batch steps)")
        names = [p.policy for p in result.batches[0].policies if p.predicted_tokens_per_s is not None]
        for header in ["b", *names]:
            errors.add_column(header, justify="right")
        for batch in result.batches:
            cells = []
            for name in names:
                policy = batch.policy(name)
                predicted = policy.predicted_tokens_per_s if policy else None
                steady = policy.median_steady_tokens_per_s if policy else None
                cells.append(_relative(None if predicted is None or not steady else predicted / steady - 1))
            errors.add_row(str(batch.batch_size), *cells)
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
    for note in result.notes:
        console.print(f"note: {note}", markup=False, highlight=False)
    console.print(f"wrote {', '.join(str(path) for path in written)}", markup=False, highlight=False)


def _short_policy(name: str, width: int = 28) -> str:
    return name if len(name) <= width else name[:width - 3] + "..."


# ---------------------------------------------------------------- performance model: fit, table, query, plot

AcceptanceOpt = Annotated[Optional[str], typer.Option(
    "--acceptance", help="What-if acceptance: one alpha (0.8) or per position (0.9,0.85,0.8); "
                         "default: the profile's measurement.")]
MaxKOpt = Annotated[Optional[int], typer.Option("--max-k", help="Largest k considered (default: the profile's max_k).")]
MaxBatchOpt = Annotated[int, typer.Option("--max-batch", help="Tabulate batch sizes 1..this.")]
TABLE_FORMATS = ("json", "csv", "vllm", "trtllm")


def _check_counts(max_batch: int | None = None, max_k: int | None = None, batch_size: int | None = None,
                  context_len: int | None = None) -> None:
    if max_batch is not None and max_batch < 1:
        raise UsageError(f"--max-batch must be >= 1, got {max_batch}")
    if max_k is not None and max_k < 0:
        raise UsageError(f"--max-k must be >= 0, got {max_k}")
    if batch_size is not None and batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {batch_size}")
    if context_len is not None and context_len < 0:
        raise UsageError(f"--context-len must be >= 0, got {context_len}")


def _acceptance_override(text: str | None):
    if text is None:
        return None
    from perfmodel.acceptance import parse_acceptance_option

    return parse_acceptance_option(text, "--acceptance")


@app.command()
@one_line_errors
def fit(
    profile: Annotated[Path, typer.Argument(help="specbatch.profile/1 file written by `specbatch calibrate`.")],
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the specbatch.model/1 file.")],
    holdout: Annotated[bool, typer.Option(
        "--holdout", help="Also fit without every other interior batch size and context length and report the "
                          "error on those.")] = False,
    json_output: JsonOpt = False,
):
    """Fit each role's pass latency T(b, n, L) from a profile; report parameters and errors."""
    from perfmodel.model import fit_profile, model_to_json, save_model
    from perfmodel.profile import load_profile

    fitted = fit_profile(load_profile(profile), holdout=holdout)
    save_model(output, fitted)
    if json_output:
        roles = {role: {key: value for key, value in obj.items() if key != "points"}
                 for role, obj in model_to_json(fitted)["roles"].items()}
        typer.echo(json.dumps({"model": str(output), "roles": roles}))
        return
    render_fit(fitted, output)


def render_fit(fitted, output: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
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
    if not fitted.overhead.measured:
        console.print("[yellow]note:[/] the profile has no step-overhead rows: overhead taken as 0 ms")
    if not fitted.acceptance:
        console.print("[yellow]note:[/] the profile has no acceptance: `table` and `query` will need --acceptance")
    console.print(f"wrote {output}")


@app.command()
@one_line_errors
def table(
    model: ModelFileArg,
    output: Annotated[Path, typer.Option("-o", "--output", help="Where to write the table (or its export).")],
    max_batch: MaxBatchOpt = 64,
    context_lens: Annotated[Optional[str], typer.Option(
        "--context-lens", help="One table bucket per context length, e.g. 512,2048,8192 "
                               "(default: one bucket at the profile's middle context length).")] = None,
    acceptance: AcceptanceOpt = None,
    max_k: MaxKOpt = None,
    strategies: Annotated[str, typer.Option(
        "--strategies", help="chain (chains only) | tree (chains and trees) | all (and the n-gram second stage, "
                             "when the profile measured one).")] = "all",
    max_tree_nodes: Annotated[int, typer.Option("--max-tree-nodes", help="Largest tree considered.")] = 64,
    fmt: Annotated[str, typer.Option("--format", help="json (specbatch.table/1) | csv | vllm | trtllm.")] = "json",
):
    """Best strategy (none, a chain of k, a tree, with or without the second stage) for every batch size
    1..max-batch, with its predicted gain. vllm/trtllm exports express chains only (a tree's depth as k)."""
    _check_counts(max_batch=max_batch, max_k=max_k)
    if fmt not in TABLE_FORMATS:
        raise UsageError(f"--format: {fmt!r} is not one of {', '.join(TABLE_FORMATS)}")
    lengths = parse_int_list("--context-lens", context_lens)
    from perfmodel import table as tables
    from perfmodel.jsonio import write_json_atomic, write_text_atomic
    from perfmodel.model import choose_acceptance, compute_table, load_model

    fitted = load_model(model)
    chosen = choose_acceptance(fitted, _acceptance_override(acceptance), str(model))
    if max_tree_nodes < 1:
        raise UsageError(f"--max-tree-nodes must be >= 1, got {max_tree_nodes}")
    result = compute_table(fitted, chosen, max_batch, lengths, max_k, strategies=strategies,
                           max_tree_nodes=max_tree_nodes)
    if fmt == "json":
        tables.save_table(output, result)
    elif fmt == "csv":
        write_text_atomic(output, tables.to_csv(result))
    else:
        export = tables.to_vllm if fmt == "vllm" else tables.to_trtllm
        write_json_atomic(output, export(result))
    notes = fitted.extrapolation_notes(max_batch, [b.context_len for b in result.buckets], result.max_k)
    render_table(result, notes, output)


def render_table(result, notes: list[str], output: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    acc = result.acceptance
    console.print(f"acceptance ({acc['source']}): per position {acc['per_position']}, "
                  f"constant-alpha fit {acc['constant_alpha']:.3f} (rmse {acc['constant_alpha_rmse']:.3f})")
    for bucket in result.buckets:
        view = Table(title=f"best strategy per batch size, context {bucket.context_len} (runs collapsed)")
        for column in ("b", "strategy", "k*", "tokens/s", "speedup vs k=0", "runner-up", "min margin"):
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
                         "; ".join(runner_ups[:2]) or "-", f"{min(margins):.1%}" if margins else "-")
        console.print(view)
    for note in notes:
        console.print(f"[yellow]note:[/] {note}")
    console.print(f"wrote {output}")


def _span(first: float, last: float, fmt: str) -> str:
    return fmt.format(first) if fmt.format(first) == fmt.format(last) else f"{fmt.format(first)}-{fmt.format(last)}"


@app.command()
@one_line_errors
def query(
    batch_size: Annotated[int, typer.Option("--batch-size", help="Sequences in the batch.")],
    model: Annotated[Optional[Path], typer.Argument(help="specbatch.model/1 file (or use --table).")] = None,
    table_path: Annotated[Optional[Path], typer.Option("--table", help="specbatch.table/1 file instead of a model.")] = None,
    context_len: Annotated[Optional[int], typer.Option(
        "--context-len", help="Mean context length (default: the profile's middle one / the table's first bucket).")] = None,
    acceptance: AcceptanceOpt = None,
    max_k: MaxKOpt = None,
    tree: TreeOpt = None,
    stage2: Stage2Opt = None,
    json_output: JsonOpt = False,
):
    """Step time, tokens per step and goodput of every k at one batch size, and the best k.

    --tree auto ranks every strategy (chains, grown trees, and with the second stage when the model has
    its measurements); --tree SPEC [--stage2 FILE] predicts that one tree (a what-if)."""
    _check_counts(batch_size=batch_size, context_len=context_len, max_k=max_k)
    if (model is None) == (table_path is None):
        raise UsageError("give either a model file or --table, not both or neither")
    if table_path is not None and (acceptance is not None or max_k is not None or tree is not None):
        raise UsageError("--acceptance, --max-k and --tree need a model file: a table was computed with fixed values")
    if stage2 is not None and tree is None:
        raise UsageError("--stage2 needs --tree (a chain is --tree chain:K)")
    if model is not None and tree is not None:
        answer, notes = _query_strategies(model, batch_size, context_len, acceptance, max_k, tree, stage2)
    elif model is not None:
        from perfmodel.model import choose_acceptance, load_model
        from perfmodel.model import query as query_model

        fitted = load_model(model)
        chosen = choose_acceptance(fitted, _acceptance_override(acceptance), str(model))
        context = fitted.default_context_len() if context_len is None else context_len
        choice = query_model(fitted, chosen, batch_size, context, fitted.grid.max_k if max_k is None else max_k)
        answer = {"batch_size": batch_size, "context_len": context, "best_k": choice.best_k,
                  "candidates": [{"k": c.k, "step_ms": c.step_ms, "tokens_per_step": c.tokens_per_step,
                                  "tokens_per_s": c.tokens_per_s} for c in choice.candidates]}
        notes = fitted.extrapolation_notes(batch_size, [context], len(choice.candidates) - 1)
    else:
        answer, notes = _query_table(table_path, batch_size, context_len), []
    if json_output:
        typer.echo(json.dumps(answer))
        return
    render_query(answer, notes)


def _query_strategies(model: Path, batch_size: int, context_len: int | None, acceptance: str | None,
                      max_k: int | None, tree: str, stage2: Path | None) -> tuple[dict, list[str]]:
    """--tree auto: every candidate strategy ranked; --tree SPEC: that strategy alone."""
    from perfmodel.jsonio import file_sha256
    from perfmodel.model import choose_acceptance, evaluate_strategy, load_model, query_strategies
    from perfmodel.tree import Strategy, parse_tree

    fitted = load_model(model)
    chosen = choose_acceptance(fitted, _acceptance_override(acceptance), str(model))
    context = fitted.default_context_len() if context_len is None else context_len
    if stage2 is not None:
        if fitted.stage2 is None:
            raise UsageError(f"--stage2: {model} has no second-stage measurements; run calibrate with --stage2 {stage2}")
        digest = file_sha256(Path(stage2))
        if digest != fitted.stage2.sha256:
            raise UsageError(f"--stage2 {stage2}: the model measured another n-gram file ({fitted.stage2.file}, "
                             f"sha256 {fitted.stage2.sha256[:12]}); calibrate with this one first")
    if tree == "auto":
        family = "all" if stage2 is not None or fitted.stage2 is not None else "tree"
        ranked = query_strategies(fitted, chosen, batch_size, context, max_k, family).ranked
    else:
        strategy = Strategy(parse_tree(tree), stage2=stage2 is not None)
        ranked = [evaluate_strategy(fitted, Strategy(None), batch_size, context, chosen),
                  evaluate_strategy(fitted, strategy, batch_size, context, chosen)]
    candidates = [{"strategy": c.strategy.describe(), "k": c.strategy.k, "step_ms": c.step_ms,
                   "tokens_per_step": c.tokens_per_step, "tokens_per_s": c.tokens_per_s,
                   "draft_passes": c.draft_passes} for c in ranked]
    best = max(ranked, key=lambda c: c.tokens_per_s)
    answer = {"batch_size": batch_size, "context_len": context, "best_k": best.strategy.k,
              "best_strategy": best.strategy.to_json(), "candidates": candidates}
    return answer, list(fitted.strategy_notes([c.strategy for c in ranked]))


def _query_table(path: Path, batch_size: int, context_len: int | None) -> dict:
    """With only a table, the candidate is the table's own choice, with the goodput it predicted; the
    step time follows from G = b * E / S when E is known (chains: from the table's acceptance)."""
    from perfmodel.acceptance import expected_tokens
    from perfmodel.table import load_table

    loaded = load_table(path)
    strategy = loaded.strategy(batch_size, context_len)
    bucket = loaded.bucket_for(context_len)
    candidate = {"strategy": strategy.describe(), "k": strategy.k, "step_ms": None, "tokens_per_step": None,
                 "tokens_per_s": None}
    per_position = loaded.acceptance.get("per_position")
    if per_position and strategy.kind != "tree":
        candidate["tokens_per_step"] = expected_tokens(per_position, strategy.k)
    if batch_size <= bucket.max_batch:  # beyond the table, its numbers belong to another batch size
        goodput = bucket.entries[batch_size - 1].predicted_tokens_per_s
        candidate["tokens_per_s"] = goodput
        if candidate["tokens_per_step"] is not None:
            candidate["step_ms"] = batch_size * candidate["tokens_per_step"] / goodput * 1e3
    return {"batch_size": batch_size, "context_len": bucket.context_len, "best_k": strategy.k,
            "best_strategy": strategy.to_json(), "candidates": [candidate]}


def render_query(answer: dict, notes: list[str]) -> None:
    from rich.console import Console
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
        cells = [f"{c[key]:.4g}" if c[key] is not None else "-" for key in ("step_ms", "tokens_per_step", "tokens_per_s")]
        is_best = (c["strategy"] == ranked[0]["strategy"]) if with_strategies else c["k"] == answer["best_k"]
        view.add_row(c["strategy"] if with_strategies else str(c["k"]), *cells, style="bold green" if is_best else None)
    console = Console()
    console.print(view)
    for note in notes:
        console.print(f"[yellow]note:[/] {note}")


@app.command()
@one_line_errors
def plot(
    model: ModelFileArg,
    output: Annotated[Path, typer.Option("-o", "--output", help="Image file to write (png, pdf, svg).")],
    max_batch: MaxBatchOpt = 64,
    context_len: Annotated[Optional[int], typer.Option("--context-len", help="Context length of the heatmap.")] = None,
    acceptance: AcceptanceOpt = None,
    max_k: MaxKOpt = None,
):
    """Goodput heatmap over (b, k) with the k*(b) curve, and fitted vs measured latency per role."""
    _check_counts(max_batch=max_batch, max_k=max_k, context_len=context_len)
    from perfmodel.model import choose_acceptance, load_model
    from perfmodel.plot import plot_model

    fitted = load_model(model)
    chosen = choose_acceptance(fitted, _acceptance_override(acceptance), str(model))
    plot_model(fitted, chosen, output, max_batch, context_len, max_k)
    typer.echo(f"wrote {output}")


# ---------------------------------------------------------------------------------------------- demo
@app.command()
@one_line_errors
def demo(
    out: Annotated[Path, typer.Option("--out", help="Folder for everything the demo writes.")] = Path("specbatch-demo"),
    batch_sizes: Annotated[str, typer.Option("--batch-sizes", help="Batch sizes at which the table is raced against plain decoding.")] = "1,8",
    prompts_shown: Annotated[int, typer.Option("--prompts-shown", help="Held-out prompts generated and printed.")] = 3,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens")] = 48,
    rounds: Annotated[int, typer.Option("--rounds", help="Interleaved timed rounds per batch size.")] = 3,
    max_batch: Annotated[int, typer.Option("--max-batch", help="Largest batch size in the table.")] = 32,
    device: DeviceOpt = None,
):
    """The whole loop on the bundled demo pair: quick calibration, fit, table, generation, measured speedup."""
    race_sizes = parse_int_list("--batch-sizes", batch_sizes)
    if prompts_shown <= 0 or max_new_tokens <= 0 or rounds <= 0 or max_batch <= 0:
        raise UsageError("--prompts-shown, --max-new-tokens, --rounds and --max-batch must be positive")
    from rich.console import Console

    console = Console()
    out.mkdir(parents=True, exist_ok=True)
    paths = {name: out / name for name in ("profile.json", "model.json", "table.json", "table.csv",
                                           "vllm.json", "trtllm.json", "generations.jsonl")}

    console.rule("[bold]1/5 calibrate (quick): time the demo pair's passes on this machine, measure acceptance")
    from calibrate.run import CalibrationRequest

    stage2 = _stage2_for_calibration(None, False, None, None)  # the bundled n-gram: trees and staged drafting
    request = CalibrationRequest(target=str(DEMO_TARGET), draft=str(DEMO_DRAFT), out=paths["profile.json"],
                                 device=device, prompts=DEMO_PROMPTS, quick=True, stage2=stage2)
    render_calibration(_calibrate_with_progress(request, show=True))

    console.rule("[bold]2/5 fit the latency and acceptance model")
    from perfmodel.model import choose_acceptance, compute_table, fit_profile, save_model
    from perfmodel.profile import load_profile

    fitted = fit_profile(load_profile(paths["profile.json"]))
    save_model(paths["model.json"], fitted)
    render_fit(fitted, paths["model.json"])

    console.rule("[bold]3/5 the table: best strategy (none, chain of k, tree, +n-gram stage) for every batch size")
    from perfmodel import table as tables
    from perfmodel.jsonio import write_json_atomic, write_text_atomic

    table_result = compute_table(fitted, choose_acceptance(fitted, None, str(paths["model.json"])), max_batch)
    tables.save_table(paths["table.json"], table_result)
    write_text_atomic(paths["table.csv"], tables.to_csv(table_result))
    write_json_atomic(paths["vllm.json"], tables.to_vllm(table_result))
    write_json_atomic(paths["trtllm.json"], tables.to_trtllm(table_result))
    render_table(table_result, fitted.extrapolation_notes(max_batch, [b.context_len for b in table_result.buckets],
                                                          table_result.max_k), paths["table.json"])

    console.rule("[bold]4/5 generate held-out prompts with the table")
    from runtime.generator import SpeculativeGenerator
    from runtime.policy import TableK

    target_model, draft_model = load_pair(None, None, device, None)
    texts = read_prompts_file(DEMO_PROMPTS)[:prompts_shown]
    policy = TableK(paths["table.json"])
    ngram = second_stage_for(policy, stage2 if policy.needs_stage2 else None, target_model)
    generator = SpeculativeGenerator(target_model.model, draft_model.model, target_model.eos_token_ids, stage2=ngram)
    encoded = [target_model.tokenizer.encode(t) for t in texts]
    result = generator.generate(encoded, max_new_tokens, policy)
    outputs = [{"prompt": t, "text": target_model.tokenizer.decode(ids), "token_ids": ids}
               for t, ids in zip(texts, result.token_ids)]
    write_text_atomic(paths["generations.jsonl"], "".join(json.dumps(o) + "\n" for o in outputs))
    render_generation(outputs, result.stats, policy.describe(), "greedy")

    console.rule(f"[bold]5/5 race the table against plain decoding (k = 0) at batch sizes {race_sizes}")
    from calibrate.bench import BenchConfig, BenchModels, compared_rate, write_outputs

    config = BenchConfig(batch_sizes=tuple(race_sizes), ks=(0,), max_new_tokens=max_new_tokens, rounds=rounds,
                         table_path=paths["table.json"], model_path=paths["model.json"],
                         stage2_path=stage2 if ngram is not None else None)
    models = BenchModels(target=target_model.model, draft=draft_model.model, target_source=str(DEMO_TARGET),
                         draft_source=str(DEMO_DRAFT), target_dir=DEMO_TARGET, draft_dir=DEMO_DRAFT,
                         random_weights=False, stage2=ngram)
    prompts = [target_model.tokenizer.encode(t) for t in read_prompts_file(DEMO_PROMPTS)]
    race = _bench_with_progress(config, models, prompts)
    written = write_outputs(race, out / "bench")
    for batch in race.batches:
        plain, tabled = batch.policy("k=0"), batch.policy("table")
        console.print(f"batch size {batch.batch_size}: table {tabled.strategy} {compared_rate(tabled):.0f} tok/s vs "
                      f"plain {compared_rate(plain):.0f} tok/s -> [bold]{batch.table_speedup:.2f}x[/] "
                      f"(steady-state goodput, median of {rounds} interleaved rounds)")
    console.print(f"everything is in {out.resolve()} (bench files: {', '.join(p.name for p in written)})",
                  markup=False, highlight=False)



# ================================================================================ serve / loadtest
# `specbatch serve` and `specbatch loadtest` (issue 11): thin commands; the engine is runtime/engine.py,
# the HTTP server and the load test live in serve/ (logging and rendering there too).

@app.command("serve")
@one_line_errors
def serve_command(
    target: TargetOpt = None,
    draft: DraftOpt = None,
    table: Annotated[Optional[Path], typer.Option("--table", help="specbatch.table/1 file (default: computed at start-up from a quick profile).")] = None,
    k: Annotated[Optional[int], typer.Option("--k", help="Fixed speculation length instead of a table (0: none).")] = None,
    tree: Annotated[Optional[str], typer.Option("--tree", help="A fixed draft tree (rank paths like 0,1,0.0) instead of a table.")] = None,
    host: Annotated[str, typer.Option("--host", help="Address to bind (loopback by default; there is no authentication).")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port")] = 8000,
    max_batch_size: Annotated[int, typer.Option("--max-batch-size", help="Running requests at most (the table's largest batch).")] = 32,
    kv_budget_tokens: Annotated[Optional[int], typer.Option("--kv-budget-tokens", help="KV tokens running requests may reserve (prompt + max_tokens + draft margin each).")] = None,
    max_waiting: Annotated[int, typer.Option("--max-waiting", help="Queued requests beyond which new ones get 429.")] = 1024,
    max_tokens_limit: Annotated[int, typer.Option("--max-tokens-limit", help="The largest max_tokens a request may ask for.")] = 1024,
    profile: Annotated[Optional[Path], typer.Option("--profile", help="Quick-profile file to reuse or write (default: the user cache directory).")] = None,
    threads: Annotated[Optional[int], typer.Option("--threads", help="torch intra-op threads (default: torch's).")] = None,
    model_name: Annotated[Optional[str], typer.Option("--model-name", help="Model name clients send (default: the target directory's name).")] = None,
    drain_s: Annotated[float, typer.Option("--drain-s", help="Seconds in-flight requests get at SIGINT/SIGTERM before they are cancelled.")] = 30.0,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
):
    """Serve the pair over an OpenAI-compatible HTTP API with continuous batching; the table picks k every step."""
    from serve.server import ServeOptions, serve

    serve(ServeOptions(target=target, draft=draft, table=table, k=k, tree=tree, host=host, port=port,
                       max_batch_size=max_batch_size, kv_budget_tokens=kv_budget_tokens, max_waiting=max_waiting,
                       max_tokens_limit=max_tokens_limit, device=device, dtype=dtype, profile=profile,
                       threads=threads, model_name=model_name, drain_s=drain_s))


@app.command("loadtest")
@one_line_errors
def loadtest_command(
    policies: Annotated[str, typer.Option("--policies", help="Comma list: table, k=K, tree=SPEC.")] = "table,k=0",
    rates: Annotated[str, typer.Option("--rates", help="Arrival rates, requests/s, comma list.")] = "1,2,4",
    cvs: Annotated[str, typer.Option("--cvs", help="Coefficients of variation of the Gamma gaps (1 = Poisson).")] = "1",
    requests: Annotated[int, typer.Option("--requests", help="Requests per (policy, rate, CV).")] = 100,
    max_duration_s: Annotated[float, typer.Option("--max-duration-s", help="Bound on each run; later arrivals are not sent.")] = 120.0,
    max_tokens: Annotated[str, typer.Option("--max-tokens", help="MIN-MAX new tokens per request (uniform).")] = "64-128",
    seed: Annotated[int, typer.Option("--seed")] = 0,
    slo_ttft_ms: Annotated[Optional[float], typer.Option("--slo-ttft-ms")] = None,
    slo_tpot_ms: Annotated[Optional[float], typer.Option("--slo-tpot-ms")] = None,
    slo_e2e_ms: Annotated[Optional[float], typer.Option("--slo-e2e-ms")] = None,
    prompts_file: Annotated[Optional[Path], typer.Option("--prompts-file", help="Default: the bundled held-out prompts.")] = None,
    out: Annotated[Path, typer.Option("--out")] = Path("specbatch-loadtest"),
    in_process: Annotated[bool, typer.Option("--in-process", help="Also replay each trace on the engine in this process (HTTP overhead).")] = False,
    check_greedy: Annotated[bool, typer.Option("--check-greedy", help="Compare every response with its solo greedy output.")] = False,
    target: TargetOpt = None,
    draft: DraftOpt = None,
    table: Annotated[Optional[Path], typer.Option("--table", help="Table for the 'table' policy (default: the server's quick profile).")] = None,
    max_batch_size: Annotated[int, typer.Option("--max-batch-size")] = 32,
    threads: Annotated[int, typer.Option("--threads", help="torch threads of each server.")] = 1,
    profile: Annotated[Optional[Path], typer.Option("--profile", help="Quick-profile file the servers share.")] = None,
):
    """Open-loop load test: the same Poisson/Gamma arrival trace against a server per policy (loopback)."""
    from serve.loadtest import LoadtestConfig, run_loadtest
    from serve.loadtest_report import Slo, render_runs

    low, _, high = max_tokens.partition("-")
    if not (low.isdigit() and high.isdigit() and 0 < int(low) <= int(high)):
        raise UsageError(f"--max-tokens {max_tokens!r}: expected MIN-MAX, e.g. 64-128")
    try:
        rates_per_s, cv_values = tuple(float(x) for x in rates.split(",")), tuple(float(x) for x in cvs.split(","))
    except ValueError:
        raise UsageError(f"--rates {rates!r} / --cvs {cvs!r}: expected comma lists of numbers") from None
    server_args = ["--max-batch-size", str(max_batch_size), "--threads", str(threads)]
    for flag, value in (("--target", target), ("--draft", draft), ("--table", table), ("--profile", profile)):
        if value is not None:
            server_args += [flag, str(value)]
    config = LoadtestConfig(
        policies=tuple(p.strip() for p in policies.split(",") if p.strip()),
        rates_per_s=rates_per_s, cvs=cv_values,
        requests=requests, max_duration_s=max_duration_s, max_tokens=(int(low), int(high)), seed=seed,
        slo=Slo(slo_ttft_ms, slo_tpot_ms, slo_e2e_ms),
        prompts=tuple(read_prompts_file(prompts_file or DEMO_PROMPTS)), server_args=tuple(server_args),
        in_process=in_process, check_greedy=check_greedy)
    report = run_loadtest(config, out)
    render_runs(report["runs"])
    typer.echo(f"wrote {out / 'loadtest.json'}, {out / 'loadtest.csv'} and {out / 'latency.png'}")
# ============================================================================ end serve / loadtest


if __name__ == "__main__":
    app()
