"""The README's commands (calibrate, fit, table, generate, bench) and the ones `--help` points to (query,
trees with the n-gram stage, adaptive, calibrate --resume), in sequence, from directories other than the
repository root: files made in one folder are used from another (paths recorded absolute, the n-gram found
by its sha256, the pair recognised by content). A tiny grid and one thread keep it short; each command runs
the installed `specbatch` as a user would, two at a time once the files they read are made."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SPECBATCH = Path(sys.executable).parent / "specbatch"
NGRAM = Path(__file__).resolve().parents[2] / "data" / "models" / "demo-ngram.safetensors"
TINY = ["--quick", "--batch-sizes", "1,2", "--context-lens", "16", "--max-k", "2", "--threads", "1"]


def start(cwd: Path, *args) -> subprocess.Popen:
    return subprocess.Popen([str(SPECBATCH), *map(str, args)], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(process: subprocess.Popen) -> str:
    """The command's standard output, once it has exited 0 without a traceback or a warning."""
    try:
        stdout, stderr = process.communicate(timeout=900)
    finally:
        process.kill()  # a no-op once it has exited
    args = process.args[1:]
    assert process.returncode == 0, (args, stdout[-2000:], stderr[-2000:])
    assert "Traceback" not in stderr and "Warning:" not in stderr, (args, stderr)
    return stdout


def run(cwd: Path, *args) -> str:
    return finish(start(cwd, *args))


def run_two_at_a_time(commands: list[tuple]) -> list[str]:
    """Each (cwd, *args) as `run` runs it, two side by side (a 2-core CI machine's cores), in order."""
    running, out = [], []
    try:
        for command in commands:
            running.append(start(*command))
            if len(running) == 2:
                out.append(finish(running.pop(0)))
        while running:
            out.append(finish(running.pop(0)))
    finally:
        for process in running:
            process.kill()  # none left behind when one fails
    return out


@pytest.mark.slow
@pytest.mark.skipif(not SPECBATCH.is_file(), reason="the specbatch command is not installed in this environment")
def test_the_readme_sequence_runs_outside_the_repo_root(tmp_path):
    made, used = tmp_path / "made", tmp_path / "used"
    made.mkdir()
    used.mkdir()
    run(made, "calibrate", "-o", "profile.json", *TINY)
    run(made, "fit", "profile.json", "-o", "model.json")
    run(made, "table", "model.json", "-o", "table.json")
    table = json.loads((made / "table.json").read_text())
    assert Path(table["target"]).is_absolute() and table["fingerprints"]["target"]
    assert table.get("stage2") is None or Path(table["stage2"]["file"]).is_absolute()

    # the rest only read the files made above (calibrate --resume measures nothing), most of them from another
    # directory, naming those files relative to it
    query, generated, _, _, _, adaptive, resumed = run_two_at_a_time([
        (made, "query", "model.json", "--batch-size", "8"),
        (used, "generate", "--prompt", "def fibonacci(n):  # returns the n-th Fibonacci number",
         "--table", "../made/table.json", "--max-new-tokens", "8",
         "--threads", "1", "--json"),
        (used, "bench", "--table", "../made/table.json", "--model", "../made/model.json", "--batch-sizes", "1",
         "--ks", "0,1", "--rounds", "1", "--max-new-tokens", "8", "--threads", "1"),
        (used, "query", "../made/model.json", "--batch-size", "1", "--tree", "auto"),
        (used, "generate", "--prompt", "def f(x):", "--tree", "0,1,0.0,0.0.0", "--stage2", NGRAM,
         "--max-new-tokens", "8", "--threads", "1"),
        (used, "generate", "--prompt", "def f(x):", "--adaptive", "../made/model.json",  # its n-gram found by sha256
         "--max-new-tokens", "8", "--threads", "1", "--json"),
        (used, "calibrate", "-o", "../made/profile.json", "--resume", "--json", *TINY),
    ])
    assert "best" in query.lower()
    assert len(json.loads(generated)["outputs"]) == 1
    assert (used / "specbatch-bench" / "bench.json").is_file()
    adaptive = json.loads(adaptive)
    assert adaptive["policy"].startswith("adaptive") and len(adaptive["stats"]["k_per_step"]) > 0
    resumed = json.loads(resumed)
    assert resumed["points_measured"] == 0 and resumed["points_left"] == 0
