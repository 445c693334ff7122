"""The `specbatch.table/1` contract: the best speculation length k per batch size, per context bucket.

This is what the runtime's `TableK` policy reads, so this module needs only the standard library and
`perfmodel.tree` (numpy; no scipy, no scikit-learn, no torch).

    {"schema": "specbatch.table/1", "target", "draft", "device", "created_utc", "max_k",
     "acceptance": {...the acceptance the table was computed with...},
     "stage2": {"file", "sha256"},                      (optional: when an entry uses the second stage)
     "fingerprints": {"target", "draft"},               (optional: the pair's content, jsonio.model_fingerprint)
     "costs": {"name", "version", "settings"},          (optional: whose step costs it was computed from:
                                                         "specbatch", our runtime, or an engine such as "vllm")
     "drafter": "eagle3" | "mtp",                       (optional: what drafts; absent means "draft_model",
                                                         a separate draft checkpoint)
     "experts": {"target": {"num_experts", "experts_per_token", "moe_layers", "routing": {...}}},
                                                        (optional: a mixture of experts' expert term; then each
                                                         entry's "experts_touched" is the distinct experts per
                                                         routed layer its verify pass reads)
     "buckets": [{"context_len", "entries": [{"batch_size", "k", "predicted_tokens_per_s",
                  "predicted_speedup", "runner_up_k", "margin",
                  "strategy", "runner_up_strategy"}, ...]}, ...]}   (both optional)

Strategies. An entry's optional `strategy` (`perfmodel.tree.Strategy.to_json()`: kind none | chain |
tree, k, the tree's rank paths, stage2) is what to run; its `k` is always the strategy's k (a tree's
depth), so a reader that knows only chains still works: it runs a chain of the tree's depth. Entries
without `strategy` (older files) mean a chain of k, or no speculation for k = 0. `Table.lookup` gives
k; `Table.strategy` gives the strategy. A table whose entries use the n-gram second stage names the
n-gram file (and its sha256) it was computed for in `stage2`.

Lookup rules (`Table.lookup`):
- bucket: the one whose context_len is nearest to the given mean context length, in tokens (KV
  cost is linear in L, so absolute distance is the physically even-handed one); a tie goes to the
  shorter bucket; no context length given means the first (shortest) bucket;
- batch size: its own entry; beyond the table, the last entry;
- a batch size beyond the table, or a context length outside [first, last] bucket, still gets an
  answer (the edge) and a `TableRangeWarning`, once per table object and per kind (batch, context).
"""
from __future__ import annotations

import csv
import io
import math
import os
import warnings
from dataclasses import dataclass, field

from .errors import NoteWarning, PerfModelError
from .exports import (  # noqa: F401  (re-exported: the engine exports' names as they were before exports.py)
    ENGINE_FORMATS,
    ENGINE_NAMES,
    TRTLLM_DRAFT_DECODING,
    VLLM_DRAFT_METHOD,
    costs_note,
    describe_clamped,
    drafter_phrase,
    engine_draft_path,
    engine_family_note,
    k_runs,
    sglang_command,
    to_sglang,
    to_trtllm,
    to_vllm,
    trtllm_clamped,
)
from .jsonio import read_json, rounded, write_json_atomic, write_text_atomic
from .tree import Strategy

TABLE_SCHEMA = "specbatch.table/1"
# What drafts: a separate draft model, an EAGLE-3 head or MTP heads; the engine exports differ per drafter
DRAFTERS = ("draft_model", "eagle3", "mtp")
DEFAULT_DRAFTER = "draft_model"  # older tables, which name no drafter, were all computed for a draft model
# A table holds an entry per batch size and context bucket (a few kB each, milliseconds each to compute):
# 4096 keeps the largest within a minute and some MB. Engines reuse the last entry's k beyond the table.
MAX_TABLE_BATCH = 4096

# The longest chain a table, query or plot considers (--max-k). A draft token past the 64th is worth the chance that
# all 64 before it were accepted: at alpha = 0.9 (a very close pair) 0.12 %, so E(k) grows by under 0.011 tokens a
# step from there on, less than any measured cost can tell apart. Meanwhile the search grows faster than k (chains,
# staged chains and trees up to depth k, each step scheduled over its k passes): --max-k 1000 ran for many minutes
# without a line, 64 takes seconds.
MAX_TABLE_K = 64


