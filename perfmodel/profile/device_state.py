"""The GPU's own state while a profile was measured (the optional `device_state` section).

A GPU under sustained load lowers its clocks when it reaches its power or temperature limit, and timings
taken after that are slower than those taken before: large-batch passes, which draw the most power,
come out optimistic if measured early. Calibrate therefore runs the device at full load before timing
(`warmup_s`), and reads clocks, power and temperature through NVML at the start of timing and at the end
(`start`, `end`). `throttle_reasons` are NVML's clock-event reasons active at that moment (e.g.
`sw_power_cap`, `hw_thermal_slowdown`). A fall of the SM clock by more than CLOCK_DROP_RULE between start
and end is reported. Profiles without the section (older ones, CPUs, machines without NVML) load unchanged.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from ..errors import PerfModelError
from ..fields import integer, number

CLOCK_DROP_RULE = 0.03  # as the repetition rule's ±3 %: a clock that fell more than this moved the timings


@dataclass(frozen=True)
class DeviceReading:
    elapsed_s: float  # since calibration started
    sm_clock_mhz: int
    memory_clock_mhz: int
    power_w: float
    temperature_c: int
    throttle_reasons: tuple[str, ...] = ()


@dataclass(frozen=True)
class DeviceState:
    warmup_s: float  # seconds of full load before timing began
    max_sm_clock_mhz: int | None  # the device's maximum SM clock, when NVML gives it
    power_limit_w: float | None  # the enforced power limit, when NVML gives it
    start: DeviceReading | None  # when timing began (after the warm-up); None without NVML
    end: DeviceReading | None  # when calibration ended

    @property
    def clock_drop(self) -> float | None:
        """How much the SM clock fell from start to end, as a fraction of the start (negative: it rose)."""
        if self.start is None or self.end is None or self.start.sm_clock_mhz <= 0:
            return None
        return 1.0 - self.end.sm_clock_mhz / self.start.sm_clock_mhz

    def warning(self) -> str | None:
        """One line when the SM clock fell by more than the rule, else None."""
        drop = self.clock_drop
        if drop is None or drop <= CLOCK_DROP_RULE:
            return None
        reasons = ", ".join(self.end.throttle_reasons) or "none reported"
        return (f"warning: the GPU's SM clock fell from {self.start.sm_clock_mhz} to {self.end.sm_clock_mhz} MHz "
                f"(-{100 * drop:.0f} %) during calibration (at {self.end.power_w:.0f} W, {self.end.temperature_c} C; "
                f"clock-event reasons at the end: {reasons}): points measured late ran slower than early ones")

    def to_json(self) -> dict[str, Any]:
        obj = asdict(self)
        for key in ("start", "end"):
            if obj[key] is not None:
                obj[key]["throttle_reasons"] = list(obj[key]["throttle_reasons"])
        return obj


def _reading(obj: Any, where: str) -> DeviceReading:
    if not isinstance(obj, dict):
        raise PerfModelError(f"{where}: expected an object with clocks, power and temperature, found {obj!r}")
    reasons = obj.get("throttle_reasons", [])
    if not isinstance(reasons, list) or not all(isinstance(r, str) for r in reasons):
        raise PerfModelError(f"{where}.throttle_reasons: expected a list of names, found {reasons!r}")
    return DeviceReading(elapsed_s=number(obj, "elapsed_s", where, minimum=0.0),
                         sm_clock_mhz=integer(obj, "sm_clock_mhz", where, minimum=0),
                         memory_clock_mhz=integer(obj, "memory_clock_mhz", where, minimum=0),
                         power_w=number(obj, "power_w", where, minimum=0.0),
                         temperature_c=integer(obj, "temperature_c", where), throttle_reasons=tuple(reasons))


def device_state_from_json(obj: Any, where: str) -> DeviceState:
    """The profile's optional `device_state` object, checked field by field."""
    if not isinstance(obj, dict):
        raise PerfModelError(f"{where}: expected an object, found {obj!r}")
    return DeviceState(
        warmup_s=number(obj, "warmup_s", where, minimum=0.0),
        max_sm_clock_mhz=integer(obj, "max_sm_clock_mhz", where, minimum=0, nullable=True),
        power_limit_w=number(obj, "power_limit_w", where, minimum=0.0, nullable=True),
        start=None if obj.get("start") is None else _reading(obj["start"], f"{where}.start"),
        end=None if obj.get("end") is None else _reading(obj["end"], f"{where}.end"),
    )
