"""Engine exports: golden configs, refusals, and a round trip through each engine's own lookup rule.

The lookups below are re-implemented from the engines' source (not imported: neither engine is a dependency),
and every constructed table must come back exactly at every batch size 1..N. vLLM itself reads the same
exports in tests/bench/test_bench_vllm_export.py when its CPU build is set up (bench/vllm/setup.sh).
"""
from __future__ import annotations

import itertools
import random
from bisect import bisect_left
from pathlib import Path

import pytest

from specbatch.perfmodel.errors import PerfModelError
from specbatch.perfmodel.table import (Bucket, Table, TableEntry, describe_clamped, to_trtllm, to_vllm, trtllm_clamped,
                                       write_table)
from test_perfmodel_head_exports import vllm_k_per_batch_size as vllm_lookup

GOLDEN_KS = [5, 5, 4, 4, 4, 2, 0]  # batch sizes 1..7: the golden table


def make_table(ks, draft: str = "drafts/opt-125m", context_lens=(512,)) -> Table:
    buckets = tuple(Bucket(context_len, tuple(TableEntry(b, max(0, k - shift), 100.0 * b, 1.5 if k else 1.0, None, None)
                                              for b, k in enumerate(ks, start=1)))
                    for shift, context_len in enumerate(context_lens))
    return Table("targets/opt-6.7b", draft, "NVIDIA H200", "2026-11-30T01:00:00Z", max(ks),
                 {"source": "user", "per_position": [0.8]}, buckets)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("draft")
    (directory / "config.json").write_text('{"model_type": "llama"}\n')
    return directory


# ---------------------------------------------------------------- the engines' rules, from their source

def vllm_k_per_batch_size(config: dict, max_num_seqs: int) -> list[int]:
    """K at batch sizes 1..max_num_seqs as vLLM's scheduler gets it, for a draft model's export: vLLM's lookup as
    re-implemented from its source in test_perfmodel_head_exports.py (one copy of it)."""
    assert config["method"] == "draft_model"
    return vllm_lookup(config, max_num_seqs)


def trtllm_draft_len(config: dict, batch_size: int) -> int:
    """The draft length TensorRT-LLM runs at `batch_size`, re-implemented from its source (main after PR #10860):
    tensorrt_llm/llmapi/llm_args.py: DraftTargetDecodingConfig (decoding_type "Draft_Target", max_draft_len
    > 0, speculative_model required) and DecodingBaseConfig.validate_draft_len_schedule_and_sort (keys >= 1,
    values >= 0, the smallest key's value == max_draft_len, every value <= max_draft_len, sorted by key;
    pydantic turns JSON's string keys into ints); tensorrt_llm/_torch/speculative/utils.py:
    get_draft_len_for_batch_size: the value at the first key >= batch_size (bisect_left), 0 above the
    largest key."""
    assert config["decoding_type"] == "Draft_Target" and Path(config["speculative_model"]).is_absolute()
    max_draft_len = config["max_draft_len"]
    assert isinstance(max_draft_len, int) and max_draft_len > 0
    schedule = dict(sorted((int(key), value) for key, value in config["draft_len_schedule"].items()))
    assert all(key >= 1 for key in schedule) and all(0 <= value <= max_draft_len for value in schedule.values())
    assert schedule[min(schedule)] == max_draft_len
    keys = list(schedule)
    index = bisect_left(keys, batch_size)
    return schedule[keys[index]] if index < len(keys) else 0


# ---------------------------------------------------------------- golden exports

def test_vllm_golden(draft_dir):
    assert to_vllm(make_table(GOLDEN_KS), draft=draft_dir) == {
        "method": "draft_model", "model": str(draft_dir.resolve()), "num_speculative_tokens": 5,
        "num_speculative_tokens_per_batch_size": [[1, 2, 5], [3, 5, 4], [6, 6, 2], [7, 7, 0]]}