def check_max_k(max_k: int) -> None:
    if not 0 <= max_k <= MAX_TABLE_K:
        raise PerfModelError(f"--max-k must be in [0, {MAX_TABLE_K}], found {max_k} (at acceptance 0.9 the draft "
                             f"tokens past the {MAX_TABLE_K}th add under 0.011 tokens a step in all, and the search "
                             "grows faster than k)")


class TableRangeWarning(NoteWarning):
    """A lookup outside the batch sizes or context lengths the table was computed for."""


@dataclass(frozen=True)
class TableEntry:
    batch_size: int
    k: int  # = strategy.k when a strategy is given
    predicted_tokens_per_s: float
    predicted_speedup: float  # over k = 0
    runner_up_k: int | None
    margin: float | None  # relative goodput lead over the runner-up
    strategy: Strategy | None = None  # None (older tables): a chain of k, or none for k = 0
    runner_up_strategy: Strategy | None = None
    # a mixture-of-experts target: the distinct experts per routed layer its verify (or decode) pass reads at this
    # batch size (perfmodel.experts); None for a dense target
    experts_touched: float | None = None

    def chosen(self) -> Strategy:
        """The strategy to run: the entry's own, else the chain of k its k means."""
        return self.strategy if self.strategy is not None else Strategy.from_k(self.k)


@dataclass(frozen=True)
class Bucket:
    context_len: int
    entries: tuple[TableEntry, ...]  # batch sizes 1..N, contiguous

    @property
    def max_batch(self) -> int:
        return self.entries[-1].batch_size


@dataclass(frozen=True)
class Table:
    target: str
    draft: str
    device: str
    created_utc: str
    max_k: int
    acceptance: dict
    buckets: tuple[Bucket, ...]  # ascending context_len
    stage2: dict | None = None  # {"file", "sha256"} of the n-gram model, when an entry uses it
    # {"target": fingerprint, "draft": fingerprint} (perfmodel.jsonio.model_fingerprint) of the pair the table
    # was computed for, so a runtime can refuse a table made for another pair; None in older tables
    fingerprints: dict | None = None
    # whose step costs the table was computed from ({"name": "specbatch" | "vllm", "version", "settings"});
    # None in older tables, which were all computed from our runtime's
    costs: dict | None = None
    # what drafts (DRAFTERS): the engine exports run it as such (vLLM's method, TensorRT-LLM's decoding config,
    # SGLang's algorithm); written to JSON only when it is not a draft model
    drafter: str = DEFAULT_DRAFTER
    # a mixture of experts' expert term, per role with experts: its shape and fitted routing (informative: what the
    # entries' experts_touched come from); None for dense pairs and older tables
    experts: dict | None = None
    # kinds of out-of-range lookups already warned about; mutable on purpose, outside equality
    _warned: set = field(default_factory=set, compare=False, repr=False)

    def _warn_once(self, kind: str, message: str) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            warnings.warn(message, TableRangeWarning, stacklevel=4)  # point at lookup's caller

    def bucket_for(self, context_len: int | None) -> Bucket:
        """The bucket nearest to `context_len` in tokens (ties: the shorter); None: the first."""
        if context_len is None:
            return self.buckets[0]
        return min(self.buckets, key=lambda bucket: abs(bucket.context_len - context_len))

    def lookup(self, batch_size: int, context_len: int | None = None) -> int:
        """The k to use for `batch_size` sequences whose mean context length is `context_len`."""
        return self._entry(batch_size, context_len).k

    def strategy(self, batch_size: int, context_len: int | None = None) -> Strategy:
        """The strategy to use (same rules as `lookup`); older tables give chains of their k."""
        return self._entry(batch_size, context_len).chosen()

    def _entry(self, batch_size: int, context_len: int | None) -> TableEntry:
        if batch_size < 1:
            raise PerfModelError(f"table lookup: batch size must be >= 1, found {batch_size}")
        first, last = self.buckets[0].context_len, self.buckets[-1].context_len
        if context_len is not None and not first <= context_len <= last:
            self._warn_once("context", f"table: context length {context_len} is outside the buckets "
                                       f"[{first}, {last}]; using the nearest edge bucket")
        bucket = self.bucket_for(context_len)
        if batch_size > bucket.max_batch:
            self._warn_once("batch", f"table: batch size {batch_size} is beyond the table's {bucket.max_batch}; "
                                     f"using the entry for {bucket.max_batch}")
            return bucket.entries[-1]
        return bucket.entries[batch_size - 1]

    def to_json(self) -> dict:
        obj = {
            "schema": TABLE_SCHEMA, "target": self.target, "draft": self.draft, "device": self.device,
            "created_utc": self.created_utc, "max_k": self.max_k, "acceptance": self.acceptance,
            "buckets": [{"context_len": bucket.context_len, "entries": [_entry_json(e) for e in bucket.entries]}
                        for bucket in self.buckets],
        }
        if self.stage2 is not None:
            obj["stage2"] = self.stage2
        if self.fingerprints is not None:
            obj["fingerprints"] = self.fingerprints
        if self.costs is not None:
            obj["costs"] = self.costs
        if self.drafter != DEFAULT_DRAFTER:
            obj["drafter"] = self.drafter
        if self.experts is not None:
            obj["experts"] = self.experts
        return obj

    def costs_name(self) -> str:
        """'specbatch' (our runtime's costs, also for older tables) or the engine's name."""
        return "specbatch" if self.costs is None else self.costs["name"]


