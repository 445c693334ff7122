"""Engine exports for every drafter (a draft model, an EAGLE-3 head, MTP heads) and the SGLang export:
each engine's lookup re-implemented from its source, every constructed table mapped back at b = 1..256.

Torch-free: no engine is imported (none is a dependency). The source each function mirrors is named in its
docstring; docs/exports.md says which versions were read.
"""
from __future__ import annotations

import argparse
import json
import random
import shlex
from bisect import bisect_left, bisect_right
from pathlib import Path

import pytest

from specbatch.perfmodel.errors import PerfModelError
from specbatch.perfmodel.exports import sglang_default_graph_bs
from specbatch.perfmodel.table import (
    DRAFTERS,
    Bucket,
    Table,
    TableEntry,
    load_table,
    save_table,
    table_from_json,
    to_sglang,
    to_trtllm,
    to_vllm,
    write_table,
)

B = 256  # every batch size checked: 1..B, past the table's own largest where it is shorter
GOLDEN_KS = [5, 5, 4, 4, 4, 2, 0]  # batch sizes 1..7


def make_table(ks, drafter="draft_model", draft="drafts/head") -> Table:
    entries = tuple(TableEntry(b, k, 100.0 * b, 1.5 if k else 1.0, None, None) for b, k in enumerate(ks, start=1))
    return Table("targets/moe", draft, "NVIDIA H200", "2026-11-30T01:00:00Z", max(ks),
                 {"source": "user", "per_position": [0.8]}, (Bucket(2048, entries),), drafter=drafter)


def checkpoint(root: Path, name: str, config: dict) -> Path:
    directory = root / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    return {"draft_model": checkpoint(root, "draft", {"architectures": ["LlamaForCausalLM"]}),
            "eagle3": checkpoint(root, "eagle3", {"architectures": ["LlamaForCausalLMEagle3"],
                                                  "draft_vocab_size": 32000}),
            "mtp": checkpoint(root, "mtp", {"speculators_model_type": "mtp", "num_nextn_predict_layers": 1}),
            "mtp3": checkpoint(root, "mtp3", {"architectures": ["DeepseekV3ForCausalLM"],
                                              "num_nextn_predict_layers": 3}),
            "gemma4": checkpoint(root, "gemma4", {"architectures": ["Gemma4AssistantForCausalLM"]})}


# ---------------------------------------------------------------- vLLM, from its source

def vllm_k_per_batch_size(config: dict, max_num_seqs: int, n_predict: int | None = None) -> list[int]:
    """K at batch sizes 1..max_num_seqs as vLLM's scheduler gets it. Mirrors vllm/config/speculative.py
    (vllm-project/vllm 002e77c1): `method` a SpeculativeMethod ("draft_model", "eagle3", "mtp" among them),
    `model` the draft model / EAGLE head / MTP checkpoint, `num_speculative_tokens` Field(gt=0), and in
    __post_init__ a num_speculative_tokens above the draft's n_predict (MTP: its MTP layers) must be a multiple
    of it; no method check on `num_speculative_tokens_per_batch_size` (uses_dynamic_speculative_decoding is
    `is not None`). Then vllm/v1/spec_decode/dynamic/utils.py (14b450ca):
    validate_and_normalize_dynamic_sd_schedule (3-item entries, positive ranges, start <= end, K >= 0, ranges
    sorted without overlap, the first starting at 1) and build_dynamic_sd_schedule_lookup (each K capped at
    num_speculative_tokens, a gap takes the previous K, past the last range the last K), indexed by the
    scheduler (vllm/v1/core/sched/scheduler.py) with the step's number of requests."""
    assert config["method"] in ("draft_model", "eagle3", "mtp")
    assert Path(config["model"]).is_absolute()
    cap = config["num_speculative_tokens"]
    assert isinstance(cap, int) and cap > 0
    if n_predict is not None and cap > n_predict:
        assert cap % n_predict == 0, "num_speculative_tokens must be divisible by n_predict"
    parsed = []
    for entry in config["num_speculative_tokens_per_batch_size"]:
        assert isinstance(entry, list) and len(entry) == 3
        lo, hi, k = (int(x) for x in entry)
        assert lo > 0 and hi > 0 and lo <= hi and k >= 0
        parsed.append((lo, hi, k))
    previous_end = 0
    for lo, hi in sorted({(lo, hi) for lo, hi, _ in parsed}):
        assert lo > previous_end, "Batch-size ranges must be non-overlapping and sorted."
        previous_end = hi
    assert min(lo for lo, _, _ in parsed) == 1
    dense, next_bs, last_k = [0] * (max_num_seqs + 1), 1, None
    for lo, hi, k in sorted(parsed):
        if lo > next_bs and last_k is not None:
            for bs in range(next_bs, min(lo, max_num_seqs + 1)):
                dense[bs] = min(cap, last_k)
        for bs in range(max(lo, next_bs), min(hi, max_num_seqs) + 1):
            dense[bs] = min(cap, k)
        next_bs, last_k = max(next_bs, hi + 1), k
        if next_bs > max_num_seqs:
            break
    if last_k is not None:
        for bs in range(next_bs, max_num_seqs + 1):
            dense[bs] = min(cap, last_k)
    return dense[1:]


