"""The `specbatch.profile/1` contract: what `calibrate` measured on one device for one model pair.

A profile is data, kept apart from fitting: device metadata, the two models' shapes, forward-pass
timings over a grid of (batch size b, new tokens n, context length L), per-step overheads and the
measured acceptance per draft position. `T(b, n, L)` is the time of ONE forward pass over b
sequences each feeding n new tokens on top of L cached tokens.

Optional parts for tree-structured drafts and the n-gram second stage (staged speculative decoding);
profiles without them still load and mean "chains only":
- `acceptance[i].rank_acceptance`: per depth and rank, P(the target's token is the draft's rank-r child);
- `overheads[i].tree_nodes` / `.stage2`: overhead rows of tree steps (chain rows: null / false);
- `stage2`: the n-gram model file, how often its guesses match the draft, and what a query costs.

Optional in-situ timing (the `insitu` section): `insitu_timings`, passes timed inside real speculative
steps, and `insitu_steps`, those steps' measured times; profiles without them mean "isolated only".

Optional device state: `device_state` (profile/device_state.py: the full-load warm-up, the GPU's clocks,
power and temperature at the start and end of timing) and `noise_large_batch`, a second drift reference
at the grid's largest batch size beside `noise`'s smallest one (power capping slows large passes first).

Optional `composition`: the pass times were composed from published per-operation timings (what was
measured, estimated, left out; `calibrate --from-vidur`); profiles without it were timed whole.
Optional engine steps (`engine` and `engine_steps`, profile/engine.py): steps measured inside a serving
engine (`calibrate --engine vllm`), with the engine's name, version and settings; such a profile is the
engine's and holds no pass timings of ours.

Optional mixture-of-experts parts (profile/routing.py): `models.<role>.experts`, the routed experts' shape, and
the `routing` section, the distinct experts per routed layer measured in windows of b rows x n tokens.

The device section says how the passes ran (`execution`: eager, or cuda-graphs replayed; older profiles:
eager): perfmodel/execution.py keeps a runtime from using the costs of the other.

Reading is strict: a missing or mistyped field is a PerfModelError that names the file and the
field (`profile.json: timings[3].median_ms: expected a number, found 'fast'`).
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import Any

from ..errors import PerfModelError
from ..fields import ROLES
from ..fields import at as _at
from ..fields import boolean as _bool
from ..fields import duration_ms as _ms
from ..fields import get as _get
from ..fields import int_list as _int_list
from ..fields import integer as _int
from ..fields import is_int as _is_int
from ..fields import listed as _list
from ..fields import number as _number
from ..fields import string as _str
from ..jsonio import read_json, write_json_atomic
from .composition import Composition, composition_from_json
from .device_state import DeviceState, device_state_from_json
from .engine import EngineInfo, EngineStepRow, check_engine_sections
from .engine import rows_json as engine_rows_json
from .engine import sections_from_json as engine_sections_from_json
from .insitu import InSituPassRow, InSituStepRow, check_unique, rows_json, sections_from_json
from .noise import NoiseFigure, noise_from_json
from .routing import ExpertShape, RoutingSection, check_routing, expert_shape_from_json, routing_from_json

PROFILE_SCHEMA = "specbatch.profile/1"
PROFILE_KIND = "specbatch.profile"  # what perfmodel.jsonio.check_replace calls a profile
DEVICE_KINDS = ("cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")
EXECUTIONS = ("eager", "cuda-graphs")  # how the runtime ran the passes it timed
HEAD_DRAFTERS = ("eagle3", "mtp")
DRAFTERS = ("draft_model",) + HEAD_DRAFTERS
ACCEPTANCE_MODES = ("greedy", "sampling")
ACCEPTANCE_SOURCES = ("measured", "user")


@dataclass(frozen=True)
class DeviceInfo:
    kind: str  # cpu | cuda
    name: str
    memory_bytes: int
    dtype: str  # float32 | bfloat16 | float16: the dtype every timing was measured in
    torch_version: str
    cpu_threads: int
    git_revision: str | None
    execution: str = "eager"  # one of EXECUTIONS: eager passes, or CUDA graphs replayed (older profiles: eager)


@dataclass(frozen=True)
class ModelInfo:
    source: str  # model directory or shape preset
    model_type: str
    random_weights: bool
    parameters: int
    layers: int
    hidden_size: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    weight_bytes: int  # all weights at the profiled dtype
    kv_bytes_per_token: int  # KV-cache bytes per cached token, all layers
    max_position_embeddings: int
    # perfmodel.jsonio.model_fingerprint: config and weights, so files made for this model are recognised
    # wherever its directory is and however its path is spelled. Optional: older profiles lack it.
    fingerprint: str | None = None
    # the draft role: what drafts. "draft_model" (a separate model), or a head: "eagle3" | "mtp", whose
    # `layers` is 1, `parameters` what a head pass reads (runtime.heads.config.HeadConfig.parameter_count) and
    # `draft_vocab_size` the vocabulary it drafts over (EAGLE-3's may be a subset of the target's)
    drafter: str = "draft_model"
    draft_vocab_size: int | None = None
    # a mixture of experts: its routed experts (profile/routing.py); `parameters` and `weight_bytes` count every
    # expert, of which a pass reads those its tokens route to. None: a dense model (and older profiles)
    experts: ExpertShape | None = None

    @property
    def is_head(self) -> bool:
        return self.drafter in HEAD_DRAFTERS


@dataclass(frozen=True)
class Grid:
    batch_sizes: tuple[int, ...]
    context_lens: tuple[int, ...]
    max_k: int
    target_new_tokens: tuple[int, ...]  # 1..max_k+1: the verify pass feeds k+1 tokens
    draft_new_tokens: tuple[int, ...]  # 1 and 2: the draft's first pass may catch up two tokens


@dataclass(frozen=True)
class TimingRow:
    model: str  # target | draft
    batch_size: int
    new_tokens: int
    context_len: int
    median_ms: float | None  # None when the pass did not fit in memory
    p10_ms: float | None
    p90_ms: float | None
    reps: int
    feasible: bool


@dataclass(frozen=True)
class OverheadRow:
    """Time a speculative step spends outside forward passes (sampling, acceptance, bookkeeping).

    Chain rows are keyed by (batch_size, k). Tree steps (and steps with the second stage) have more
    bookkeeping: their rows also give `tree_nodes` (draft tokens in the tree; k is its depth) and/or
    `stage2` (the n-gram's own query time is NOT in the row: it is modelled from `Stage2Info`)."""

    batch_size: int
    k: int
    median_ms: float
    p10_ms: float
    p90_ms: float
    reps: int
    tree_nodes: int | None = None  # None: a chain step of k draft tokens
    stage2: bool = False  # measured with the n-gram second stage on


@dataclass(frozen=True)
class AcceptanceEntry:
    mode: str  # greedy | sampling
    temperature: float | None
    top_k: int | None
    top_p: float | None
    source: str  # measured | user
    per_position: tuple[float, ...]  # alpha_i = P(draft token i accepted | tokens 1..i-1 accepted)
    trials: tuple[int, ...] | None  # how many times position i was reached while measuring
    prompts: str | None
    prompt_count: int | None
    # E(k) for k = 0..len(per_position) as the runtime meets it (each step starts where the last one
    # ended, right after a disagreement); None for user values. Optional: older profiles lack it.
    tokens_per_step: tuple[float, ...] | None = None
    # Depth-major D x R table: P(the target's token at depth d is the draft's rank-r child | the path to
    # depth d-1 was accepted), measured step-aligned (steps start right after a rejection). A row's
    # ranks are exclusive events, so it sums to <= 1. Optional: only profiles measured for trees have it.
    rank_acceptance: tuple[tuple[float, ...], ...] | None = None
    # Greedy only: per scored continuation, the rank of the target's token among the draft's at every
    # position (R = "R or worse"). A tree's tokens per step are replayed on them exactly
    # (perfmodel.tree.simulate_tree_steps). Optional.
    rank_sequences: tuple[tuple[int, ...], ...] | None = None
    # Standard error of each tokens_per_step value across prompts (the independent units), k = 0..max_k
    # (perfmodel.uncertainty). Optional: older profiles and user values lack it.
    tokens_per_step_se: tuple[float, ...] | None = None
    # Per k = 1..max_k, per prompt: [tokens, steps] behind tokens_per_step[k] (expectations when sampling),
    # so two k can be compared prompt by prompt (perfmodel.uncertainty.paired_difference_se). Optional.
    step_counts_by_prompt: tuple[tuple[tuple[float, float], ...], ...] | None = None


@dataclass(frozen=True)
class Stage2Info:
    """The n-gram second stage that guesses the draft's tokens so the draft drafts in fewer passes."""

    file: str  # the n-gram model the measurements belong to
    sha256: str  # of that file: tables that use stage 2 name this exact model
    guess_accuracy: tuple[float, ...]  # per rank r: P(the n-gram's rank-r next token == the draft's rank-r token)
    query_overhead_ms: float  # one batched query over n contexts costs
    query_ms_per_context: float  # query_overhead_ms + n * query_ms_per_context

    def accuracy(self, rank: int) -> float:
        """Ranks beyond the measured ones are taken as never guessed right (the pessimistic edge)."""
        return self.guess_accuracy[rank] if rank < len(self.guess_accuracy) else 0.0

    def query_ms(self, contexts: int) -> float:
        return self.query_overhead_ms + contexts * self.query_ms_per_context if contexts > 0 else 0.0

    def to_json(self) -> dict:
        return {"file": self.file, "sha256": self.sha256, "guess_accuracy": list(self.guess_accuracy),
                "query_overhead_ms": self.query_overhead_ms, "query_ms_per_context": self.query_ms_per_context}


@dataclass(frozen=True)
class Profile:
    created_utc: str
    device: DeviceInfo
    target: ModelInfo
    draft: ModelInfo
    grid: Grid
    timings: tuple[TimingRow, ...]
    overheads: tuple[OverheadRow, ...]
    acceptance: tuple[AcceptanceEntry, ...]
    stage2: Stage2Info | None = None  # optional: profiles measured without an n-gram model lack it
    noise: NoiseFigure | None = None  # optional (the `noise` section): how noisy the machine was
    # optional (the `insitu` section): passes and steps timed inside real speculative generation
    insitu_timings: tuple[InSituPassRow, ...] = ()
    insitu_steps: tuple[InSituStepRow, ...] = ()
    device_state: DeviceState | None = None  # optional: the GPU's warm-up, clocks, power and temperature
    noise_large_batch: NoiseFigure | None = None  # optional: the drift reference at the largest batch size
    engine: EngineInfo | None = None  # optional: the serving engine whose steps these are (profile/engine.py)
    engine_steps: tuple[EngineStepRow, ...] = ()
    stopped_early: str | None = None  # optional: why calibrate stopped before its plan ('--max-seconds 30')
    routing: RoutingSection | None = None  # optional: distinct experts per layer measured for MoE models

    def warnings(self) -> tuple[str, ...]:
        """One line for each figure of the machine's state that exceeds its rule."""
        figures = (self.noise, self.noise_large_batch, self.device_state)
        return tuple(line for line in (None if f is None else f.warning() for f in figures) if line)
    composition: Composition | None = None  # optional: the timings were composed from per-operation ones

    def model(self, role: str) -> ModelInfo:
        if role not in ROLES:
            raise PerfModelError(f"unknown model role {role!r}; valid roles: {', '.join(ROLES)}")
        return self.target if role == "target" else self.draft

    def timings_of(self, role: str, feasible_only: bool = True) -> tuple[TimingRow, ...]:
        return tuple(row for row in self.timings if row.model == role and (row.feasible or not feasible_only))

    def to_json(self) -> dict:
        return {
            "schema": PROFILE_SCHEMA,
            "created_utc": self.created_utc,
            "device": asdict(self.device),
            "models": {"target": _model_json(self.target), "draft": _model_json(self.draft)},
            "grid": {key: list(value) if isinstance(value, tuple) else value
                     for key, value in asdict(self.grid).items()},
            "timings": [asdict(row) for row in self.timings],
            "overheads": [asdict(row) for row in self.overheads],
            "acceptance": [_acceptance_json(entry) for entry in self.acceptance],
            "stage2": None if self.stage2 is None else self.stage2.to_json(),
            **({} if self.noise is None else {"noise": self.noise.to_json()}),
            **({"insitu_timings": rows_json(self.insitu_timings)} if self.insitu_timings else {}),
            **({"insitu_steps": rows_json(self.insitu_steps)} if self.insitu_steps else {}),
            **({} if self.device_state is None else {"device_state": self.device_state.to_json()}),
            **({} if self.noise_large_batch is None else {"noise_large_batch": self.noise_large_batch.to_json()}),
            **({} if self.composition is None else {"composition": self.composition.to_json()}),
            **({} if self.engine is None else {"engine": self.engine.to_json()}),
            **({"engine_steps": engine_rows_json(self.engine_steps)} if self.engine_steps else {}),
            **({} if self.stopped_early is None else {"stopped_early": self.stopped_early}),
            **({} if self.routing is None else {"routing": self.routing.to_json()}),
        }


def _model_json(info: ModelInfo) -> dict:
    """A model's section; `experts` only for a mixture of experts (older readers then see nothing new)."""
    obj = asdict(info)
    if info.experts is None:
        del obj["experts"]
    return obj


def _acceptance_json(entry: AcceptanceEntry) -> dict:
    obj = asdict(entry)
    obj["per_position"] = list(entry.per_position)
    obj["trials"] = None if entry.trials is None else list(entry.trials)
    obj["tokens_per_step"] = None if entry.tokens_per_step is None else list(entry.tokens_per_step)
    obj["tokens_per_step_se"] = None if entry.tokens_per_step_se is None else list(entry.tokens_per_step_se)
    obj["step_counts_by_prompt"] = None if entry.step_counts_by_prompt is None else \
        [[list(pair) for pair in per_k] for per_k in entry.step_counts_by_prompt]
    obj["rank_acceptance"] = None if entry.rank_acceptance is None else [list(row) for row in entry.rank_acceptance]
    obj["rank_sequences"] = None if entry.rank_sequences is None else [list(row) for row in entry.rank_sequences]
    return obj


# ---------------------------------------------------------------- sections

def _device(obj: dict, where: str) -> DeviceInfo:
    return DeviceInfo(
        kind=_str(obj, "kind", where, DEVICE_KINDS),
        name=_str(obj, "name", where),
        memory_bytes=_int(obj, "memory_bytes", where, minimum=0),
        dtype=_str(obj, "dtype", where, DTYPES),
        torch_version=_str(obj, "torch_version", where),
        cpu_threads=_int(obj, "cpu_threads", where, minimum=1),
        git_revision=_str(obj, "git_revision", where, nullable=True),
        execution=_str(obj, "execution", where, EXECUTIONS) if "execution" in obj else "eager",
    )


def _model_info(obj: dict, where: str) -> ModelInfo:
    positive = ("parameters", "layers", "hidden_size", "heads", "kv_heads", "head_dim", "intermediate_size",
                "vocab_size", "weight_bytes", "kv_bytes_per_token", "max_position_embeddings")
    return ModelInfo(
        source=_str(obj, "source", where),
        model_type=_str(obj, "model_type", where),
        random_weights=_bool(obj, "random_weights", where),
        **{key: _int(obj, key, where, minimum=1) for key in positive},
        fingerprint=_str(obj, "fingerprint", where, nullable=True) if "fingerprint" in obj else None,
        drafter=_str(obj, "drafter", where, DRAFTERS) if "drafter" in obj else "draft_model",
        draft_vocab_size=(_int(obj, "draft_vocab_size", where, minimum=1, nullable=True)
                          if "draft_vocab_size" in obj else None),
        experts=(expert_shape_from_json(obj["experts"], _at(where, "experts"))
                 if obj.get("experts") is not None else None),
    )


def _grid(obj: dict, where: str) -> Grid:
    grid = Grid(
        batch_sizes=_int_list(obj, "batch_sizes", where, minimum=1),
        context_lens=_int_list(obj, "context_lens", where, minimum=0),
        max_k=_int(obj, "max_k", where, minimum=0),
        target_new_tokens=_int_list(obj, "target_new_tokens", where, minimum=1),
        draft_new_tokens=_int_list(obj, "draft_new_tokens", where, minimum=1),
    )
    for key in ("batch_sizes", "context_lens", "target_new_tokens", "draft_new_tokens"):
        if not getattr(grid, key):
            raise PerfModelError(f"{_at(where, key)}: must not be empty")
    return grid


def _timing(obj: dict, where: str) -> TimingRow:
    feasible = _bool(obj, "feasible", where)
    times = {key: _ms(obj, key, where, nullable=True, allow_zero=True) for key in ("median_ms", "p10_ms", "p90_ms")}
    for key, value in times.items():
        if feasible and (value is None or value <= 0):
            raise PerfModelError(f"{_at(where, key)}: a feasible row needs a positive time, found {value!r}")
        if not feasible and value is not None:
            raise PerfModelError(f"{_at(where, key)}: an infeasible (out of memory) row must have null times")
    return TimingRow(
        model=_str(obj, "model", where, ROLES),
        batch_size=_int(obj, "batch_size", where, minimum=1),
        new_tokens=_int(obj, "new_tokens", where, minimum=1),
        context_len=_int(obj, "context_len", where, minimum=0),
        reps=_int(obj, "reps", where, minimum=0),
        feasible=feasible,
        **times,
    )


def _overhead(obj: dict, where: str) -> OverheadRow:
    row = OverheadRow(
        batch_size=_int(obj, "batch_size", where, minimum=1),
        k=_int(obj, "k", where, minimum=0),
        median_ms=_ms(obj, "median_ms", where, allow_zero=True),
        p10_ms=_ms(obj, "p10_ms", where, allow_zero=True),
        p90_ms=_ms(obj, "p90_ms", where, allow_zero=True),
        reps=_int(obj, "reps", where, minimum=1),
        tree_nodes=_int(obj, "tree_nodes", where, minimum=1, nullable=True) if "tree_nodes" in obj else None,
        stage2=_bool(obj, "stage2", where) if "stage2" in obj else False,
    )
    if row.tree_nodes is not None and row.k > row.tree_nodes:
        raise PerfModelError(f"{_at(where, 'k')}: a tree of {row.tree_nodes} nodes cannot be {row.k} deep")
    return row


def _probability(value: Any) -> bool:
    return (_is_int(value) or isinstance(value, float)) and 0.0 <= value <= 1.0


def _rank_sequences(obj: dict, where: str) -> tuple[tuple[int, ...], ...] | None:
    """Optional lists of ranks (integers >= 0), one list per scored continuation."""
    sequences = obj.get("rank_sequences")
    if sequences is None:
        return None
    at = _at(where, "rank_sequences")
    if not isinstance(sequences, list) or not any(isinstance(row, list) and row for row in sequences):
        raise PerfModelError(f"{at}: expected a list of non-empty lists of ranks")
    for index, row in enumerate(sequences):
        if not isinstance(row, list) or not all(_is_int(rank) and rank >= 0 for rank in row):
            raise PerfModelError(f"{at}[{index}]: expected a list of integer ranks >= 0")
    return tuple(tuple(row) for row in sequences)


def _rank_acceptance(obj: dict, where: str) -> tuple[tuple[float, ...], ...] | None:
    """Optional depth-major table; every row has the same number (>= 1) of ranks and sums to <= 1."""
    table = obj.get("rank_acceptance")
    if table is None:
        return None
    at = _at(where, "rank_acceptance")
    if not isinstance(table, list) or not table:
        raise PerfModelError(f"{at}: expected a non-empty list of rows (one per depth), found {table!r}")
    rows = []
    for depth, row in enumerate(table):
        if not isinstance(row, list) or not row:
            raise PerfModelError(f"{at}[{depth}]: expected a non-empty list of probabilities (one per rank)")
        if len(row) != len(table[0]):
            raise PerfModelError(f"{at}[{depth}]: has {len(row)} ranks but row 0 has {len(table[0])}")
        for rank, value in enumerate(row):
            if not _probability(value):
                raise PerfModelError(f"{at}[{depth}][{rank}]: expected a probability in [0, 1], found {value!r}")
        if sum(row) > 1.0 + 1e-6:
            raise PerfModelError(f"{at}[{depth}]: ranks sum to {sum(row):.6g} > 1 "
                                 "(the target's token is at most one of the draft's children)")
        rows.append(tuple(float(value) for value in row))
    return tuple(rows)


def stage2_from_json(obj: dict, where: str) -> Stage2Info:
    """Read a `stage2` object; errors name the field (`profile.json: stage2.sha256: ...`)."""
    sha256 = _str(obj, "sha256", where)
    if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256.lower()):
        raise PerfModelError(f"{_at(where, 'sha256')}: expected 64 hexadecimal digits, found {sha256!r}")
    accuracy = _list(obj, "guess_accuracy", where)
    if not accuracy:
        raise PerfModelError(f"{_at(where, 'guess_accuracy')}: needs at least one value (rank 0)")
    for rank, value in enumerate(accuracy):
        if not _probability(value):
            raise PerfModelError(f"{_at(where, 'guess_accuracy')}[{rank}]: expected a probability in [0, 1], "
                                 f"found {value!r}")
    return Stage2Info(
        file=_str(obj, "file", where),
        sha256=sha256.lower(),
        guess_accuracy=tuple(float(value) for value in accuracy),
        query_overhead_ms=_ms(obj, "query_overhead_ms", where, allow_zero=True),
        query_ms_per_context=_ms(obj, "query_ms_per_context", where, allow_zero=True),
    )