def _entry_json(entry: TableEntry) -> dict:
    obj = {"batch_size": entry.batch_size, "k": entry.k,
           "predicted_tokens_per_s": rounded(entry.predicted_tokens_per_s),
           "predicted_speedup": rounded(entry.predicted_speedup),
           "runner_up_k": entry.runner_up_k, "margin": rounded(entry.margin)}
    if entry.strategy is not None:
        obj["strategy"] = entry.strategy.to_json()
    if entry.runner_up_strategy is not None:
        obj["runner_up_strategy"] = entry.runner_up_strategy.to_json()
    if entry.experts_touched is not None:
        obj["experts_touched"] = rounded(entry.experts_touched, 4)
    return obj


# ---------------------------------------------------------------- reading

def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _entry(obj, where: str, max_k: int) -> TableEntry:
    if not isinstance(obj, dict):
        raise PerfModelError(f"{where}: expected an object")
    for key in ("batch_size", "k", "predicted_tokens_per_s", "predicted_speedup"):
        if key not in obj:
            raise PerfModelError(f"{where}: missing {key!r}")
    k, runner_up, margin = obj["k"], obj.get("runner_up_k"), obj.get("margin")
    if not _is_int(obj["batch_size"]):
        raise PerfModelError(f"{where}.batch_size: expected an integer, found {obj['batch_size']!r}")
    if not _is_int(k) or not 0 <= k <= max_k:
        raise PerfModelError(f"{where}.k: expected an integer in [0, max_k={max_k}], found {k!r}")
    for key in ("predicted_tokens_per_s", "predicted_speedup"):
        if not _is_number(obj[key]) or obj[key] <= 0:
            raise PerfModelError(f"{where}.{key}: expected a positive number, found {obj[key]!r}")
    if runner_up is not None and (not _is_int(runner_up) or runner_up < 0):
        raise PerfModelError(f"{where}.runner_up_k: expected an integer >= 0 or null, found {runner_up!r}")
    if margin is not None and (not _is_number(margin) or margin < 0):
        raise PerfModelError(f"{where}.margin: expected a number >= 0 or null, found {margin!r}")
    strategy, runner_up_strategy = (None if obj.get(key) is None else Strategy.from_json(obj[key], f"{where}.{key}")
                                    for key in ("strategy", "runner_up_strategy"))
    if strategy is not None and strategy.k != k:
        raise PerfModelError(f"{where}.k: {k} is not its strategy's k {strategy.k} ({strategy.describe(40)})")
    experts = obj.get("experts_touched")
    if experts is not None and (not _is_number(experts) or experts < 1):
        raise PerfModelError(f"{where}.experts_touched: expected a number >= 1 or null, found {experts!r}")
    return TableEntry(obj["batch_size"], k, float(obj["predicted_tokens_per_s"]), float(obj["predicted_speedup"]),
                      runner_up, None if margin is None else float(margin), strategy, runner_up_strategy,
                      None if experts is None else float(experts))


def _bucket(obj, where: str, max_k: int) -> Bucket:
    if not isinstance(obj, dict) or not _is_int(obj.get("context_len")) or obj["context_len"] < 0:
        raise PerfModelError(f"{where}: expected an object with an integer context_len >= 0")
    rows = obj.get("entries")
    if not isinstance(rows, list) or not rows:
        raise PerfModelError(f"{where}.entries: expected a non-empty list")
    entries = tuple(_entry(row, f"{where}.entries[{i}]", max_k) for i, row in enumerate(rows))
    for expected, entry in enumerate(entries, start=1):
        if entry.batch_size != expected:
            raise PerfModelError(f"{where}.entries: batch sizes must be 1, 2, 3, ... in order without gaps; "
                                 f"entry {expected} has batch_size {entry.batch_size}")
    return Bucket(obj["context_len"], entries)


