"""Engine exports of a table: vLLM's `speculative_config`, TensorRT-LLM's decoding config, SGLang's adaptive
config with its server flags, for each drafter a table can record (`Table.drafter`).

Standard library only, like `perfmodel.table`, which re-exports these names (`from specbatch.perfmodel.table
import to_vllm` keeps working). Each rule was read in the engine's source; the files and what they say are in
docs/exports.md. An export is right only when the engine's own lookup maps it back to our table at every batch
size 1..N: tests/perfmodel/test_perfmodel_exports.py (draft models) and test_perfmodel_head_exports.py (every
drafter, every engine) re-implement each lookup from that source and check exactly that.

Drafters (`DRAFTERS` in perfmodel.table): "draft_model" (a separate draft checkpoint), "eagle3" (an EAGLE-3
head), "mtp" (multi-token-prediction heads: the target's own MTP layers or a separate MTP-head checkpoint).
`--draft DIR` (or the table's `draft`) names the checkpoint the engine loads: the draft model or the head.
"""
from __future__ import annotations

import json
import os
import shlex
from bisect import bisect_left
from pathlib import Path
from typing import Any

from .errors import PerfModelError

# perfmodel.table's Table, Bucket and TableEntry, by name only: table.py imports this module, not the reverse
Table = Bucket = TableEntry = Any

# how messages name each drafter (perfmodel.table.DRAFTERS)
DRAFTER_PHRASES = {"draft_model": "a draft model", "eagle3": "an EAGLE-3 head", "mtp": "an MTP head"}
ENGINE_FORMATS = ("vllm", "trtllm", "sglang")  # schedules by batch size only: one context bucket
ENGINE_NAMES = {"vllm": "vLLM", "trtllm": "TensorRT-LLM", "sglang": "SGLang"}

# vLLM, vllm/config/speculative.py (SpeculativeConfig.method): the method per drafter. "mtp" with `model` set
# loads that checkpoint's MTP layers (the target's own directory, or a speculators-format MTP head).
VLLM_METHODS = {"draft_model": "draft_model", "eagle3": "eagle3", "mtp": "mtp"}
VLLM_DRAFT_METHOD = VLLM_METHODS["draft_model"]

# TensorRT-LLM, tensorrt_llm/llmapi/llm_args.py: decoding_type per drafter and the fields that pin the
# speculative mode whose runtime reads draft_len_schedule (tensorrt_llm/_torch/speculative/interface.py,
# SpeculativeDecodingMode.support_dynamic_draft_len). Eagle3 is pinned to its one-model path; MTP runs as
# MTP_EAGLE_ONE_MODEL with one MTP layer (its default mtp_eagle_one_model) and as vanilla MTP with more.
TRTLLM_DECODING = {"draft_model": ("Draft_Target", {}), "eagle3": ("Eagle3", {"eagle3_one_model": True}),
                   "mtp": ("MTP", {})}
TRTLLM_DRAFT_DECODING = TRTLLM_DECODING["draft_model"][0]
# support_dynamic_draft_len() of the version read (after PR #12262); two-model paths are not in it
TRTLLM_SCHEDULE_MODES = frozenset({"MTP", "MTP_EAGLE_ONE_MODEL", "EAGLE3_ONE_MODEL", "PARD", "DFLASH",
                                   "DRAFT_TARGET_ONE_MODEL", "SA"})

