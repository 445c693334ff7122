"""Steps measured inside a serving engine (`specbatch calibrate --engine vllm`): the costs the engine itself pays,
for a table that engine will obey. Two optional sections of `specbatch.profile/1`:

- `engine`: which engine measured them, `{name, version, settings}` (settings: whatever decides its costs and
  how they were measured: dtype, eager or graphs, thread binding, how K was set, what a decode step is);
- `engine_steps`: one row per (mode, b, k, prompt length, sweep), `{mode, batch_size, k, prompt_len,
  context_len, tokens_per_step, drafts, draft_tokens, accepted_tokens, accepted_per_position, median_ms,
  p10_ms, p90_ms, reps, sweep}`: the engine's decode steps of one generation, timed one by one (prefill steps
  left out), over the full batch. `mode` "none" is the engine without a speculative configuration (k = 0);
  "schedule" is the engine with one, its batch size -> K schedule saying k for every batch size (k = 0: the
  schedule says 0, which is not free: vLLM's drafter still runs its first pass to keep its cache in step).
  `drafts`, `draft_tokens`, `accepted_tokens`, `accepted_per_position` are the engine's own spec-decode counters
  over the generation; `tokens_per_step` per row is 1 + accepted_tokens / drafts (1 without drafts).
  `context_len` is the mean context the timed steps paid for; `prompt_len` the prompt tokens per row.

A profile with an `engine` section is that engine's: its pass `timings` and `overheads` are empty, and `fit`
fits the engine's step model (perfmodel/engine_steps.py) instead of pass latencies.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

from ..errors import PerfModelError
from ..fields import at, duration_ms, get, int_list, integer, listed, number, string

ENGINE_MODES = ("none", "schedule")  # no speculative configuration | the schedule says k


@dataclass(frozen=True)
class EngineInfo:
    name: str  # e.g. "vllm"
    version: str
    settings: dict  # JSON values: what decides the engine's costs and how its steps were measured

    def describe(self) -> str:
        """'vllm 0.32.0'"""
        return f"{self.name} {self.version}"

    def to_json(self) -> dict:
        return {"name": self.name, "version": self.version, "settings": dict(self.settings)}


@dataclass(frozen=True)
class EngineStepRow:
    mode: str  # none | schedule
    batch_size: int
    k: int  # draft tokens per row per step (0 in mode none)
    prompt_len: int  # prompt tokens per row
    context_len: int  # mean context (cached tokens per row) the timed steps paid for
    tokens_per_step: float  # per row: 1 + accepted_tokens / drafts
    drafts: int  # the engine's counters over the generation (prefill step included)
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: tuple[int, ...]  # drafts whose first i + 1 tokens were accepted, i = 0..k-1
    median_ms: float  # of the timed decode steps' wall times
    p10_ms: float
    p90_ms: float
    reps: int  # decode steps timed
    sweep: int  # which sweep over every configuration measured it (1, 2, ...)

    def key(self) -> tuple:
        return (self.mode, self.batch_size, self.k, self.prompt_len, self.sweep)

    def point(self) -> tuple:
        """The configuration the row measured, whichever sweep: (mode, b, k, prompt length)."""
        return self.key()[:-1]


def engine_from_json(obj: Any, where: str) -> EngineInfo:
    settings = get(obj, "settings", where)
    if not isinstance(settings, dict):
        raise PerfModelError(f"{at(where, 'settings')}: expected an object, found {settings!r}")
    return EngineInfo(string(obj, "name", where), string(obj, "version", where), dict(settings))


def step_row_from_json(obj: Any, where: str) -> EngineStepRow:
    mode, k = string(obj, "mode", where, ENGINE_MODES), integer(obj, "k", where, 0)
    if mode == "none" and k != 0:
        raise PerfModelError(f"{at(where, 'k')}: an engine without a speculative configuration drafts nothing: "
                             f"k must be 0, found {k}")
    times = {key: duration_ms(obj, key, where) for key in ("median_ms", "p10_ms", "p90_ms")}
    if not times["p10_ms"] <= times["median_ms"] <= times["p90_ms"]:
        raise PerfModelError(f"{where}: expected p10_ms <= median_ms <= p90_ms, found {times['p10_ms']}, "
                             f"{times['median_ms']}, {times['p90_ms']}")
    tokens = number(obj, "tokens_per_step", where, minimum=1.0)
    if tokens > k + 1 + 1e-9:
        raise PerfModelError(f"{at(where, 'tokens_per_step')}: at most k + 1 = {k + 1} per step, found {tokens}")
    counts = {key: integer(obj, key, where, 0) for key in ("drafts", "draft_tokens", "accepted_tokens")}
    if counts["accepted_tokens"] > counts["draft_tokens"]:
        raise PerfModelError(f"{at(where, 'accepted_tokens')}: {counts['accepted_tokens']} accepted of "
                             f"{counts['draft_tokens']} drafted")
    per_position = int_list(obj, "accepted_per_position", where, minimum=0)
    if len(per_position) > max(k, 0) or any(n > counts["drafts"] for n in per_position):
        raise PerfModelError(f"{at(where, 'accepted_per_position')}: expected at most k = {k} counts, none above "
                             f"drafts = {counts['drafts']}, found {list(per_position)}")
    return EngineStepRow(mode=mode, batch_size=integer(obj, "batch_size", where, 1), k=k,
                         prompt_len=integer(obj, "prompt_len", where, 1),
                         context_len=integer(obj, "context_len", where, 0), tokens_per_step=tokens,
                         accepted_per_position=per_position, reps=integer(obj, "reps", where, 1),
                         sweep=integer(obj, "sweep", where, 1), **counts, **times)


def sections_from_json(obj: dict, top: str) -> tuple[EngineInfo | None, tuple[EngineStepRow, ...]]:
    """The profile's optional `engine` and `engine_steps` (absent or null: none); `top` is 'file:'."""
    engine = None if obj.get("engine") is None else engine_from_json(obj["engine"], at(top, "engine"))
    if obj.get("engine_steps") is None:
        return engine, ()
    rows = tuple(step_row_from_json(item, f"{at(top, 'engine_steps')}[{index}]")
                 for index, item in enumerate(listed(obj, "engine_steps", top)))
    return engine, rows


def rows_json(rows: Sequence[EngineStepRow]) -> list[dict]:
    return [{**asdict(row), "accepted_per_position": list(row.accepted_per_position)} for row in rows]


def check_engine_sections(engine: EngineInfo | None, rows: Sequence[EngineStepRow], has_passes: bool,
                          where: str) -> None:
    """Rows need their engine; an engine's profile holds its steps only (no passes of ours); keys are unique."""
    if rows and engine is None:
        raise PerfModelError(f"{where}: engine_steps without an engine section (which engine measured them?)")
    if engine is not None and has_passes:
        raise PerfModelError(f"{where}: an engine's profile ({engine.describe()}) holds its measured steps only; "
                             "its timings and overheads must be empty (our runtime's go in a profile of their own)")
    seen = set()
    for index, row in enumerate(rows):
        if row.key() in seen:
            raise PerfModelError(f"{where}: engine_steps[{index}]: duplicate (mode, batch_size, k, prompt_len, sweep) "
                                 f"row {row.key()}")
        seen.add(row.key())
