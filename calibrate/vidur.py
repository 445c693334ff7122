"""`calibrate --from-vidur DIR`: a profile composed from vidur's published per-operation GPU timings.

vidur (microsoft/vidur) times the operations of ONE transformer block on a GPU over every token count
(`mlp.csv`) and its attention kernel over batch size and cached tokens (`attention.csv`). A whole pass
of `b` rows feeding `n` tokens each on top of `L` cached ones is composed here as

    T(b, n, L) = emb(t) + layers * (block(t) + add(t) + attention(b, n, L)) + norm(t) + lm_head(t),   t = b * n

- block(t): vidur's input norm, fused QKV GEMM, rope, O GEMM, post-attention norm, fused gate/up GEMM,
  SiLU-and-mul, down GEMM and one residual add, each its median at t tokens (tensor parallel 1);
- add(t): the block's second residual add, which vidur does not time: taken equal to the timed one;
- attention(b, 1, L): vidur's decode kernel (and its output reshape) at batch size b over L cached tokens;
  n > 1 (a verify pass) is not profiled: the decode time scaled by the keys read, (L + n) / (L + 1);
- emb(t): vidur's embedding; norm(t): the final norm, taken equal to the input norm;
- lm_head(t): the LM head over every fed token, not profiled: the fused gate/up GEMM (same K) scaled by
  vocab / (2 * intermediate), so it keeps that GEMM's tile steps.

Token counts vidur did not profile (it steps by 8 above 8 tokens, by 16 above 1024) read the linear
operations at the next profiled count: a GEMM's tiles hold a multiple of 8 rows, so its time is flat
within one. Left out: kernel launch gaps between operations, sampling, the step's bookkeeping. All of
it is written in the profile's `composition` section.
"""
from __future__ import annotations

import csv
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from specbatch.perfmodel.exports import drafter_phrase
from specbatch.perfmodel.jsonio import check_replace, file_sha256
from specbatch.perfmodel.profile import PROFILE_KIND, DeviceInfo, Grid, Profile, TimingRow
from specbatch.perfmodel.profile.composition import Composition, SourceFile
from specbatch.runtime.config import ModelConfig
from specbatch.runtime.loading import ModelSpec, named_head, resolve_model
from specbatch.runtime.sampling import Sampling

from .acceptance import parse_acceptance, user_entry
from .errors import CalibrationError
from .grid import DRAFT_NEW_TOKENS, DEFAULT_MAX_K
from .models import model_info
from .store import TIMINGS_CSV_KIND, csv_path_for, new_profile, write_profile

MLP_FILE = "mlp.csv"
ATTENTION_FILE = "attention.csv"  # vidur's own file: every attention row it profiled
DECODE_FILE = "attention_decode_tp1.csv"  # a transcription of its decode rows at tensor parallel 1
BLOCK_OPS = ("input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
             "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
SHAPE_COLUMNS = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "use_gated_mlp")
ATTENTION_PARTS = ("attn_input_reshape", "attn_kv_cache_save", "attn_decode", "attn_output_reshape")
# A context is offered by default when the decode kernel was profiled there at half the batch sizes or more;
# the transcription's partial contexts (a few batch sizes each) are not.
MIN_CONTEXT_COVERAGE = 0.5


@dataclass(frozen=True)
class VidurTimings:
    """One folder's medians, in ms: per operation of one block by token count; attention by (L, b)."""

    folder: Path
    shape: dict  # SHAPE_COLUMNS -> value, as vidur profiled the block
    token_counts: np.ndarray  # (T,) profiled token counts, ascending
    op_ms: dict  # op -> (T,) median ms at each token count (emb and BLOCK_OPS)
    attention_ms: dict  # context_len -> {batch_size: ms of the decode kernel and its reshapes}
    attention_parts: tuple[str, ...]  # which ATTENTION_PARTS the attention times add up
    files: tuple[SourceFile, ...]

    def linear_ms(self, op: str, tokens: int) -> tuple[float, bool] | None:
        """The op at `tokens`, or at the next profiled count (padded: True); None beyond the largest."""
        index = int(np.searchsorted(self.token_counts, tokens))
        if index == len(self.token_counts):
            return None
        return float(self.op_ms[op][index]), bool(self.token_counts[index] != tokens)