# SGLang, python/sglang/srt/speculative/adaptive_spec_params.py (adaptive_unsupported_reason): per-batch-size
# step slots exist for EAGLE/EAGLE3 only (topk 1); NEXTN, the MTP algorithm, is resolved to EAGLE first
# (sglang/srt/arg_groups/speculative_hook.py, _resolve_speculative_algorithm_alias).
SGLANG_ALGORITHMS = {"eagle3": "EAGLE3", "mtp": "NEXTN"}
# architectures for which SGLang turns the algorithm into one adaptive refuses (it then warns and runs static
# steps): Gemma 4 assistant drafts become FROZEN_KV_MTP; MiMo-V2 and GigaChat 3.5 turn on multi-layer EAGLE
# (speculative_hook.py; arg_groups/model_overrides/mimo_v2.py, gigachat35.py)
SGLANG_NO_ADAPTIVE = {"Gemma4AssistantForCausalLM": "FROZEN_KV_MTP", "Gemma4UnifiedAssistantForCausalLM":
                      "FROZEN_KV_MTP", "MiMoV2ForCausalLM": "multi-layer EAGLE", "MiMoV2FlashForCausalLM":
                      "multi-layer EAGLE", "GigaChat35ForCausalLM": "multi-layer EAGLE",
                      "GigaChat35ForCausalLMNextN": "multi-layer EAGLE"}


def k_runs(entries: tuple[TableEntry, ...]) -> list[tuple[int, int, int]]:
    """Contiguous runs of equal k: [(start_batch, end_batch, k), ...], ends inclusive."""
    return _runs([entry.k for entry in entries])


def _runs(ks: list[int]) -> list[tuple[int, int, int]]:
    """Runs of equal k in the k of batch sizes 1, 2, ..., len(ks)."""
    runs: list[list[int]] = []
    for batch_size, k in enumerate(ks, start=1):
        if runs and runs[-1][2] == k:
            runs[-1][1] = batch_size
        else:
            runs.append([batch_size, batch_size, k])
    return [tuple(run) for run in runs]


def _single_bucket(table: Table, context_len: int | None, fmt: str) -> Bucket:
    """Engine schedules know batch sizes only: export one bucket. An all-zero bucket is refused: every engine
    needs a draft length > 0 to enable speculation at all."""
    if context_len is None:
        if len(table.buckets) > 1:
            lengths = ", ".join(str(bucket.context_len) for bucket in table.buckets)
            raise PerfModelError(f"--format {fmt}: the table has context buckets {lengths}; "
                                 "an engine schedule takes one: build the table with a single --context-lens value")
        bucket = table.buckets[0]
    else:
        bucket = table.bucket_for(context_len)
    unrunnable = [e for e in bucket.entries if e.chosen().kind == "tree" or e.chosen().stage2]
    if unrunnable:  # the engine would run a chain of the tree's depth: not what the table predicted
        first = unrunnable[0]
        raise PerfModelError(f"--format {fmt}: the table has strategies {fmt} cannot run (b = {first.batch_size}: "
                             f"{first.chosen().describe()}); export from the model (specbatch table MODEL --format "
                             f"{fmt} ranks chains only) or from a table built with --strategies chain")
    if all(entry.k == 0 for entry in bucket.entries):
        raise PerfModelError(f"--format {fmt}: every k in the table is 0 (speculation never pays at batch sizes "
                             f"1-{bucket.max_batch}): run the engine without speculation instead")
    return bucket


def drafter_phrase(drafter: str) -> str:
    """'an EAGLE-3 head' for "eagle3": a drafter as messages name it."""
    return DRAFTER_PHRASES.get(drafter, repr(drafter))


def checkpoint_drafter(path: str) -> str | None:
    """The head kind a checkpoint's config.json declares ("eagle3", "mtp": the speculators format's
    `speculators_model_type`, or EAGLE-3's original architecture), None for a model."""
    config = _config(path)
    kind = config.get("speculators_model_type")
    if isinstance(kind, str):
        return kind
    architectures = config.get("architectures") or []
    eagle3 = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")  # runtime.heads.config's original layout
    return "eagle3" if "draft_vocab_size" in config and any(a in eagle3 for a in architectures) else None


