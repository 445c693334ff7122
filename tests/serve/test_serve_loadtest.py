"""The load test: the arrival generator's statistics, the duration bound, one short end-to-end run (the
server's own SIGTERM drain is tested in test_serve_shutdown.py)."""
from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest

from specbatch.serve.loadtest import LoadtestConfig, TraceItem, arrival_times, make_trace, replay_engine, run_loadtest
from specbatch.serve.loadtest_servers import LoadtestError


@pytest.mark.parametrize("rate, cv", [(2.0, 1.0), (10.0, 3.0), (0.5, 0.5)])
def test_arrivals_have_the_asked_mean_and_cv(rate, cv):
    gaps = np.diff(np.concatenate([[0.0], arrival_times(40000, rate, cv, seed=1)]))
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)
    assert np.array_equal(arrival_times(50, rate, cv, seed=1), arrival_times(50, rate, cv, seed=1))


def test_trace_is_the_same_for_every_policy_and_within_bounds():
    trace = make_trace(200, 3.0, 3.0, seed=5, prompts=7, max_tokens=(64, 128))
    assert trace == make_trace(200, 3.0, 3.0, seed=5, prompts=7, max_tokens=(64, 128))
    assert all(64 <= item.max_tokens <= 128 for item in trace)
    assert [item.prompt_index for item in trace[:9]] == [0, 1, 2, 3, 4, 5, 6, 0, 1]


def test_a_share_of_the_trace_is_hostile_every_kind_in_turn():
    from specbatch.serve.adversarial import KINDS

    trace = make_trace(2000, 3.0, 1.0, seed=5, prompts=7, max_tokens=(64, 128), adversarial_share=0.05)
    hostile = [item.adversarial for item in trace if item.adversarial is not None]
    assert 70 <= len(hostile) <= 130  # 5 % of 2000, binomial
    assert hostile[:len(KINDS)] == list(KINDS)
    plain = make_trace(2000, 3.0, 1.0, seed=5, prompts=7, max_tokens=(64, 128))
    assert [(i.arrival_s, i.prompt_index, i.max_tokens) for i in trace] == [
        (i.arrival_s, i.prompt_index, i.max_tokens) for i in plain]  # the same arrivals, some of them hostile


def test_a_run_is_bounded_in_time():
    from serve_helpers import demo_server

    with demo_server(k=0) as server:
        server.runner.engine.generator.eos_token_ids = ()
        trace = [TraceItem(0.0, 0, 900), TraceItem(0.1, 0, 4), TraceItem(60.0, 0, 4)]
        records = asyncio.run(replay_engine(server.runner, server.served.encode, trace, ("def f(x):",), 1.5))
        assert len(records) == 2  # the arrival after the bound is never sent
        assert records[0].error == "unfinished" and records[1].ok
        engine = server.runner.engine  # the cut request was cancelled: its slot comes free
        deadline = time.monotonic() + 20
        while engine.running and time.monotonic() < deadline:
            time.sleep(0.02)
        assert engine.running == 0 and engine.metrics.snapshot()["finished_total"]["cancelled"] == 1


def test_a_refused_request_is_recorded_with_the_servers_reason():
    from serve_helpers import demo_server
    from specbatch.serve.loadtest import replay_http

    with demo_server(k=0, max_tokens_limit=8) as server:
        trace = [TraceItem(0.0, 0, 20), TraceItem(0.0, 0, 4)]
        refused, served = asyncio.run(replay_http(server.url, server.served.name, trace, ("def f(x):",), 60, False))
    assert refused.error == "HTTP 400: max_tokens must be in [1, 8], got 20"
    assert served.ok


@pytest.mark.parametrize("body, reason", [
    (b'{"error": {"message": "bad max_tokens", "type": "x"}}', "bad max_tokens"),
    (b'{"object": "error", "message": "vLLM says no"}', "vLLM says no"),  # vLLM's older error shape
    (b"Internal Server Error", "Internal Server Error"), (b"", "no reason given"),
])
def test_the_servers_reason_is_its_error_message_or_its_body(body, reason):
    from specbatch.serve.loadtest import server_reason

    assert server_reason(body) == reason


def test_the_in_process_row_counts_only_the_arrivals_it_replays():
    """Hostile arrivals are HTTP requests: the in-process replay sends none, so its row neither counts them as
    failed nor checks a replayed request against another arrival's prompt."""
    from specbatch.serve.loadtest import run_in_process, solo_references

    prompts = ("def eggs(b):\n    return", "import os\n", "class A:\n")
    config = LoadtestConfig(policies=("k=0",), rates_per_s=(20.0,), requests=3, max_duration_s=60,
                            max_tokens=(4, 9), prompts=prompts, server_args=("--max-batch-size", "4"),
                            in_process=True, check_greedy=True)
    trace = [TraceItem(0.0, 0, 4), TraceItem(0.05, 1, 9, "nan_temperature"), TraceItem(0.1, 2, 6)]
    (run,) = run_in_process(config, "k=0", {(20.0, 1.0): trace}, solo_references(config))
    assert (run["requests"], run["sent"], run["ok"], run["errors"], run["unfinished"], run["mismatched"]) == (
        2, 2, 2, 0, 0, 0)
    assert run["adversarial"]["sent"] == 0