def _tokens_per_step_se(obj: dict, where: str, tokens_per_step: tuple[float, ...] | None) -> tuple[float, ...] | None:
    values = obj.get("tokens_per_step_se")
    if values is None:
        return None
    at = _at(where, "tokens_per_step_se")
    if tokens_per_step is None or not isinstance(values, list) or len(values) != len(tokens_per_step):
        raise PerfModelError(f"{at}: expected one standard error per tokens_per_step value")
    if not all((_is_int(v) or isinstance(v, float)) and v >= 0 for v in values):
        raise PerfModelError(f"{at}: expected numbers >= 0")
    return tuple(float(v) for v in values)


def _step_counts_by_prompt(obj: dict, where: str, max_k: int) -> tuple | None:
    values = obj.get("step_counts_by_prompt")
    if values is None:
        return None
    at = _at(where, "step_counts_by_prompt")
    try:
        counts = tuple(tuple((float(t), float(n)) for t, n in per_k) for per_k in values)
    except (TypeError, ValueError):
        raise PerfModelError(f"{at}: expected per k a list of [tokens, steps] per prompt") from None
    if (len(counts) != max_k or len({len(per_k) for per_k in counts}) != 1 or not counts[0]
            or min(min(p) for c in counts for p in c) < 0):
        raise PerfModelError(f"{at}: expected {max_k} non-empty lists (k = 1..{max_k}) of equal length with "
                             "counts >= 0")
    return counts


