"""What every command shares: option types defined once, option parsing, and the one place where a
library error becomes `error: <message>` (exit code 2) and a table range warning a `note:` line."""
from __future__ import annotations

import errno
import functools
import io
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.core import TyperCommand, TyperGroup

from specbatch.runtime import presets as _presets
from specbatch.perfmodel.errors import SpecbatchError, UsageError
from specbatch.perfmodel.jsonio import REPLACE_RULE_HELP
from specbatch.perfmodel.table import MAX_TABLE_BATCH, MAX_TABLE_K, check_max_k


class _FlagsTakeNoValue:
    """--help shows no `<bool>` type beside a flag: a flag takes no value (`--force`, not `--force true`)."""

    def get_params(self, ctx):
        params = super().get_params(ctx)
        for param in params:
            if getattr(param, "is_flag", False) and param.metavar is None:
                param.metavar = ""
        return params


class _Command(_FlagsTakeNoValue, TyperCommand):
    pass


class _Group(_FlagsTakeNoValue, TyperGroup):
    pass


class App(typer.Typer):
    """typer.Typer whose commands show flags as flags in --help."""

    def __init__(self, **kwargs):
        super().__init__(cls=_Group, **kwargs)

    def command(self, *args, cls=None, **kwargs):
        return super().command(*args, cls=cls or _Command, **kwargs)