def engine_draft_path(table: Table, draft: str | os.PathLike | None, fmt: str) -> str:
    """The checkpoint an engine should load (the draft model, or the head's directory), as an absolute path:
    `draft` when given, else the table's own draft (recorded relative to the directory calibrate ran in, so
    resolved against the current one). A shape preset or a config.json (random weights) is no checkpoint an
    engine can load."""
    path = Path(draft if draft is not None else table.draft).expanduser()
    if not (path / "config.json").is_file():
        named = f"--draft {path}" if draft is not None else f"the table's draft {table.draft!r}"
        raise PerfModelError(f"--format {fmt}: {named} is not a model directory with a config.json here "
                             "(a shape preset or config.json means random weights); pass --draft DIR")
    drafter = getattr(table, "drafter", "draft_model")
    declared = checkpoint_drafter(str(path)) or "draft_model"
    # an MTP table may name the target itself (its own MTP layers): only a head of another kind is wrong there
    if declared != drafter and not (drafter == "mtp" and declared == "draft_model"):
        named = f"--draft {path}" if draft is not None else f"the table's draft {table.draft!r}"
        raise PerfModelError(f"--format {fmt}: the table was made for {drafter_phrase(drafter)}, and {named} is "
                             f"{drafter_phrase(declared)}; pass the checkpoint the table was made for as --draft DIR")
    return str(path.resolve())


def _config(path: str) -> dict:
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def checkpoint_mtp_layers(path: str) -> int | None:
    """The number of MTP layers a checkpoint's config.json declares, where the engines read it:
    `num_nextn_predict_layers` (DeepSeek-style and speculators MTP heads) or `mtp_num_hidden_layers`
    (Qwen3-Next-style), at the top or in `text_config`; None when it declares none."""
    config = _config(path)
    for section in (config, config.get("text_config")):
        if isinstance(section, dict):
            for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers"):
                value = section.get(key)
                if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                    return value
    return None


def _drafter(table: Table, known: dict, fmt: str) -> str:
    drafter = getattr(table, "drafter", "draft_model")
    if drafter not in known:
        raise PerfModelError(f"--format {fmt}: {ENGINE_NAMES[fmt]} export knows drafters {', '.join(known)}, "
                             f"not {drafter!r}")
    return drafter


# ---------------------------------------------------------------- vLLM

def to_vllm(table: Table, context_len: int | None = None, draft: str | os.PathLike | None = None) -> dict:
    """vLLM's complete `speculative_config`: `method` from the table's drafter (draft_model, eagle3 or mtp),
    `model` the checkpoint, `num_speculative_tokens` the largest k (vLLM caps every per-batch-size k by it and
    refuses 0), and `num_speculative_tokens_per_batch_size` the inclusive ranges [[start_bs, end_bs, k], ...]
    from 1 (vLLM reuses the last range's k for batch sizes past it); the same runs for every method. Chains
    only: a table with trees or the n-gram second stage is refused (vLLM would run a chain of the tree's depth,
    which the table did not predict). MTP: vLLM refuses a num_speculative_tokens above the checkpoint's MTP
    layer count that is not a multiple of it, so such a table is refused here."""
    drafter = _drafter(table, VLLM_METHODS, "vllm")
    bucket = _single_bucket(table, context_len, "vllm")
    runs = k_runs(bucket.entries)
    model = engine_draft_path(table, draft, "vllm")
    cap = max(k for _, _, k in runs)
    layers = checkpoint_mtp_layers(model) if drafter == "mtp" else None
    if layers is not None and cap > layers and cap % layers:
        raise PerfModelError(f"--format vllm: {model} has {layers} MTP layers and vLLM runs num_speculative_tokens "
                             f"(the table's largest k, {cap}) only up to {layers} or as a multiple of {layers} "
                             "(vllm/config/speculative.py)")
    return {"method": VLLM_METHODS[drafter], "model": model, "num_speculative_tokens": cap,
            "num_speculative_tokens_per_batch_size": [list(run) for run in runs]}


# ---------------------------------------------------------------- TensorRT-LLM