def acceptance_entry_from_json(obj: dict, where: str) -> AcceptanceEntry:
    """One acceptance entry, strictly (the model file's entries are checked by the same rules)."""
    per_position = _list(obj, "per_position", where)
    if not per_position:
        raise PerfModelError(f"{_at(where, 'per_position')}: needs at least one value")
    for index, value in enumerate(per_position):
        if not (_is_int(value) or isinstance(value, float)) or not 0.0 <= value <= 1.0:
            raise PerfModelError(f"{_at(where, 'per_position')}[{index}]: expected a probability in [0, 1], "
                                 f"found {value!r}")
    trials = _int_list(obj, "trials", where, minimum=0, nullable=True)
    if trials is not None and len(trials) != len(per_position):
        raise PerfModelError(f"{_at(where, 'trials')}: has {len(trials)} values but per_position has "
                             f"{len(per_position)}")
    tokens_per_step = obj.get("tokens_per_step")
    if tokens_per_step is not None:
        where_tokens = _at(where, "tokens_per_step")
        if not isinstance(tokens_per_step, list) or len(tokens_per_step) != len(per_position) + 1:
            raise PerfModelError(f"{where_tokens}: expected a list of {len(per_position) + 1} values (k = 0..max_k)")
        for k, value in enumerate(tokens_per_step):
            if not (_is_int(value) or isinstance(value, float)) or not 1.0 <= value <= k + 1 + 1e-9:
                raise PerfModelError(f"{where_tokens}[{k}]: expected tokens per step in [1, {k + 1}], found {value!r}")
        tokens_per_step = tuple(float(value) for value in tokens_per_step)
    return AcceptanceEntry(
        tokens_per_step=tokens_per_step, tokens_per_step_se=_tokens_per_step_se(obj, where, tokens_per_step),
        step_counts_by_prompt=_step_counts_by_prompt(obj, where, len(per_position)),
        rank_acceptance=_rank_acceptance(obj, where),
        rank_sequences=_rank_sequences(obj, where),
        mode=_str(obj, "mode", where, ACCEPTANCE_MODES),
        temperature=_number(obj, "temperature", where, minimum=0.0, nullable=True),
        top_k=_int(obj, "top_k", where, minimum=1, nullable=True),
        top_p=_number(obj, "top_p", where, minimum=0.0, nullable=True),
        source=_str(obj, "source", where, ACCEPTANCE_SOURCES),
        per_position=tuple(float(value) for value in per_position),
        trials=trials,
        prompts=_str(obj, "prompts", where, nullable=True),
        prompt_count=_int(obj, "prompt_count", where, minimum=0, nullable=True),
    )


