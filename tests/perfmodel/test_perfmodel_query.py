"""`perfmodel.query` against golden answers: what `specbatch query --json` printed before the chain-only
prediction path (goodput.evaluate) was removed, on a model fitted from a quick calibration of the bundled
demo pair on a CPU (tests/perfmodel/golden/query: model.json, its --max-batch 8 table.json, answers.json). Chains
now go through StepModel like every other strategy; their answers must agree to float rounding."""
from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path

import pytest

from cli_helpers import assert_one_line_error, invoke
from specbatch.perfmodel.acceptance import parse_acceptance_option
from specbatch.perfmodel.errors import PerfModelError
from specbatch.perfmodel.jsonio import file_sha256
from specbatch.perfmodel.model import choose_acceptance, load_model
from specbatch.perfmodel.query import QueryAnswer, chain_answer, strategy_answer, table_answer
from specbatch.perfmodel.table import TableRangeWarning, load_table
from specbatch.perfmodel.tree import Strategy

GOLDEN = Path(__file__).resolve().parent / "golden" / "query"
MODEL, TABLE = GOLDEN / "model.json", GOLDEN / "table.json"
CASES = json.loads((GOLDEN / "answers.json").read_text())
FLAGS = {"batch_size": "--batch-size", "context_len": "--context-len", "acceptance": "--acceptance",
         "max_k": "--max-k", "tree": "--tree"}


def assert_close(got, want, where="answer"):
    """Same structure, same keys in the same order, floats equal to rounding."""
    if isinstance(want, dict):
        assert isinstance(got, dict) and list(got) == list(want), (where, list(got), list(want))
        for key in want:
            assert_close(got[key], want[key], f"{where}.{key}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), (where, got, want)
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, f"{where}[{i}]")
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12), (where, got, want)
    else:
        assert got == want and type(got) is type(want), (where, got, want)


@pytest.fixture(scope="module")
def fitted():
    return load_model(MODEL)


@pytest.fixture(scope="module")
def ngram_file(tmp_path_factory):
    """A stand-in n-gram file; the model's stage2 sha256 is pointed at it (only the hash is checked)."""
    path = tmp_path_factory.mktemp("query") / "ngram.bin"
    path.write_bytes(b"not a real n-gram model")
    return path


def answer(fitted, query: dict, ngram_file: Path) -> QueryAnswer:
    override = None if "acceptance" not in query else parse_acceptance_option(query["acceptance"])
    acceptance = choose_acceptance(fitted, override, str(MODEL))
    if "tree" not in query:
        return chain_answer(fitted, acceptance, query["batch_size"], query.get("context_len"), query.get("max_k"))
    stage2 = None
    if query.get("stage2"):
        fitted = dataclasses.replace(fitted, stage2=dataclasses.replace(fitted.stage2, sha256=file_sha256(ngram_file)))
        stage2 = ngram_file
    return strategy_answer(fitted, acceptance, query["batch_size"], query["tree"], query.get("context_len"),
                           query.get("max_k"), stage2, str(MODEL))


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case["source"] == "model"])
def test_model_answers_match_the_golden_json(name, fitted, ngram_file):
    assert_close(answer(fitted, CASES[name]["query"], ngram_file).to_json(), CASES[name]["json"])


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case["source"] == "table"])
def test_table_answers_match_the_golden_json(name):
    query = CASES[name]["query"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", TableRangeWarning)  # beyond the table's batch sizes or buckets
        got = table_answer(load_table(TABLE), query["batch_size"], query.get("context_len"))
    assert_close(got.to_json(), CASES[name]["json"])


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if not case["query"].get("stage2")])
def test_the_cli_prints_the_golden_json(name):
    case = CASES[name]
    args = ["query", MODEL] if case["source"] == "model" else ["query", "--table", TABLE]
    for key, value in case["query"].items():
        args += [FLAGS[key], value]
    if case["source"] == "model" and "tree" not in case["query"]:
        args += ["--strategies", "chain"]  # the chain answers (the default ranks every strategy, as `table`)
    result = invoke(*args, "--json")
    assert result.exit_code == 0, result.output
    assert_close(json.loads(result.stdout), case["json"])


