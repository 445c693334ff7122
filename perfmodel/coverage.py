"""What a profile's grid planned and what it holds. A calibration cut short (--max-seconds, Ctrl-C) keeps
the points measured so far and records that it stopped (`stopped_early`); a fit of them would extrapolate
over the rest without saying so. `fit` and `table` report the gap; `table` refuses to compute entries over
a region with no measurement at all unless told to (--force).

A region is a (role, batch size, context length) cell of the grid: the fit's shape in b and L comes from
the cells it saw, so a cell with no timing is a place the fitted time is a guess. Every cell plans the
chain's new-token counts (target 1..max_k+1, draft 1..2); wide passes at small batch sizes are extras
and not counted here.
"""
from __future__ import annotations

from dataclasses import dataclass

from .errors import PerfModelError
from .fields import ROLES, at, integer, is_int, listed, string

DRAFT_CHAIN_TOKENS = 2  # the draft's first pass may catch up two tokens


@dataclass(frozen=True)
class Coverage:
    planned_points: int  # chain timing points of the grid
    measured_points: int  # of those, the ones with a row (a pass that did not fit in memory counts: it was tried)
    missing_cells: tuple[tuple[str, int, int], ...]  # (role, batch size, context length) without any timing
    planned_overheads: int
    measured_overheads: int
    stopped_by: str = "an early stop"  # what cut the calibration short ('--max-seconds 30')

    @property
    def complete(self) -> bool:
        return self.measured_points == self.planned_points and self.measured_overheads == self.planned_overheads

    def describe(self) -> str:
        """One line: how much is missing and where."""
        share = 100 * (1 - self.measured_points / self.planned_points) if self.planned_points else 0.0
        text = (f"the profile is incomplete: {self.measured_points} of {self.planned_points} planned pass timings "
                f"({share:.0f} % missing) and {self.measured_overheads} of {self.planned_overheads} step overheads "
                f"were measured (calibrate stopped by {self.stopped_by})")
        if self.missing_cells:
            text += f"; no timing at all for {describe_cells(self.missing_cells)}"
        return text + "; calibrate --resume measures the rest"

    def cells_within(self, max_batch: int, batch_sizes: tuple[int, ...]) -> tuple[tuple[str, int, int], ...]:
        """The missing cells a table over batch sizes 1..max_batch draws on: up to the first grid batch size
        at or above max_batch (the fit interpolates from it)."""
        reach = min([b for b in batch_sizes if b >= max_batch], default=max(batch_sizes))
        return tuple(cell for cell in self.missing_cells if cell[1] <= reach)

    def to_json(self) -> dict:
        return {"planned_points": self.planned_points, "measured_points": self.measured_points,
                "missing_cells": [list(cell) for cell in self.missing_cells],
                "planned_overheads": self.planned_overheads, "measured_overheads": self.measured_overheads,
                "stopped_by": self.stopped_by}

    @classmethod
    def from_json(cls, obj: dict, where: str) -> Coverage:
        """`where`: the section ('model.json: coverage'); each field is named with its rule when it breaks it."""
        counts = {key: integer(obj, key, where, 0) for key in
                  ("planned_points", "measured_points", "planned_overheads", "measured_overheads")}
        for measured, planned in (("measured_points", "planned_points"), ("measured_overheads", "planned_overheads")):
            if counts[measured] > counts[planned]:
                raise PerfModelError(f"{at(where, measured)}: at most {planned} = {counts[planned]}, found "
                                     f"{counts[measured]}")
        cells = []
        for index, cell in enumerate(listed(obj, "missing_cells", where)):
            if not (isinstance(cell, list) and len(cell) == 3 and cell[0] in ROLES and is_int(cell[1])
                    and cell[1] >= 1 and is_int(cell[2]) and cell[2] >= 0):
                raise PerfModelError(f"{at(where, 'missing_cells')}[{index}]: expected [role, batch_size, "
                                     f"context_len] (a role of {', '.join(ROLES)}, batch_size >= 1, "
                                     f"context_len >= 0), found {cell!r}")
            cells.append(tuple(cell))
        return cls(counts["planned_points"], counts["measured_points"], tuple(cells), counts["planned_overheads"],
                   counts["measured_overheads"], string(obj, "stopped_by", where))


def describe_cells(cells: tuple[tuple[str, int, int], ...], shown: int = 6) -> str:
    """'target b=16 L=512, target b=32 L=512 and 3 more'."""
    names = [f"{role} b={b} L={L}" for role, b, L in cells]
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def profile_coverage(profile) -> Coverage:
    """`profile`: a perfmodel.profile.Profile with pass timings (not an engine's)."""
    grid = profile.grid
    draft_chain = grid.max_k + 1 if profile.draft.is_head else DRAFT_CHAIN_TOKENS  # a head's pass reads k + 1
    chain = {"target": [n for n in grid.target_new_tokens if n <= grid.max_k + 1],
             "draft": [n for n in grid.draft_new_tokens if n <= draft_chain]}
    measured = {(row.model, row.batch_size, row.new_tokens, row.context_len) for row in profile.timings}
    planned = [(role, b, n, L) for role in ("target", "draft") for L in grid.context_lens
               for b in grid.batch_sizes for n in chain[role]]
    cells_seen = {(role, b, L) for role, b, _, L in measured}
    missing_cells = tuple(sorted({(role, b, L) for role, b, _, L in planned} - cells_seen,
                                 key=lambda cell: (cell[0] != "target", cell[2], cell[1])))
    overheads = {(row.batch_size, row.k) for row in profile.overheads if row.tree_nodes is None and not row.stage2}
    planned_overheads = [(b, k) for b in grid.batch_sizes for k in range(grid.max_k + 1)]
    return Coverage(len(planned), sum(point in measured for point in planned), missing_cells,
                    len(planned_overheads), sum(point in overheads for point in planned_overheads),
                    profile.stopped_early or "an early stop")
