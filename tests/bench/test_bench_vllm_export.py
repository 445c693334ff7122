"""vLLM itself reads our `--format vllm` exports: its own SpeculativeConfig is built from each (through
EngineArgs, as `LLM(speculative_config=...)` does) and its scheduler's batch-size lookup maps back to our table at
every batch size. Runs in vLLM's own virtual environment (bench/vllm/setup.sh, bench/vllm/run.sh); skipped when
that is not set up, as in CI (the setup takes minutes and gigabytes). Then bench/vllm/compare.py end to end,
small: the same greedy tokens from both engines, and vLLM's scheduler looking up the table's k at every step.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


from specbatch.perfmodel.jsonio import write_json_atomic
from specbatch.perfmodel.table import save_table, to_vllm
from vllm_helpers import DRAFT, ROOT, RUN, TARGET, needs_vllm, table_of

MAX_NUM_SEQS = 40  # above every table's --max-batch: vLLM carries the last k on past the last range

TABLES = {  # k at batch sizes 1..N
    "golden": [5, 5, 4, 4, 4, 2, 0],
    "falling": [8, 7, 6, 6, 5, 4, 4, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
    "rising": [1, 2, 2, 3, 4, 4, 4, 4],
    "constant": [4] * 16,
    "single": [3],
    "zeros_inside": [4, 0, 0, 3, 3, 0, 2],
}


pytestmark = needs_vllm()


def test_vllm_builds_its_config_from_our_exports_and_runs_our_table(tmp_path):
    paths = {}
    for name, ks in TABLES.items():
        paths[name] = tmp_path / f"{name}.vllm.json"
        write_json_atomic(paths[name], to_vllm(table_of(ks)))
    fragment = tmp_path / "fragment.json"  # the old export: the per-batch-size list alone
    write_json_atomic(fragment, {"num_speculative_tokens_per_batch_size": [[1, 2, 5], [3, 7, 4]]})
    oracle = ROOT / "benchmarks" / "vllm_schedule_oracle.py"
    run = subprocess.run(["bash", str(RUN), str(oracle), str(TARGET), str(MAX_NUM_SEQS), *map(str, paths.values()),
                          str(fragment)], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    answers = {Path(a["export"]).name: a for a in (json.loads(line) for line in run.stdout.splitlines()
                                                   if line.startswith('{"export"'))}
    for name, ks in TABLES.items():
        answer = answers[paths[name].name]
        assert "refused" not in answer, answer
        assert answer["method"] == "draft_model" and answer["num_speculative_tokens"] == max(ks)
        assert answer["k_per_batch_size"] == ks + [ks[-1]] * (MAX_NUM_SEQS - len(ks)), name
    assert "refused" in answers["fragment.json"]  # vLLM needs num_speculative_tokens and the draft model


def _check_comparison(results: list[dict], batch_sizes: list[int], rounds: int) -> None:
    assert [(r["batch_size"], r["policy"]) for r in results] == [(b, p) for b in batch_sizes for p in ("k=0", "table")]
    for r in results:
        assert r["identical_rows"] == r["rows"] == r["batch_size"] * rounds, r  # greedy: token for token
        assert len(r["ours_tokens_per_s"]) == len(r["vllm_tokens_per_s"]) == rounds, r
        assert r["vllm_k_mismatches"] == [] and (r["vllm_steps"] > 0) == (r["policy"] == "table"), r


def test_compare_runs_both_engines_on_the_same_tokens(tmp_path):
    save_table(tmp_path / "t.json", table_of([3, 2]))
    compare = ROOT / "bench" / "vllm" / "compare.py"
    run = subprocess.run([sys.executable, str(compare), "--table", str(tmp_path / "t.json"), "--batch-sizes", "1,2",
                          "--max-new-tokens", "12", "--rounds", "2", "-o", str(tmp_path / "c.json")],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-3000:]
    _check_comparison(json.loads((tmp_path / "c.json").read_text())["results"], [1, 2], rounds=2)


def test_bench_peers_vllm_runs_vllm_beside_our_policies(tmp_path):
    """`specbatch bench --peers vllm`: the comparison lands in bench.json beside the usual results."""
    save_table(tmp_path / "t.json", table_of([2, 3, 1]))
    run = subprocess.run([sys.executable, "-m", "specbatch.cli", "bench", "--table", str(tmp_path / "t.json"),
                          "--ks", "0,2",
                          "--batch-sizes", "1,3", "--rounds", "1", "--max-new-tokens", "10", "--peers", "vllm",
                          "--out", str(tmp_path / "b")], capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "vLLM K = table" in run.stdout
    bench = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert bench["config"]["peers"] == ["vllm"]
    _check_comparison(bench["vllm"]["results"], [1, 3], rounds=1)


def test_loadtest_serves_the_same_trace_through_vllm_with_our_table(tmp_path):
    """`specbatch loadtest --policies vllm:table`: vLLM's own server runs our export; every greedy response
    equals the target's solo greedy output."""
    from specbatch.serve.loadtest import LoadtestConfig, run_loadtest

    save_table(tmp_path / "t.json", table_of([3, 2, 2, 1]))
    prompts = ("def fibonacci(n):\n", "import os\n\n\ndef main():\n", "class Stack:\n    def push(self, item):\n")
    config = LoadtestConfig(policies=("vllm:table",), rates_per_s=(4.0,), requests=4, max_duration_s=120,
                            max_tokens=(8, 16), prompts=prompts, check_greedy=True, vllm_target=TARGET,
                            vllm_draft=DRAFT, vllm_table=tmp_path / "t.json", vllm_max_num_seqs=4)
    (run,) = run_loadtest(config, tmp_path / "out")["runs"]
    assert (run["policy"], run["ok"], run["errors"], run["mismatched"]) == ("vllm:table", 4, 0, 0), run