def trtllm_clamped(entries: tuple[TableEntry, ...]) -> list[tuple[int, int, int]]:
    """[(batch_size, k, clamped_k), ...] for the entries whose k exceeds the first run's k: TensorRT-LLM
    requires the smallest key's draft length to equal max_draft_len and no draft length to exceed it, so
    --clamp caps them at the first run's k."""
    first_k = entries[0].k
    return [(entry.batch_size, entry.k, first_k) for entry in entries if entry.k > first_k]


def describe_clamped(clamped: list[tuple[int, int, int]]) -> str:
    """'b=2-5: k=4, b=7: k=5' for `trtllm_clamped` entries: consecutive batch sizes of equal k as one range."""
    runs: list[list[int]] = []
    for batch_size, k, _ in clamped:
        if runs and runs[-1][1] == batch_size - 1 and runs[-1][2] == k:
            runs[-1][1] = batch_size
        else:
            runs.append([batch_size, batch_size, k])
    return ", ".join(f"b={start}: k={k}" if start == end else f"b={start}-{end}: k={k}" for start, end, k in runs)


def trtllm_mode(drafter: str, mtp_layers: int | None = None) -> str:
    """The SpeculativeDecodingMode TensorRT-LLM runs our export as (llm_args.py `spec_dec_mode`): a draft model
    as DRAFT_TARGET_ONE_MODEL, an EAGLE-3 head (eagle3_one_model) as EAGLE3_ONE_MODEL, MTP as
    MTP_EAGLE_ONE_MODEL with one MTP layer (a checkpoint that declares none counts as one) and as vanilla MTP
    with more."""
    if drafter == "mtp":
        return "MTP_EAGLE_ONE_MODEL" if (mtp_layers or 1) == 1 else "MTP"
    return {"draft_model": "DRAFT_TARGET_ONE_MODEL", "eagle3": "EAGLE3_ONE_MODEL"}[drafter]


def to_trtllm(table: Table, context_len: int | None = None, draft: str | os.PathLike | None = None,
              clamp: bool = False) -> dict:
    """TensorRT-LLM's decoding config for the table's drafter (DraftTargetDecodingConfig, Eagle3DecodingConfig
    pinned to its one-model path, MTPDecodingConfig) with `draft_len_schedule` (semantics since its PR #10860):
    a key is the LAST batch size of its run ("draft_len for batch sizes up to that key"), batch sizes above the
    largest key run with 0, so a trailing run of k = 0 needs no key; `max_draft_len` is the first run's k. A
    table whose k later rises above the first run's is refused, or capped with `clamp` (`trtllm_clamped` says
    which entries change). A drafter whose mode does not read the schedule is refused, and so is vanilla MTP
    (several MTP layers) asked for more draft tokens than it has layers. Chains only, as `to_vllm`."""
    drafter = _drafter(table, TRTLLM_DECODING, "trtllm")
    bucket = _single_bucket(table, context_len, "trtllm")
    first_k, raised = bucket.entries[0].k, trtllm_clamped(bucket.entries)
    where = describe_clamped(raised)
    if raised and first_k == 0:
        raise PerfModelError(f"--format trtllm: k is 0 at batch size 1 and rises later ({where}); TensorRT-LLM "
                             "needs the k at the smallest batch size to be the largest (capping would leave no "
                             "speculation)")
    if raised and not clamp:
        raise PerfModelError(f"--format trtllm: k rises above batch size 1's k={first_k} ({where}); TensorRT-LLM "
                             "needs the k at the smallest batch size to be the largest: "
                             f"--clamp caps them at {first_k}")
    model = engine_draft_path(table, draft, "trtllm")
    layers = checkpoint_mtp_layers(model) if drafter == "mtp" else None
    mode = trtllm_mode(drafter, layers)
    if mode not in TRTLLM_SCHEDULE_MODES:
        raise PerfModelError(f"--format trtllm: TensorRT-LLM runs a {drafter} drafter as {mode}, which ignores "
                             "draft_len_schedule (support_dynamic_draft_len, tensorrt_llm/_torch/speculative/"
                             "interface.py): export --format vllm")
    if mode == "MTP" and first_k > layers:
        raise PerfModelError(f"--format trtllm: {model} has {layers} MTP layers and TensorRT-LLM's vanilla MTP "
                             f"drafts one token per layer, fewer than batch size 1's k={first_k} "
                             "(tensorrt_llm/_torch/speculative/utils.py): rebuild the table with --max-k "
                             f"{layers}")
    runs = _runs([min(entry.k, first_k) for entry in bucket.entries])
    if runs[-1][2] == 0:
        runs = runs[:-1]  # above the largest key TensorRT-LLM already runs 0
    decoding_type, pinned = TRTLLM_DECODING[drafter]
    return {"decoding_type": decoding_type, "max_draft_len": runs[0][2], "speculative_model": model,
            "draft_len_schedule": {str(end): k for _, end, k in runs}, **pinned}


