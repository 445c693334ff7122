"""benchmarks/gpu_results.py end to end on the committed vidur fixture: the section it writes, its place in
results.md, and the figures and goals it must show, as a reference page (tables, no history columns)."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "calibrate" / "fixtures" / "vidur" / "a100" / "Llama-2-7b-hf"
_spec = importlib.util.spec_from_file_location("gpu_results_script", ROOT / "benchmarks" / "gpu_results.py")
gpu_results = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = gpu_results  # its dataclasses look their module up by name
_spec.loader.exec_module(gpu_results)
pytestmark = pytest.mark.slow


def run(out: Path, work: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_results.py"), "--vidur", str(FIXTURE),
                           "--max-batch", "40", "--out", str(out), "--work", str(work), *args], capture_output=True,
                          text=True, timeout=900, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpu_results")
    out = root / "results.md"
    out.write_text("# Results\n\nThe CPU figures.\n")
    done = run(out, root / "work")
    assert done.returncode == 0, done.stderr
    return out, root, done.stdout


def test_the_section_is_appended_between_its_markers_and_replaced_when_written_again(written):
    out, root, _ = written
    text = out.read_text()
    assert text.startswith("# Results\n\nThe CPU figures.\n")
    begin, end = "<!-- gpu-data:begin -->", "<!-- gpu-data:end -->"
    assert text.count(begin) == 1 and text.count(end) == 1
    assert "## The GPU regime, from published timings" in text
    gpu_results.write_section(out, "## The GPU regime, rewritten\n")  # what a rerun does with its section
    rewritten = out.read_text()
    assert rewritten.count(begin) == 1 and "rewritten" in rewritten  # replaced, not appended twice
    assert "## The GPU regime, from published timings" not in rewritten
    assert rewritten.startswith("# Results\n\nThe CPU figures.\n")
    # and benchmarks/results.py, rewriting the page, keeps it
    kept = gpu_results.results.with_other_sections("# Results\n", out.read_text())
    assert kept.count(begin) == 1 and kept.startswith("# Results\n")


def _loss_rows(section: str) -> list[float]:
    """The worst goodput given up per context of the goodput tables: the GPU's, then the CPU's."""
    return [float(worst) for worst in re.findall(r"^\| \d+ \| \d+ \| ([\d.]+) % \(.*?\) \| [\d.]+ % \|$", section,
                                                 re.MULTILINE)]


def test_the_figures_are_there(written):
    _, _, section = written
    losses = _loss_rows(section)
    assert len(losses) == 4 + 2  # the GPU's contexts 256, 512, 1024, 2048; the CPU profile's 128 and 512
    assert all(0 <= loss < 100 for loss in losses)
    assert "before" not in section and " now" not in section  # a reference page: no history columns
    held = re.findall(r"^\| (target|draft) \| (.+?) \|", section, re.MULTILINE)
    labels = {label for role, label in held if role == "target"}
    assert {"every b not fitted", "b inside the grid", "b beyond the grid", "L = 256 left out",
            "L = 2048 left out"} <= labels
    # the combined protocol's figure is the goal, reported beside the split
    assert re.search(r"^\| target, every b not fitted \| [\d.]+ % (not )?met \| [\d.]+ % (not )?met \| b = \d+",
                     section, re.MULTILINE)
    # where the data step past b = 32 and where the fit on b <= 32 puts its steps, per role, context and width
    steps = re.findall(r"^\| (target|draft) \| (\d+) \| (\d+) \| (.+?) \| (.+?) \|$", section, re.MULTILINE)
    assert {(role, int(n)) for role, _, n, _, _ in steps} == {("target", 1), ("target", 9), ("draft", 1), ("draft", 2)}
    assert "- Fitted on b <= 32, the target's rows reach" in section
    assert "(+staircase)" in section  # what fit chooses on these data
    k_rows = re.findall(r"^\| (\d+) \| (\d+|-) \| (\d) \| (\d) \| (\d) \| (\d) \|$", section, re.MULTILINE)
    assert [int(row[0]) for row in k_rows][:6] == [1, 2, 4, 8, 16, 32]
    assert "(goal <= 1 %: " in section and "CPU calibration" in section
    # the refinement's protocol at each budget, calibrate's default last, and its goal lines
    table = section[section.index("| budget |"):].split("\n\n")[0]
    budgets = re.findall(r"^\| (\d+)(?: \(calibrate's\))? \| (\d+)(?: \(\d+ more not in the data\))? \|", table,
                         re.MULTILINE)
    assert [int(b) for b, _ in budgets] == list(gpu_results.REFINE_BUDGETS)
    assert all(int(added) <= int(b) for b, added in budgets)
    assert re.search(r"^\| draft, refined \(budget \d+, \d+ target passes added\), every b not fitted nor refined \| "
                     r"[\d.]+ % ", section, re.MULTILINE)
    # a reference page: no paragraph longer than a few lines
    assert max(len(paragraph) for paragraph in section.split("\n\n") if not paragraph.startswith("|")) <= 600


def test_bad_input_is_one_line(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_results.py"), "--vidur", str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 1
    assert done.stderr.strip() == f"benchmarks/gpu_results.py: --vidur {tmp_path}: no mlp.csv there"
