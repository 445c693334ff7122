"""The device script itself (calibrate/gpu_reference.sh): valid bash, and end to end on a CPU with tiny
shapes: the eight files it promises, each what it says (a loadable profile, model and table; the probe's
versions, kernels and two timings per pass; the GPU tests' run)."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from specbatch.perfmodel.profile import load_profile

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "calibrate" / "gpu_reference.sh"
FILES = {"nvidia-smi.txt", "probe.txt", "pytest-gpu.txt", "profile.json", "profile.csv", "model.json", "table.json",
         "run.log"}


def test_the_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


@pytest.mark.slow
def test_the_script_runs_end_to_end_on_a_cpu_with_tiny_shapes(tmp_path):
    out = tmp_path / "out"
    run = subprocess.run(["bash", str(SCRIPT), "--device", "cpu"], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "OUT": str(out), "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stdout + run.stderr
    assert {path.name for path in out.iterdir()} == FILES
    profile = load_profile(out / "profile.json")
    assert profile.device.kind == "cpu" and profile.grid.batch_sizes == (1, 4) and profile.timings
    assert json.loads((out / "model.json").read_text())["schema"] == "specbatch.model/1"
    assert json.loads((out / "table.json").read_text())["schema"] == "specbatch.table/1"
    probe = (out / "probe.txt").read_text()
    assert "torch " in probe and probe.count("attention kernel") == 2
    assert "b=1 k=4" in probe and "b=8 k=4" in probe and "wall/events" in probe and "step (no barrier inside)" in probe
    tests = (out / "pytest-gpu.txt").read_text()
    assert "skipped" in tests and "failed" not in tests and "error" not in tests.lower()
