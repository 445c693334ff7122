"""The specbatch.table/1 contract: validation, lookup rules, and the CSV export checked against golden text
(engine exports: test_perfmodel_exports.py)."""
from __future__ import annotations

import json
import warnings

import pytest

from specbatch.perfmodel.errors import PerfModelError
from specbatch.perfmodel.table import Bucket, Table, TableEntry, TableRangeWarning, load_table, save_table, to_csv

KS = [5, 5, 4, 4, 4, 2, 0]  # batch sizes 1..7


def make_table(ks=KS, context_lens=(512,)) -> Table:
    buckets = []
    for shift, context_len in enumerate(context_lens):
        entries = tuple(TableEntry(b, max(0, k - shift), 100.0 * b, 1.5 if k else 1.0, 3, 0.125)
                        for b, k in enumerate(ks, start=1))
        buckets.append(Bucket(context_len, entries))
    return Table("targets/opt-6.7b", "drafts/opt-125m", "NVIDIA H200", "2026-11-30T01:00:00Z", 8,
                 {"source": "user", "per_position": [0.8]}, tuple(buckets))


def test_csv_export_golden():
    golden = (  # entries without a strategy (older tables) mean chains of k
        "batch_size,k,predicted_tokens_per_s,predicted_speedup,context_len,strategy\n"
        "1,3,100,1.5,128,chain k=3\n"
        "2,1,200,1.5,128,chain k=1\n"
        "1,2,100,1.5,2048,chain k=2\n"
        "2,0,200,1.5,2048,none\n"
    )
    assert to_csv(make_table(ks=[3, 1], context_lens=(128, 2048))) == golden


def test_save_load_round_trip(tmp_path):
    table = make_table(context_lens=(512, 4096))
    path = tmp_path / "table.json"
    save_table(path, table)
    assert load_table(path) == table
    assert [p.name for p in tmp_path.iterdir()] == ["table.json"]  # the temporary file was renamed away


def write(tmp_path, obj) -> str:
    path = tmp_path / "table.json"
    path.write_text(json.dumps(obj))
    return str(path)


def test_load_rejects_wrong_schema(tmp_path):
    obj = make_table().to_json() | {"schema": "specbatch.table/2"}
    with pytest.raises(PerfModelError, match=r"schema 'specbatch.table/2', expected 'specbatch.table/1'"):
        load_table(write(tmp_path, obj))
    with pytest.raises(PerfModelError, match=r"schema 'specbatch.profile/1', expected 'specbatch.table/1'"):
        load_table(write(tmp_path, obj | {"schema": "specbatch.profile/1"}))


def test_load_rejects_non_contiguous_or_unsorted_entries(tmp_path):
    obj = make_table().to_json()
    entries = obj["buckets"][0]["entries"]
    gap = json.loads(json.dumps(obj))
    del gap["buckets"][0]["entries"][2]
    with pytest.raises(PerfModelError, match="without gaps; entry 3 has batch_size 4"):
        load_table(write(tmp_path, gap))
    swapped = json.loads(json.dumps(obj))
    swapped["buckets"][0]["entries"][0], swapped["buckets"][0]["entries"][1] = entries[1], entries[0]
    with pytest.raises(PerfModelError, match="entry 1 has batch_size 2"):
        load_table(write(tmp_path, swapped))
    not_from_one = json.loads(json.dumps(obj))
    del not_from_one["buckets"][0]["entries"][0]
    with pytest.raises(PerfModelError, match="entry 1 has batch_size 2"):
        load_table(write(tmp_path, not_from_one))


def test_load_rejects_negative_k(tmp_path):
    obj = make_table().to_json()
    obj["buckets"][0]["entries"][3]["k"] = -1
    with pytest.raises(PerfModelError, match=r"entries\[3\].k: expected an integer in \[0, max_k=8\], found -1"):
        load_table(write(tmp_path, obj))


def test_lookup_inside_the_table():
    table = make_table(context_lens=(512, 2048, 8192))
    assert [table.lookup(b, 512) for b in range(1, 8)] == KS
    assert table.lookup(1, 1200) == 5  # 688 tokens from 512, 848 from 2048: the 512 bucket
    assert table.lookup(1, 1400) == 4  # 888 from 512, 648 from 2048: the 2048 bucket (k shifted by 1)
    assert table.lookup(1, 1280) == 5  # equidistant from 512 and 2048: the shorter bucket
    assert table.lookup(1) == 5  # no context given: the first bucket


def test_lookup_outside_uses_the_edge_and_warns_once_per_kind():
    table = make_table(context_lens=(512, 2048))
    with pytest.warns(TableRangeWarning, match="batch size 50 is beyond the table's 7") as caught:
        assert table.lookup(50, 512) == 0
        assert table.lookup(60, 512) == 0
    assert len(caught) == 1
    with pytest.warns(TableRangeWarning, match="context length 9000 is outside the buckets") as caught:
        assert table.lookup(1, 9000) == 4
        assert table.lookup(1, 100) == 5
    assert len(caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # already warned about both kinds: silence
        assert table.lookup(99, 99999) == 0
    fresh = make_table(context_lens=(512, 2048))  # another table object warns again
    with pytest.warns(TableRangeWarning):
        fresh.lookup(8)


def test_lookup_rejects_non_positive_batch_size():
    with pytest.raises(PerfModelError, match="batch size must be >= 1, found 0"):
        make_table().lookup(0)


def test_table_module_needs_no_scientific_stack():
    """The runtime imports perfmodel.table: it must not pull scipy or scikit-learn."""
    import subprocess
    import sys

    code = ("import sys, perfmodel.table; "
            "bad = [m for m in ('torch', 'scipy', 'sklearn') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_strategy_entries_round_trip_and_lookup(tmp_path):
    from specbatch.perfmodel.tree import Strategy, parse_tree

    tree = Strategy(parse_tree("0,1,0.0"), stage2=True)
    entries = (TableEntry(1, 2, 300.0, 2.0, 2, 0.1, tree, Strategy.from_k(2)),
               TableEntry(2, 1, 400.0, 1.5, 0, 0.2, Strategy.from_k(1), Strategy(None)),
               TableEntry(3, 0, 500.0, 1.0, 1, 0.3, Strategy(None), Strategy.from_k(1)))
    table = Table("t", "d", "dev", "2026-11-30T01:00:00Z", 2, {"source": "user", "per_position": [0.8]},
                  (Bucket(512, entries),), {"file": "ngram.bin", "sha256": "ab" * 32})
    save_table(tmp_path / "table.json", table)
    loaded = load_table(tmp_path / "table.json")
    assert loaded == table
    assert [loaded.strategy(b) for b in (1, 2, 3)] == [tree, Strategy.from_k(1), Strategy(None)]
    assert [loaded.lookup(b) for b in (1, 2, 3)] == [2, 1, 0]
    with pytest.warns(TableRangeWarning, match="batch size 9 is beyond the table's 3"):
        assert loaded.strategy(9) == Strategy(None)
    assert to_csv(loaded).splitlines()[1] == '1,2,300,2,512,"tree 0,1,0.0 (3 nodes) +ngram"'


def test_stage2_field_must_name_file_and_sha256(tmp_path):
    obj = make_table().to_json() | {"stage2": {"file": "ngram.bin"}}
    with pytest.raises(PerfModelError, match="stage2: expected an object with the n-gram's file and sha256"):
        load_table(write(tmp_path, obj))
