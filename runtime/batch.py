"""The rows a speculative step works on, and how rows leave: their slots are refilled in place.

A `BatchState` holds, per row, its committed tokens (prompt + generated) in a token buffer, how many there
are (on the device, `committed`, and mirrored on the host, `host_committed`), and both models' KV caches.
Its invariants (runtime.generator relies on them):
  * `tokens[r, :committed[r]]` are final;
  * the target's cache holds all committed tokens but the last: `target_cache.lengths == committed - 1`;
  * the draft's cache holds a prefix of them: `draft_cache.lengths <= committed - 1` (it lags after steps
    with k = 0, or by one token after a step in which the row accepted every draft token).

Rows leave the way the serving engine's requests do: the last running row moves into a freed slot (its
live entries only), and the batch is the first b rows of the same buffers (`rows`, a view): nothing else is
copied and nothing is allocated.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from .kv_cache import KVCache, upload
from .sampling import Sampling


@dataclass
class BatchState:
    tokens: torch.Tensor  # (b, buffer): each row's committed tokens, then scratch
    committed: torch.Tensor  # (b,): final tokens per row, prompt included (device)
    host_committed: np.ndarray  # (b,): the same, on the host (int64)
    target_cache: KVCache
    draft_cache: KVCache | None  # None: no draft model, or a policy that never drafts
    max_k: int  # draft tokens per step the buffer and the caches have room for
    sampling: Sampling = field(default_factory=Sampling)
    rng: object = None  # a torch.Generator for the batch, or runtime.sampling.RowGenerators
    # benchmarks and random weights: accept each draft token with this probability (one per position)
    synthetic_acceptance: float | tuple[float, ...] | None = None

    @property
    def batch_size(self) -> int:
        return self.tokens.shape[0]

    def rows(self, start: int, count: int, **changes) -> BatchState:
        """Rows start..start+count-1 as a state of their own sharing this one's buffers (views: what a step
        writes lands here); `changes` replace other fields (the rows' sampling, their generators)."""
        return replace(self, tokens=self.tokens.narrow(0, start, count),
                       committed=self.committed.narrow(0, start, count),
                       host_committed=self.host_committed[start:start + count],
                       target_cache=self.target_cache.rows(start, count),
                       draft_cache=None if self.draft_cache is None else self.draft_cache.rows(start, count),
                       **changes)

    def move_row(self, source: int, destination: int) -> None:
        """Row `source` takes slot `destination` (its tokens, its count and both caches' live entries)."""
        self.tokens[destination] = self.tokens[source]
        self.committed[destination] = self.committed[source]
        self.host_committed[destination] = self.host_committed[source]
        self.target_cache.move_row(source, destination)
        if self.draft_cache is not None:
            self.draft_cache.move_row(source, destination)

    def set_committed(self, device_committed: torch.Tensor | None, host_committed) -> None:
        """Every row's committed count, on the device (None: uploaded from the host values) and the host."""
        host = np.asarray(host_committed, dtype=np.int64)
        self.committed.copy_(upload(host, self.committed.device) if device_committed is None else device_committed)
        self.host_committed[:] = host


def fill_holes(state: BatchState, holes: list[int], size: int) -> list[tuple[int, int]]:
    """Free rows `holes` among the first `size` rows of `state`: the last running row moves into each
    hole, largest hole first (a hole that is the last row is just dropped). Returns the moves (source,
    destination) in order, for the caller's own per-row records; rows 0..size - len(holes) - 1 run on.

    >>> class Rows:  # only the moves matter here
    ...     def move_row(self, source, destination): pass
    >>> fill_holes(Rows(), [1, 3], 5)
    [(4, 3), (3, 1)]
    """
    moves = []
    for hole in sorted(set(holes), reverse=True):
        last = size - 1
        if hole != last:
            state.move_row(last, hole)
            moves.append((last, hole))
        size -= 1
    return moves


def apply_moves(records: list, moves: list[tuple[int, int]], remaining: int) -> list:
    """The caller's per-row `records` after `fill_holes`' moves: the first `remaining` rows, in slot order.

    >>> apply_moves(["a", "b", "c", "d", "e"], [(4, 3), (3, 1)], 3)
    ['a', 'e', 'c']
    """
    records = list(records)
    for source, destination in moves:
        records[destination] = records[source]
    return records[:remaining]
