"""Which execution the step costs describe (eager passes, or CUDA graphs replayed), and the one check that a
runtime is not given the costs of the other: on CUDA a graphed pass can cost a third of an eager one, so a
table chosen on eager costs is chosen for another runtime. On a CPU everything is eager and nothing differs.
A profile records its execution in its device section (older profiles: eager); a model file carries the
profile's device section, and a table the model's costs, settings included.
"""
from __future__ import annotations

from .errors import UsageError

EAGER, GRAPHS = "eager", "cuda-graphs"


def check_execution(what: str, measured: str, running: str, allowed: bool = False) -> None:
    """Refuse, in one line, costs measured in one execution for a runtime running the other."""
    if measured == running or allowed:
        return
    how = "without --eager" if running == GRAPHS else "with --eager"
    raise UsageError(f"{what} holds costs of {measured} passes but the runtime runs {running} passes here: "
                     f"calibrate {how}, or pass --allow-mode-mismatch")


def check_costs(what: str, device, composition, engine, running: str, allowed: bool = False) -> None:
    """`fit`/`table`: a profile's (or model's) costs against `running`, the runtime's default execution on
    its device kind (runtime.devices.execution_on); composed costs (vidur's kernels) and an engine's own
    steps describe no execution of ours."""
    if composition is None and engine is None:
        check_execution(what, device.execution, running, allowed)


def table_execution(costs: dict | None) -> str:
    """The execution a table's costs were measured in (older tables, and engines' costs: eager)."""
    settings = (costs or {}).get("settings") or {}
    return settings.get("execution", EAGER)
