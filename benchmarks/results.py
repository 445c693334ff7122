"""Reproduce docs/results.md: the whole loop on the bundled demo pair, on this machine, one torch thread.

    python benchmarks/results.py [--quick] [--out DIR] [--work DIR]

Runs the installed `specbatch` command (the one beside this Python) as a user would, from a work folder:
calibrate (the default grid), fit --holdout, table, plot, and bench of the table against fixed k at batch
sizes 1-32. Then writes DIR/results.md (the conditions, the exact commands, the results table and the
fit's held-out figures) and DIR/img/best-k.png (`specbatch plot`), and prints the table. DIR defaults to
the repository's docs/; only then is the results block of README.md (between its results markers)
replaced too, so README and docs carry the same figures. --quick is a smoke test (calibrate --quick,
three batch sizes, two rounds): its figures are not the published ones, and results.md says so.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence

from specbatch.perfmodel.jsonio import write_text_atomic

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the scripts' own shared module, however this is run
from docs_sections import replace_section, sections  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PLOT_NAME = "img/best-k.png"
README_BEGIN, README_END = "<!-- results:begin -->", "<!-- results:end -->"

FULL = {"calibrate": [], "batch_sizes": "1,2,4,8,16,32", "ks": "0,1,2,3,4,5,6,7,8", "bench": ["--full"]}
QUICK = {"calibrate": ["--quick"], "batch_sizes": "1,4,16", "ks": "0,2,4",
         "bench": ["--rounds", "2", "--resolve-rounds", "2", "--max-new-tokens", "32"]}


class ResultsError(Exception):
    """A one-line reason the run cannot go on."""


# ---------------------------------------------------------------- reading bench.json and the fit's JSON

def _pct(value: float | None, signed: bool = False) -> str:
    if value is None:
        return "-"
    return f"{100 * value:+.1f} %" if signed else f"{100 * value:.1f} %"


def results_rows(bench: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per batch size of a `specbatch.bench/1` document: the table's strategy, its steady-state
    speedup over k = 0, its paired regret against the best fixed k (95 % interval, verdict) and the
    prediction error of its goodput (geometric mean over rounds of predicted / measured - 1)."""
    if bench.get("schema") != "specbatch.bench/1":
        raise ResultsError(f"bench.json: schema {bench.get('schema')!r}, expected 'specbatch.bench/1'")
    rows = []
    for batch in bench["batch_sizes"]:
        table = next((p for p in batch["policies"] if p["policy"] == "table"), None)
        if table is None:
            raise ResultsError(f"bench.json: batch size {batch['batch_size']} has no table policy (bench --table)")
        regret = batch.get("paired_regret") or {}
        strategy = short_strategy(table.get("strategy") or f"k={table['k']}")
        rows.append({"batch_size": batch["batch_size"], "strategy": strategy,
                     "speedup": batch.get("table_speedup"), "regret": regret.get("regret"),
                     "ci95": regret.get("ci95"), "against": regret.get("against"), "verdict": regret.get("verdict"),
                     "rounds": regret.get("rounds"), "prediction_error": table.get("prediction_error")})
    return rows


def short_strategy(text: str) -> str:
    """A tree's strategy by its size, not its paths: a table cell stays readable.

    >>> short_strategy("tree 0,1,0.0,0.0.0 (4 nodes) +ngram")
    'tree of 4 nodes +ngram'
    >>> short_strategy("chain k=4")
    'chain k=4'
    """
    found = re.fullmatch(r"tree \S+ \((\d+) nodes\)(.*)", text)
    return f"tree of {found.group(1)} nodes{found.group(2)}" if found else text