def _read_csv(path: Path) -> list[dict]:
    try:
        with path.open(newline="", encoding="utf-8") as file:
            return list(csv.DictReader(line for line in file if not line.startswith("#")))
    except (OSError, UnicodeDecodeError, csv.Error) as error:
        raise CalibrationError(f"--from-vidur: {path}: not readable ({error})") from None


def _number(row: dict, column: str, path: Path, index: int) -> float:
    try:
        value = float(row[column])
    except (KeyError, TypeError, ValueError):
        raise CalibrationError(f"--from-vidur: {path}: row {index + 2}: column {column!r} is missing or not a "
                               f"number ({row.get(column)!r})") from None
    if not math.isfinite(value) or value < 0:
        raise CalibrationError(f"--from-vidur: {path}: row {index + 2}: {column} = {value} is not a time")
    return value


def _require_columns(rows: list[dict], columns, path: Path) -> None:
    if not rows:
        raise CalibrationError(f"--from-vidur: {path}: no rows")
    missing = [c for c in columns if c not in rows[0]]
    if missing:
        raise CalibrationError(f"--from-vidur: {path}: missing columns {', '.join(missing)} (is it vidur's?)")


def _tp1(rows: list[dict], path: Path) -> list[dict]:
    kept = [row for row in rows if row.get("num_tensor_parallel_workers", "1") == "1"]
    if not kept:
        raise CalibrationError(f"--from-vidur: {path}: no rows at num_tensor_parallel_workers = 1 (one GPU)")
    return kept


def _read_mlp(path: Path) -> tuple[dict, np.ndarray, dict]:
    ops = ("emb",) + BLOCK_OPS
    rows = _read_csv(path)
    _require_columns(rows, [f"time_stats.{op}.median" for op in ops] + ["num_tokens", *SHAPE_COLUMNS], path)
    rows = _tp1(rows, path)
    shapes = {tuple(row[c] for c in SHAPE_COLUMNS) for row in rows}
    if len(shapes) > 1:
        raise CalibrationError(f"--from-vidur: {path}: rows of {len(shapes)} block shapes; one folder is one model")
    by_tokens: dict[int, list[list[float]]] = {}
    for index, row in enumerate(rows):
        tokens = int(_number(row, "num_tokens", path, index))
        by_tokens.setdefault(tokens, []).append([_number(row, f"time_stats.{op}.median", path, index) for op in ops])
    counts = np.array(sorted(by_tokens))
    table = np.array([np.mean(by_tokens[t], axis=0) for t in counts])  # repeated token counts: their mean
    shape = dict(zip(SHAPE_COLUMNS, shapes.pop()))
    shape = {key: value == "True" if key == "use_gated_mlp" else int(value) for key, value in shape.items()}
    return shape, counts, {op: table[:, i] for i, op in enumerate(ops)}


