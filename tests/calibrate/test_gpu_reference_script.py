"""The device script itself (calibrate/gpu_reference.sh): valid bash, within its budget (8 files, the
steps' time limits under 8 minutes), and end to end on a CPU with tiny shapes: the eight files it promises,
each what it says (a loadable profile, model and table; the probe's versions, kernels, steps in both
execution modes and every pass eager vs graphed; the GPU tests' run; the bench with the table and the demo
in the log)."""
from __future__ import annotations

import json
import os
import re
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


def test_the_device_run_fits_its_budget_and_asks_for_everything():
    """The CUDA branch's time limits add up to less than 8 minutes (the rest is loading); it measures both
    execution modes, the 8B/1B shapes at b 1 and 64 (n = 1 and k + 1 = 5), a bench with the table at
    synthetic acceptance 0.8 and 128 new tokens, and the demo on the device."""
    text = SCRIPT.read_text()
    cuda = text[text.index("else\n    target=llama-3.1-8b"):text.index("\nfi\n")]
    limits = dict(part.split("=") for line in cuda.splitlines() if "_s=" in line
                  for part in line.split("#")[0].split())
    assert set(limits) == {"probe_s", "pytest_s", "calibrate_s", "fit_s", "table_s", "bench_s", "demo_s"}
    assert sum(map(int, limits.values())) <= 450
    for step in ("device_probe", "pytest -m gpu", "specbatch calibrate", "specbatch fit", "specbatch table",
                 "specbatch bench", "specbatch demo"):  # every step under its own time limit
        line = next(line for line in text.splitlines()
                    if step in line and not line.lstrip().startswith(("#", "echo")))
        assert "timeout" in line, step
    assert "\npython " not in text and " python -m" not in text  # python3 (or $PYTHON): an image may lack python
    assert "tests/serve" not in text and "tests/ >" not in text  # only the folders with GPU tests are collected
    assert "--batch-sizes 1,64" in cuda and "--k 4 --modes eager,cuda-graphs" in text
    assert "--synthetic-acceptance 0.8" in text and "--max-new-tokens 128" in cuda and "--table" in text
    assert "specbatch demo --device" in text and "pytest -m gpu" in text
    written = set(re.findall(r'"\$OUT/([\w.-]+)"', text)) | {"profile.csv"}  # calibrate writes the CSV beside
    assert written == FILES


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
    assert "[eager] b=8 k=4" in probe and "[cuda-graphs] b=8 k=4" in probe
    assert "pass target b=8   n=5  L=32: eager" in probe and "cuda-graphs" in probe.split("pass draft  b=1")[1]
    log = (out / "run.log").read_text()
    assert "== bench with the table" in log and '"schema": "specbatch.bench/1"' in log
    assert "== specbatch demo --device cpu" in log
    assert "everything is in" in log  # the demo's last line
    tests = (out / "pytest-gpu.txt").read_text()
    assert "skipped" in tests and "failed" not in tests and "error" not in tests.lower()