def _rows(obj: dict, key: str, where: str, parse) -> tuple:
    return tuple(parse(item, f"{_at(where, key)}[{index}]") for index, item in enumerate(_list(obj, key, where)))


def profile_from_json(obj: dict, source: str = "profile") -> Profile:
    """Build a Profile from its parsed JSON (schema already checked); `source` (the file) prefixes errors."""
    top = f"{source}:"
    models = _get(obj, "models", top)
    insitu_timings, insitu_steps = sections_from_json(obj, top)
    engine, engine_steps = engine_sections_from_json(obj, top)
    profile = Profile(
        created_utc=_str(obj, "created_utc", top),
        device=_device(_get(obj, "device", top), f"{top} device"),
        target=_model_info(_get(models, "target", f"{top} models"), f"{top} models.target"),
        draft=_model_info(_get(models, "draft", f"{top} models"), f"{top} models.draft"),
        grid=_grid(_get(obj, "grid", top), f"{top} grid"),
        timings=_rows(obj, "timings", top, _timing),
        overheads=_rows(obj, "overheads", top, _overhead),
        acceptance=_rows(obj, "acceptance", top, acceptance_entry_from_json),
        stage2=None if obj.get("stage2") is None else stage2_from_json(obj["stage2"], f"{top} stage2"),
        noise=None if obj.get("noise") is None else noise_from_json(obj["noise"], f"{top} noise"),
        insitu_timings=insitu_timings, insitu_steps=insitu_steps,
        device_state=None if obj.get("device_state") is None else device_state_from_json(obj["device_state"],
                                                                                        f"{top} device_state"),
        noise_large_batch=None if obj.get("noise_large_batch") is None else noise_from_json(
            obj["noise_large_batch"], f"{top} noise_large_batch"),
        composition=None if obj.get("composition") is None else composition_from_json(obj["composition"],
                                                                                      f"{top} composition"),
        engine=engine, engine_steps=engine_steps,
        stopped_early=_str(obj, "stopped_early", top) if obj.get("stopped_early") is not None else None,
        routing=None if obj.get("routing") is None else routing_from_json(obj["routing"], f"{top} routing"),
    )
    validate(profile, source)
    return profile


