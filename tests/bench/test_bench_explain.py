"""A bench run with a model and a table: every pass is timed in place, each batch size carries the
decomposition of the table's prediction and the paired regret (structure only: no wall-clock values)."""
from __future__ import annotations

import json
import math

import pytest

from specbatch.bench.config import BenchConfig
from specbatch.bench.harness import run_bench
from specbatch.bench.outputs import write_outputs


def _model_file(tmp_path):
    from specbatch.perfmodel.fit import fit_profile
    from specbatch.perfmodel.model import save_model
    from specbatch.perfmodel.profile import profile_from_json
    from perfmodel_fixtures import build_profile, roofline_latency

    obj = build_profile(roofline_latency(), batch_sizes=(1, 2, 4, 8), context_lens=(128, 512), max_k=4,
                        acceptance=[0.7] * 4)
    # calibration's reference pass: the bench times it again to compare the machine's speed (bench.speed)
    obj["noise"] = {"reference": "target b=1 n=1 L=16",
                    "checks": [{"elapsed_s": 0.0, "median_ms": 1.0, "p10_ms": 0.9, "p90_ms": 1.1}]}
    path = tmp_path / "model.json"
    save_model(path, fit_profile(profile_from_json(obj)))
    return path


def test_bench_explains_the_tables_prediction_at_every_batch_size(tiny_pair, prompts, table_path, tmp_path):
    config = BenchConfig(batch_sizes=(1, 3), ks=(1, 2), max_new_tokens=6, rounds=2, warmup_rounds=0,
                         resolve_rounds=4, synthetic_acceptance=0.7, table_path=table_path,
                         model_path=_model_file(tmp_path))
    result = run_bench(config, tiny_pair, prompts)
    for run in result.runs:  # k draft passes and one target pass per full-batch step of a fixed k
        measured = run.measured_steps
        if run.policy.startswith("k=") and measured is not None:
            k = int(run.policy[2:])
            counts = {(p.role, p.new_tokens): p.count for p in measured.passes}
            assert sum(c for (role, _), c in counts.items() if role == "draft") == k * measured.steps
            assert sum(c for (role, _), c in counts.items() if role == "target") == measured.steps
            assert set(counts) <= {("draft", 1), ("draft", 2), ("target", k + 1)}
    written = write_outputs(result, tmp_path / "out")
    document = json.loads(written[0].read_text())
    for entry in document["batch_sizes"]:
        explained = entry["explanation"]
        assert explained["batch_size"] == entry["batch_size"]
        terms = explained["terms"]
        assert sum(t["predicted_ms"] for t in terms) == pytest.approx(explained["step_ms"]["predicted"])
        assert sum(t["measured_ms"] for t in terms) == pytest.approx(explained["step_ms"]["measured"])
        assert explained["culprit"]["term"] == explained["effects"][0]["term"]
        speed = entry["machine_speed"]  # checked before every timed round and after the last
        assert speed["checks"] >= 3 and speed["calibration_ms"] == 1.0
        assert speed["slowdown"] == pytest.approx(speed["bench_ms"] / 1.0)
        regret = entry["paired_regret"]
        assert regret["verdict"] in ("met", "missed", "not resolved")
        # extra paired rounds run until the verdict is settled, at most resolve_rounds of them
        extra_notes = [n for n in document["notes"] if n.startswith(f"b = {entry['batch_size']}: ")]
        assert regret["rounds"] <= 2 + 4
        if not extra_notes:
            assert regret["settled"] and regret["rounds"] == 2
        elif regret["settled"]:
            assert f"settled the paired regret: {regret['verdict']}" in extra_notes[0]
        elif regret["verdict"] == "not resolved":
            assert "still not resolved after 4 extra paired rounds" in extra_notes[0]
        else:
            assert f"{regret['verdict']}, but after 4 extra paired rounds" in extra_notes[0]
        assert regret["against"] == f"k={entry['best_k']}" and set(regret["per_k"]) == {"k=0", "k=1", "k=2"}
        assert regret["ci95"][0] <= regret["regret"] + 1e-12 and regret["regret"] <= regret["ci95"][1] + 1e-12


