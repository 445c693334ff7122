"""In-situ timing: forward passes and whole steps timed inside real speculative generation.

Passes timed alone, back to back on the same tokens (the profile's `timings`), are not the passes the
runtime runs: there the draft and the target alternate, the caches are ragged and the allocator's state
differs. Calibrate therefore also generates with a few fixed chain lengths k at a few batch sizes on
held-out prompts, times every forward pass and every step (`calibrate/pass_clock.py`), and keeps two
optional sections of `specbatch.profile/1`:

- `insitu_timings`: pass rows like the isolated ones, `{model, batch_size, new_tokens, context_len, k,
  median_ms, p10_ms, p90_ms, reps, in_situ: true, sweep}`; the passes of one generation point (b, k) at one
  width are grouped by context in bins of CONTEXT_BIN_TOKENS, `context_len` being the bin's mean context
  (the longest row's cached tokens before the pass: what its attention spans) and `k` the chain length
  of the steps they ran in;
- `insitu_steps`: rows `{batch_size, k, context_len, tokens_per_step, median_ms, p10_ms, p90_ms, reps,
  sweep}` over the full-batch steps of one generation (the batch thins out in the last steps; those are
  left out), `context_len` the mean context the steps paid for and `tokens_per_step` per row, as E(k) is;
  a (b, k) point has one row per generation.

`sweep` (optional, >= 1) says in which of calibrate's sweeps over all in-situ points the row's generation
ran: a point's generations are spread over the stage, one per sweep, so that a slow spell of the machine
spoils one generation of a point rather than all of them. Rows without it (older profiles) were measured
point by point. Rows of different sweeps may share (b, n, context): the key includes the sweep.

`fit`'s step stage fits the latency model from either kind of pass row and keeps the one that predicts
these measured steps better. Profiles without the sections load unchanged and mean "isolated only".
Assumption: the passes of one row differ only in their measurement noise and in the context spread
within a bin (64 tokens: a few per cent of a pass at the contexts measured).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

import numpy as np

from ..errors import PerfModelError
from ..fields import ROLES, at, boolean, duration_ms, integer, listed, number, string

CONTEXT_BIN_TOKENS = 64  # passes of one (role, b, n, k) are grouped by context in bins this wide


@dataclass(frozen=True)
class InSituPassRow:
    model: str  # target | draft
    batch_size: int
    new_tokens: int
    context_len: int  # mean cached context (longest row) of the passes in the row
    k: int  # chain length of the steps these passes ran in
    median_ms: float
    p10_ms: float
    p90_ms: float
    reps: int  # passes in the row
    in_situ: bool = True  # marks the row: timed inside real steps, not alone
    sweep: int | None = None  # calibrate's sweep over the in-situ points that timed it; None: older profiles

    def key(self) -> tuple:
        return (self.model, self.batch_size, self.new_tokens, self.context_len, self.k, self.sweep)


@dataclass(frozen=True)
class InSituStepRow:
    batch_size: int
    k: int
    context_len: int  # mean context the steps paid for (the longest row's, as the policy is asked)
    tokens_per_step: float  # per row
    median_ms: float  # of the full-batch steps' wall times: passes and everything between them
    p10_ms: float
    p90_ms: float
    reps: int  # full-batch steps
    sweep: int | None = None  # as the pass rows' sweep

    def key(self) -> tuple:
        return (self.batch_size, self.k, self.context_len, self.sweep)


def _spread(values_ms: Sequence[float]) -> tuple[float, float, float]:
    """(median, p10, p90), rounded to the microsecond's thousandth as the isolated rows are."""
    median, p10, p90 = np.percentile(np.asarray(values_ms, dtype=float), [50, 10, 90])
    return round(float(median), 6), round(float(p10), 6), round(float(p90), 6)