def validate(profile: Profile, where: str = "profile") -> None:
    """Checks across fields that the per-field readers cannot make; raises PerfModelError."""
    seen: set[tuple[str, int, int, int]] = set()
    for index, row in enumerate(profile.timings):
        key = (row.model, row.batch_size, row.new_tokens, row.context_len)
        if key in seen:
            raise PerfModelError(f"{where}: timings[{index}]: duplicate row for {row.model} "
                                 f"b={row.batch_size} n={row.new_tokens} L={row.context_len}")
        seen.add(key)
    overhead_keys = [(row.batch_size, row.k, row.tree_nodes, row.stage2) for row in profile.overheads]
    if len(set(overhead_keys)) != len(overhead_keys):
        raise PerfModelError(f"{where}: overheads: duplicate (batch_size, k, tree_nodes, stage2) rows")
    check_unique(profile.insitu_timings, profile.insitu_steps, where)
    check_engine_sections(profile.engine, profile.engine_steps,
                          bool(profile.timings or profile.overheads or profile.insitu_timings or profile.insitu_steps),
                          where)
    for role in ROLES:
        info = profile.model(role)
        if info.kv_heads > info.heads:
            raise PerfModelError(f"{where}: models.{role}: kv_heads ({info.kv_heads}) > heads ({info.heads})")
    check_rows_fit_in_memory(profile, where)
    check_routing(profile.routing, {role: profile.model(role).experts for role in ROLES
                                    if profile.model(role).experts is not None}, where)