def results_table(rows: Sequence[dict[str, Any]]) -> str:
    """The results as a markdown table: the README's and results.md's.

    >>> print(results_table([{"batch_size": 1, "strategy": "chain k=4", "speedup": 1.5, "regret": 0.01,
    ...     "ci95": [-0.005, 0.02], "against": "k=4", "verdict": "met", "rounds": 5, "prediction_error": -0.04}]))
    | b | table's strategy | speedup over k = 0 | regret [95 % interval] | prediction error |
    |---:|---|---:|---|---:|
    | 1 | chain k=4 | 1.50x | 1.0 % [-0.5, 2.0] | -4.0 % |
    """
    lines = ["| b | table's strategy | speedup over k = 0 | regret [95 % interval] | prediction error |",
             "|---:|---|---:|---|---:|"]
    for row in rows:
        speedup = "-" if row["speedup"] is None else f"{row['speedup']:.2f}x"
        regret = "-"
        if row["regret"] is not None:
            low, high = row["ci95"]
            regret = f"{100 * row['regret']:.1f} % [{100 * low:.1f}, {100 * high:.1f}]"
        lines.append(f"| {row['batch_size']} | {row['strategy']} | {speedup} | {regret} | "
                     f"{_pct(row['prediction_error'], signed=True)} |")
    return "\n".join(lines)


def regret_details(rows: Sequence[dict[str, Any]]) -> str:
    """What each regret was measured against, over how many rounds, and its verdict (results.md only).

    >>> print(regret_details([{"batch_size": 1, "against": "k=4", "rounds": 7, "verdict": "met", "regret": 0.0}]))
    - b = 1: against k=4 over 7 paired rounds: met.
    """
    return "\n".join(f"- b = {row['batch_size']}: against {row['against']} over {row['rounds']} paired rounds: "
                     f"{row['verdict']}." for row in rows if row["regret"] is not None)


def _step_stage(fit: dict[str, Any]) -> tuple[dict | None, dict | None]:
    """(timing source, step correction) of the fit's JSON: top level, or inside its step stage."""
    stage = fit.get("step_stage") or {}
    source = fit.get("timing_source") or stage.get("timing_source")
    correction = fit.get("step_correction") or stage.get("step_correction") or stage.get("correction")
    return source, correction


def _listed(values: Sequence[int]) -> str:
    """A few values listed, many summarized: [2, 8] -> '2, 8'; 20 values -> '20 from 48 to 385'."""
    return ", ".join(map(str, values)) if len(values) <= 4 else f"{len(values)} from {min(values)} to {max(values)}"


def fit_figures(fit: dict[str, Any], noise: dict[str, Any] | None = None) -> str:
    """The fit's held-out figures: a table of each role's pass MAPE in sample and held out, then bullets for the
    timing source's held-out step MAPE, the in-situ step correction's held-out paired error and the noise floor."""
    lines = ["| role | kind | in-sample MAPE | held out (b; L) | points | held-out MAPE | worst |",
             "|---|---|---:|---|---:|---:|---:|"]
    for role, obj in fit.get("roles", {}).items():
        validation = obj.get("validation", {})
        holdout = validation.get("holdout")
        cells = ["-"] * 4
        if holdout:
            left_out = _listed(holdout["held_out_batch_sizes"]) or "-"
            left_out += f"; {_listed(holdout['held_out_context_lens']) or '-'}"
            cells = [left_out, str(holdout["test_points"]), f"{holdout['mape_pct']:.1f} %",
                     f"{holdout['max_error_pct']:.1f} %"]
        lines.append(f"| {role} | {obj.get('kind', '?')} | {validation.get('in_sample_mape_pct', 0):.1f} % | "
                     + " | ".join(cells) + " |")
    lines.append("")
    source, correction = _step_stage(fit)
    if source:
        held = [f"{s['source']} {s['heldout_step_mape_pct']:.1f} %" for s in source.get("sources", [])
                if s.get("heldout_step_mape_pct") is not None]
        line = f"- **Timing source**: {source['chosen']} (lowest {source.get('criterion', 'step MAPE')})"
        lines.append(line + (f"; held-out step MAPE by batch size: {', '.join(held)}." if held else "."))
    if correction:
        state = "applied" if correction.get("applied") else "not applied"
        lines.append(f"- **In-situ step correction**: {state}; paired step error on held-out sweeps "
                     f"{correction['heldout_uncorrected_pct']:.2f} % by the model alone, "
                     f"{correction['heldout_error_pct']:.2f} % corrected.")
    if noise:
        lines.append(f"- **Noise floor**: the reference pass ({noise['reference']}), timed {len(noise['checks'])} "
                     f"times during calibration, lay {100 * noise['floor_mape']:.1f} % from its own median on "
                     f"average (drift ±{100 * noise['drift']:.1f} %): a MAPE near that is the machine's.")
    return "\n".join(lines)


