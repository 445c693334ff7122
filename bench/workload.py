"""What a bench round generates from: one prompt population, or two mixed or switched.

  * `heldout`: the --prompts file alone (default data/prompts/heldout.jsonl), as before;
  * `mixed`: the --prompts and --second-prompts populations alternate row by row, so every batch holds
    half of each (batch size 1 alternates them round by round);
  * `switch`: the first half of the timed rounds (and the warm-up) draw from --prompts, the rest from
    --second-prompts: the population changes half-way through the measurement.
A round's batch takes the next batch_size prompts of its population (cycling), as `heldout` always did.
Every policy of a round gets the same batch (interleaved rounds, `bench.harness`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

WORKLOADS = ("heldout", "mixed", "switch")


def cycled(prompts: Sequence[list[int]], count: int, offset: int) -> list[list[int]]:
    """`count` prompts from `offset` on, cycling through the list (deterministic)."""
    return [list(prompts[(offset + i) % len(prompts)]) for i in range(count)]


@dataclass(frozen=True)
class Workload:
    name: str  # one of WORKLOADS
    primary: tuple[tuple[int, ...], ...]
    secondary: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self):
        if self.name not in WORKLOADS:
            raise ValueError(f"--workload {self.name!r}: expected one of {', '.join(WORKLOADS)}")
        if not self.primary or (self.name != "heldout" and not self.secondary):
            raise ValueError(f"--workload {self.name}: no prompts to benchmark with")

    @property
    def prompts(self) -> list[list[int]]:
        """Every prompt the workload can draw (context checks, prompt statistics)."""
        return [list(p) for p in self.primary + (self.secondary if self.name != "heldout" else ())]

    def batch(self, batch_size: int, slot: int, warmup_rounds: int, rounds: int) -> list[list[int]]:
        """The prompts of round `slot` (0-based, the warm-up rounds first) at this batch size."""
        offset = slot * batch_size
        if self.name == "mixed":
            both = [p for pair in zip(self.primary, self.secondary) for p in pair]
            return cycled(both, batch_size, offset)
        if self.name == "switch" and slot - warmup_rounds >= (rounds + 1) // 2:
            return cycled(self.secondary, batch_size, offset)
        return cycled(self.primary, batch_size, offset)
