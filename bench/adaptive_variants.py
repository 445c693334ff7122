"""The adaptive policy's draft stop, measured: the policy with its stop at two margins and without it,
beside a fixed k, in lockstep on the same rounds (calibrate.lockstep), paired per round.

    OMP_NUM_THREADS=1 python -m bench.adaptive_variants MODEL.json --batch-size 4 --rounds 10 [--mixed]

Contenders: `adaptive` with the stop's margin at each of `--margins` (default 0.03 and 0.10), `adaptive`
without the stop, and `k=K` (`--k`, default 4). Each round generates the next batch of held-out prompts
(`--mixed`: held-out and data/prompts/base64.jsonl alternating row by row, as `bench --workload mixed`)
with all of them in lockstep, after one warm-up round; printed per contender: the geometric mean over
rounds of its steady-state goodput over the fixed k's, with a 95 % bootstrap interval over rounds, and
its decisions' share of its steps' time. Demo pair, greedy, EOS ignored, 64 new tokens per row.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

from specbatch.calibrate.acceptance import encode_prompts, read_prompts
from specbatch.calibrate.lockstep import run_lockstep
from specbatch.calibrate.pass_clock import PassClock
from specbatch.runtime.adaptive import adaptive_policy
from specbatch.runtime.assembly import load_pair
from specbatch.runtime.generator import SpeculativeGenerator
from specbatch.runtime.policy import FixedK

from .harness import balanced_order
from .regret import paired_ratio

PROMPTS = Path(__file__).resolve().parents[1] / "data" / "prompts"


def contenders(model: Path, margins: list[float], k: int) -> dict:
    found = {}
    for margin in margins:
        policy = adaptive_policy(model)
        policy.draft_stop.margin = margin  # before its first plan: thresholds are made per (b, L, k) from it
        found[f"adaptive, stop margin {margin:g}"] = policy
    found["adaptive, no stop"] = adaptive_policy(model, early_stop=False)
    found[f"k={k}"] = FixedK(k)
    return found


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="specbatch.model/1 file (specbatch fit)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--margins", default="0.03,0.10")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--mixed", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    target, draft = load_pair(None, None, "cpu", None)
    code = encode_prompts(target.tokenizer, read_prompts(PROMPTS / "heldout.jsonl"), 256)
    prompts = code
    if args.mixed:
        other = encode_prompts(target.tokenizer, read_prompts(PROMPTS / "base64.jsonl"), 256)
        prompts = [p for pair in zip(code, other) for p in pair]
    generator = SpeculativeGenerator(target.model, draft.model, eos_token_ids=())
    policies = contenders(args.model, [float(m) for m in args.margins.split(",")], args.k)
    names, b = list(policies), args.batch_size
    steady: dict[str, dict[int, float]] = {name: {} for name in names}
    shares: dict[str, list[float]] = {name: [] for name in names}
    for r in range(-1, args.rounds):  # round -1: the warm-up
        batch = [prompts[((r + 1) * b + i) % len(prompts)] for i in range(b)]
        order = balanced_order(names, r)
        generations = {name: generator.generation(batch, 64, policies[name], seed=r) for name in order}
        for name, (result, _) in run_lockstep(generations, PassClock({}, generator.device)).items():
            if r >= 0:
                steady[name][r] = result.stats.steady_tokens_per_s(b)
                shares[name].append(result.stats.decision_fraction)
    fixed = names[-1]
    print(f"b = {b}, {args.rounds} rounds, {'mixed' if args.mixed else 'held-out'} prompts, paired against {fixed}")
    for name in names[:-1]:
        found = paired_ratio(steady[name], steady[fixed])
        print(f"{name:>28}: {found['ratio']:.3f} [{found['ci95'][0]:.3f}, {found['ci95'][1]:.3f}], decisions "
              f"{100 * float(np.median(shares[name])):.1f} % of its steps (median over rounds)")


if __name__ == "__main__":
    main()