def _read_attention(folder: Path) -> tuple[Path, dict, tuple[str, ...], dict]:
    """vidur's attention.csv (decode rows at tensor parallel 1), else the transcription of those rows."""
    path = folder / ATTENTION_FILE
    if path.is_file():
        rows = _read_csv(path)
        _require_columns(rows, ["batch_size", "kv_cache_size", "is_prefill", "time_stats.attn_decode.median"], path)
        rows = [row for row in _tp1(rows, path) if row["is_prefill"] == "False"]
        parts = tuple(p for p in ATTENTION_PARTS if f"time_stats.{p}.median" in rows[0]) if rows else ()
        columns = [f"time_stats.{p}.median" for p in parts]
        shape = {"n_head": "n_q_head", "n_kv_head": "n_kv_head", "n_embd": "n_embd"}
        shape = {key: int(rows[0][column]) for key, column in shape.items() if rows and column in rows[0]}
    else:
        path = folder / DECODE_FILE
        if not path.is_file():
            raise CalibrationError(f"--from-vidur {folder}: neither {ATTENTION_FILE} nor {DECODE_FILE} is there")
        rows = _read_csv(path)
        parts, columns, shape = ("attn_decode", "attn_output_reshape"), [
            "attn_decode_median_ms", "attn_output_reshape_median_ms"], {}
        _require_columns(rows, ["batch_size", "kv_cache_size", *columns], path)
    if not rows:
        raise CalibrationError(f"--from-vidur: {path}: no decode rows (is_prefill = False) at tensor parallel 1")
    samples: dict[tuple[int, int], list[float]] = {}
    for index, row in enumerate(rows):
        key = (int(_number(row, "kv_cache_size", path, index)), int(_number(row, "batch_size", path, index)))
        # an empty cell is a part that did not run at that shape (vidur leaves it blank)
        samples.setdefault(key, []).append(sum(_number(row, c, path, index) for c in columns if row.get(c, "") != ""))
    attention: dict[int, dict[int, float]] = {}
    for (context_len, batch_size), values in sorted(samples.items()):
        attention.setdefault(context_len, {})[batch_size] = float(np.mean(values))  # profiled twice: the mean
    return path, attention, parts, shape


def read_vidur_folder(folder: Path) -> VidurTimings:
    """The medians of one vidur model folder; any problem is a one-line CalibrationError naming the file."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CalibrationError(f"--from-vidur {folder}: not a directory (give vidur's compute/<gpu>/<model> folder)")
    mlp = folder / MLP_FILE
    if not mlp.is_file():
        raise CalibrationError(f"--from-vidur {folder}: no {MLP_FILE} there (vidur's per-operation timings)")
    shape, counts, op_ms = _read_mlp(mlp)
    attention_path, attention, parts, attention_shape = _read_attention(folder)
    for key, value in attention_shape.items():
        if shape[key] != value:
            raise CalibrationError(f"--from-vidur: {attention_path}: {key} {value}, but {mlp} has {shape[key]}")
    files = tuple(SourceFile(str(p.resolve()), file_sha256(p)) for p in (mlp, attention_path))
    return VidurTimings(folder, shape, counts, op_ms, attention, parts, files)


def check_block(timings: VidurTimings, config: ModelConfig, option: str) -> None:
    """The model's block must be the one vidur timed (the layer count and vocabulary may differ). vidur times a
    dense MLP: a mixture of experts' layers are not composed from it (whatever its widths)."""
    if config.num_experts:
        raise CalibrationError(f"{option}: a mixture of experts ({config.num_experts} experts, top-"
                               f"{config.experts_per_token}); vidur's per-operation timings are of a dense MLP, which "
                               "reads every weight a pass, so they cannot compose its passes; calibrate it on a GPU")
    mine = {"n_head": config.num_heads, "n_kv_head": config.num_kv_heads, "n_embd": config.hidden_size,
            "n_expanded_embd": config.intermediate_size, "use_gated_mlp": config.family == "llama"}
    differ = [f"{key} {mine[key]} here, {timings.shape[key]} there" for key in SHAPE_COLUMNS
              if mine[key] != timings.shape[key]]
    if config.num_heads * config.head_dim != config.hidden_size:
        differ.append(f"head_dim {config.head_dim} x {config.num_heads} heads is not hidden_size {config.hidden_size}")
    if differ:
        raise CalibrationError(f"{option}: its block is not the one vidur profiled in {timings.folder} "
                               f"({'; '.join(differ)})")


