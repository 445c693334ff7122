"""`bench` as a newcomer runs it: a quick default with --full for the thorough run, `-o` like `--out`, the
plan and an ETA said up front, progress lines off a terminal, what was measured written when interrupted,
one regret figure per batch size, speedups and trees explained."""
from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from cli_helpers import invoke
from specbatch.console.bench import FULL_RUN, QUICK_RUN, BenchClock

TINY = ["--ks", "0,1", "--max-new-tokens", "4", "--threads", "1"]


def _bench_json(out) -> dict:
    return json.loads((out / "bench.json").read_text())


def test_the_default_is_the_quick_run_and_full_the_thorough_one(tmp_path):
    assert invoke("bench", *TINY, "-o", tmp_path / "quick").exit_code == 0
    quick = _bench_json(tmp_path / "quick")["config"]
    assert (tuple(quick["batch_sizes"]), quick["rounds"]) == (QUICK_RUN["batch_sizes"], QUICK_RUN["rounds"])
    result = invoke("bench", "--full", "--ks", "0", "--max-new-tokens", "2", "--threads", "1", "--out", tmp_path / "f")
    assert result.exit_code == 0, result.output
    full = _bench_json(tmp_path / "f")["config"]
    assert (tuple(full["batch_sizes"]), full["rounds"]) == (FULL_RUN["batch_sizes"], FULL_RUN["rounds"])
    chosen = invoke("bench", "--full", "--batch-sizes", "2", "--rounds", "1", *TINY, "-o", tmp_path / "c")
    assert chosen.exit_code == 0 and _bench_json(tmp_path / "c")["config"]["batch_sizes"] == [2]


def test_off_a_terminal_bench_says_its_plan_then_progress_with_an_eta(tmp_path):
    run = subprocess.run([sys.executable, "-m", "specbatch.cli", "bench", "--batch-sizes", "1,2", "--rounds", "2",
                          *TINY, "-o", tmp_path / "b"], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.startswith("bench: ")]
    assert lines[0].startswith("bench: 12 generations of 4 new tokens per row at batch sizes 1, 2 (2 policies, "
                               "2 rounds + 1 warm-up each)")
    progress = lines[1:]
    assert progress and all(" generations, b=" in line and "so far, ETA " in line for line in progress)
    assert any("b=2" in line for line in progress)  # a line at every batch size at least


def interruptible() -> None:
    """In the child before it runs: SIGINT back to its default. A shell starts background jobs with SIGINT
    ignored, and an ignored signal stays ignored through exec (Python then installs no KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_interrupted_bench_writes_the_rounds_it_finished(tmp_path):
    out = tmp_path / "b"
    # b = 64 last: work enough after the b = 4 line that the interrupt lands before the run ends, even when
    # this reader is slow to see the line on a busy machine
    process = subprocess.Popen([sys.executable, "-m", "specbatch.cli", "bench", "--ks", "0,1,2",
                                "--batch-sizes", "1,4,64", "--max-new-tokens", "16", "--threads", "1", "-o", out],
                               stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                               preexec_fn=interruptible)
    seen = []
    try:
        for line in process.stderr:  # the first progress line past b = 1: b = 1's rounds are all done
            seen.append(line)
            if line.startswith("bench: ") and " generations, b=" in line and " generations, b=1 " not in line:
                process.send_signal(signal.SIGINT)
                break
        rest = process.stderr.read()
        assert process.wait(120) == 130, "".join(seen[-20:]) + rest[-2000:]
    finally:
        if process.poll() is None:
            process.kill()
    written = _bench_json(out)
    measured = [batch["batch_size"] for batch in written["batch_sizes"]]
    assert written["interrupted"] is True and measured[0] == 1 and 64 not in measured
    assert any(note.startswith("interrupted: batch sizes 1") for note in written["notes"])
    assert "interrupted: the finished rounds are in" in rest and "Traceback" not in rest
    rounds = {(r["batch_size"], r["round"]) for r in written["runs"] if not r["warmup"]}
    assert {(1, 0), (1, 1), (1, 2)} <= rounds  # b = 1: every round; no round of b = 64
    assert not any(b == 64 for b, _ in rounds)


def test_the_eta_reads_the_clock_at_the_end_of_rounds():
    now = [0.0]
    clock = BenchClock({1: 3, 4: 3}, rounds=2, warmup_rounds=1, clock=lambda: now[0])
    assert clock.eta_s() is None  # nothing measured yet
    now[0] = 6.0  # a warm-up round of 3 generations at b = 1, reported at its end
    assert [clock.observe(1, -1) for _ in range(3)] == [False, False, True]
    assert clock.per_generation_s(1) == 2.0
    # left: 6 at b = 1 at 2 s; 9 at b = 4, guessed as 2 s x (1 + 4/8) / (1 + 1/8)
    assert clock.eta_s() == pytest.approx(6 * 2.0 + 9 * 2.0 * 1.5 / 1.125)
    now[0] = 12.0
    for _ in range(3):
        clock.observe(4, -1)  # b = 4 measured: 6 s for 3 generations
    assert clock.per_generation_s(4) == 2.0 and clock.eta_s() == pytest.approx(6 * 2.0 + 6 * 2.0)


def test_the_summary_shows_the_paired_regret_and_explains_speedup_and_trees(tiny_pair, prompts, table_path,
                                                                             capsys, monkeypatch):
    from pathlib import Path

    from specbatch.bench.config import BenchConfig
    from specbatch.bench.harness import run_bench
    from specbatch.console.bench import render_bench

    config = BenchConfig(batch_sizes=(1, 2), ks=(0, 1, 2), max_new_tokens=6, rounds=3, resolve_rounds=0,
                         table_path=Path(table_path), trees=("0,1,0.0",))
    result = run_bench(config, tiny_pair, prompts)
    monkeypatch.setenv("COLUMNS", "300")  # cells on one line each
    render_bench(result, [])
    text = " ".join(capsys.readouterr().out.split())
    for batch in result.batches:
        paired = batch.paired_regret
        assert f"{100 * paired['regret']:.1f}% [{100 * paired['ci95'][0]:.1f}, {100 * paired['ci95'][1]:.1f}]" in text
    assert "(medians)" not in text
    assert "in brackets over whole generate() calls" in text
    assert "tree paths: each number is a draft token's rank among its siblings" in text
