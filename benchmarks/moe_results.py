"""The demo mixture of experts' results (docs/results.md `moe`): the whole loop with a MoE target.

    python benchmarks/moe_results.py [--quick] [--work DIR] [--write-docs]

Runs the installed `specbatch` as `results.py` does, from a work folder, one torch thread: calibrate
`--target data/models/demo-moe` (a byte-level qwen3_moe trained by data/train_demo_moe.py) with the demo draft
model, fit --holdout, table, and bench of the table against every fixed k at batch sizes 1-32. Beside the
results: the routing calibrate measured (distinct experts per routed layer in windows of the prompts, against
uniform routing's count), the exponents the fit found, and the experts each table entry's verify pass reads.
--write-docs replaces the `moe` section of docs/results.md; --quick is a smoke test whose figures are not the
published ones.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Sequence

from specbatch.perfmodel.experts import uniform_distinct_experts
from specbatch.perfmodel.jsonio import write_text_atomic

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the scripts' own shared modules
from docs_sections import replace_section  # noqa: E402
from results import (QUICK, FULL, ResultsError, cpu_model, regret_details, results_rows, results_table,  # noqa: E402
                     run, specbatch_command)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results.md"
MOE = ROOT / "data" / "models" / "demo-moe"
DRAFT = ROOT / "data" / "models" / "demo-draft"
SHOWN_WIDTHS = (1, 2, 4, 8)  # tokens per row in the routing table


def routing_table(profile: dict) -> str:
    """Measured distinct experts per layer (mean over the routed layers) against uniform routing, per (b, n)."""
    experts = profile["models"]["target"]["experts"]
    rows = {(row["batch_size"], row["new_tokens"]): sum(row["distinct_experts"]) / len(row["distinct_experts"])
            for row in profile["routing"]["rows"] if row["model"] == "target"}
    batch_sizes = sorted({b for b, _ in rows})
    widths = [n for n in SHOWN_WIDTHS if any((b, n) in rows for b in batch_sizes)]
    lines = ["| b | " + " | ".join(f"n = {n}: measured / uniform" for n in widths) + " |",
             "|---:|" + "---|" * len(widths)]
    for b in batch_sizes:
        cells = []
        for n in widths:
            uniform = float(uniform_distinct_experts(experts["num_experts"], experts["experts_per_token"], b * n))
            cells.append(f"{rows[(b, n)]:.1f} / {uniform:.1f}" if (b, n) in rows else "-")
        lines.append(f"| {b} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table_experts(table: dict) -> str:
    """The table's k and the experts its verify pass reads at the benched batch sizes, over its context buckets
    (a range where the buckets differ: the runtime reads the bucket nearest the batch's longest context)."""
    sizes = (1, 2, 4, 8, 16, 32)
    by_b = {b: [bucket["entries"][b - 1] for bucket in table["buckets"]] for b in sizes}

    def span(values, fmt: str) -> str:
        low, high = fmt.format(min(values)), fmt.format(max(values))
        return low if low == high else f"{low}-{high}"

    contexts = [bucket["context_len"] for bucket in table["buckets"]]
    return (f"| b (context buckets {contexts[0]}-{contexts[-1]}) | " + " | ".join(map(str, sizes)) + " |\n|---|"
            + "---:|" * len(sizes) + "\n"
            "| k | " + " | ".join(span([e["k"] for e in by_b[b]], "{}") for b in sizes) + " |\n"
            "| experts a layer (verify) | "
            + " | ".join(span([e["experts_touched"] for e in by_b[b]], "{:.1f}") for b in sizes) + " |")


def render_section(conditions: str, commands: Sequence[tuple[str, float]], routing: str, fit_line: str,
                   experts: str, table: str, details: str) -> str:
    listed = "\n".join(f"{command}    # {seconds:.0f} s" for command, seconds in commands)
    return f"""## The demo mixture of experts

Written by `python benchmarks/moe_results.py --write-docs`. The loop with `data/models/demo-moe` (a byte-level
qwen3_moe trained by `data/train_demo_moe.py`) as the target and the demo draft model as its drafter.
{conditions}

```bash
{listed}
```

The routing calibrate measured: distinct experts per routed layer (mean over layers) touched by b rows of n
consecutive tokens of the prompts, beside what uniform, independent routing would touch:

{routing}

{fit_line}

The table's k and the experts per layer its verify pass reads (b rows x (k + 1) tokens, from the fitted routing):

{experts}

The table against plain decoding and every fixed k, as in the sections above:

{table}

{details}"""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: calibrate --quick, fewer sizes and rounds")
    parser.add_argument("--work", type=Path, help="folder for the run's files (default: a new temporary folder)")
    parser.add_argument("--write-docs", action="store_true", help="replace the moe section of docs/results.md")
    parser.add_argument("--render", action="store_true",
                        help="measure nothing: render the section again from the files a run left in --work")
    args = parser.parse_args(argv)
    if args.render and args.work is None:
        parser.error("--render needs the --work folder of an earlier run")
    try:
        return _main(args)
    except ResultsError as error:
        print(f"benchmarks/moe_results.py: {error}", file=sys.stderr)
        return 1


def _main(args: argparse.Namespace) -> int:
    if not (MOE / "config.json").is_file():
        raise ResultsError(f"{MOE}: no demo mixture of experts; train it with python data/train_demo_moe.py")
    command = specbatch_command()
    settings = QUICK if args.quick else FULL
    work = Path(tempfile.mkdtemp(prefix="specbatch-moe-")) if args.work is None else args.work
    if args.render:
        return _render(args, work)
    work.mkdir(parents=True, exist_ok=True)
    if (work / "profile.json").exists():
        raise ResultsError(f"--work {work}: already holds profile.json; give an empty folder")
    pair = ["--target", str(MOE), "--draft", str(DRAFT)]
    steps = [
        ["calibrate", *pair, "-o", "profile.json", "--threads", "1", *settings["calibrate"]],
        ["fit", "profile.json", "-o", "model.json", "--holdout"],
        ["table", "model.json", "-o", "table.json", "--max-batch", "32"],
        ["bench", *pair, "--table", "table.json", "--model", "model.json", "--batch-sizes",
         settings["batch_sizes"], "--ks", settings["ks"], "--threads", "1", "--out", "bench", *settings["bench"]],
    ]
    commands = []
    shown_paths = {str(MOE): "data/models/demo-moe", str(DRAFT): "data/models/demo-draft"}
    for step in steps:
        _, seconds = run(command, step, work, capture=False)
        commands.append(("specbatch " + shlex.join(shown_paths.get(arg, arg) for arg in step), seconds))
    (work / "commands.json").write_text(json.dumps(commands))
    return _render(args, work)


def _render(args: argparse.Namespace, work: Path) -> int:
    """The section from a run's files (profile, model, table, bench, and the commands with their seconds)."""
    missing = [name for name in ("commands.json", "profile.json", "model.json", "table.json", "bench/bench.json")
               if not (work / name).is_file()]
    if missing:
        raise ResultsError(f"--work {work}: {', '.join(missing)} missing (not a finished run's folder)")
    commands = [tuple(pair) for pair in json.loads((work / "commands.json").read_text())]
    profile = json.loads((work / "profile.json").read_text())
    model = json.loads((work / "model.json").read_text())
    table = json.loads((work / "table.json").read_text())
    bench = json.loads((work / "bench" / "bench.json").read_text())
    experts = profile["models"]["target"]["experts"]
    routing = model["roles"]["target"]["shape"]["routing"]
    cv = "" if routing["cv_mape_pct"] is None else f", {routing['cv_mape_pct']:.1f} % leaving each batch size out"
    fit_line = (f"The fitted routing: b^{routing['row_exponent']:.3f} x n^{routing['token_exponent']:.3f} "
                f"independent draws (uniform: 1 and 1), error {routing['mape_pct']:.1f} % over "
                f"{routing['rows']} rows{cv}.")
    device = profile["device"]
    conditions = (f"Target: {profile['models']['target']['parameters'] / 1e6:.2f} M parameters, "
                  f"{experts['moe_layers']} routed layers of {experts['num_experts']} experts, top-"
                  f"{experts['experts_per_token']}; routing measured over {profile['routing']['prompt_count']} "
                  f"prompts; {bench['config']['sampling']}, {bench['config']['max_new_tokens']} new tokens per row, "
                  f"{bench['config']['rounds']} rounds; {cpu_model()}, {os.cpu_count()} cores, torch "
                  f"{device.get('torch_version')}, 1 thread, {device.get('dtype')}."
                  + (" **Smoke test (`--quick`): not the published figures.**" if args.quick else ""))
    rows = results_rows(bench)
    section = render_section(conditions, commands, routing_table(profile), fit_line, table_experts(table),
                             results_table(rows), regret_details(rows))
    print(f"\n{section}\n\nthe run's files are in {work}")
    if args.write_docs:
        write_text_atomic(RESULTS, replace_section(RESULTS.read_text(), "moe", section))
        print(f"replaced the moe section of {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