@pytest.mark.slow
def test_short_loadtest_over_http_and_in_process(tmp_path):
    prompts = ("def eggs(b):\n    return", "import os\n", "class A:\n")
    config = LoadtestConfig(policies=("k=2",), rates_per_s=(20.0,), requests=5, max_duration_s=60,
                            max_tokens=(4, 12), prompts=prompts, server_args=("--max-batch-size", "4"),
                            in_process=True, check_greedy=True)
    report = run_loadtest(config, tmp_path)
    assert [(r["mode"], r["ok"], r["errors"], r["unfinished"], r["mismatched"]) for r in report["runs"]] == [
        ("http", 5, 0, 0, 0), ("in-process", 5, 0, 0, 0)]
    for run in report["runs"]:
        assert run["ttft_ms"]["p50"] <= run["e2e_ms"]["p50"] and run["throughput_tokens_per_s"] > 0
        (label, mix), = run["strategy_mix"].items()  # a fixed k runs one strategy in every step
        assert label == "chain k=2" and mix["share"] == 1.0
        assert mix["mean_batch_size"] <= mix["tokens_per_step"] <= 3 * mix["mean_batch_size"]
    assert json.loads((tmp_path / "loadtest.json").read_text())["schema"] == "specbatch.loadtest/1"
    assert (tmp_path / "loadtest.csv").read_text().startswith("policy,mode,rate_per_s")
    assert (tmp_path / "latency.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_a_poisson_trace_with_hostile_requests_leaves_every_well_formed_one_its_greedy_output(tmp_path):
    """13 hostile requests of every kind (NaN and tiny temperatures, huge bodies and prompts, bad JSON,
    clients that hang up...) among 27 well-formed ones: each hostile one gets the answer it must, every
    well-formed one completes with its solo greedy output."""
    prompts = ("def eggs(b):\n    return", "import os\n", "class A:\n")
    config = LoadtestConfig(policies=("k=2",), rates_per_s=(8.0,), requests=40, max_duration_s=120,
                            max_tokens=(4, 12), prompts=prompts, server_args=("--max-batch-size", "8"),
                            check_greedy=True, adversarial_share=0.35, seed=3)
    (run,) = run_loadtest(config, tmp_path)["runs"]
    hostile = run["adversarial"]
    assert hostile["sent"] >= 13 and hostile["as_expected"] == hostile["sent"], hostile["unexpected"]
    assert run["ok"] == run["requests"] == 40 - hostile["sent"]
    assert run["errors"] == run["unfinished"] == run["mismatched"] == 0


# ---------------------------------------------------------------------------------------------- vLLM as the peer
def _vllm_config(tmp_path, policies, table=None):
    from specbatch.runtime.assembly import DEMO_DRAFT, DEMO_TARGET

    return LoadtestConfig(policies=policies, rates_per_s=(1.0,), requests=1, prompts=("import os\n",),
                          vllm_target=DEMO_TARGET, vllm_draft=DEMO_DRAFT, vllm_table=table)


def test_vllm_policies_run_our_export_or_a_fixed_k(tmp_path, write_table):
    from specbatch.perfmodel.table import load_table, to_vllm
    from specbatch.runtime.assembly import DEMO_DRAFT
    from specbatch.serve.loadtest import vllm_speculative_config

    table = write_table({1: 4, 2: 3, 3: 0})
    config = _vllm_config(tmp_path, ("vllm:table",), table=table)
    assert vllm_speculative_config(config, "vllm:table") == to_vllm(load_table(table), draft=DEMO_DRAFT)
    assert vllm_speculative_config(config, "vllm:k=0") is None
    assert vllm_speculative_config(config, "vllm:k=3") == {"method": "draft_model", "model": str(DEMO_DRAFT),
                                                            "num_speculative_tokens": 3}
    for policy, message in (("vllm:tree=0,1", "expected vllm:table or vllm:k=K"), ("vllm:k=x", "vllm:table")):
        with pytest.raises(LoadtestError, match=message):
            vllm_speculative_config(config, policy)
    with pytest.raises(LoadtestError, match="give --table"):
        vllm_speculative_config(_vllm_config(tmp_path, ("vllm:table",)), "vllm:table")


def test_vllm_policies_refused_before_any_server_starts_without_vllm(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECBATCH_VLLM_VENV", str(tmp_path / "no-venv"))
    with pytest.raises(LoadtestError, match="vLLM is not set up in .*setup.sh"):
        run_loadtest(_vllm_config(tmp_path, ("k=0", "vllm:k=0")), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_vllm_table_policy_refuses_trees(tmp_path):
    """vLLM would run a tree as a plain chain of its depth: not the table we measured."""
    from specbatch.perfmodel.table import Bucket, Table, TableEntry, save_table
    from specbatch.perfmodel.tree import Strategy, parse_tree
    from specbatch.serve.loadtest import vllm_speculative_config

    shaped = Strategy(parse_tree("0,1,0.0"))
    entries = (TableEntry(1, shaped.k, 100.0, 1.5, None, None, shaped), TableEntry(2, 2, 150.0, 1.3, None, None))
    save_table(tmp_path / "t.json", Table("t", "d", "cpu", "2026-11-30T00:00:00Z", 3, {}, (Bucket(128, entries),)))
    config = _vllm_config(tmp_path, ("vllm:table",), table=tmp_path / "t.json")
    with pytest.raises(LoadtestError, match="vllm:table: --table .* has trees or the n-gram second stage"):
        vllm_speculative_config(config, "vllm:table")


def test_strategy_mix_survives_the_metrics_page_and_is_the_difference_of_two_readings():
    from specbatch.runtime.engine_metrics import EngineMetrics
    from specbatch.serve.loadtest_servers import engine_counters, parse_counters, strategy_mix
    from specbatch.serve.metrics import render_metrics

    def step(metrics, label, seconds, tokens, rows):
        metrics.observe_step(label, 2, 2, [tokens // rows] * rows, seconds)  # k = 2: each row keeps 1-3 tokens

    metrics = EngineMetrics()
    step(metrics, "chain k=2", 0.010, 6, 2)
    before = engine_counters(metrics.snapshot())
    odd = 'tree "a\\b" (3 nodes)'  # a label the exposition format has to escape
    for seconds, tokens in ((0.020, 9), (0.040, 3)):
        step(metrics, odd, seconds, tokens, 3)
    step(metrics, "chain k=2", 0.030, 4, 2)
    page = render_metrics(metrics.snapshot(), 0, 0, 0, 0, "m")
    after = parse_counters(page)
    assert after["by_strategy"] == engine_counters(metrics.snapshot())["by_strategy"]
    mix = strategy_mix(before, after)
    assert list(mix) == [odd, "chain k=2"]  # most used first
    assert mix[odd] == pytest.approx({"share": 2 / 3, "step_ms": 30.0, "tokens_per_step": 6.0, "mean_batch_size": 3})
    assert mix["chain k=2"] == pytest.approx({"share": 1 / 3, "step_ms": 30.0, "tokens_per_step": 4.0,
                                              "mean_batch_size": 2})


def test_a_chain_table_against_a_staged_adaptive_is_called_out(tmp_path):
    """The golden model measured the second stage: against its chain-only table the load test notes that
    the two policies choose among different strategies; against the golden all-strategies table (it has
    staged entries) and without an adaptive policy it says nothing."""
    from pathlib import Path

    from specbatch.perfmodel.model import choose_acceptance, compute_table, load_model
    from specbatch.perfmodel.table import save_table
    from specbatch.serve.loadtest import candidate_set_notes

    golden = Path(__file__).parents[1] / "perfmodel" / "golden" / "query"
    model = golden / "model.json"
    fitted = load_model(model)
    chain = tmp_path / "chain.json"
    save_table(chain, compute_table(fitted, choose_acceptance(fitted, None, str(model)), 4, strategies="chain"))

    def notes(table, policies):
        return candidate_set_notes(LoadtestConfig(policies=policies, rates_per_s=(1.0,),
                                                  server_args=("--table", str(table))))

    (found,) = notes(chain, ("table", f"adaptive={model}"))
    assert found.startswith(f"the table {chain} has no second-stage entries but {model} measured the second stage")
    assert notes(golden / "table.json", ("table", f"adaptive={model}")) == []
    assert notes(chain, ("table", "k=2")) == []


def test_a_replay_with_no_arrival_within_the_duration_sends_nothing():
    trace = [TraceItem(5.0, 0, 4)]
    records = asyncio.run(replay_engine(None, lambda text: [1], trace, ("x",), 1.0))
    assert records == []


def test_a_run_where_every_request_failed_is_named_with_its_errors():
    from specbatch.serve.loadtest_report import RequestRecord, Slo, failed_runs, summarize

    failed = [RequestRecord(i, 0.1 * i, error="HTTP 400") for i in range(3)]
    mixed = [RequestRecord(0, 0.0, 0.1, 0.5, completion_tokens=4), RequestRecord(1, 0.2, error="HTTP 503")]
    runs = [{"policy": "table", "mode": "http", "rate_per_s": 2.0, "cv": 1.0, **summarize(failed, 3, Slo(), None)},
            {"policy": "k=0", "mode": "http", "rate_per_s": 2.0, "cv": 1.0, **summarize(mixed, 2, Slo(), None)}]
    assert failed_runs(runs) == ["policy table (http) at 2/s: none of 3 requests succeeded (HTTP 400)"]