def check_rows_fit_in_memory(profile: Profile, where: str) -> None:
    """A timed pass held its rows' KV cache, b x (L + n) tokens at the model's bytes per token, in the device's
    memory: a row needing more than the whole memory (a batch size of 1e9 "at 17 ms") was never measured, and a
    fit through it would silently carry its cost past every real batch size. The KV cache alone is a lower
    bound on what the pass held (weights and activations come on top), so no real measurement breaks this.
    A device whose memory is unknown (0: vidur's profiles) bounds nothing."""
    memory = profile.device.memory_bytes
    if not memory:
        return
    for key, rows in (("timings", profile.timings), ("insitu_timings", profile.insitu_timings)):
        for index, row in enumerate(rows):
            if not getattr(row, "feasible", True):
                continue  # a pass that did not fit is recorded as such: its size is the point
            kv_bytes = row.batch_size * (row.context_len + row.new_tokens) * profile.model(row.model).kv_bytes_per_token
            if kv_bytes > memory:
                raise PerfModelError(
                    f"{where}: {key}[{index}]: {row.model} b={row.batch_size} L={row.context_len} n={row.new_tokens} "
                    f"needs {kv_bytes / 2**30:.3g} GiB of KV cache alone, more than the device's "
                    f"{memory / 2**30:.3g} GiB (device.memory_bytes): no pass of that size was measured there")
    per_token = profile.target.kv_bytes_per_token
    for index, row in enumerate(profile.overheads):  # a step verifies at least k + 1 tokens a row
        if row.batch_size * (row.k + 1) * per_token > memory:
            raise PerfModelError(f"{where}: overheads[{index}]: b={row.batch_size} k={row.k} needs more KV cache "
                                 f"than the device's {memory / 2**30:.3g} GiB (device.memory_bytes): no step of "
                                 f"that size was measured there")


def load_profile(path: str | os.PathLike) -> Profile:
    """Read and validate a `specbatch.profile/1` file."""
    return profile_from_json(read_json(path, PROFILE_SCHEMA), str(path))


def save_profile(path: str | os.PathLike, profile: Profile) -> None:
    """Validate, then write atomically."""
    validate(profile, str(path))
    write_json_atomic(path, profile.to_json())
