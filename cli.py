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


if __name__ == "__main__":
    app()
