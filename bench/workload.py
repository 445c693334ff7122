"""What a bench round generates from: the prompts of every round at every batch size.

  * `heldout`: the --prompts file alone (default data/prompts/heldout.jsonl);
  * `mixed`: the --prompts and --second-prompts populations alternate row by row, so every batch holds
    half of each (batch size 1 alternates them round by round);
  * `switch`: the first half of the timed rounds (and the warm-up) draw from --prompts, the rest from
    --second-prompts: the population changes half-way through the measurement.
A round's batch takes the next batch_size prompts of its population (cycling); every policy of a round
gets the same batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

WORKLOADS = ("heldout", "mixed", "switch")
# Prompt length for models without a tokenizer (presets): about the held-out demo prompts' median
# (70 bytes, one token per byte with the demo pair's byte-level tokenizer).
RANDOM_PROMPT_TOKENS = 64


def random_prompts(count: int, length_tokens: int, vocab_size: int, seed: int) -> list[list[int]]:
    """Random token ids, for models without a tokenizer (presets): the text is irrelevant to timing."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (count, length_tokens), generator=gen).tolist()


def cycled_prompts(prompts: Sequence[list[int]], count: int, offset: int = 0) -> list[list[int]]:
    """`count` prompts from `offset` on, cycling through the list (deterministic). Each round takes the
    next slice, so a small batch size is measured on many prompts, not on one."""
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
            return cycled_prompts(both, batch_size, offset)
        if self.name == "switch" and slot - warmup_rounds >= (rounds + 1) // 2:
            return cycled_prompts(self.secondary, batch_size, offset)
        return cycled_prompts(self.primary, batch_size, offset)


def round_prompts(prompts: "Sequence[list[int]] | Workload", batch_size: int, round_index: int,
                  warmup_rounds: int, rounds: int) -> list[list[int]]:
    """The batch of round `round_index` (negative: a warm-up round) at this batch size."""
    slot = round_index + warmup_rounds
    if isinstance(prompts, Workload):
        return prompts.batch(batch_size, slot, warmup_rounds, rounds)
    return cycled_prompts(prompts, batch_size, offset=slot * batch_size)


def timed_round_prompts(prompts: "Sequence[list[int]] | Workload", batch_size: int, warmup_rounds: int,
                        rounds: int) -> list[list[list[int]]]:
    """The batches of every timed round at one batch size."""
    return [round_prompts(prompts, batch_size, r, warmup_rounds, rounds) for r in range(rounds)]


def attended_context_len(batches: Sequence[Sequence[list[int]]], max_new_tokens: int) -> int:
    """The context every row's attention pays for, averaged over a run and over rounds: the runtime's
    attention spans the longest row of the batch (shorter rows are masked, not skipped), so it is the
    longest prompt of each round plus half the generated tokens."""
    longest = [max(len(p) for p in prompts) for prompts in batches]
    return round(sum(longest) / len(longest) + max_new_tokens / 2)