def table_from_json(obj: dict, source: str = "table") -> Table:
    """Validate a parsed table (schema already checked); `source` (the file) prefixes errors."""
    for key in ("target", "draft", "device", "created_utc"):
        if not isinstance(obj.get(key), str):
            raise PerfModelError(f"{source}: {key}: expected a string, found {obj.get(key)!r}")
    max_k = obj.get("max_k")
    if not _is_int(max_k) or max_k < 0:
        raise PerfModelError(f"{source}: max_k: expected an integer >= 0, found {max_k!r}")
    acceptance = obj.get("acceptance")
    if not isinstance(acceptance, dict):
        raise PerfModelError(f"{source}: acceptance: expected an object, found {acceptance!r}")
    rows = obj.get("buckets")
    if not isinstance(rows, list) or not rows:
        raise PerfModelError(f"{source}: buckets: expected a non-empty list")
    buckets = tuple(_bucket(row, f"{source}: buckets[{i}]", max_k) for i, row in enumerate(rows))
    lengths = [bucket.context_len for bucket in buckets]
    if lengths != sorted(set(lengths)):
        raise PerfModelError(f"{source}: buckets: context_len must be strictly increasing, found {lengths}")
    stage2 = obj.get("stage2")
    if stage2 is not None and (not isinstance(stage2, dict) or not all(isinstance(stage2.get(key), str)
                                                                       for key in ("file", "sha256"))):
        raise PerfModelError(f"{source}: stage2: expected an object with the n-gram's file and sha256 strings, "
                             f"found {stage2!r}")
    if stage2 is None and any(e.strategy is not None and e.strategy.stage2 for b in buckets for e in b.entries):
        raise PerfModelError(f"{source}: stage2: missing, but entries use the n-gram second stage "
                             "(the table must name the n-gram file they were computed for)")
    fingerprints = obj.get("fingerprints")
    if fingerprints is not None and (not isinstance(fingerprints, dict) or not all(
            isinstance(fingerprints.get(role), (str, type(None))) for role in ("target", "draft"))):
        raise PerfModelError(f"{source}: fingerprints: expected an object with target and draft strings, "
                             f"found {fingerprints!r}")
    costs = obj.get("costs")
    if costs is not None and (not isinstance(costs, dict) or not isinstance(costs.get("name"), str)
                              or not isinstance(costs.get("settings", {}), dict)):
        raise PerfModelError(f"{source}: costs: expected an object with the name of whose step costs the table "
                             f"carries (and its settings), found {costs!r}")
    drafter = obj.get("drafter", DEFAULT_DRAFTER)
    if drafter not in DRAFTERS:
        raise PerfModelError(f"{source}: drafter: {drafter!r} is not one of {', '.join(DRAFTERS)} (what drafts: "
                             "a separate draft model, an EAGLE-3 head, MTP heads)")
    experts = obj.get("experts")
    if experts is not None and (not isinstance(experts, dict) or not all(
            role in ("target", "draft") and isinstance(value, dict) for role, value in experts.items())):
        raise PerfModelError(f"{source}: experts: expected an object of target/draft expert terms, found {experts!r}")
    return Table(obj["target"], obj["draft"], obj["device"], obj["created_utc"], max_k, acceptance, buckets,
                 None if stage2 is None else {"file": stage2["file"], "sha256": stage2["sha256"]},
                 None if fingerprints is None else {role: fingerprints.get(role) for role in ("target", "draft")},
                 None if costs is None else dict(costs), drafter, experts)


def load_table(path: str | os.PathLike) -> Table:
    return table_from_json(read_json(path, TABLE_SCHEMA), str(path))


def save_table(path: str | os.PathLike, table: Table) -> None:
    obj = table.to_json()
    table_from_json(obj, str(path))  # never write a file our own reader would refuse
    write_json_atomic(path, obj)


# ---------------------------------------------------------------- exports
# Engine configs live in perfmodel/exports.py (each checked against the engine's own source; the files and
# versions are in docs/exports.md); their names stay importable from here.