# ---------------------------------------------------------------- TensorRT-LLM, from its source

# tensorrt_llm/llmapi/llm_args.py: the fields each config class accepts (StrictBaseModel: any other is refused)
TRT_BASE_FIELDS = {"decoding_type", "max_draft_len", "max_total_draft_tokens", "speculative_model",
                   "speculative_model_dir", "max_concurrency", "draft_len_schedule", "load_format",
                   "acceptance_window", "acceptance_length_threshold", "use_rejection_sampling",
                   "allow_advanced_sampling"}
TRT_FIELDS = {"Draft_Target": TRT_BASE_FIELDS,
              "Eagle3": TRT_BASE_FIELDS | {"eagle_choices", "greedy_sampling", "posterior_threshold",
                                           "use_dynamic_tree", "dynamic_tree_max_topK", "num_eagle_layers",
                                           "max_non_leaves_per_layer", "eagle3_one_model",
                                           "eagle3_layers_to_capture", "eagle3_model_arch", "sa_config"},
              "MTP": TRT_BASE_FIELDS | {"use_relaxed_acceptance_for_thinking", "relaxed_topk", "relaxed_delta",
                                        "use_mtp_vanilla", "mtp_eagle_one_model", "sa_config",
                                        "begin_thinking_phase_token", "end_thinking_phase_token"}}
# tensorrt_llm/_torch/speculative/interface.py: SpeculativeDecodingMode.support_dynamic_draft_len()
TRT_DYNAMIC = {"MTP", "MTP_EAGLE_ONE_MODEL", "EAGLE3_ONE_MODEL", "PARD", "DFLASH", "DRAFT_TARGET_ONE_MODEL", "SA"}


