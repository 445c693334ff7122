"""How noisy the machine was while a profile was measured: a reference pass timed again and again.

Calibrate times one cheap reference pass (the target at the grid's smallest batch size, one new token,
the smallest context) at the start, at intervals while it measures, and at the end; each check is the
median of a few samples with its p10 and p90. Two figures, both relative to the checks' median:

    drift  = (max - min) / 2 over the checks' medians: the machine got faster or slower (another job
             started, thermal throttling), so points measured at different times are not comparable;
    jitter = the median over checks of (p90 - p10) / 2: sample-to-sample spread within one check;
    floor  = the mean |check - median| of the checks' medians: the MAPE a perfect model of this one pass
             would still show against timings taken at those moments. A fit's MAPE near it is the
             machine's, not the model's (`fit` prints both).

A figure above the ±3 % repetition rule (calibrate.timing) means timings can be off by that much with
nothing else to show for it: the profile records it and calibrate says so in one line. Assumption: the
reference pass is slowed as much as the grid's passes are; oversubscribed threads slow wide passes more
than this narrow one, so the figures are a lower bound on the noise.
"""
from __future__ import annotations

import re
import statistics
from dataclasses import dataclass
from typing import Any

from ..errors import PerfModelError
from ..fields import duration_ms, listed, record, string

NOISE_RULE = 0.03  # the repetition rule's ±3 %: noise above it is larger than the precision we claim


@dataclass(frozen=True)
class NoiseCheck:
    elapsed_s: float  # since calibration started
    median_ms: float
    p10_ms: float
    p90_ms: float


@dataclass(frozen=True)
class NoiseFigure:
    reference: str  # which pass, e.g. "target b=1 n=1 L=64"
    checks: tuple[NoiseCheck, ...]  # in time order

    @property
    def level_ms(self) -> float:
        return statistics.median(c.median_ms for c in self.checks)

    @property
    def drift(self) -> float:
        medians = [c.median_ms for c in self.checks]
        return (max(medians) - min(medians)) / 2 / self.level_ms

    @property
    def jitter(self) -> float:
        return statistics.median((c.p90_ms - c.p10_ms) / 2 / c.median_ms for c in self.checks)

    def reference_shape(self) -> tuple[int, int]:
        """(batch size, context) of the reference pass, a target pass of one new token: what `bench` times
        again to compare the machine's speed with calibration's."""
        found = re.fullmatch(r"target b=(\d+) n=1 L=(\d+)", self.reference)
        if found is None:
            raise PerfModelError(f"noise reference {self.reference!r}: expected 'target b=B n=1 L=L'")
        return int(found.group(1)), int(found.group(2))

    @property
    def floor_mape(self) -> float:
        return statistics.fmean(abs(c.median_ms - self.level_ms) for c in self.checks) / self.level_ms

    @property
    def too_noisy(self) -> bool:
        return self.drift > NOISE_RULE or self.jitter > NOISE_RULE

    def warning(self) -> str | None:
        """One line when the noise exceeds the rule, else None."""
        if not self.too_noisy:
            return None
        return (f"warning: noisy machine: the reference pass ({self.reference}) drifted ±{100 * self.drift:.1f} % "
                f"over {len(self.checks)} checks and jittered ±{100 * self.jitter:.1f} % within them, above the "
                f"±{100 * NOISE_RULE:.0f} % rule; timings may be off by that much (other jobs on the cores?)")

    def to_json(self) -> dict[str, Any]:
        return {"reference": self.reference, "drift": self.drift, "jitter": self.jitter,
                "floor_mape": self.floor_mape, "rule": NOISE_RULE,
                "too_noisy": self.too_noisy,
                "checks": [{"elapsed_s": c.elapsed_s, "median_ms": c.median_ms, "p10_ms": c.p10_ms,
                            "p90_ms": c.p90_ms} for c in self.checks]}


def noise_from_json(obj: Any, where: str) -> NoiseFigure:
    """The profile's optional `noise` object; drift, jitter and too_noisy are recomputed from the checks."""
    checks = tuple(record(NoiseCheck, check, f"{where}.checks[{index}]")
                   for index, check in enumerate(listed(obj, "checks", where)))
    reference = string(obj, "reference", where)
    if not checks:
        raise PerfModelError(f"{where}.checks: expected at least one check")
    for index, check in enumerate(checks):
        for key in ("median_ms", "p10_ms", "p90_ms"):
            duration_ms({key: getattr(check, key)}, key, f"{where}.checks[{index}]", allow_zero=key != "median_ms")
    return NoiseFigure(reference, checks)
