"""CUDA graphs are how the runtime runs on CUDA, and nothing changes on a CPU: the default per device,
`--eager` everywhere, calibration's isolated passes timed at the bucket generation runs (the capture kept
out of every sample), serve refusing costs of the other execution, and the adaptive policy pricing a
graphed step at its bucket's rows.

Oracles: the stand-in capture of test_runtime_cuda_graphs (a replay reruns the pass's device work), the
constructed step model of test_adaptive_policy (known pass costs), tables written by hand."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specbatch.calibrate import benchmarks
from specbatch.calibrate.benchmarks import ForwardTimer
from specbatch.calibrate.grid import TimingPoint
from specbatch.calibrate.timing import RepetitionRule
from specbatch.perfmodel.errors import UsageError
from specbatch.perfmodel.profile import Grid
from specbatch.runtime.adaptive import AdaptivePolicy
from specbatch.runtime.cuda_graphs import bucket_for
from specbatch.runtime.devices import execution_on, graphs_by_default
from specbatch.runtime.generator import SpeculativeGenerator
from specbatch.runtime.policy import TableK
from specbatch.serve.server import ServeOptions, check_policy_execution

from test_adaptive_policy import constructed_model
from test_runtime_cuda_graphs import graphed_on_cpu  # noqa: F401 - a fixture


def test_graphs_are_the_default_on_cuda_in_half_precision_only(greedy_target):
    assert graphs_by_default("cuda", torch.bfloat16) and graphs_by_default(torch.device("cuda", 0), "float16")
    assert not graphs_by_default("cpu", torch.bfloat16)
    # float32 takes sdpa, which no graph captures: it runs eager, and its profile must say so
    assert not graphs_by_default("cuda", torch.float32) and not graphs_by_default("cuda", "float32")
    assert execution_on("cuda", "float32") == "eager" and execution_on("cuda", "bfloat16") == "cuda-graphs"
    assert execution_on("cuda", "float32", cuda_graphs=True) == "cuda-graphs"  # asked for: as asked
    assert SpeculativeGenerator(greedy_target).cuda_graphs is False  # on this CPU: eager, as before
    assert SpeculativeGenerator(greedy_target, cuda_graphs=True).cuda_graphs is True


def test_isolated_passes_are_timed_graphed_at_the_bucket_with_the_capture_outside_the_samples(
        greedy_target, graphed_on_cpu, monkeypatch):  # noqa: F811
    captures_at_first_sample = []
    real_repeat = benchmarks.repeat

    def watched_repeat(sampler, rule, clock):
        captures_at_first_sample.append(len(graphed_on_cpu))
        return real_repeat(sampler, rule, clock)

    monkeypatch.setattr(benchmarks, "repeat", watched_repeat)
    grid = Grid(batch_sizes=(5,), context_lens=(16,), max_k=2, target_new_tokens=(1, 2, 3), draft_new_tokens=(1, 2))
    timer = ForwardTimer({"target": greedy_target}, grid, "cpu", RepetitionRule(warmup_reps=0, min_reps=2,
                                                                                 budget_s=0.0), graphs=True)
    measurement = timer.measure(TimingPoint("target", 5, 3, 16))
    assert measurement.reps >= 2
    assert timer.cache.root.batch_size == bucket_for(5, 256) == 8  # the rows generation's graph runs
    assert [shape[0] for shape in graphed_on_cpu] == [1, 2, 4, 8]  # captured before the first sample...
    assert captures_at_first_sample == [4] and len(graphed_on_cpu) == 4  # ...and never during the samples


def table_with_execution(path, execution):
    table = {"schema": "specbatch.table/1", "target": "t", "draft": "d", "device": "cpu",
             "created_utc": "2026-11-30T00:00:00Z", "max_k": 2, "acceptance": {},
             "buckets": [{"context_len": 128, "entries": [
                 {"batch_size": 1, "k": 2, "predicted_tokens_per_s": 1.0, "predicted_speedup": 1.0,
                  "runner_up_k": None, "margin": None}]}],
             "costs": {"name": "specbatch", "version": None, "settings": {"execution": execution}}}
    path.write_text(json.dumps(table))
    return path


def test_serve_refuses_a_table_of_the_other_execution_unless_told(tmp_path):
    graphed = table_with_execution(tmp_path / "graphed.json", "cuda-graphs")
    eager = table_with_execution(tmp_path / "eager.json", "eager")
    with pytest.raises(UsageError, match=r"^--table .*graphed.json holds costs of cuda-graphs passes but the runtime "
                                         r"runs eager passes here: calibrate with --eager \(or run without it where "
                                         r"passes replay CUDA graphs: CUDA in half precision\), or pass "
                                         r"--allow-mode-mismatch$"):
        check_policy_execution(TableK(graphed), ServeOptions(table=graphed), "cpu", torch.float32)
    check_policy_execution(TableK(graphed), ServeOptions(table=graphed, allow_mode_mismatch=True), "cpu",
                           torch.float32)
    check_policy_execution(TableK(eager), ServeOptions(table=eager), "cpu", torch.float32)
    with pytest.raises(UsageError, match="costs of eager passes but the runtime runs cuda-graphs passes here: run "
                                         "with --eager, or calibrate without --eager"):
        check_policy_execution(TableK(eager), ServeOptions(table=eager), "cuda", torch.bfloat16)  # no model runs
    serve_eager = ServeOptions(table=eager, cuda_graphs=False)  # serve --eager
    check_policy_execution(TableK(eager), serve_eager, "cuda", torch.bfloat16)
    check_policy_execution(TableK(eager), ServeOptions(table=eager), "cuda", torch.float32)  # float32 runs eager


def test_the_adaptive_policy_prices_a_graphed_step_at_its_buckets_rows():
    plain, graphed = AdaptivePolicy(constructed_model(), max_k=3), AdaptivePolicy(constructed_model(), max_k=3)
    graphed.cost_rows = lambda b: bucket_for(b, 64)
    at_eight = plain._step_times(8, 128)
    assert not np.array_equal(plain._step_times(5, 128), at_eight)  # the target's cost grows with b
    np.testing.assert_array_equal(graphed._step_times(5, 128), at_eight)  # 5 rows run the bucket of 8
    # goodput still counts the 5 rows' tokens: A_s = 5 * 1e3 / S_s(8)
    lines = graphed._lines(5, 128)
    np.testing.assert_allclose([a for a, _ in lines], 5e3 / at_eight)


def test_every_command_that_runs_the_runtime_takes_eager_and_on_a_cpu_nothing_changes():
    from cli_helpers import invoke

    for command in ("generate", "bench", "calibrate", "demo", "serve"):
        assert "--eager" in " ".join(invoke(command, "--help").stdout.split()), command
    for command in ("generate", "bench", "serve"):  # where a table runs (fit and table run nothing: a note)
        assert "--allow-mode-mismatch" in " ".join(invoke(command, "--help").stdout.split()), command
    args = ("generate", "--prompt", "def f(x):", "--max-new-tokens", "6", "--k", "2", "--threads", "1", "--json")
    eager, default = invoke(*args, "--eager"), invoke(*args)
    assert eager.exit_code == default.exit_code == 0, eager.output + default.output
    assert json.loads(eager.stdout)["outputs"] == json.loads(default.stdout)["outputs"]


@pytest.mark.parametrize("command", ["generate", "bench"])
def test_generate_and_bench_refuse_a_table_of_the_other_execution_as_serve_does(tmp_path, command):
    """serve refused a graphed table on this eager runtime while generate and bench ran it without a word: one
    rule (perfmodel.execution.check_execution) where a table runs, naming the runtime here."""
    from cli_helpers import assert_one_line_error, invoke

    graphed = table_with_execution(tmp_path / "graphed.json", "cuda-graphs")
    args = (["generate", "--prompt", "def f(x):", "--max-new-tokens", "4"] if command == "generate" else
            ["bench", "--batch-sizes", "1", "--ks", "0", "--rounds", "1", "--max-new-tokens", "2",
             "-o", tmp_path / "b"])
    args += ["--table", graphed, "--threads", "1"]
    assert_one_line_error(invoke(*args), f"--table {graphed} holds costs of cuda-graphs passes but the runtime "
                                         "runs eager passes here", "--allow-mode-mismatch")
    told = invoke(*args, "--allow-mode-mismatch", "--force")  # --force: the hand-written table names another pair
    assert told.exit_code == 0, told.output
