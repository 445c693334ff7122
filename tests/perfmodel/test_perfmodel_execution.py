"""A profile says how its passes ran (eager or CUDA graphs); costs of one execution are refused where a runtime
of the other runs them (generate, bench, serve: tests/runtime/test_runtime_execution_mode.py), and `fit` and
`table`, which may run anywhere, note which runtime such costs describe (perfmodel/execution.py). On a CPU
everything is eager."""
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


def test_fit_and_table_note_eager_cuda_costs_without_claiming_anything_of_this_machine(tmp_path):
    """They used to refuse: "the runtime runs cuda-graphs passes here" on a CPU-only machine, telling whoever
    calibrated --eager on purpose to drop it."""
    eager = write(tmp_path, "eager.json", "cuda", None)
    fitted = invoke("fit", eager, "-o", tmp_path / "m.json")
    assert fitted.exit_code == 0, fitted.output
    for result in (fitted, invoke("table", tmp_path / "m.json", "-o", tmp_path / "t.json")):
        assert result.exit_code == 0, result.output
        text = " ".join(result.stdout.split())
        assert "holds costs of eager passes, where the runtime on its device (cuda, bfloat16) runs cuda-graphs " \
               "passes by default: its table describes a runtime run with --eager" in text
        assert " here" not in text and "calibrate without --eager" not in text
    assert table_execution(json.loads((tmp_path / "t.json").read_text())["costs"]) == "eager"
    assert "note:" in invoke("fit", eager, "-o", tmp_path / "m2.json", "--json").stderr  # stdout: the JSON alone


def test_graphed_cuda_costs_and_cpu_costs_pass_and_tables_record_them(tmp_path):
    for kind, execution in (("cuda", "cuda-graphs"), ("cpu", None)):
        profile = write(tmp_path, f"{kind}.json", kind, execution)
        assert invoke("fit", profile, "-o", tmp_path / f"{kind}-m.json").exit_code == 0
        result = invoke("table", tmp_path / f"{kind}-m.json", "-o", tmp_path / f"{kind}-t.json")
        assert result.exit_code == 0, result.output
        costs = json.loads((tmp_path / f"{kind}-t.json").read_text())["costs"]
        assert table_execution(costs) == (execution or "eager")
        assert "holds costs of" not in result.stdout
    graphed_on_cpu = write(tmp_path, "odd.json", "cpu", "cuda-graphs")
    result = invoke("fit", graphed_on_cpu, "-o", tmp_path / "m.json")
    assert result.exit_code == 0 and "costs of cuda-graphs passes, where the runtime on its device (cpu, " \
                                     "float32) runs eager passes by default" in " ".join(result.stdout.split())


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
    graphed = invoke("fit", float32("graphed.json", "cuda-graphs"), "-o", tmp_path / "m2.json")
    assert "costs of cuda-graphs passes, where the runtime on its device (cuda, float32) runs eager passes" in \
        " ".join(graphed.stdout.split())