def default_context_lens(timings: VidurTimings) -> tuple[int, ...]:
    largest = max(max(by_b) for by_b in timings.attention_ms.values())
    return tuple(L for L, by_b in sorted(timings.attention_ms.items()) if len(by_b) >= MIN_CONTEXT_COVERAGE * largest)


def pass_ms(timings: VidurTimings, config: ModelConfig, b: int, n: int, L: int) -> tuple[float, bool] | None:
    """One composed pass (module docstring) and whether its token count was padded; None where vidur has no
    attention time at (b, L) or the token count is beyond its largest."""
    attention = timings.attention_ms.get(L, {}).get(b)
    if attention is None:
        return None
    tokens = b * n
    linear = {op: timings.linear_ms(op, tokens) for op in ("emb",) + BLOCK_OPS}
    if any(value is None for value in linear.values()):
        return None
    ms = {op: value[0] for op, value in linear.items()}
    up_columns = 2 * config.intermediate_size if timings.shape["use_gated_mlp"] else config.intermediate_size
    block = sum(ms[op] for op in BLOCK_OPS) + ms["add"] + attention * (L + n) / (L + 1)
    total = ms["emb"] + config.num_layers * block + ms["input_layernorm"] + ms["mlp_up_proj"] * (
        config.vocab_size / up_columns)
    return total, linear["attn_pre_proj"][1]


def composition(timings: dict[str, VidurTimings], padded_rows: int) -> Composition:
    parts = next(iter(timings.values())).attention_parts
    files = tuple(dict.fromkeys(f for t in timings.values() for f in t.files))
    return Composition(
        source="vidur", files=files,
        measured=(f"per layer: {', '.join(BLOCK_OPS)} (medians, tensor parallel 1)",
                  f"per layer, one query token per row: {', '.join(parts)}", "once per pass: emb"),
        estimated=("the second residual add per layer: equal to the timed add",
                   "attention of n > 1 new tokens per row: the decode time scaled by (L + n) / (L + 1)",
                   "the final norm: equal to input_layernorm",
                   "the LM head over every fed token: mlp_up_proj scaled by vocab / its output columns",
                   "token counts vidur did not profile: the linear operations at the next profiled count",
                   "p10_ms and p90_ms: the composed median (vidur's files give medians)"),
        left_out=("kernel launch gaps between operations", "sampling", "the step's bookkeeping (no overhead rows)"),
        padded_rows=padded_rows)


@dataclass(frozen=True)
class VidurRequest:
    folder: Path  # the target's vidur folder
    target: str  # preset name or config.json (a model directory's config is read too)
    draft: str
    acceptance: str  # as calibrate --acceptance: given, never measured
    out: Path
    draft_folder: Path | None = None  # None: the target's folder (a draft of the same block, fewer layers)
    batch_sizes: tuple[int, ...] | None = None  # None: every batch size the attention data has
    context_lens: tuple[int, ...] | None = None  # None: the contexts profiled at most batch sizes
    max_k: int = DEFAULT_MAX_K
    force: bool = False


@dataclass(frozen=True)
class VidurImport:
    profile: Profile
    rows: int
    padded_rows: int
    missing_rows: int  # (b, n, L) asked for that vidur's data cannot compose


def _device(folder: Path) -> DeviceInfo:
    """The GPU is the folder's: vidur keeps compute/<gpu>/<organisation>/<model>; a copy may drop a level."""
    parts = Path(folder).resolve().parts
    gpu = parts[parts.index("compute") + 1] if "compute" in parts[:-1] else Path(folder).resolve().parent.name
    return DeviceInfo(kind="cuda", name=f"{gpu} (vidur's per-operation timings)", memory_bytes=0, dtype="float16",
                      torch_version="n/a (composed)", cpu_threads=1, git_revision=None)


