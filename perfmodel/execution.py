"""Which execution the step costs describe (eager passes, or CUDA graphs replayed), and the one rule that a
runtime is not given the costs of the other: on CUDA a graphed pass can cost a third of an eager one, so a
table chosen on eager costs is chosen for another runtime. On a CPU everything is eager and nothing differs.
A profile records its execution in its device section (older profiles: eager); a model file carries the
profile's device section, and a table the model's costs, settings included.

The rule is applied where costs choose what the runtime runs, on the machine that runs it: generate, bench and
serve (`check_execution`, with the execution their runtime really runs). `fit` and `table` may run anywhere,
for a runtime elsewhere, and only note a profile whose execution is not its own device's default
(`execution_note`): a deliberate --eager calibration is the costs of an --eager runtime.
"""
from __future__ import annotations

from .errors import UsageError

EAGER, GRAPHS = "eager", "cuda-graphs"


def check_execution(what: str, measured: str, running: str, allowed: bool = False) -> None:
    """Refuse, in one line, costs measured in one execution for the runtime here, which runs the other
    (`running`: what this machine's runtime runs, runtime.devices.execution_on with its --eager)."""
    if measured == running or allowed:
        return
    how = ("run with --eager, or calibrate without --eager" if running == GRAPHS else
           "calibrate with --eager (or run without it where passes replay CUDA graphs: CUDA in half precision)")
    raise UsageError(f"{what} holds costs of {measured} passes but the runtime runs {running} passes here: "
                     f"{how}, or pass --allow-mode-mismatch")


def model_execution(fitted) -> str | None:
    """The execution a fitted model's (or profile's) costs were measured in; None for costs that describe no
    execution of ours: composed from vidur's kernels, or an engine's own steps."""
    if getattr(fitted, "composition", None) is not None or getattr(fitted, "engine", None) is not None:
        return None
    return fitted.device.execution


def execution_note(what: str, device, measured: str | None, default: str) -> str | None:
    """`fit`/`table`: a line when the costs' execution is not the default on the device they were measured on
    (`default`: runtime.devices.execution_on of its kind and dtype), saying which runtime they describe; it says
    nothing of this machine, where the table may never run."""
    if measured is None or measured == default:
        return None
    runtime = "a runtime run with --eager" if measured == EAGER else "a runtime replaying CUDA graphs"
    return (f"{what} holds costs of {measured} passes, where the runtime on its device ({device.kind}, "
            f"{device.dtype}) runs {default} passes by default: its table describes {runtime} (generate, bench "
            "and serve refuse it for the other unless --allow-mode-mismatch)")


def table_execution(costs: dict | None) -> str:
    """The execution a table's costs were measured in (older tables, and engines' costs: eager)."""
    settings = (costs or {}).get("settings") or {}
    return settings.get("execution", EAGER)