# ---------------------------------------------------------------- SGLang

def sglang_default_graph_bs(max_bs: int) -> list[int]:
    """The decode CUDA-graph batch sizes SGLang captures by default with speculative decoding up to `max_bs`
    (sglang/srt/arg_groups/cuda_graph_hook.py, generate_decode_cuda_graph_batch_sizes)."""
    sizes = (list(range(1, 9)) + list(range(10, 33, 2)) + list(range(40, 65, 4)) + list(range(72, 257, 8))
             + list(range(272, max_bs + 1, 16)))
    sizes = [size for size in sizes if size <= max_bs]
    return sizes if max_bs in sizes else sizes + [max_bs]


def sglang_padding_conflicts(ks: list[int], graph_bs: list[int]) -> list[tuple[int, int]]:
    """[(e, p), ...]: the last batch size e of a run of equal k (but the last run) that SGLang pads past, to the
    graph size p: `_route` pads a batch size to the smallest captured size >= it before it picks a slot, so e
    and e + 1, whose k differ, would both run as p. Empty when the export is exact at every batch size."""
    graphs = sorted(set(graph_bs))
    conflicts = []
    for _, end, _ in _runs(ks)[:-1]:
        index = bisect_left(graphs, end)
        if index < len(graphs) and graphs[index] != end:
            conflicts.append((end, graphs[index]))
    return conflicts