CSV_COLUMNS = ("batch_size", "k", "predicted_tokens_per_s", "predicted_speedup", "context_len", "strategy")


def to_csv(table: Table) -> str:
    """One row per (bucket, batch size); plain numbers, no units in cells (the header names them).
    `strategy` is `Strategy.describe()`: 'none', 'chain k=3', 'tree 0,1,0.0 (3 nodes)' (the spec is
    what `parse_tree` reads), with ' +ngram' for the second stage."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    for bucket in table.buckets:
        for entry in bucket.entries:
            writer.writerow([entry.batch_size, entry.k, f"{entry.predicted_tokens_per_s:.6g}",
                             f"{entry.predicted_speedup:.6g}", bucket.context_len, entry.chosen().describe()])
    return out.getvalue()


TABLE_FORMATS = ("json", "csv", *ENGINE_FORMATS)


def table_output_kind(fmt: str) -> str:
    """What `write_table` writes in format `fmt`, as perfmodel.jsonio.check_replace names kinds."""
    return {"json": TABLE_SCHEMA.split("/")[0], "csv": "csv:" + ",".join(CSV_COLUMNS), "vllm": "vllm config",
            "trtllm": "trtllm config", "sglang": "sglang config"}[fmt]


def check_table_format(fmt: str, draft: str | os.PathLike | None = None, clamp: bool = False,
                       graph_bs: list[int] | None = None) -> None:
    """The format and its options, checked before anything is computed."""
    if fmt not in TABLE_FORMATS:
        raise PerfModelError(f"--format: {fmt!r} is not one of {', '.join(TABLE_FORMATS)}")
    if clamp and fmt != "trtllm":
        raise PerfModelError(f"--clamp applies to --format trtllm only, not {fmt}")
    if draft is not None and fmt not in ENGINE_FORMATS:
        raise PerfModelError(f"--draft applies to --format vllm or trtllm or sglang only, not {fmt}")
    if graph_bs is not None and fmt != "sglang":
        raise PerfModelError(f"--cuda-graph-bs applies to --format sglang only, not {fmt}")


def trtllm_end_note(export: dict, table: Table) -> list[str]:
    """TensorRT-LLM runs every batch size past the schedule's largest key without speculation. Where the table
    ends on a k > 0 (it stops at --max-batch, not at a choice of 0), a server batching more requests loses
    speculation there without a word; vLLM instead keeps the last entry's k."""
    largest = max(bucket.max_batch for bucket in table.buckets)
    schedule = export["draft_len_schedule"]
    if not schedule or max(int(key) for key in schedule) < largest:
        return []  # the table itself chose k = 0 at its end, as TensorRT-LLM runs past it
    return [f"trtllm: TensorRT-LLM runs batch sizes above {largest} (the table's largest, --max-batch) without "
            f"speculation, where this table still drafts; a server batching more requests than {largest} needs "
            f"a table up to its max_batch_size (--max-batch)"]


def write_table(path: str | os.PathLike, table: Table, fmt: str = "json", *, draft: str | os.PathLike | None = None,
                clamp: bool = False, graph_bs: list[int] | None = None) -> list[str]:
    """The one table writer (`table -o` and the demo): our JSON, CSV, or an engine's export for the table's
    drafter (`draft`: the checkpoint the export names, default the table's; `clamp`: cap a rising k for
    TensorRT-LLM; `graph_bs`: SGLang's decode CUDA-graph sizes). Returns notes on what the export changed
    and, for SGLang, the server flags that read it."""
    check_table_format(fmt, draft, clamp, graph_bs)
    notes = [costs_note(table, fmt)] if fmt in ENGINE_FORMATS else []
    if fmt == "json":
        save_table(path, table)
    elif fmt == "csv":
        write_text_atomic(path, to_csv(table))
    elif fmt == "vllm":
        write_json_atomic(path, to_vllm(table, draft=draft))
    elif fmt == "sglang":
        export = to_sglang(table, draft=draft, graph_bs=graph_bs, config_path=path)
        write_json_atomic(path, export)
        notes.append(f"sglang: serve with {sglang_command(export)}")
    else:
        export = to_trtllm(table, draft=draft, clamp=clamp)
        write_json_atomic(path, export)
        notes += trtllm_end_note(export, table)
    changed = trtllm_clamped(table.buckets[0].entries) if clamp else []
    if changed:
        notes.append(f"--clamp: k capped at {changed[0][2]} in {path} where the table has {describe_clamped(changed)}")
    return notes
