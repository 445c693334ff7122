"""The README's commands (calibrate, fit, table, generate, bench) and the ones `--help` points to (query,
trees with the n-gram stage, adaptive, calibrate --resume), in sequence, from directories other than the
repository root: files made in one folder are used from another (paths recorded absolute, the n-gram found
by its sha256, the pair recognised by content). A tiny grid and one thread keep it short; each command runs
the installed `specbatch` as a user would."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SPECBATCH = Path(sys.executable).parent / "specbatch"
NGRAM = Path(__file__).resolve().parents[2] / "data" / "models" / "demo-ngram.safetensors"
TINY = ["--quick", "--batch-sizes", "1,2", "--context-lens", "16", "--max-k", "2", "--threads", "1"]


def run(cwd: Path, *args) -> str:
    result = subprocess.run([str(SPECBATCH), *map(str, args)], cwd=cwd, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, (args, result.stdout[-2000:], result.stderr[-2000:])
    assert "Traceback" not in result.stderr and "Warning:" not in result.stderr, result.stderr
    return result.stdout


@pytest.mark.slow
@pytest.mark.skipif(not SPECBATCH.is_file(), reason="the specbatch command is not installed in this environment")
def test_the_readme_sequence_runs_outside_the_repo_root(tmp_path):
    made, used = tmp_path / "made", tmp_path / "used"
    made.mkdir()
    used.mkdir()
    run(made, "calibrate", "-o", "profile.json", *TINY)
    run(made, "fit", "profile.json", "-o", "model.json")
    run(made, "table", "model.json", "-o", "table.json")
    assert "best" in run(made, "query", "model.json", "--batch-size", "8").lower()
    table = json.loads((made / "table.json").read_text())
    assert Path(table["target"]).is_absolute() and table["fingerprints"]["target"]
    assert table.get("stage2") is None or Path(table["stage2"]["file"]).is_absolute()

    # from another directory: the files made above, named relative to it
    generated = json.loads(run(used, "generate", "--prompt", "def fibonacci(n):", "--table", "../made/table.json",
                               "--max-new-tokens", "8", "--threads", "1", "--json"))
    assert len(generated["outputs"]) == 1
    run(used, "bench", "--table", "../made/table.json", "--model", "../made/model.json", "--batch-sizes", "1",
        "--ks", "0,1", "--rounds", "1", "--max-new-tokens", "8", "--threads", "1")
    assert (used / "specbatch-bench" / "bench.json").is_file()
    run(used, "query", "../made/model.json", "--batch-size", "1", "--tree", "auto")
    run(used, "generate", "--prompt", "def f(x):", "--tree", "0,1,0.0,0.0.0", "--stage2", NGRAM,
        "--max-new-tokens", "8", "--threads", "1")
    adaptive = json.loads(run(used, "generate", "--prompt", "def f(x):", "--adaptive", "../made/model.json",
                              "--max-new-tokens", "8", "--threads", "1", "--json"))  # its n-gram found by sha256
    assert adaptive["policy"].startswith("adaptive") and len(adaptive["stats"]["k_per_step"]) > 0
    resumed = json.loads(run(used, "calibrate", "-o", "../made/profile.json", "--resume", "--json", *TINY))
    assert resumed["points_measured"] == 0 and resumed["points_left"] == 0