def to_sglang(table: Table, context_len: int | None = None, draft: str | os.PathLike | None = None,
              graph_bs: list[int] | None = None, config_path: str | os.PathLike = "sglang.json") -> dict:
    """SGLang's adaptive speculative config (the file `--speculative-adaptive-config` names) that runs the
    table: one slot per run of equal k, keyed by the run's first batch size, each with the one candidate step
    k (a slot with one candidate never moves, whatever acceptance it sees); plus, under `server_args` (a key
    SGLang's loader skips, as every key that is not an integer), the flags that make SGLang read it: EAGLE3 or
    NEXTN (MTP), the checkpoint, top-k 1, --speculative-adaptive, the config's absolute path (`config_path`),
    and the decode CUDA-graph sizes `graph_bs` (default: SGLang's own up to the table's largest batch size plus
    each run's last batch size). SGLang pads a batch to a graph size before it picks a slot, so a run's last
    batch size must be a graph size for the next batch size not to share its slot: a `graph_bs` that breaks
    this is refused, naming those batch sizes. A separate draft model is refused: SGLang has no per-batch-size
    steps for it. Chains only, as `to_vllm`."""
    drafter = getattr(table, "drafter", "draft_model")
    if drafter == "draft_model":
        raise PerfModelError("--format sglang: SGLang switches speculation steps by batch size for EAGLE/EAGLE3 "
                             "heads only (adaptive_unsupported_reason, sglang/srt/speculative/"
                             "adaptive_spec_params.py); a separate draft model runs as STANDALONE with one static "
                             "--speculative-num-steps: export --format vllm or trtllm")
    drafter = _drafter(table, SGLANG_ALGORITHMS, "sglang")
    bucket = _single_bucket(table, context_len, "sglang")
    ks = [entry.k for entry in bucket.entries]
    model = engine_draft_path(table, draft, "sglang")
    architectures = _config(model).get("architectures") or []
    blocked = [arch for arch in architectures if arch in SGLANG_NO_ADAPTIVE]
    if blocked:
        raise PerfModelError(f"--format sglang: SGLang runs {blocked[0]} as {SGLANG_NO_ADAPTIVE[blocked[0]]}, for "
                             "which it turns the adaptive steps off and runs static ones (adaptive_spec_params.py): "
                             "export --format vllm or trtllm")
    runs = _runs(ks)
    if graph_bs is None:
        graphs = sorted(set(sglang_default_graph_bs(len(ks))) | {end for _, end, _ in runs})
    else:
        graphs = sorted(set(graph_bs))
        conflicts = sglang_padding_conflicts(ks, graphs)
        if conflicts:
            said = "; ".join(f"b={end} (k={ks[end - 1]}) and b={end + 1} (k={ks[end]}) both run as {padded}"
                             for end, padded in conflicts)
            raise PerfModelError(f"--format sglang: SGLang pads a batch to its next CUDA-graph size before it picks "
                                 f"a slot (_route, adaptive_spec_params.py), so {said}; add those last batch sizes "
                                 f"({', '.join(str(end) for end, _ in conflicts)}) to the graph sizes")
    initial = ks[0] if ks[0] > 0 else max(ks)  # --speculative-num-steps must be a candidate; 0 would not draft
    config: dict = {str(start): {"candidate_steps": [k]} for start, _, k in runs}
    config["server_args"] = [
        "--speculative-algorithm", SGLANG_ALGORITHMS[drafter], "--speculative-draft-model-path", model,
        "--speculative-num-steps", str(initial), "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", str(initial + 1), "--speculative-adaptive",
        "--speculative-adaptive-config", str(Path(config_path).resolve()),
        "--cuda-graph-bs-decode", *(str(size) for size in graphs)]
    return config


def sglang_command(config: dict) -> str:
    """The launch line for a written export (the target's path left to the user)."""
    return "python -m sglang.launch_server --model-path TARGET " + shlex.join(config["server_args"])


# ---------------------------------------------------------------- notes

def engine_family_note(fmt: str, model: str | os.PathLike, context_len: int) -> str:
    """What an engine export ranked, said where the user asked for more strategies."""
    return (f"--format {fmt}: chains only were ranked, the strategies {fmt} runs (no trees, no n-gram stage); the "
            f"predictions shown are theirs. The same table as JSON, for bench --peers vllm: specbatch table {model} "
            f"--strategies chain --context-lens {context_len} -o TABLE.json")


def costs_note(table: Table, fmt: str) -> str:
    """What an engine export says about the costs its k were chosen by: the engine's own measured steps, or
    another runtime's (then the k at the edges of each run are that runtime's, not the engine's)."""
    costs = table.costs or {"name": "specbatch"}
    engine = ENGINE_NAMES[fmt]
    if costs["name"] == fmt:
        return (f"costs: {engine} {costs.get('version')}'s own steps, measured on this machine "
                "(calibrate --engine vllm): the schedule is chosen for the engine that will run it")
    if costs["name"] == "specbatch":
        hint = " (specbatch calibrate --engine vllm measures vLLM's)" if fmt == "vllm" else ""
        return (f"costs: our runtime's (specbatch) passes, not {engine}'s: the engine's steps cost otherwise (its "
                f"kernels, scheduler, a drafter that runs at K = 0), so its best k may differ{hint}")
    return f"costs: {costs['name']} {costs.get('version')}'s steps, not {engine}'s"