def one_line_errors(command):
    """Turn the library's input errors into `error: <message>` on stderr and exit code 2, and the table's
    range warnings into one `note:` line each (not a Python warning with its source line). A system error
    (a full disk, a read-only folder, standard output that takes no more bytes) is one line too: the path
    or "standard output" and the system's reason; files themselves are written atomically, so the old
    one is kept."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            with warnings.catch_warnings(record=True) as caught:  # the filters in force stay as they are
                result = command(*args, **kwargs)
            _say_warnings(caught)
            sys.stdout.flush()  # a full stdout fails here, inside the command, not at the interpreter's exit
            return result
        except KeyboardInterrupt:
            typer.echo("interrupted", err=True)
            raise typer.Exit(130)
        except (SpecbatchError, FileNotFoundError, json.JSONDecodeError) as error:
            typer.echo(f"error: {error}", err=True)
            raise typer.Exit(2)
        except OSError as error:
            typer.echo(f"error: {_os_error_line(error)}", err=True)
            raise typer.Exit(2)

    return wrapper


# A system error without a path at this level comes from a stream: files are written by the atomic
# writer (its errors name the file) and folders by jsonio.make_dir; stderr is where we would report it.
_STREAM_WRITE_ERRNOS = {errno.ENOSPC, errno.EPIPE, errno.EIO, errno.EFBIG, errno.EDQUOT}


def _os_error_line(error: OSError) -> str:
    from specbatch.perfmodel.jsonio import os_reason

    if error.filename is not None:
        return f"{error.filename}: {os_reason(error)}"
    if error.errno in _STREAM_WRITE_ERRNOS:
        _discard_stdout()
        return f"cannot write standard output ({os_reason(error)})"
    return os_reason(error)


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so the interpreter's last flush of what is still buffered does not fail
    a second time with a traceback of its own."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, io.UnsupportedOperation):  # not a real file (a test's capture)
        pass


def _say_warnings(caught) -> None:
    """Each distinct NoteWarning (a table's range, a pair's tokenizers) once, as a note; any other warning as
    Python would show it."""
    from specbatch.perfmodel.errors import NoteWarning

    said = set()
    for warning in caught:
        if issubclass(warning.category, NoteWarning):
            if str(warning.message) not in said:
                said.add(str(warning.message))
                typer.echo(f"note: {warning.message}", err=True)
        else:
            warnings.showwarning(warning.message, warning.category, warning.filename, warning.lineno)


def parse_int_list(option: str, text: str | None, minimum: int = 1) -> list[int] | None:
    """'1,2,4' -> [1, 2, 4]; every value an integer >= minimum, at least one."""
    if text is None:
        return None
    values = [part.strip() for part in text.split(",") if part.strip()]
    for part in values:
        if not part.isdigit() or int(part) < minimum:
            kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
            raise UsageError(f"{option}: {part!r} is not {kind} (expected e.g. {minimum},2,4)")
    if not values:
        raise UsageError(f"{option}: give at least one value (e.g. {minimum},2,4)")
    return [int(part) for part in values]


def check_counts(max_batch: int | None = None, max_k: int | None = None, batch_size: int | None = None,
                 context_len: int | None = None) -> None:
    for option, value, minimum in (("--max-batch", max_batch, 1), ("--max-k", max_k, 0),
                                   ("--batch-size", batch_size, 1), ("--context-len", context_len, 0)):
        if value is not None and value < minimum:
            raise UsageError(f"{option} must be >= {minimum}, got {value}")
    if max_batch is not None:
        from specbatch.perfmodel.model import check_max_batch

        check_max_batch(max_batch)
    if max_k is not None:
        check_max_k(max_k)


def acceptance_override(text: str | None):
    if text is None:
        return None
    from specbatch.perfmodel.acceptance import parse_acceptance_option

    return parse_acceptance_option(text, "--acceptance")


def read_prompts_file(path: Path, option: str = "--prompts-file") -> list[str]:
    from specbatch.calibrate.acceptance import read_prompts

    return read_prompts(path, option)


def busy_cores_elsewhere(interval_s: float = 0.2) -> float | None:
    """Cores kept busy right now by other processes: /proc/stat's non-idle share over `interval_s`, while
    this process sleeps (the load average would count our own previous command for a minute). None where
    /proc/stat cannot be read."""
    def sample() -> tuple[int, int]:
        with open("/proc/stat") as stat:
            values = [int(v) for v in stat.readline().split()[1:]]
        return sum(values), values[3] + values[4]  # all jiffies, idle + iowait

    try:
        total0, idle0 = sample()
        time.sleep(interval_s)
        total1, idle1 = sample()
    except (OSError, ValueError, IndexError):
        return None
    if total1 <= total0:
        return None
    return (os.cpu_count() or 1) * (1 - (idle1 - idle0) / (total1 - total0))


def set_threads(threads: int | None, resumed_profile: Path | None = None) -> None:
    """--threads: torch's intra-op threads for this run (recorded in every profile and bench file).

    Without --threads (and without OMP_NUM_THREADS, an explicit choice too), a machine whose other
    processes keep all but one core busy right now gets one thread, and a note says so: threads that wait
    for busy cores slow every pass many times over. The bounded spin of runtime/__init__.py limits the
    damage when the load arrives after the choice. A resumed calibration keeps the thread count its
    profile recorded (its timings must stay comparable)."""
    if threads is not None and threads < 1:
        raise UsageError(f"--threads must be >= 1, got {threads}")
    if threads is None and resumed_profile is not None and Path(resumed_profile).is_file():
        try:
            threads = int(json.loads(Path(resumed_profile).read_text())["device"]["cpu_threads"])
        except (ValueError, KeyError, TypeError, OSError):
            pass  # calibrate's own reader says what is wrong with the file
    import torch

    if threads is None and "OMP_NUM_THREADS" not in os.environ and torch.get_num_threads() > 1:
        cores, busy = os.cpu_count() or 1, busy_cores_elsewhere()
        if busy is not None and cores > 1 and busy >= cores - 1 - 0.25:
            typer.echo(f"note: other processes keep {busy:.1f} of {cores} cores busy: torch runs on 1 thread "
                       "(--threads N overrides)", err=True)
            threads = 1
    if threads is not None:
        torch.set_num_threads(threads)


def ints_text(values) -> str:
    """(1, 2, 4) -> '1,2,4', as an option takes it."""
    return ",".join(map(str, values))


def check_query_options(model: Path | None, table: Path | None, acceptance: str | None, max_k: int | None,
                        tree: str | None, stage2: Path | None, strategies: str) -> None:
    """`query`: a model file or --table (not both), and the options each of them can answer."""
    if (model is None) == (table is None):
        raise UsageError("give either a model file or --table, not both or neither")
    if table is not None and (acceptance is not None or max_k is not None or tree is not None):
        raise UsageError("--acceptance, --max-k and --tree need a model file: a table was computed with fixed values")
    if stage2 is not None and tree is None:
        raise UsageError("--stage2 needs --tree (a chain is --tree chain:K)")
    if strategies not in ("all", "tree", "chain"):
        raise UsageError(f"--strategies: {strategies!r} is not one of all, tree, chain")


# Shared options, defined once.
DRAFT_DEFAULT_HELP = ("Draft model directory, or a head (EAGLE-3/MTP in the speculators format: its directory, its "
                      f"config.json for random weights, or a head preset: {', '.join(_presets.HEAD_PRESETS)}), "
                      "or mtp: the target's own MTP layer (GLM-4.5, vLLM's method mtp). "
                      "Default: the bundled demo draft when the target is the demo target; with another --target, "
                      "no draft (a command that needs one says so)")
TargetOpt = Annotated[Optional[str], typer.Option(
    "--target", help="Target model directory (default: bundled demo target).")]
DraftOpt = Annotated[Optional[str], typer.Option(
    "--draft", help=DRAFT_DEFAULT_HELP)]
DeviceOpt = Annotated[Optional[str], typer.Option("--device", help="cpu or cuda (default: cuda if available).")]
DtypeOpt = Annotated[Optional[str], typer.Option(
    "--dtype", help="float32 | bfloat16 | float16 (default: float32 on CPU, bfloat16 on CUDA).")]
ModelFileArg = Annotated[Path, typer.Argument(help="specbatch.model/1 file written by `specbatch fit`.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print one JSON object on stdout and nothing else.")]
TreeOpt = Annotated[Optional[str], typer.Option(
    "--tree", help="Draft tree: rank paths like 0,1,0.0,0.1 (rank 0 = the draft's top token), chain:K, a JSON "
                   "list of paths, or auto (the tree the performance model in --model picks per batch size).")]
AdaptiveOpt = Annotated[Optional[Path], typer.Option(
    "--adaptive", help="specbatch.model/1 file: choose the strategy every step from the fitted model and each "
                       "request's acceptance learned online (runtime/adaptive.py).")]
RefitOpt = Annotated[bool, typer.Option(
    "--refit", help="With --adaptive: re-fit the step costs per role and pass width from the steps it runs, the "
                    "calibration as the prior (docs/adaptive.md).")]
Stage2Opt = Annotated[Optional[Path], typer.Option(
    "--stage2", help="n-gram file (specbatch.ngram/1) that speeds up the draft model's own drafting.")]
AcceptanceOpt = Annotated[Optional[str], typer.Option(
    "--acceptance", help="What-if acceptance: one alpha (0.8) or per position (0.9,0.85,0.8); "
                         "default: the profile's measurement.")]
ThreadsOpt = Annotated[Optional[int], typer.Option(
    "--threads", help="CPU threads torch may use (default: torch's choice, usually one per core).")]
ReplaceOpt = Annotated[bool, typer.Option("--force", help=REPLACE_RULE_HELP)]  # every command that writes files
EagerOpt = Annotated[bool, typer.Option(
    "--eager", help="Run every pass eagerly, kernel by kernel, instead of replaying CUDA graphs (graphs are how the "
                    "runtime runs on CUDA in bfloat16/float16; this is for comparison; float32 and CPU passes run "
                    "eagerly anyway).")]
AllowModeMismatchOpt = Annotated[bool, typer.Option(
    "--allow-mode-mismatch", help="Use costs measured with eager passes for a runtime that replays CUDA graphs, or "
                                  "the other way round (the step costs then describe another runtime).")]


def graphs_option(eager: bool) -> bool | None:
    """--eager: no CUDA graphs; otherwise the device's default (runtime.devices.graphs_by_default)."""
    return False if eager else None