def trtllm_draft_len(config: dict, batch_size: int, mtp_layers: int | None = None) -> int:
    """The draft length TensorRT-LLM runs at `batch_size`. Mirrors tensorrt_llm/llmapi/llm_args.py:
    DraftTargetDecodingConfig ("Draft_Target", max_draft_len > 0, speculative_model required, one-model),
    EagleDecodingConfig/Eagle3DecodingConfig ("Eagle3", max_draft_len > 0, speculative_model required,
    spec_dec_mode EAGLE3_ONE_MODEL when eagle3_one_model, default True), MTPDecodingConfig ("MTP",
    max_draft_len > 0; spec_dec_mode MTP_EAGLE_ONE_MODEL with one MTP layer, not use_mtp_vanilla and
    mtp_eagle_one_model (default True), else MTP), DecodingBaseConfig.validate_draft_len_schedule_and_sort
    (keys >= 1, values >= 0, the smallest key's value == max_draft_len, none above it, sorted; pydantic turns
    JSON's string keys into ints); tensorrt_llm/_torch/speculative/utils.py: update_spec_config_from_model_config
    (vanilla MTP runs min(max_draft_len, MTP layers), the layer count defaulting to 1) and
    get_draft_len_for_batch_size (the value at the first key >= batch_size, bisect_left; 0 above the largest);
    interface.py: the schedule is read only in a mode support_dynamic_draft_len() accepts."""
    decoding_type = config["decoding_type"]
    assert set(config) <= TRT_FIELDS[decoding_type], set(config) - TRT_FIELDS[decoding_type]
    assert Path(config["speculative_model"]).is_absolute()
    max_draft_len = config["max_draft_len"]
    assert isinstance(max_draft_len, int) and max_draft_len > 0
    if decoding_type == "Draft_Target":
        mode = "DRAFT_TARGET_ONE_MODEL"
    elif decoding_type == "Eagle3":
        mode = "EAGLE3_ONE_MODEL" if config.get("eagle3_one_model", True) else "EAGLE3"
    else:
        layers = mtp_layers or 1
        vanilla, one_model = config.get("use_mtp_vanilla", False), config.get("mtp_eagle_one_model", True)
        mode = "MTP" if layers != 1 or vanilla else ("MTP_EAGLE_ONE_MODEL" if one_model else "MTP_EAGLE")
        if mode == "MTP":
            assert min(max_draft_len, layers) == max_draft_len, "vanilla MTP would lower max_draft_len"
    assert mode in TRT_DYNAMIC, f"{mode} ignores draft_len_schedule"
    schedule = dict(sorted((int(key), value) for key, value in config["draft_len_schedule"].items()))
    assert all(key >= 1 for key in schedule) and all(0 <= value <= max_draft_len for value in schedule.values())
    assert schedule[min(schedule)] == max_draft_len
    keys = list(schedule)
    index = bisect_left(keys, batch_size)
    return schedule[keys[index]] if index < len(keys) else 0


# ---------------------------------------------------------------- SGLang, from its source (0.5.23)