def pass_rows(records: Iterable[tuple[str, int, int, int, float]], batch_size: int, k: int,
              bin_tokens: int = CONTEXT_BIN_TOKENS, sweep: int | None = None) -> tuple[InSituPassRow, ...]:
    """The pass rows of one generation point from its timed passes `(role, batch, new tokens, context,
    seconds)`: only passes over the full batch, grouped by (role, width, context // bin_tokens).

    >>> rows = pass_rows([("draft", 2, 1, 70, 0.001), ("draft", 2, 1, 90, 0.003), ("draft", 1, 1, 95, 0.5)], 2, 3)
    >>> [(r.model, r.new_tokens, r.context_len, r.median_ms, r.reps) for r in rows]
    [('draft', 1, 80, 2.0, 2)]
    """
    groups: dict[tuple[str, int, int], list[tuple[int, float]]] = defaultdict(list)
    for role, batch, new_tokens, context, seconds in records:
        if batch == batch_size:
            groups[(role, new_tokens, context // bin_tokens)].append((context, seconds * 1e3))
    rows = []
    for (role, new_tokens, _), passes in sorted(groups.items()):
        median, p10, p90 = _spread([ms for _, ms in passes])
        context = round(sum(c for c, _ in passes) / len(passes))
        rows.append(InSituPassRow(role, batch_size, new_tokens, context, k, median, p10, p90, len(passes),
                                  sweep=sweep))
    return _unique_contexts(rows)


def _unique_contexts(rows: list[InSituPassRow]) -> tuple[InSituPassRow, ...]:
    """Two bins' mean contexts cannot coincide (they lie in disjoint ranges); kept as a check."""
    if len({row.key() for row in rows}) != len(rows):
        raise PerfModelError("in-situ pass rows: two bins with the same mean context")
    return tuple(rows)


def step_row(step_seconds: Sequence[float], contexts: Sequence[int], tokens: int, batch_size: int,
             k: int, sweep: int | None = None) -> InSituStepRow:
    """One (b, k) point's measured steps: the full-batch steps' wall times, the contexts they paid for and
    the tokens they added (all rows together).

    >>> step_row([0.010, 0.012, 0.030], [100, 101, 103], 12, 2, 4).tokens_per_step  # 12 / (3 steps x 2 rows)
    2.0
    """
    if not step_seconds or len(step_seconds) != len(contexts):
        raise PerfModelError(f"in-situ steps at b={batch_size} k={k}: expected one context per step, "
                             f"found {len(step_seconds)} steps and {len(contexts)} contexts")
    median, p10, p90 = _spread([s * 1e3 for s in step_seconds])
    return InSituStepRow(batch_size, k, round(sum(contexts) / len(contexts)),
                         round(tokens / (len(step_seconds) * batch_size), 6), median, p10, p90, len(step_seconds),
                         sweep)


# ---------------------------------------------------------------- JSON

def rows_json(rows: Sequence) -> list[dict]:
    """The rows as JSON objects; `sweep` only where it is known (older rows are written as they were read)."""
    return [{key: value for key, value in asdict(row).items() if key != "sweep" or value is not None}
            for row in rows]


def _times(obj: dict, where: str) -> dict[str, float]:
    times = {key: duration_ms(obj, key, where, allow_zero=key != "median_ms")
             for key in ("median_ms", "p10_ms", "p90_ms")}
    if not times["p10_ms"] <= times["median_ms"] <= times["p90_ms"]:
        raise PerfModelError(f"{where}: expected p10_ms <= median_ms <= p90_ms, found {times['p10_ms']}, "
                             f"{times['median_ms']}, {times['p90_ms']}")
    return times


def pass_row_from_json(obj: dict, where: str) -> InSituPassRow:
    if not boolean(obj, "in_situ", where):
        raise PerfModelError(f"{at(where, 'in_situ')}: an in-situ row must say true (isolated rows go in timings)")
    return InSituPassRow(model=string(obj, "model", where, ROLES), batch_size=integer(obj, "batch_size", where, 1),
                         new_tokens=integer(obj, "new_tokens", where, 1),
                         context_len=integer(obj, "context_len", where, 0), k=integer(obj, "k", where, 0),
                         reps=integer(obj, "reps", where, 1), sweep=_sweep(obj, where), **_times(obj, where))


def _sweep(obj: dict, where: str) -> int | None:
    return integer(obj, "sweep", where, 1, nullable=True) if "sweep" in obj else None


def step_row_from_json(obj: dict, where: str) -> InSituStepRow:
    k = integer(obj, "k", where, 0)
    tokens = number(obj, "tokens_per_step", where, minimum=1.0)
    if tokens > k + 1 + 1e-9:
        raise PerfModelError(f"{at(where, 'tokens_per_step')}: at most k + 1 = {k + 1} per step, found {tokens}")
    return InSituStepRow(batch_size=integer(obj, "batch_size", where, 1), k=k,
                         context_len=integer(obj, "context_len", where, 0), tokens_per_step=tokens,
                         reps=integer(obj, "reps", where, 1), sweep=_sweep(obj, where), **_times(obj, where))


def sections_from_json(obj: dict, top: str) -> tuple[tuple[InSituPassRow, ...], tuple[InSituStepRow, ...]]:
    """The profile's optional `insitu_timings` and `insitu_steps` (absent or null: none); `top` is 'file:'."""
    found = []
    for key, parse in (("insitu_timings", pass_row_from_json), ("insitu_steps", step_row_from_json)):
        if obj.get(key) is None:
            found.append(())
            continue
        found.append(tuple(parse(item, f"{at(top, key)}[{index}]") for index, item in enumerate(listed(obj, key, top))))
    return found[0], found[1]


def check_unique(passes: Sequence[InSituPassRow], steps: Sequence[InSituStepRow], where: str) -> None:
    for key, rows, fields in (("insitu_timings", passes, "(model, batch_size, new_tokens, context_len, k, sweep)"),
                              ("insitu_steps", steps, "(batch_size, k, context_len, sweep)")):
        seen = set()
        for index, row in enumerate(rows):
            if row.key() in seen:
                raise PerfModelError(f"{where}: {key}[{index}]: duplicate {fields} row {row.key()}")
            seen.add(row.key())