def test_chain_answer_is_every_k_in_order_with_the_models_notes(fitted):
    got = chain_answer(fitted, choose_acceptance(fitted, None), 64, max_k=10)
    assert got.kind == "chains" and [c.k for c in got.candidates] == list(range(11))
    assert got.best_k == max(got.candidates, key=lambda c: c.tokens_per_s).k
    assert all(c.strategy.kind in ("none", "chain") and not c.strategy.stage2 for c in got.candidates)
    assert any("batch sizes above 16 were not measured" in note for note in got.notes)
    assert any("k above the profiled max_k=8" in note for note in got.notes)


def test_stage2_file_must_be_the_measured_one(fitted, ngram_file):
    acceptance = choose_acceptance(fitted, None)
    with pytest.raises(PerfModelError, match=r"--stage2 .*ngram.bin: the model measured another n-gram file "
                                             r"\(data/models/demo-ngram.safetensors, sha256 ca94b3de4311\)"):
        strategy_answer(fitted, acceptance, 1, "0,1", stage2=ngram_file, source="m.json")
    without = dataclasses.replace(fitted, stage2=None)
    with pytest.raises(PerfModelError, match="--stage2: m.json has no second-stage measurements"):
        strategy_answer(without, acceptance, 1, "0,1", stage2=ngram_file, source="m.json")
    assert_one_line_error(invoke("query", MODEL, "--batch-size", "1", "--tree", "0,1", "--stage2", ngram_file),
                          "--stage2", "the model measured another n-gram file")


def test_what_if_lists_no_speculation_then_the_strategy(fitted):
    got = strategy_answer(fitted, choose_acceptance(fitted, None), 2, "chain:2")
    assert got.kind == "strategies"
    assert [c.strategy.describe() for c in got.candidates] == ["none", "chain k=2"]
    assert got.best_strategy == max(got.candidates, key=lambda c: c.tokens_per_s).strategy


def test_unknown_answer_kind_is_refused():
    with pytest.raises(PerfModelError, match="kind 'chain' is not one of chains, strategies, table"):
        QueryAnswer("chain", 1, 0, Strategy(None), ())


@pytest.mark.filterwarnings("ignore::specbatch.perfmodel.table.TableRangeWarning")
def test_one_answer_per_point_query_ranks_what_the_table_chooses_from(fitted, tmp_path):
    """`query` by default and `table` pick the same strategy at every batch size."""
    from specbatch.perfmodel.model import compute_table
    from specbatch.perfmodel.table import save_table

    table = compute_table(fitted, choose_acceptance(fitted, None), 8)
    assert any(entry.chosen().kind == "tree" or entry.chosen().stage2 for entry in table.buckets[0].entries)
    save_table(tmp_path / "t.json", table)
    for batch_size in range(1, 9):
        result = invoke("query", MODEL, "--batch-size", batch_size, "--json")
        assert result.exit_code == 0, result.output
        chosen = table.strategy(batch_size)
        assert json.loads(result.stdout)["best_strategy"] == chosen.to_json(), batch_size
        from_table = json.loads(invoke("query", "--table", tmp_path / "t.json", "--batch-size", batch_size,
                                       "--json").stdout)
        assert from_table["best_strategy"] == chosen.to_json()


def test_query_notes_the_ties_that_table_notes():
    """With a wide standard error on the measured E(k) the best chain and its runner-up tie (as `table` says);
    with none measured (the golden model's, an older profile's) nothing is claimed."""
    fitted = load_model(MODEL)
    measured = choose_acceptance(fitted, None)
    wide = dataclasses.replace(measured, tokens_per_step_se=(0.0,) + (1.0,) * (len(measured.tokens_per_step) - 1))
    answer = chain_answer(fitted, wide, 4)
    ties = [note for note in answer.notes if "indistinguishable" in note]
    assert len(ties) == 1 and ties[0].startswith(f"b = 4: k = {answer.best_k} or k = ")
    assert not any("indistinguishable" in note for note in chain_answer(fitted, measured, 4).notes)
    auto = strategy_answer(fitted, wide, 4, "auto", strategies="chain")
    assert [note for note in auto.notes if "indistinguishable" in note] == ties
