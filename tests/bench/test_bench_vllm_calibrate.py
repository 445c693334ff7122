"""vLLM's own steps end to end, where its CPU build is set up (bench/vllm/setup.sh; skipped otherwise, as in CI):
`calibrate --engine vllm` stopped by --max-seconds and resumed, every configuration's row as vLLM ran it (the K
its scheduler chose, its counters), `fit` and `table --format vllm` on the result, then the round trip in vLLM
with a schedule from those costs and one from a constructed table."""
from __future__ import annotations

import json
import subprocess
import sys

from specbatch.perfmodel.profile import load_profile
from specbatch.perfmodel.table import load_table, save_table
from vllm_helpers import ROOT, needs_vllm, table_of

pytestmark = needs_vllm()


def specbatch(*args: str) -> subprocess.CompletedProcess:
    run = subprocess.run([sys.executable, "-m", "specbatch.cli", *args], capture_output=True, text=True, timeout=900,
                         cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    return run


def test_vllm_steps_calibrated_resumed_fitted_tabulated_and_run_back_in_vllm(tmp_path):
    out = tmp_path / "vllm.json"
    grid = ["--engine", "vllm", "--batch-sizes", "1,2,4,8", "--context-lens", "64", "--max-k", "2", "--quick",
            "--threads", "1", "-o", str(out)]
    first = json.loads(specbatch("calibrate", *grid, "--max-seconds", "1", "--json").stdout)
    assert first["points_measured"] == 1 and first["points_left"] == 2 * 4 * 4 - 1  # 2 sweeps x 4 b x (none, K 0-2)
    second = json.loads(specbatch("calibrate", *grid, "--resume", "--json").stdout)
    assert (second["points_resumed"], second["points_measured"], second["points_left"]) == (1, 31, 0)
    profile = load_profile(out)
    assert profile.engine.name == "vllm" and profile.engine.settings["threads"] == "1 OpenMP thread(s), unbound"
    assert profile.timings == () and len(profile.engine_steps) == 32
    for row in profile.engine_steps:
        assert row.reps == 8  # every decode step before the abort ran over the full batch
        assert 64 <= row.context_len <= 64 + 8 * 3 and 1.0 <= row.tokens_per_step <= row.k + 1
        assert (row.drafts > 0) == (row.mode == "schedule" and row.k > 0)
        if row.drafts:  # every decode step verified one draft per row (the prefill step's drafts included)
            assert row.drafts == row.batch_size * 8 and row.draft_tokens == row.drafts * row.k
    (acceptance,) = profile.acceptance
    assert len(acceptance.per_position) == 2 and acceptance.tokens_per_step[0] == 1.0

    fitted = json.loads(specbatch("fit", str(out), "-o", str(tmp_path / "m.json"), "--json").stdout)
    assert fitted["engine_steps"]["engine"]["name"] == "vllm"
    export = specbatch("table", str(tmp_path / "m.json"), "-o", str(tmp_path / "v.json"), "--max-batch", "8",
                       "--format", "vllm")
    assert "own steps" in export.stdout
    specbatch("table", str(tmp_path / "m.json"), "-o", str(tmp_path / "t.json"), "--max-batch", "8",
              "--context-lens", "64")
    assert load_table(tmp_path / "t.json").costs_name() == "vllm"

    save_table(tmp_path / "ours.json", table_of([2, 1, 1, 1], context_len=64))
    options = ["--vllm-table", tmp_path / "t.json", "--ours-table", tmp_path / "ours.json", "--batch-sizes", "1,4",
               "--max-k", "2", "--rounds", "2", "--paired-rounds", "2", "--max-new-tokens", "12", "--threads", "1",
               "-o", tmp_path / "rt.json"]
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vllm_roundtrip.py"), *map(str, options)],
                         capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "rt.json").read_text())
    assert [r["batch_size"] for r in result["results"]] == [1, 4]
    for r in result["results"]:
        assert set(r["screening_tokens_per_s"]) == {"vllm-costs", "ours-costs", "K=0", "K=1", "K=2"}
        assert len(r["median_tokens_per_s"]) == 4 and r["best_fixed"] in r["median_tokens_per_s"]  # + two fixed K
        assert r["lookup_mismatches"] == {"vllm-costs": [], "ours-costs": []}  # vLLM ran our schedules
        assert r["regret"]["vllm-costs"]["rounds"] == r["regret"]["ours-costs"]["rounds"] == 2
    # batch sizes x (warm-up + 2 screening rounds) x 5 contenders, then 2 paired rounds x 4 in lockstep
    assert len(result["runs"]) == 2 * 3 * 5 + 2 * 2 * 4
    for run in result["runs"]:  # a decode step over b rows adds b tokens, plus those of K accepted per row
        k = 0 if run["contender"] in ("K=0", "vllm-costs", "ours-costs") else int(run["contender"][2:])
        full = [generated for requests, generated, _ in run["decode_steps"] if requests == run["batch_size"]]
        assert full and all(run["batch_size"] <= g <= run["batch_size"] * (k + 1) for g in full if k or
                            run["contender"] == "K=0"), run
        assert run["steady_tokens_per_s"] > 0