def test_a_model_with_an_unreadable_reference_pass_is_refused_naming_the_file(tiny_pair, prompts, tmp_path):
    from specbatch.bench.config import BenchError

    path = _model_file(tmp_path)
    obj = json.loads(path.read_text())
    obj["profile"]["noise"]["reference"] = "draft b=1"
    path.write_text(json.dumps(obj))
    config = BenchConfig(batch_sizes=(1,), ks=(1,), max_new_tokens=4, rounds=1, warmup_rounds=0,
                         synthetic_acceptance=0.7, model_path=path)
    with pytest.raises(BenchError, match=r"^--model .*model\.json: noise reference 'draft b=1'"):
        run_bench(config, tiny_pair, prompts)


def test_every_round_is_predicted_at_the_context_its_own_steps_paid_for(tiny_pair, prompts, table_path, tmp_path):
    from specbatch.bench.predict import load_predictor
    from specbatch.bench.workload import cycled_prompts
    from specbatch.runtime.sampling import Sampling

    model = _model_file(tmp_path)
    config = BenchConfig(batch_sizes=(1, 3), ks=(1, 2), max_new_tokens=6, rounds=3, warmup_rounds=1,
                         resolve_rounds=0, synthetic_acceptance=0.7, table_path=table_path, model_path=model)
    result = run_bench(config, tiny_pair, prompts)
    predictor = load_predictor(model, Sampling(), 0.7)
    for run in result.runs:
        longest = max(len(p) for p in cycled_prompts(prompts, run.batch_size, (run.round + 1) * run.batch_size))
        # the longest row's cache before each full-batch step's verify: the prompt, then what it generated
        assert longest <= run.context_len <= longest + config.max_new_tokens
    for batch in result.batches:
        for name in ("k=0", "k=1", "k=2"):
            policy = batch.policy(name)
            timed = sorted((r for r in result.runs if r.batch_size == batch.batch_size and r.policy == name
                            and not r.warmup), key=lambda r: r.round)
            predicted = [predictor.tokens_per_s(batch.batch_size, policy.k, round(r.context_len)) for r in timed]
            assert policy.predicted_tokens_per_s == pytest.approx(sorted(predicted)[1])  # the median of three
            ratios = [p / r.steady_tokens_per_s for p, r in zip(predicted, timed)]
            assert policy.prediction_error == pytest.approx(math.prod(ratios) ** (1 / 3) - 1)


def test_a_table_that_chose_differently_by_round_is_explained_on_its_most_run_strategy(tmp_path):
    """Two buckets (k = 2 at context 100, k = 4 at 300): rounds at 90 and 120 ran k = 2, one at 310 ran k = 4,
    one crossed the bucket edge (k = 2 and 4 in its steps). Explained: k = 2 over its two rounds alone."""
    from specbatch.bench.explain_steps import pooled_context_len, table_rounds
    from specbatch.bench.results import RunRecord
    from specbatch.perfmodel.explain import MeasuredSteps
    from specbatch.runtime.policy import TableK

    def entries(k):
        return [{"batch_size": 1, "k": k, "predicted_tokens_per_s": 1.0, "predicted_speedup": 1.0,
                 "runner_up_k": None, "margin": None}]
    table = {"schema": "specbatch.table/1", "target": "t", "draft": "d", "device": "cpu",
             "created_utc": "2026-12-01T00:00:00Z", "max_k": 4, "acceptance": {},
             "buckets": [{"context_len": 100, "entries": entries(2)}, {"context_len": 300, "entries": entries(4)}]}
    path = tmp_path / "table.json"
    path.write_text(json.dumps(table))

    def run(context, ks, steps):
        return RunRecord(1, 0, "table", 10, 1.0, k_counts_full_batch=ks, nodes_counts_full_batch=ks,
                         measured_steps=MeasuredSteps(1, steps, 0.01 * steps, 3 * steps, ()), context_len=context)

    runs = [run(90, {2: 5}, 5), run(310, {4: 6}, 6), run(120, {2: 4}, 4), run(190, {2: 2, 4: 3}, 5)]
    strategy, chosen, note = table_rounds(TableK(path), 1, runs)
    assert strategy.k == 2 and chosen == [runs[0], runs[2]]
    assert note == ("decomposition at b = 1: the table ran chain k=2 in 2 rounds, chain k=4 in 1, several "
                    "strategies in 1; the decomposition is chain k=2's, over its rounds")
    assert pooled_context_len(chosen, 0) == pytest.approx((5 * 90 + 4 * 120) / 9)
    alone = table_rounds(TableK(path), 1, [runs[1]])
    assert alone[0].k == 4 and alone[2] is None
    assert table_rounds(TableK(path), 1, [runs[3]])[0] is None


