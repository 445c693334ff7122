"""The scripts in benchmarks/ (not installed): each answers --help run as its README runs it, and those that can
finish in a few seconds run end to end on tiny inputs."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ("results", "cpu_spells", "pairing_noise", "pass_ratios", "runtime_costs", "gpu_results",
           "serving_fidelity", "vllm_loop", "vllm_roundtrip", "linear_layout", "host_step_cost", "moe_results",
           "moe_routing", "moesd")


def run_script(name: str, *args: str, timeout_s: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), *args], capture_output=True,
                          text=True, timeout=timeout_s, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_the_readme_indexes_every_script_and_each_section_it_names_exists():
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)\.py` \| [^|]+ \| ([^|]+) \|", readme, re.MULTILINE))
    assert set(rows) == {path.stem for path in (ROOT / "benchmarks").glob("*.py")}
    assert set(SCRIPTS) <= set(rows)
    results = (ROOT / "docs" / "results.md").read_text()
    for name, written in rows.items():
        for section in re.findall(r"docs/results\.md `([a-z0-9-]+)`", written):
            assert f"<!-- {section}:begin -->" in results, (name, section)


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_exits_0_with_the_docstrings_summary(name):
    run = run_script(name, "--help")
    assert run.returncode == 0, run.stderr
    summary = (ROOT / "benchmarks" / f"{name}.py").read_text().split('"""')[1].splitlines()[0]
    assert " ".join(summary.split()[:5]) in " ".join(run.stdout.split())


@pytest.mark.parametrize("name, args", [("cpu_spells", ["--seconds", "0.5"]), ("pass_ratios", ["--seconds", "0"]),
                                        ("pairing_noise", ["--rounds", "1"]), ("pairing_noise", ["--ks", "4"]),
                                        ("runtime_costs", ["--k", "x"]), ("runtime_costs", ["--batch-size", "1"]),
                                        ("host_step_cost", ["--ks", "x"]), ("host_step_cost", ["--batch-sizes", "0"])])
def test_bad_options_are_one_line_exit_2(name, args):
    run = run_script(name, *args)
    assert run.returncode == 2 and run.stderr.strip().splitlines()[-1].startswith(f"{name}.py: error:"), run.stderr


def test_pairing_noise_runs_on_the_demo_pair():
    run = run_script("pairing_noise", "--batch-size", "1", "--rounds", "2", "--new-tokens", "4", "--ks", "1,1")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith("demo-target b = 1, 2 rounds, 4 new tokens") and len(lines) == 3
    for line, mode in zip(lines[1:], ("back to back", "lockstep")):
        assert re.fullmatch(rf"k=1 / k=1 +{mode}: geometric mean [\d.]+, sd of log ratio [\d.]+ %, "
                            r"standard error [\d.]+ %", line), line


def test_host_step_cost_runs_on_the_demo_pair():
    """A row per (b, k); a chain's step issues more ops than a plain one (its draft passes and their picks)."""
    run = run_script("host_step_cost", "--batch-sizes", "2", "--ks", "0,2", "--new-tokens", "6")
    assert run.returncode == 0, run.stderr
    rows = [line.split() for line in run.stdout.splitlines()[2:]]
    assert [row[:2] for row in rows] == [["2", "0"], ["2", "2"]]
    assert all(float(row[2]) > 0 for row in rows) and int(rows[1][3]) > int(rows[0][3]) > 0


def test_pass_ratios_runs_on_the_demo_pair():
    run = run_script("pass_ratios", "--seconds", "0.1")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert re.match(r"\d+ windows of 2 s; reference target b=1 n=1 L=128: median [\d.]+ ms", lines[0]), lines[0]
    assert [line.split(" / ")[0] for line in lines[1:]] == [
        "target b=32 n=5 L=256", "target b=8 n=3 L=128", "draft b=1 n=1 L=128", "draft b=16 n=1 L=256"]


def test_runtime_costs_runs_on_the_demo_pair(tmp_path):
    out = tmp_path / "costs.json"
    run = run_script("runtime_costs", "--rounds", "1", "--new-tokens", "4", "--batch-size", "3", "--long-prompt", "40",
                     "--k", "0,2", "-o", str(out))
    assert run.returncode == 0, run.stderr
    import json

    figures = json.loads(out.read_text())
    assert [row["k"] for row in figures["ragged"]] == [0, 2]
    assert all(row["packed"] > 0 and row["padded"] > 0 for row in figures["prefill"].values())
    assert [row["syncs"] for row in figures["ops"]] == [1, 1, 1]  # one read-back per step, as CUDA runs it
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from runtime_costs import markdown

    assert "Beside vLLM" not in markdown(figures)
    title, conditions, command = markdown(figures).split("\n\n")[:3]  # a reference section's head
    assert conditions.startswith("Demo pair, float32, ") and "\n" not in conditions
    assert command.startswith("```bash\nOMP_NUM_THREADS=1 python benchmarks/runtime_costs.py --write-docs --rounds 1")
    figures["vllm"] = {"vllm_version": "0.32.0", "vllm_torch_threads": 2, "torch_threads": 1, "max_new_tokens": 4,
                       "rounds": 1, "table": "/x/table-chain.json", "results": [
                           {"batch_size": 8, "policy": "k=0", "ours_tokens_per_s": [300.0],
                            "vllm_tokens_per_s": [200.0],
                            "ours_over_vllm": 1.5, "ours_over_vllm_range": [1.5, 1.5], "identical_rows": 8, "rows": 8},
                           {"batch_size": 8, "policy": "table", "ours_tokens_per_s": [450.0],
                            "vllm_tokens_per_s": [500.0], "ours_over_vllm": 0.9, "ours_over_vllm_range": [0.9, 0.9],
                            "identical_rows": 7, "rows": 8}]}
    page = markdown(figures)
    assert "| 8 | plain (k = 0) | 300 | 200 | 1.50x [1.50, 1.50] | 8/8 |" in page
    assert "| 8 | table | 450 | 500 | 0.90x [0.90, 0.90] | 7/8 |" in page and "`table-chain.json`" in page


def test_moe_routing_runs_and_counts_the_experts_it_forces():
    """Each forced D appears with the rows an expert multiplies (16 tokens x top-4 / D); no timing is asserted."""
    run = run_script("moe_routing", "--quick", timeout_s=300)
    assert run.returncode == 0, run.stderr
    for touched in (4, 8, 16, 32, 48, 64):
        assert f"| {touched} | {64 / touched:g} | " in run.stdout
    assert "uniform routing's expectation: 41.2" in " ".join(run.stdout.split())  # 64 (1 - (1 - 4/64)^16)
