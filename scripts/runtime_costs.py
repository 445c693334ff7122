"""What the runtime pays for a batch: a ragged batch against a uniform one, and the prefill's peak memory.

    OMP_NUM_THREADS=1 python scripts/runtime_costs.py [--rounds 5] [--new-tokens 64] [--k 0,4]

Ragged: one prompt of --long-prompt tokens among b - 1 of --short-prompt tokens; uniform: b prompts of
--short-prompt tokens (random token ids, EOS ignored so every row generates --new-tokens). Each round runs
the uniform and the ragged batch back to back (the order alternating by round) at every k; the figure is
wall seconds per generated token, prefill included, and the ragged/uniform ratio is taken within each
round (its median and range over rounds). The prefill's peak memory is the growth of the process's
resident set's peak (Linux: VmHWM, reset through /proc/self/clear_refs) over one prefill of --batch-size rows
of --long-prompt tokens, in a fresh process.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time


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


def peak_prefill_bytes(b: int, prompt_len: int) -> int:
    """Resident-set growth of one prefill (both models), in a fresh process."""
    code = f"""
import torch
torch.set_num_threads(1)
from specbatch.runtime.assembly import load_named_pair
from specbatch.runtime.generator import SpeculativeGenerator
from specbatch.runtime.policy import FixedK
pair = load_named_pair(None, None, "cpu", None)
generator = SpeculativeGenerator(pair.target, pair.draft)
prompts = [[i % 250 for i in range(r, r + {prompt_len})] for r in range({b})]
generator.generate([[1, 2, 3]], 2, FixedK(2))  # allocator and kernels warm
def status_kib(field):
    with open("/proc/self/status") as file:
        return next(int(line.split()[1]) for line in file if line.startswith(field + ":"))
with open("/proc/self/clear_refs", "w") as file:
    file.write("5")  # resets the peak resident set (VmHWM) to the current one
before = status_kib("VmRSS")
generator.generate(prompts, 1, FixedK(2))
print((status_kib("VmHWM") - before) * 1024)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--short-prompt", type=int, default=16)
    parser.add_argument("--long-prompt", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--k", default="0,4", help="comma-separated chain lengths")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("-o", "--out", help="write the figures as JSON here")
    args = parser.parse_args(argv)
    ks = [int(k) for k in args.k.split(",")]
    if args.batch_size < 2 or args.rounds < 1 or min(ks) < 0 or args.new_tokens < 1:
        parser.error("need --batch-size >= 2, --rounds >= 1, --new-tokens >= 1 and k >= 0")
    import torch

    from specbatch.runtime.assembly import load_named_pair
    from specbatch.runtime.generator import SpeculativeGenerator

    torch.set_num_threads(args.threads)
    pair = load_named_pair(None, None, "cpu", None)
    generator = SpeculativeGenerator(pair.target, pair.draft)  # no EOS: every row generates new_tokens
    uniform, ragged = batches(pair.target.config.vocab_size, args.batch_size, args.short_prompt, args.long_prompt)
    for k in ks:  # warm-up
        per_token_s(generator, uniform, 4, k), per_token_s(generator, ragged, 4, k)
    seconds = {(k, kind): [] for k in ks for kind in ("uniform", "ragged")}
    for round_index in range(args.rounds):
        for k in ks:
            order = ("uniform", "ragged") if round_index % 2 == 0 else ("ragged", "uniform")
            for kind in order:
                prompts = uniform if kind == "uniform" else ragged
                seconds[(k, kind)].append(per_token_s(generator, prompts, args.new_tokens, k))
    figures = {"batch_size": args.batch_size, "threads": args.threads, "rounds": args.rounds, "ragged": []}
    for k in ks:
        ratios = [r / u for r, u in zip(seconds[(k, "ragged")], seconds[(k, "uniform")])]
        row = {"k": k, "uniform_ms_per_token": 1e3 * statistics.median(seconds[(k, "uniform")]),
               "ragged_ms_per_token": 1e3 * statistics.median(seconds[(k, "ragged")]),
               "ragged_over_uniform": statistics.median(ratios), "range": [min(ratios), max(ratios)]}
        figures["ragged"].append(row)
        print(f"k={k}: uniform {row['uniform_ms_per_token']:.3f} ms/token, ragged {row['ragged_ms_per_token']:.3f} "
              f"ms/token, ragged/uniform {row['ragged_over_uniform']:.2f}x [{min(ratios):.2f}, {max(ratios):.2f}]")
    peak = peak_prefill_bytes(args.batch_size, args.long_prompt)
    figures["prefill_peak_bytes"] = peak
    print(f"prefill of {args.batch_size} x {args.long_prompt} tokens: peak resident growth {peak / 2**20:.1f} MiB")
    if args.out:
        with open(args.out, "w") as file:
            json.dump(figures, file, indent=1)


if __name__ == "__main__":
    main()