def test_the_report_is_readable_off_a_terminal(tiny_pair, prompts, table_path, tmp_path, capsys, monkeypatch):
    """Off a terminal rich assumed 80 columns and cut every cell of the prediction-error table to '…'; a table
    prints at its own width there. A warning note is not 'note: warning:'."""
    from specbatch.console.bench import render_bench

    config = BenchConfig(batch_sizes=(1, 3), ks=(0, 1, 2, 3, 4, 5), max_new_tokens=6, rounds=1, warmup_rounds=0,
                         resolve_rounds=0, synthetic_acceptance=0.7, table_path=table_path,
                         model_path=_model_file(tmp_path))
    result = run_bench(config, tiny_pair, prompts)
    # the fixture's model is of graphed CUDA passes: on this eager runtime it only predicts, and says so
    assert any("holds costs of cuda-graphs passes but the runtime runs eager passes here: its predictions are for "
               "the other runtime" in note for note in result.notes)
    result.notes += ["a plain note", "warning: a warning"]
    monkeypatch.delenv("COLUMNS", raising=False)  # rich's own default off a terminal
    render_bench(result, [])
    out = capsys.readouterr().out
    assert "…" not in out
    for batch in result.batches:
        for policy in batch.policies:
            if policy.prediction_error is not None:
                assert f"{100 * policy.prediction_error:+.1f}%" in out, policy.policy
    lines = out.splitlines()
    assert "note: a plain note" in lines and "warning: a warning" in lines and "note: warning:" not in out


def test_a_table_range_note_raised_while_measuring_is_a_note_and_other_warnings_stay_warnings():
    import warnings

    from specbatch.bench.rounds import _warning_notes
    from specbatch.perfmodel.table import TableRangeWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.warn("table: context length 19 is outside the buckets [38, 512]", TableRangeWarning)
        warnings.warn("something else", RuntimeWarning)
    assert _warning_notes(caught) == ["table: context length 19 is outside the buckets [38, 512]",
                                      "warning: something else"]


def test_off_a_terminal_a_very_long_cell_wraps_within_the_widest_report_line(capsys, monkeypatch):
    """A 64-node tree's description is thousands of characters: the table takes MAX_REPORT_WIDTH columns and the
    cell wraps inside them, every character still printed; a narrow table keeps its own width."""
    from rich.table import Table

    from specbatch.console.output import MAX_REPORT_WIDTH, report_console

    monkeypatch.delenv("COLUMNS", raising=False)
    long_name = ",".join("0." * depth + "0" for depth in range(60))
    table = Table("strategy", "tokens/s")
    table.add_row(long_name, "1382")
    report_console().print(table)
    out = capsys.readouterr().out
    assert max(len(line) for line in out.splitlines()) <= MAX_REPORT_WIDTH
    cells = "".join(ch for ch in out if ch not in "│┃━┏┓┡┩└┘┴┬╇┳─ \n")  # the cells' text, line after line
    assert cells.count("1382") == 1 and long_name in cells.replace("1382", "", 1)  # wrapped, not cut