def conditions_line(profile: dict[str, Any], bench_config: dict[str, Any], cpu: str, cores: int,
                    quick: bool) -> str:
    """One line: the pair, the machine, torch, threads and dtype, and what each bench round generated."""
    device, models = profile["device"], profile["models"]
    where = f"{cpu}, {cores} cores" if device.get("kind") == "cpu" else f"{device.get('name')} ({device.get('kind')})"
    threads = device.get("cpu_threads")
    line = (f"Demo pair ({models['target']['parameters'] / 1e6:.1f} M-parameter target, "
            f"{models['draft']['parameters'] / 1e6:.2f} M draft), {bench_config['sampling']}, "
            f"{bench_config['max_new_tokens']} new tokens per row, {bench_config['rounds']} rounds "
            f"({'in lockstep' if bench_config.get('interleave') == 'steps' else 'back to back'}); {where}, "
            f"torch {device.get('torch_version')}, {threads} thread{'s' if threads != 1 else ''}, "
            f"{device.get('dtype')}.")
    if quick:
        line += " **Smoke test (`--quick`): not the published figures.**"
    return line


def render_results(conditions: str, commands: Sequence[tuple[str, float]], table: str, details: str,
                   figures: str) -> str:
    """The whole of docs/results.md."""
    listed = "\n".join(f"{command}    # {seconds:.0f} s" for command, seconds in commands)
    return f"""# Results

Written by `python benchmarks/results.py` (this page down to "The fit, held out", and the README's results
table); each later section is written by the script it names ([benchmarks/README.md](../benchmarks/README.md)).
[validation.md](validation.md) says how each figure is measured.

{conditions}

The commands, as the script ran them from an empty folder (one torch thread, `OMP_NUM_THREADS=1`), with
the time each took:

```bash
{listed}
```

## The table against plain decoding and every fixed k

Steady-state goodput (the steps that ran with the whole batch; prefill excluded). Speedup: the table's
median over rounds against k = 0's. Regret: 1 - the geometric mean of the per-round ratios table / best
fixed k in hindsight, with a 95 % bootstrap interval over rounds. Prediction error: predicted / measured
goodput - 1 of the table's policy, each round predicted at its own context.

{table}

The regret's verdict against the 3 % goal (met: the whole interval at or below it; missed: above it; not
resolved: it straddles it):

{details}

## The fit, held out

{figures}

![goodput over (b, k) with the best k per batch size, and the fitted latency](img/best-k.png)
"""


def replace_block(text: str, block: str) -> str:
    """`text` with what lies between the results markers replaced by `block`.

    >>> replace_block("a\\n<!-- results:begin -->\\nold\\n<!-- results:end -->\\nb", "new")
    'a\\n<!-- results:begin -->\\nnew\\n<!-- results:end -->\\nb'
    """
    try:
        return replace_section(text, "results", block, append=False)
    except ValueError:
        raise ResultsError(f"README.md: no {README_BEGIN} ... {README_END} block to replace") from None


def with_other_sections(page: str, previous: str) -> str:
    """`page` followed by the sections other scripts wrote into the previous results.md (docs_sections)."""
    for name, block in sections(previous).items():
        if name != "results":
            page = page.rstrip("\n") + "\n\n" + block + "\n"
    return page


