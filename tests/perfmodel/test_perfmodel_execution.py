"""A profile says how its passes ran (eager or CUDA graphs), and costs of one execution are refused for a
runtime of the other unless --allow-mode-mismatch (perfmodel/execution.py). On a CPU everything is eager."""
from __future__ import annotations

import json

from cli_helpers import assert_one_line_error, invoke
from specbatch.perfmodel.execution import table_execution
from specbatch.perfmodel.profile import load_profile
from perfmodel_fixtures import build_profile, roofline_latency


def write(tmp_path, name, device_kind, execution):
    profile = build_profile(roofline_latency(), device_kind=device_kind, acceptance=[0.8] * 6)
    if execution is None:
        del profile["device"]["execution"]  # a profile from before the field
    else:
        profile["device"]["execution"] = execution
    path = tmp_path / name
    path.write_text(json.dumps(profile))
    return path


def test_old_profiles_read_as_eager_and_new_ones_keep_their_execution(tmp_path):
    assert load_profile(write(tmp_path, "old.json", "cuda", None)).device.execution == "eager"
    assert load_profile(write(tmp_path, "new.json", "cuda", "cuda-graphs")).device.execution == "cuda-graphs"
    assert_one_line_error(invoke("fit", write(tmp_path, "bad.json", "cuda", "lazy"), "-o", tmp_path / "m.json"),
                          "device.execution", "'lazy' is not one of eager, cuda-graphs")


def test_fit_and_table_refuse_eager_cuda_costs_for_the_graphed_runtime_unless_told(tmp_path):
    eager = write(tmp_path, "eager.json", "cuda", None)
    assert_one_line_error(invoke("fit", eager, "-o", tmp_path / "m.json"), f"profile {eager}",
                          "costs of eager passes", "runs cuda-graphs passes", "--allow-mode-mismatch")
    assert invoke("fit", eager, "-o", tmp_path / "m.json", "--allow-mode-mismatch").exit_code == 0
    assert_one_line_error(invoke("table", tmp_path / "m.json", "-o", tmp_path / "t.json"), "costs of eager passes")
    result = invoke("table", tmp_path / "m.json", "-o", tmp_path / "t.json", "--allow-mode-mismatch")
    assert result.exit_code == 0, result.output
    assert table_execution(json.loads((tmp_path / "t.json").read_text())["costs"]) == "eager"


def test_graphed_cuda_costs_and_cpu_costs_pass_and_tables_record_them(tmp_path):
    for kind, execution in (("cuda", "cuda-graphs"), ("cpu", None)):
        profile = write(tmp_path, f"{kind}.json", kind, execution)
        assert invoke("fit", profile, "-o", tmp_path / f"{kind}-m.json").exit_code == 0
        result = invoke("table", tmp_path / f"{kind}-m.json", "-o", tmp_path / f"{kind}-t.json")
        assert result.exit_code == 0, result.output
        costs = json.loads((tmp_path / f"{kind}-t.json").read_text())["costs"]
        assert table_execution(costs) == (execution or "eager")
    graphed_on_cpu = write(tmp_path, "odd.json", "cpu", "cuda-graphs")
    assert_one_line_error(invoke("fit", graphed_on_cpu, "-o", tmp_path / "m.json"), "costs of cuda-graphs passes",
                          "runs eager passes", "calibrate with --eager")


def test_a_float32_cuda_profile_is_eager_and_fit_takes_it_as_the_runtime_runs_it(tmp_path):
    """float32 passes take sdpa, which no CUDA graph captures (runtime.devices.graphs_by_default): the
    runtime runs them eager, so an eager float32 profile is the runtime's and a graphed one is not."""
    def float32(name, execution):
        path = write(tmp_path, name, "cuda", execution)
        profile = json.loads(path.read_text())
        profile["device"]["dtype"] = "float32"
        path.write_text(json.dumps(profile))
        return path

    assert invoke("fit", float32("eager.json", "eager"), "-o", tmp_path / "m.json").exit_code == 0
    assert invoke("table", tmp_path / "m.json", "-o", tmp_path / "t.json").exit_code == 0
    assert_one_line_error(invoke("fit", float32("graphed.json", "cuda-graphs"), "-o", tmp_path / "m2.json"),
                          "costs of cuda-graphs passes", "runs eager passes")