def sglang_parse_args(args: list[str]) -> argparse.Namespace:
    """The flags as SGLang's parser reads them (sglang/srt/arg_groups/arg_utils.py: a List[int] field takes
    nargs='+', a bool is store_true; sglang/srt/arg_groups/fields/spec.py and exec_.py name them)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--speculative-algorithm")
    parser.add_argument("--speculative-draft-model-path")
    parser.add_argument("--speculative-num-steps", type=int)
    parser.add_argument("--speculative-eagle-topk", type=int)
    parser.add_argument("--speculative-num-draft-tokens", type=int)
    parser.add_argument("--speculative-adaptive", action="store_true")
    parser.add_argument("--speculative-adaptive-config")
    parser.add_argument("--cuda-graph-bs-decode", type=int, nargs="+")
    return parser.parse_args(args)


def sglang_router(export: dict, graphs_on: bool = True):
    """The draft steps SGLang runs for a decode batch of b requests, as a function of b. Mirrors sglang 0.5.23:
    arg_groups/speculative_hook.py (_resolve_speculative_algorithm_alias: NEXTN and EAGLE become EAGLE;
    _maybe_disable_adaptive: adaptive_unsupported_reason turns adaptive off, falling back to static steps,
    unless the algorithm is EAGLE/EAGLE3 with topk 1; _init_adaptive_speculative_params: num_steps must be one
    of the candidate steps, num_draft_tokens = num_steps + 1), speculative/adaptive_spec_params.py
    (_load_adaptive_config: the integer keys are the slots, each a non-empty list of candidate_steps >= 0,
    every other key skipped; AdaptiveStepSlot: one candidate is the slot's steps for good, _recompute_params
    can only move between candidates; AdaptiveSpeculativeParams._route: pad to the smallest CUDA-graph size
    >= batch_size (bisect_left; unpadded above the largest, or without graphs), then the slot with the largest
    key <= it (bisect_right - 1, the first slot below the first key)), speculative/eagle_worker_v2.py
    (init_states gets get_exec().graph.cuda_graph_bs_decode, the --cuda-graph-bs-decode list, or None when
    decode graphs are disabled; activate_step_by_batch(batch.seq_lens.shape[0]) before each decode step)."""
    args = sglang_parse_args(export["server_args"])
    algorithm = "EAGLE" if args.speculative_algorithm in ("NEXTN", "EAGLE") else args.speculative_algorithm
    assert args.speculative_adaptive and algorithm in ("EAGLE", "EAGLE3"), "adaptive would be turned off"
    assert args.speculative_eagle_topk in (None, 1)
    assert Path(args.speculative_draft_model_path).is_absolute()
    assert Path(args.speculative_adaptive_config).is_absolute()
    slots = {}
    for key, entry in export.items():
        if not key.isdigit():
            continue
        steps = entry.get("candidate_steps")
        assert isinstance(steps, list) and steps and all(isinstance(s, int) and s >= 0 for s in steps)
        slots[int(key)] = sorted(set(steps))
    assert slots
    assert all(len(steps) == 1 for steps in slots.values()), "a slot with more candidates adapts"
    union = sorted({step for steps in slots.values() for step in steps})
    assert args.speculative_num_steps in union
    assert args.speculative_num_draft_tokens in (None, args.speculative_num_steps + 1)
    graphs = sorted(args.cuda_graph_bs_decode) if graphs_on and args.cuda_graph_bs_decode else None
    keys = sorted(slots)

    def steps(batch_size: int) -> int:
        padded = batch_size
        if graphs is not None:
            index = bisect_left(graphs, batch_size)
            padded = graphs[index] if index < len(graphs) else batch_size
        return slots[keys[max(0, bisect_right(keys, padded) - 1)]][0]

    return steps


# ---------------------------------------------------------------- constructed tables

def constructed_tables() -> list[list[int]]:
    """Tables of 1..256 batch sizes: rising, falling, rising-then-falling (a mixture-of-experts target: k grows
    while more experts are read anyway, then falls as compute binds), constant, single entry, zeros inside, and
    random; every one with some k > 0."""
    rng = random.Random(256)
    tables = [[k] for k in range(1, 9)]  # single entry
    for _ in range(40):
        n = rng.choice([2, 3, 7, 16, 33, 64, 100, 200, 256])
        ks = [rng.randint(0, 8) for _ in range(n)]
        peak = rng.randint(1, n)
        rise = sorted(rng.randint(1, 8) for _ in range(peak))
        fall = sorted((rng.randint(0, rise[-1]) for _ in range(n - peak)), reverse=True)
        zeros = [0 if rng.random() < 0.3 else k for k in ks]
        tables += [sorted(ks), sorted(ks, reverse=True), rise + fall, [rng.randint(1, 8)] * n, zeros, ks]
    return [ks for ks in tables if any(ks)]


def expected_vllm(ks):  # past the table vLLM carries the last k on
    return ks[:B] + [ks[-1]] * (B - len(ks))


def expected_trtllm(ks):  # capped at batch size 1's k (--clamp where it rises); past the table 0
    return [min(k, ks[0]) for k in ks[:B]] + [0] * (B - len(ks))


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_vllm_maps_back_for_every_drafter(dirs, drafter):
    checked = 0
    for ks in constructed_tables():
        export = to_vllm(make_table(ks, drafter), draft=dirs[drafter])
        assert export["method"] == drafter and export["model"] == str(dirs[drafter].resolve())
        assert vllm_k_per_batch_size(export, B, n_predict=1 if drafter == "mtp" else None) == expected_vllm(ks), ks
        checked += 1
    assert checked > 200


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_trtllm_maps_back_for_every_drafter(dirs, drafter):
    exact = clamped = 0
    for ks in constructed_tables():
        table = make_table(ks, drafter)
        if ks[0] == 0:
            with pytest.raises(PerfModelError, match="k is 0 at batch size 1 and rises later"):
                to_trtllm(table, draft=dirs[drafter], clamp=True)
            continue
        rises = max(ks) > ks[0]
        if rises:
            with pytest.raises(PerfModelError, match="k rises above batch size 1's"):
                to_trtllm(table, draft=dirs[drafter])
        export = to_trtllm(table, draft=dirs[drafter], clamp=rises)
        got = [trtllm_draft_len(export, b, mtp_layers=1 if drafter == "mtp" else None) for b in range(1, B + 1)]
        assert got == expected_trtllm(ks), ks
        clamped, exact = clamped + rises, exact + (not rises)
    assert exact > 50 and clamped > 50


@pytest.mark.parametrize("drafter", ["eagle3", "mtp"])
def test_sglang_maps_back_for_every_head(dirs, drafter, tmp_path):
    checked = 0
    for ks in constructed_tables():
        export = to_sglang(make_table(ks, drafter), draft=dirs[drafter], config_path=tmp_path / "spec.json")
        for graphs_on in (True, False):  # with its decode graphs, or with them disabled: the same k
            steps = sglang_router(export, graphs_on)
            assert [steps(b) for b in range(1, B + 1)] == expected_vllm(ks), ks
        checked += 1
    assert checked > 200


def test_sglang_with_the_servers_own_graph_sizes_is_exact_or_refused_naming_the_batch_sizes(dirs, tmp_path):
    """A --cuda-graph-bs list of the user's: exact wherever each run's last batch size is a graph size (or above
    the largest), else refused in one line naming each pair SGLang's padding would put in one slot."""
    exact = refused = 0
    for ks in constructed_tables():
        graphs = sglang_default_graph_bs(len(ks))
        table = make_table(ks, "eagle3")
        try:
            export = to_sglang(table, draft=dirs["eagle3"], graph_bs=graphs, config_path=tmp_path / "s.json")
        except PerfModelError as error:
            message = str(error)
            assert "\n" not in message and "SGLang pads a batch to its next CUDA-graph size" in message
            for b in range(1, len(ks)):
                if ks[b - 1] != ks[b] and b not in graphs:
                    assert f"b={b} (k={ks[b - 1]}) and b={b + 1} (k={ks[b]}) both run as " in message
            refused += 1
            continue
        steps = sglang_router(export)
        assert [steps(b) for b in range(1, B + 1)] == expected_vllm(ks), ks
        exact += 1
    assert exact > 50 and refused > 50