def test_trtllm_golden_keys_are_the_last_batch_size_of_each_run(draft_dir):
    export = to_trtllm(make_table(GOLDEN_KS), draft=draft_dir)
    assert export == {"decoding_type": "Draft_Target", "max_draft_len": 5,
                      "speculative_model": str(draft_dir.resolve()),
                      "draft_len_schedule": {"2": 5, "5": 4, "6": 2}}  # b = 7 (k = 0) is above the largest key
    assert [trtllm_draft_len(export, b) for b in range(1, 8)] == GOLDEN_KS
    old = dict(export, draft_len_schedule={"1": 5, "3": 4, "6": 2, "7": 0})  # first batch size of each run
    assert [trtllm_draft_len(old, b) for b in range(1, 8)] == [5, 4, 4, 2, 2, 2, 0]  # what the issue saw


def test_trtllm_zero_inside_the_table_keeps_its_key(draft_dir):
    export = to_trtllm(make_table([4, 0, 0, 3, 3, 0]), draft=draft_dir)
    assert export["draft_len_schedule"] == {"1": 4, "3": 0, "5": 3} and export["max_draft_len"] == 4


@pytest.mark.parametrize("export", [to_vllm, to_trtllm])
@pytest.mark.parametrize("spec, stage2", [("0,1,0.0", False), ("chain:2", True)])
def test_trees_and_staged_entries_are_refused_not_exported_as_chains(draft_dir, export, spec, stage2):
    """The engine would run a chain of the tree's depth (or without the n-gram stage): a strategy the table
    never predicted."""
    from specbatch.perfmodel.tree import Strategy, parse_tree

    shaped = Strategy(parse_tree(spec), stage2=stage2)
    entries = (TableEntry(1, 2, 300.0, 2.0, None, None, shaped), TableEntry(2, 1, 400.0, 1.5, None, None,
                                                                            Strategy.from_k(1)))
    table = Table("t", str(draft_dir), "dev", "2026-11-30T01:00:00Z", 2, {}, (Bucket(512, entries),))
    with pytest.raises(PerfModelError, match=r"strategies .* cannot run \(b = 1: .*--strategies chain"):
        export(table)


# ---------------------------------------------------------------- refusals, each one line

@pytest.mark.parametrize("export", [to_vllm, to_trtllm])
def test_all_zero_table_is_refused(export, draft_dir):
    with pytest.raises(PerfModelError, match="every k in the table is 0.*without speculation") as error:
        export(make_table([0, 0, 0]), draft=draft_dir)
    assert "\n" not in str(error.value)


def test_trtllm_refuses_a_rising_k_and_clamp_caps_it(draft_dir):
    table = make_table([3, 3, 5, 4, 2])
    with pytest.raises(PerfModelError, match=r"k rises above batch size 1's k=3 \(b=3: k=5, b=4: k=4\).*--clamp"):
        to_trtllm(table, draft=draft_dir)
    assert trtllm_clamped(table.buckets[0].entries) == [(3, 5, 3), (4, 4, 3)]
    assert describe_clamped([(2, 4, 3), (3, 4, 3), (4, 5, 3), (6, 4, 3)]) == "b=2-3: k=4, b=4: k=5, b=6: k=4"
    assert to_trtllm(table, draft=draft_dir, clamp=True)["draft_len_schedule"] == {"4": 3, "5": 2}
    assert to_vllm(table, draft=draft_dir)["num_speculative_tokens"] == 5  # vLLM expresses it as it is


def test_trtllm_refuses_speculation_off_at_batch_one_even_with_clamp(draft_dir):
    for clamp in (False, True):
        with pytest.raises(PerfModelError, match="k is 0 at batch size 1 and rises later"):
            to_trtllm(make_table([0, 2, 1]), draft=draft_dir, clamp=clamp)


def test_engine_exports_need_one_bucket_or_a_context_length(draft_dir):
    table = make_table(GOLDEN_KS, context_lens=(512, 4096))
    with pytest.raises(PerfModelError, match="--format vllm: the table has context buckets 512, 4096"):
        to_vllm(table, draft=draft_dir)
    assert to_trtllm(table, context_len=4000, draft=draft_dir)["draft_len_schedule"] == {"2": 4, "5": 3, "6": 1}


