"""The demo head's results (docs/results.md `heads`): the whole loop with the demo EAGLE-3 head as the drafter.

    python benchmarks/head_results.py [--quick] [--work DIR] [--write-docs]

Runs the installed `specbatch` as `results.py` does, from a work folder, one torch thread: calibrate with
`--draft data/models/demo-head`, fit --holdout, table, and bench of the table against every fixed k at batch
sizes 1-32. Beside it, the acceptance per draft position of the head and of the demo draft model, both measured
the same way (`calibrate.acceptance.drafted_acceptance`: chains of 8 drafted on the calibration prompts): a head
wired wrong accepts almost nothing, so this is part of the proof. --write-docs replaces the `heads` section of
docs/results.md; --quick is a smoke test whose figures are not the published ones.
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

from specbatch.perfmodel.jsonio import write_text_atomic

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the scripts' own shared modules
from docs_sections import replace_section  # noqa: E402
from results import (QUICK, FULL, ResultsError, cpu_model, regret_details, results_rows, results_table,  # noqa: E402
                     run, specbatch_command)

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results.md"
HEAD = ROOT / "data" / "models" / "demo-head"
ACCEPTANCE_K = 8
ACCEPTANCE_PROMPTS = 64  # the calibration prompts' count (calibrate's default effort)
ACCEPTANCE_TOKENS = 64


def acceptance_rows(quick: bool) -> dict[str, list[float]]:
    """Per-position acceptance of the demo head and of the demo draft model, greedy, drafted the same way on the
    same prompts (one torch thread)."""
    import torch

    from specbatch.calibrate.acceptance import drafted_acceptance, encode_prompts, read_prompts
    from specbatch.runtime.assembly import DEMO_DRAFT, DEMO_PROMPTS, DEMO_TARGET
    from specbatch.runtime.checkpoint import load_checkpoint
    from specbatch.runtime.heads import load_head
    from specbatch.runtime.sampling import Sampling

    torch.set_num_threads(1)
    target = load_checkpoint(DEMO_TARGET, "cpu", torch.float32)
    count = 8 if quick else ACCEPTANCE_PROMPTS
    prompts = encode_prompts(target.tokenizer, read_prompts(DEMO_PROMPTS)[:count], 256)
    drafters = {"head (EAGLE-3)": load_head(HEAD, target.model),
                "draft model": load_checkpoint(DEMO_DRAFT, "cpu", torch.float32).model}
    return {name: list(drafted_acceptance(target.model, draft, prompts, Sampling(), ACCEPTANCE_K,
                                          16 if quick else ACCEPTANCE_TOKENS, target.eos_token_ids).per_position)
            for name, draft in drafters.items()}


def acceptance_table(rows: dict[str, list[float]]) -> str:
    """Per-position acceptance, one row per drafter.

    >>> print(acceptance_table({"head": [0.8, 0.75], "draft": [0.7, 0.7]}))
    | drafter | 1 | 2 |
    |---|---:|---:|
    | head | 0.80 | 0.75 |
    | draft | 0.70 | 0.70 |
    """
    width = max(len(values) for values in rows.values())
    lines = ["| drafter | " + " | ".join(str(i + 1) for i in range(width)) + " |",
             "|---|" + "---:|" * width]
    lines += [f"| {name} | " + " | ".join(f"{value:.2f}" for value in values) + " |" for name, values in rows.items()]
    return "\n".join(lines)


def render_section(conditions: str, commands: Sequence[tuple[str, float]], acceptance: str, table: str,
                   details: str) -> str:
    listed = "\n".join(f"{command}    # {seconds:.0f} s" for command, seconds in commands)
    return f"""## The demo head (EAGLE-3)

Written by `python benchmarks/head_results.py --write-docs`. The demo target with the demo head
(`data/models/demo-head`, trained by `data/train_demo_head.py`) as its drafter instead of the draft model.
{conditions}

Acceptance per draft position, greedy, both drafters measured the same way (chains of {ACCEPTANCE_K} drafted on
the calibration prompts, `calibrate.acceptance.drafted_acceptance`):

{acceptance}

```bash
{listed}
```

The table against plain decoding (without the head) and every fixed k, as in the section above:

{table}

{details}"""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke test: calibrate --quick, fewer sizes and rounds")
    parser.add_argument("--work", type=Path, help="folder for the run's files (default: a new temporary folder)")
    parser.add_argument("--write-docs", action="store_true", help="replace the heads section of docs/results.md")
    args = parser.parse_args(argv)
    try:
        return _main(args)
    except ResultsError as error:
        print(f"benchmarks/head_results.py: {error}", file=sys.stderr)
        return 1


def _main(args: argparse.Namespace) -> int:
    if not (HEAD / "config.json").is_file():
        raise ResultsError(f"{HEAD}: no demo head; train it with python data/train_demo_head.py")
    command = specbatch_command()
    settings = QUICK if args.quick else FULL
    work = Path(tempfile.mkdtemp(prefix="specbatch-heads-")) if args.work is None else args.work
    work.mkdir(parents=True, exist_ok=True)
    if (work / "profile.json").exists():
        raise ResultsError(f"--work {work}: already holds profile.json; give an empty folder")
    head = str(HEAD)
    steps = [
        ["calibrate", "--draft", head, "-o", "profile.json", "--threads", "1", *settings["calibrate"]],
        ["fit", "profile.json", "-o", "model.json", "--holdout"],
        ["table", "model.json", "-o", "table.json", "--max-batch", "32"],
        ["bench", "--draft", head, "--table", "table.json", "--model", "model.json", "--batch-sizes",
         settings["batch_sizes"], "--ks", settings["ks"], "--threads", "1", "--out", "bench", *settings["bench"]],
    ]
    commands = []
    for step in steps:
        _, seconds = run(command, step, work, capture=False)
        shown = ["data/models/demo-head" if arg == head else arg for arg in step]
        commands.append(("specbatch " + shlex.join(shown), seconds))
    profile = json.loads((work / "profile.json").read_text())
    bench = json.loads((work / "bench" / "bench.json").read_text())
    rows = results_rows(bench)
    device = profile["device"]
    conditions = (f"Head: {profile['models']['draft']['parameters'] / 1e6:.2f} M parameters a pass reads, draft "
                  f"vocabulary {profile['models']['draft']['draft_vocab_size']}; {bench['config']['sampling']}, "
                  f"{bench['config']['max_new_tokens']} new tokens per row, {bench['config']['rounds']} rounds; "
                  f"{cpu_model()}, {os.cpu_count()} cores, torch {device.get('torch_version')}, 1 thread, "
                  f"{device.get('dtype')}." + (" **Smoke test (`--quick`): not the published figures.**"
                                               if args.quick else ""))
    acceptance = acceptance_table(acceptance_rows(args.quick))
    section = render_section(conditions, commands, acceptance, results_table(rows), regret_details(rows))
    print(f"\n{section}\n\nthe run's files are in {work}")
    if args.write_docs:
        write_text_atomic(RESULTS, replace_section(RESULTS.read_text(), "heads", section))
        print(f"replaced the heads section of {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