# ---------------------------------------------------------------- golden exports, by hand

def test_golden_exports_of_an_eagle3_head(dirs, tmp_path):
    table, head = make_table(GOLDEN_KS, "eagle3"), str(dirs["eagle3"].resolve())
    assert to_vllm(table, draft=dirs["eagle3"]) == {
        "method": "eagle3", "model": head, "num_speculative_tokens": 5,
        "num_speculative_tokens_per_batch_size": [[1, 2, 5], [3, 5, 4], [6, 6, 2], [7, 7, 0]]}
    assert to_trtllm(table, draft=dirs["eagle3"]) == {
        "decoding_type": "Eagle3", "max_draft_len": 5, "speculative_model": head,
        "draft_len_schedule": {"2": 5, "5": 4, "6": 2}, "eagle3_one_model": True}
    config = tmp_path / "sglang.json"
    assert to_sglang(table, draft=dirs["eagle3"], config_path=config) == {
        "1": {"candidate_steps": [5]}, "3": {"candidate_steps": [4]}, "6": {"candidate_steps": [2]},
        "7": {"candidate_steps": [0]},
        "server_args": ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", head,
                        "--speculative-num-steps", "5", "--speculative-eagle-topk", "1",
                        "--speculative-num-draft-tokens", "6", "--speculative-adaptive",
                        "--speculative-adaptive-config", str(config.resolve()),
                        "--cuda-graph-bs-decode", "1", "2", "3", "4", "5", "6", "7"]}


