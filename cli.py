"""`specbatch`: calibrate a machine, fit the performance model, tabulate the best speculation length
per batch size, and generate with the table.

Commands are thin: they parse options, call library functions that return dataclasses, and render.
Heavy modules (torch, scipy, scikit-learn) are imported inside the commands so `--help` is instant.
"""
from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

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


class UsageError(ValueError):
    """Bad input found by the CLI itself; printed as one line."""


def _user_errors() -> tuple[type[BaseException], ...]:
    """Error classes that mean 'bad input': printed as one line, exit code 2, never a traceback."""
    errors: list[type[BaseException]] = [UsageError, FileNotFoundError, json.JSONDecodeError]
    for module, name in (("runtime.config", "ConfigError"), ("runtime.checkpoint", "CheckpointError"),
                         ("runtime.generator", "GenerationError"), ("perfmodel.errors", "PerfModelError"),
                         ("calibrate.errors", "CalibrationError")):
        loaded = sys.modules.get(module)
        if loaded is not None and hasattr(loaded, name):
            errors.append(getattr(loaded, name))
    return tuple(errors)


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
            if isinstance(error, _user_errors()):
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
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout and nothing else.")]


def default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def read_prompts_file(path: Path) -> list[str]:
    """One prompt per line: a JSON string, or the plain line itself."""
    if not path.is_file():
        raise UsageError(f"{path}: no such prompts file")
    prompts = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            value = line
        prompts.append(value if isinstance(value, str) else line)
    if not prompts:
        raise UsageError(f"{path}: the prompts file is empty")
    return prompts


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


@app.command()
@one_line_errors
def generate(
    prompt: Annotated[Optional[list[str]], typer.Option("--prompt", help="Prompt text (repeatable).")] = None,
    prompts_file: Annotated[Optional[Path], typer.Option("--prompts-file", help="One JSON string (or plain line) per line.")] = None,
    target: TargetOpt = None,
    draft: DraftOpt = None,
    k: Annotated[Optional[int], typer.Option("--k", help="Fixed speculation length (default 4 with a draft, 0 without).")] = None,
    table: Annotated[Optional[Path], typer.Option("--table", help="specbatch.table/1 file: k per batch size.")] = None,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens")] = 64,
    temperature: Annotated[float, typer.Option("--temperature", help="0 = greedy.")] = 0.0,
    top_k: Annotated[int, typer.Option("--top-k", help="0 = no top-k filter.")] = 0,
    top_p: Annotated[float, typer.Option("--top-p", help="Nucleus mass in (0, 1].")] = 1.0,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    json_output: JsonOpt = False,
):
    """Generate text with batched speculative decoding (all prompts in one batch)."""
    if k is not None and k < 0:
        raise UsageError(f"--k must be >= 0, got {k}")
    if k is not None and table is not None:
        raise UsageError("--k and --table are mutually exclusive")
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

    target_model, draft_model = load_pair(target, draft, device, dtype, need_draft=k != 0)
    if target_model.tokenizer is None:
        raise UsageError(f"{target_model.path}: no tokenizer.json, cannot encode text prompts")
    policy = TableK(table) if table is not None else FixedK(k if k is not None else (4 if draft_model else 0))
    if draft_model is None and policy.max_k > 0:
        raise UsageError("k > 0 needs a draft model (--draft)")
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p)
    encoded = [target_model.tokenizer.encode(t) for t in texts]
    generator = SpeculativeGenerator(target_model.model, draft_model.model if draft_model else None,
                                     target_model.eos_token_ids)
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


if __name__ == "__main__":
    app()