def _grid(request: VidurRequest, timings: VidurTimings) -> Grid:
    contexts = request.context_lens or default_context_lens(timings)
    unknown = [L for L in contexts if L not in timings.attention_ms]
    if unknown:
        raise CalibrationError(f"--context-lens {unknown}: vidur profiled the decode kernel at "
                               f"{sorted(timings.attention_ms)} cached tokens only")
    profiled = sorted({b for L in contexts for b in timings.attention_ms[L]})
    batch_sizes = request.batch_sizes or tuple(profiled)
    unknown = [b for b in batch_sizes if b not in profiled]
    if unknown:
        raise CalibrationError(f"--batch-sizes {unknown}: not profiled at --context-lens {list(contexts)} "
                               f"(profiled: {profiled[0]}..{profiled[-1]})")
    if request.max_k < 1:
        raise CalibrationError(f"--max-k: must be a positive integer, got {request.max_k}")
    return Grid(batch_sizes=tuple(sorted(set(batch_sizes))), context_lens=tuple(sorted(set(contexts))),
                max_k=request.max_k, target_new_tokens=tuple(range(1, request.max_k + 2)),
                draft_new_tokens=DRAFT_NEW_TOKENS)


def compose_profile(request: VidurRequest) -> VidurImport:
    """Read, check and compose; nothing is written."""
    if (kind := named_head(request.draft)) is not None:
        raise CalibrationError(f"--draft {request.draft} is {drafter_phrase(kind)}: --from-vidur composes a draft "
                               "model's layers from vidur's per-operation timings, and a head's passes (its "
                               "projection of the target's states, its draft vocabulary) are none of them; time the "
                               "head with `specbatch calibrate --draft`")
    specs: dict[str, ModelSpec] = {"target": resolve_model(request.target, "target"),
                                   "draft": resolve_model(request.draft, "draft")}
    folders = {"target": request.folder, "draft": request.draft_folder or request.folder}
    timings = {role: read_vidur_folder(folder) for role, folder in folders.items()}
    for role, spec in specs.items():
        option = f"--{role} {spec.source}" + ("" if role == "target" or request.draft_folder else
                                              " (or give its own --draft-from-vidur folder)")
        check_block(timings[role], spec.config, option)
    grid = _grid(request, timings["target"])
    for L in grid.context_lens:
        if L + grid.max_k + 1 > min(spec.config.max_position_embeddings for spec in specs.values()):
            raise CalibrationError(f"--context-lens: {L} + max_k {grid.max_k} + 1 is past the models' positions")
    rows, padded, missing = [], 0, 0
    for role, widths in (("target", grid.target_new_tokens), ("draft", grid.draft_new_tokens)):
        for L in grid.context_lens:
            for b in grid.batch_sizes:
                for n in widths:
                    composed = pass_ms(timings[role], specs[role].config, b, n, L)
                    if composed is None:
                        missing += 1
                        continue
                    ms = float(f"{composed[0]:.6g}")
                    padded += composed[1]
                    rows.append(TimingRow(role, b, n, L, ms, ms, ms, reps=0, feasible=True))
    if not rows:
        raise CalibrationError(f"--from-vidur {request.folder}: no pass could be composed at the chosen grid")
    infos = {role: model_info(spec, torch.float16) for role, spec in specs.items()}
    alphas = parse_acceptance(request.acceptance, grid.max_k)
    profile = new_profile(_device(request.folder), infos["target"], infos["draft"], grid)
    profile = replace(profile, timings=tuple(rows), acceptance=(user_entry(Sampling(), alphas),),
                      composition=composition(timings, padded))
    return VidurImport(profile, len(rows), padded, missing)


def import_vidur(request: VidurRequest) -> VidurImport:
    """Compose the profile and write it (JSON and the timing CSV beside it), refusing to replace a file
    without `force`."""
    check_replace(request.out, PROFILE_KIND, request.force, "--out")
    check_replace(csv_path_for(request.out), TIMINGS_CSV_KIND, request.force, "--out")
    result = compose_profile(request)
    write_profile(request.out, result.profile)
    return result