def test_golden_exports_of_mtp_heads_on_a_mixture_of_experts_target(dirs, tmp_path):
    """k rises from 2 to 3 (more experts are read at b = 3 anyway) and falls to 1 at b = 14, up to b = 20."""
    ks = [2] * 2 + [3] * 11 + [1] * 7
    table, mtp = make_table(ks, "mtp"), str(dirs["mtp"].resolve())
    assert to_vllm(table, draft=dirs["mtp"]) == {
        "method": "mtp", "model": mtp, "num_speculative_tokens": 3,
        "num_speculative_tokens_per_batch_size": [[1, 2, 2], [3, 13, 3], [14, 20, 1]]}
    assert to_trtllm(table, draft=dirs["mtp"], clamp=True) == {
        "decoding_type": "MTP", "max_draft_len": 2, "speculative_model": mtp,
        "draft_len_schedule": {"13": 2, "20": 1}}
    export = to_sglang(table, draft=dirs["mtp"], config_path=tmp_path / "sglang.json")
    assert {key: value for key, value in export.items() if key.isdigit()} == {
        "1": {"candidate_steps": [2]}, "3": {"candidate_steps": [3]}, "14": {"candidate_steps": [1]}}
    args = export["server_args"]
    assert args[:2] == ["--speculative-algorithm", "NEXTN"]  # SGLang's MTP, resolved to EAGLE
    # SGLang's default sizes up to 20 (1-8, 10, 12, ..., 20) plus 13, the last batch size of the k = 3 run
    assert args[args.index("--cuda-graph-bs-decode") + 1:] == [str(b) for b in [1, 2, 3, 4, 5, 6, 7, 8, 10, 12,
                                                                                13, 14, 16, 18, 20]]
    with pytest.raises(PerfModelError) as error:  # the server's own sizes: 13 pads to 16, where 14 runs k = 1
        to_sglang(table, draft=dirs["mtp"], graph_bs=[1, 2, 4, 8, 16, 20])
    assert str(error.value) == (
        "--format sglang: SGLang pads a batch to its next CUDA-graph size before it picks a slot (_route, "
        "adaptive_spec_params.py), so b=13 (k=3) and b=14 (k=1) both run as 16; add those last batch sizes (13) "
        "to the graph sizes")


def test_sglang_default_graph_sizes_are_sglangs_speculative_ones():
    """sglang/srt/arg_groups/cuda_graph_hook.py, generate_decode_cuda_graph_batch_sizes (speculative case)."""
    sizes = sglang_default_graph_bs(300)
    assert sizes[:14] == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16, 18, 20]
    assert sizes[-4:] == [256, 272, 288, 300] and 40 in sizes and 36 not in sizes
    assert sglang_default_graph_bs(5) == [1, 2, 3, 4, 5] and sglang_default_graph_bs(9) == list(range(1, 9)) + [9]


# ---------------------------------------------------------------- refusals, each one line

def one_line(error) -> str:
    message = str(error.value)
    assert "\n" not in message
    return message


def test_sglang_refuses_a_draft_model(dirs):
    with pytest.raises(PerfModelError) as error:
        to_sglang(make_table(GOLDEN_KS), draft=dirs["draft_model"])
    assert "EAGLE/EAGLE3 heads only" in one_line(error) and "STANDALONE" in str(error.value)


def test_sglang_refuses_a_head_it_would_run_without_adaptive_steps(dirs):
    with pytest.raises(PerfModelError) as error:
        to_sglang(make_table(GOLDEN_KS, "mtp"), draft=dirs["gemma4"])
    assert "FROZEN_KV_MTP" in one_line(error)


@pytest.mark.parametrize("export", [to_vllm, to_trtllm, to_sglang])
@pytest.mark.parametrize("drafter", ["eagle3", "mtp"])
def test_every_head_export_refuses_an_all_zero_table(dirs, export, drafter):
    with pytest.raises(PerfModelError) as error:
        export(make_table([0, 0, 0], drafter), draft=dirs[drafter])
    assert "every k in the table is 0" in one_line(error)


def test_vllm_refuses_mtp_tokens_its_layers_do_not_divide(dirs):
    """n_predict = 3 MTP layers: K up to 3, or 6, 9, ... (vllm/config/speculative.py); not 4 or 5."""
    for ks, ok in (([3, 2, 1], True), ([6, 3], True), ([4, 1], False), ([5, 5], False)):
        table = make_table(ks, "mtp")
        if ok:
            export = to_vllm(table, draft=dirs["mtp3"])
            assert vllm_k_per_batch_size(export, B, n_predict=3) == expected_vllm(ks)
        else:
            with pytest.raises(PerfModelError) as error:
                to_vllm(table, draft=dirs["mtp3"])
            assert "has 3 MTP layers" in one_line(error) and "multiple of 3" in str(error.value)