# ---------------------------------------------------------------- running the loop

def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def specbatch_command() -> Path:
    command = Path(sys.executable).parent / "specbatch"
    if not command.is_file():
        raise ResultsError(f"no specbatch command beside {sys.executable}: install the package first "
                           "(pip install -e .)")
    return command


def run(command: Path, args: Sequence[str], cwd: Path, capture: bool) -> tuple[str, float]:
    """Run `specbatch ARGS` in `cwd` with one torch thread; (its stdout when `capture`, else "", seconds)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    shown = "specbatch " + shlex.join(args)
    print(f"$ {shown}", flush=True)
    started = time.monotonic()
    result = subprocess.run([str(command), *args], cwd=cwd, env=env, stdout=subprocess.PIPE if capture else None,
                            text=True)
    if result.returncode != 0:
        raise ResultsError(f"`{shown}` failed with exit status {result.returncode} (its output is above)")
    return result.stdout or "", time.monotonic() - started


def shown_path(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path.resolve())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: calibrate --quick, fewer batch sizes and rounds")
    parser.add_argument("--out", type=Path, default=DOCS, help="where results.md and img/ go (default: docs/)")
    parser.add_argument("--work", type=Path, help="folder for the run's profile, model, table and bench files "
                                                  "(default: a new temporary folder)")
    args = parser.parse_args(argv)
    try:
        return _main(args)
    except ResultsError as error:
        print(f"benchmarks/results.py: {error}", file=sys.stderr)
        return 1


def _main(args: argparse.Namespace) -> int:
    command = specbatch_command()
    settings = QUICK if args.quick else FULL
    work = Path(tempfile.mkdtemp(prefix="specbatch-results-")) if args.work is None else args.work
    work.mkdir(parents=True, exist_ok=True)
    if (work / "profile.json").exists():
        raise ResultsError(f"--work {work}: already holds profile.json; give an empty folder")
    out = args.out.resolve()
    (out / "img").mkdir(parents=True, exist_ok=True)
    plot = out / PLOT_NAME
    steps = [
        ["calibrate", "-o", "profile.json", "--threads", "1", *settings["calibrate"]],
        ["fit", "profile.json", "-o", "model.json", "--holdout", "--json"],
        ["table", "model.json", "-o", "table.json", "--max-batch", "32"],
        ["plot", "model.json", "-o", str(plot), "--max-batch", "32", "--force"],  # the picture the docs show
        ["bench", "--table", "table.json", "--model", "model.json", "--batch-sizes", settings["batch_sizes"],
         "--ks", settings["ks"], "--threads", "1", "--out", "bench", *settings["bench"]],
    ]
    commands, fit = [], None
    for step in steps:
        stdout, seconds = run(command, step, work, capture=step[0] == "fit")
        if step[0] == "fit":
            fit = json.loads(stdout)
        shown = [shown_path(plot) if arg == str(plot) else arg for arg in step]
        commands.append(("specbatch " + shlex.join(shown), seconds))
    profile = json.loads((work / "profile.json").read_text())
    model = json.loads((work / "model.json").read_text())
    bench = json.loads((work / "bench" / "bench.json").read_text())
    rows = results_rows(bench)
    table = results_table(rows)
    conditions = conditions_line(profile, bench["config"], cpu_model(), os.cpu_count() or 1, args.quick)
    text = render_results(conditions, commands, table, regret_details(rows),
                          fit_figures(fit, model.get("profile", {}).get("noise")))
    previous = (out / "results.md").read_text() if (out / "results.md").is_file() else ""
    write_text_atomic(out / "results.md", with_other_sections(text, previous))
    print(f"\n{conditions}\n\n{table}\n\nwrote {out / 'results.md'} and {plot}; the run's files are in {work}")
    if out == DOCS.resolve():
        block = f"{conditions}\n\n{table}"
        write_text_atomic(README, replace_block(README.read_text(), block))
        print(f"updated the results block of {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