def check_costs_here(device: str | None, dtype: str | None, eager: bool, allowed: bool, **files: Path | None) -> None:
    """`generate`: the execution rule (perfmodel.execution.check_execution) for every file whose costs choose what
    runs (keyword: the option; table: a table file, else a model file), against what the runtime runs here: on
    this machine's --device, in its --dtype, with or without --eager. Before anything is loaded."""
    from specbatch.perfmodel.execution import check_execution, model_execution, table_execution
    from specbatch.runtime.checkpoint import parse_dtype
    from specbatch.runtime.devices import execution_on, resolve_device

    given = {option: path for option, path in files.items() if path is not None}
    if not given:
        return
    resolved = resolve_device(device)
    running = execution_on(resolved, parse_dtype(dtype, resolved), graphs_option(eager))
    for option, path in given.items():
        if option == "table":
            from specbatch.perfmodel.table import load_table

            measured = table_execution(load_table(path).costs)
        else:
            from specbatch.perfmodel.model import load_model

            measured = model_execution(load_model(path))
        if measured is not None:
            check_execution(f"--{option} {path}", measured, running, allowed)


ForceOpt = Annotated[bool, typer.Option(
    "--force", help="Use a table or model made for another target/draft pair anyway.")]
MaxKOpt = Annotated[Optional[int], typer.Option("--max-k", help=(
    f"Largest k considered, at most {MAX_TABLE_K} (default: the profile's max_k)."))]
MaxBatchOpt = Annotated[int, typer.Option(
    "--max-batch", help=f"Tabulate batch sizes 1..this (at most {MAX_TABLE_BATCH}).")]
_RUNNABLE_PRESETS = [name for name in _presets.PRESET_NAMES
                     if _presets.PRESETS[name]["model_type"] not in _presets.SHAPE_ONLY]
MODEL_FORMS_HELP = ("Model directory (real weights), config.json or shape preset (random weights: "
                    f"{', '.join(_RUNNABLE_PRESETS)})")
AnyTargetOpt = Annotated[Optional[str], typer.Option(  # calibrate and bench: every form runtime.loading reads
    "--target", help=f"{MODEL_FORMS_HELP}. Default: bundled demo target.")]
AnyDraftOpt = Annotated[Optional[str], typer.Option(
    "--draft", help=f"Same forms as --target. {DRAFT_DEFAULT_HELP}")]