def test_trtllm_refuses_vanilla_mtp_asked_for_more_tokens_than_layers(dirs):
    export = to_trtllm(make_table([3, 3, 1], "mtp"), draft=dirs["mtp3"])
    assert [trtllm_draft_len(export, b, mtp_layers=3) for b in range(1, 5)] == [3, 3, 1, 0]
    with pytest.raises(PerfModelError) as error:
        to_trtllm(make_table([4, 2], "mtp"), draft=dirs["mtp3"])
    assert "vanilla MTP drafts one token per layer" in one_line(error) and "--max-k 3" in str(error.value)


def test_an_unknown_drafter_is_refused_by_every_export(dirs):
    table = make_table(GOLDEN_KS, "medusa")
    for export in (to_vllm, to_trtllm, to_sglang):
        with pytest.raises(PerfModelError) as error:
            export(table, draft=dirs["eagle3"])
        assert "'medusa'" in one_line(error)


# ---------------------------------------------------------------- the table records its drafter

@pytest.mark.parametrize("drafter", DRAFTERS)
def test_the_drafter_round_trips_through_json(tmp_path, drafter):
    table = make_table(GOLDEN_KS, drafter)
    save_table(tmp_path / "t.json", table)
    obj = json.loads((tmp_path / "t.json").read_text())
    assert ("drafter" in obj) == (drafter != "draft_model")  # older tables, without it, mean a draft model
    assert load_table(tmp_path / "t.json").drafter == drafter


def test_a_table_without_a_drafter_is_a_draft_models_and_a_bad_one_is_one_line(tmp_path):
    obj = make_table([2, 1]).to_json()
    assert "drafter" not in obj and table_from_json(obj).drafter == "draft_model"
    with pytest.raises(PerfModelError) as error:
        table_from_json(dict(obj, drafter="medusa"), "old.table.json")
    assert one_line(error) == ("old.table.json: drafter: 'medusa' is not one of draft_model, eagle3, mtp (what "
                               "drafts: a separate draft model, an EAGLE-3 head, MTP heads)")


def test_write_table_writes_sglangs_file_and_says_how_to_serve_it(dirs, tmp_path):
    path = tmp_path / "sglang.json"
    notes = write_table(path, make_table(GOLDEN_KS, "eagle3"), "sglang", draft=dirs["eagle3"])
    written = json.loads(path.read_text())
    assert written == to_sglang(make_table(GOLDEN_KS, "eagle3"), draft=dirs["eagle3"], config_path=path)
    serve = next(note for note in notes if note.startswith("sglang: serve with "))
    command = shlex.split(serve.removeprefix("sglang: serve with "))
    assert command[:5] == ["python", "-m", "sglang.launch_server", "--model-path", "TARGET"]
    assert sglang_parse_args(command[5:]).speculative_adaptive_config == str(path.resolve())
    with pytest.raises(PerfModelError, match="--cuda-graph-bs applies to --format sglang only"):
        write_table(tmp_path / "v.json", make_table(GOLDEN_KS, "eagle3"), "vllm", graph_bs=[1, 2])


def test_an_sglang_export_is_known_as_one_when_it_is_to_be_replaced(dirs, tmp_path):
    from specbatch.perfmodel.jsonio import check_replace, output_kind

    path = tmp_path / "sglang.json"
    write_table(path, make_table(GOLDEN_KS, "eagle3"), "sglang", draft=dirs["eagle3"])
    assert output_kind(path) == "sglang config"
    check_replace(path, "sglang config", force=True)  # the same kind: replaced with --force
    with pytest.raises(PerfModelError, match="an SGLang adaptive speculative config is there, not a vLLM"):
        check_replace(path, "vllm config", force=True)
