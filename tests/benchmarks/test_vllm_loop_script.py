"""benchmarks/vllm_loop.py writes its section of docs/results.md from a finished run's files (here constructed, as
the commands write them), says each goal's verdict from the figures, and keeps the page's other sections."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from vllm_roundtrip import RoundTrip, Run, summarize
from vllm_helpers import table_of

ROOT = Path(__file__).resolve().parents[2]


def finished_run(work: Path, calibration_s: float, held_out_pct: float) -> None:
    def write(name: str, obj) -> None:
        (work / name).write_text(json.dumps(obj))

    tables = {"vllm-costs": table_of([6, 6, 5, 4, 4, 4, 4, 4] + [3] * 24), "ours-costs": table_of([6] * 4 + [3] * 28)}
    runs = []
    for r in range(4):  # K=4 the faster fixed K; vllm-costs 1 % below it every round, ours-costs 10 %
        machine = 1.0 + 0.2 * r
        runs += [Run(8, r, name, "paired", rate * machine, rate, rate, [[8, table.lookup(8)]] if table else [])
                 for name, rate, table in (("vllm-costs", 990.0, tables["vllm-costs"]),
                                           ("ours-costs", 900.0, tables["ours-costs"]), ("K=4", 1000.0, None),
                                           ("K=3", 980.0, None))]
    trip = RoundTrip({}, {"vllm-costs": "vllm", "ours-costs": "specbatch"}, 8, 3, 4, 64, 1, vllm_version="0.32.0")
    trip.results.append(summarize(8, runs, tables))
    write("roundtrip.json", trip.to_json())
    write("vllm.json", {"engine": {"name": "vllm", "version": "0.32.0", "settings": {"acceptance": "real"}}})
    write("vllm.table.json", tables["vllm-costs"].to_json())
    write("ours.table.json", tables["ours-costs"].to_json())
    write("calibrate.answer.json", {"engine_steps": 600, "points_left": 0})
    held = [{"by": by, "mape_pct": held_out_pct, "worst_pct": 30.0, "per_group": {"1": held_out_pct}}
            for by in ("k", "batch_size")]
    write("fit.answer.json", {"engine_steps": {"in_sample_mape_pct": 7.0, "held_out": held, "sweep_spread_pct": 20.0}})
    write("commands.json", [["specbatch calibrate --engine vllm --threads 1 -o vllm.json", calibration_s],
                            ["specbatch fit vllm.json -o vllm.model.json --json", 3.0]])


def render(work: Path, results: Path) -> str:
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vllm_loop.py"), "--render-only", "--work",
                          str(work), "--write-docs", "--results", str(results)], capture_output=True, text=True,
                         timeout=120, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr
    return results.read_text()


def test_the_section_says_each_goal_s_verdict_from_the_figures(tmp_path):
    finished_run(tmp_path, calibration_s=600.0, held_out_pct=8.5)
    results = tmp_path / "results.md"
    results.write_text("# Results\n\n<!-- runtime-costs:begin -->\nratio 1.1x\n<!-- runtime-costs:end -->\n")
    page = render(tmp_path, results)
    assert "<!-- runtime-costs:begin -->\nratio 1.1x\n<!-- runtime-costs:end -->" in page  # the other script's
    section = page.split("<!-- vllm-loop:begin -->")[1].split("<!-- vllm-loop:end -->")[0]
    assert "in 600 s, the two workers' starts included: within the 15-minute goal" in section
    assert "one K at a time: MAPE 8.5 %" in section and "the goal is 10 %: met" in section
    assert "specbatch calibrate --engine vllm --threads 1 -o vllm.json    # 600 s" in section
    row = next(line for line in section.splitlines() if line.startswith("| 8 |"))
    assert row == "| 8 | K=4 | 1300 | 4 | +1.0 % [+1.0, +1.0] met | 3 | +10.0 % [+10.0, +10.0] missed |"
    assert "the table's k at its batch size: yes" in section

    finished_run(tmp_path, calibration_s=1000.0, held_out_pct=12.0)
    section = render(tmp_path, results).split("<!-- vllm-loop:begin -->")[1]
    assert "not within the 15-minute goal" in section and "the goal is 10 %: not met" in section
    assert page.count("<!-- vllm-loop:begin -->") == 1