def test_draft_path_comes_from_the_table_or_the_option(draft_dir, monkeypatch):
    monkeypatch.chdir(draft_dir.parent)  # tables record paths relative to the directory calibrate ran in
    assert to_vllm(make_table([2], draft=draft_dir.name))["model"] == str(draft_dir.resolve())
    for fmt, export in (("vllm", to_vllm), ("trtllm", to_trtllm)):
        with pytest.raises(PerfModelError, match=f"--format {fmt}: the table's draft 'llama-68m' is not a model "
                                                 "directory.*pass --draft DIR"):
            export(make_table([2], draft="llama-68m"))
        with pytest.raises(PerfModelError, match=f"--format {fmt}: --draft nowhere is not a model directory"):
            export(make_table([2]), draft="nowhere")


# ---------------------------------------------------------------- round trips over many tables

def constructed_tables() -> list[list[int]]:
    """Every k sequence over 0..3 of length 1..5, plus long random ones: rising, falling, constant, single."""
    exhaustive = [list(ks) for n in range(1, 6) for ks in itertools.product(range(4), repeat=n)]
    rng = random.Random(14)
    shaped = []
    for _ in range(60):
        n = rng.randint(1, 64)
        ks = [rng.randint(0, 8) for _ in range(n)]
        shaped += [sorted(ks, reverse=True), sorted(ks), [ks[0]] * n, ks, [rng.randint(1, 8)]]
    return exhaustive + shaped


def test_vllm_round_trip(draft_dir):
    checked = 0
    for ks in constructed_tables():
        if not any(ks):
            continue  # refused (tested above)
        export = to_vllm(make_table(ks), draft=draft_dir)
        beyond = len(ks) + 8  # an engine max_num_seqs above --max-batch: vLLM carries the last k on
        assert vllm_k_per_batch_size(export, beyond) == ks + [ks[-1]] * 8, ks
        checked += 1
    assert checked > 1000


def test_trtllm_round_trip(draft_dir):
    exact = clamped = 0
    for ks in constructed_tables():
        table = make_table(ks)
        if not any(ks) or (ks[0] == 0 and max(ks) > 0):
            with pytest.raises(PerfModelError):
                to_trtllm(table, draft=draft_dir, clamp=True)
            continue
        if max(ks) > ks[0]:
            with pytest.raises(PerfModelError, match="k rises"):
                to_trtllm(table, draft=draft_dir)
            export, expected = to_trtllm(table, draft=draft_dir, clamp=True), [min(k, ks[0]) for k in ks]
            changed = [(b, k) for b, k in enumerate(ks, start=1) if k > ks[0]]
            assert [(b, k) for b, k, _ in trtllm_clamped(table.buckets[0].entries)] == changed
            clamped += 1
        else:
            export, expected = to_trtllm(table, draft=draft_dir), ks
            exact += 1
        got = [trtllm_draft_len(export, b) for b in range(1, len(ks) + 9)]
        assert got == expected + [0] * 8, ks  # above --max-batch TensorRT-LLM runs 0
    assert exact > 300 and clamped > 300


def test_a_trtllm_export_that_ends_drafting_says_speculation_stops_past_the_table(draft_dir, tmp_path):
    """TensorRT-LLM runs 0 past the schedule's largest key: a table ending at k > 0 (cut by --max-batch) says so;
    one whose own last entries are k = 0 needs no word."""
    drafting = write_table(tmp_path / "a.json", make_table([5, 4, 4, 2], draft=str(draft_dir)), "trtllm")
    assert any("TensorRT-LLM runs batch sizes above 4 (the table's largest, --max-batch) without speculation" in note
               for note in drafting), drafting
    stopping = write_table(tmp_path / "b.json", make_table(GOLDEN_KS, draft=str(draft_dir)), "trtllm")
    assert not any("without speculation" in note for note in stopping), stopping
