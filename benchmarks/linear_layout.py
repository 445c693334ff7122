"""The CPU weight layout of a projection, measured: `F.linear` over the usual (out, in) weight against the
same values stored transposed, (in, out) contiguous, as `CausalLM.lay_out_for_matmul` keeps them on CPU.

    python benchmarks/linear_layout.py [--target DIR] [--tokens 1,8,32,160,512] [--rounds 7] [--threads 1]

For every distinct projection shape of the target (and the demo draft when no --target is given) and every
token count, the two layouts run alternately within each round on the same input; reported: the median
microseconds of each and the median over rounds of the per-round ratio transposed / usual (below 1: the
transposed layout is faster). Both layouts give the same products up to float rounding.
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F


def projection_shapes(config) -> list[tuple[int, int]]:
    """(in, out) of a block's projections: fused qkv, attention output, the MLP's input and output."""
    q_size, kv_size = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    mlp_in = 2 * config.intermediate_size if config.family == "llama" else config.intermediate_size
    shapes = [(config.hidden_size, q_size + 2 * kv_size), (q_size, config.hidden_size),
              (config.hidden_size, mlp_in), (config.intermediate_size, config.hidden_size)]
    return list(dict.fromkeys(shapes))


def time_us(call, repeats: int) -> float:
    call()
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    return (time.perf_counter() - start) / repeats * 1e6


def measure(in_features: int, out_features: int, tokens: int, rounds: int) -> dict:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, in_features, generator=generator)
    usual = torch.randn(out_features, in_features, generator=generator)
    transposed = usual.t().contiguous().t()  # same values and shape, (in, out) storage
    repeats = max(3, int(2e7 / (tokens * in_features * out_features)))  # ~ 20 MFLOP per timing
    pairs = []
    for round_index in range(rounds):
        order = (usual, transposed) if round_index % 2 == 0 else (transposed, usual)
        timings = {id(weight): time_us(lambda w=weight: F.linear(x, w), repeats) for weight in order}
        pairs.append((timings[id(usual)], timings[id(transposed)]))
    return {"in": in_features, "out": out_features, "tokens": tokens,
            "usual_us": statistics.median(p[0] for p in pairs),
            "transposed_us": statistics.median(p[1] for p in pairs),
            "ratio": statistics.median(p[1] / p[0] for p in pairs)}


def main(argv: list[str] | None = None) -> None:
    from specbatch.runtime.assembly import DEMO_DRAFT, DEMO_TARGET
    from specbatch.runtime.config import load_config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", type=Path, help="a Hugging Face model directory (default: the demo pair)")
    parser.add_argument("--tokens", default="1,8,32,160,512", help="comma-separated token counts")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.threads < 1:
        parser.error("--rounds and --threads must be >= 1")
    try:
        token_counts = [int(text) for text in args.tokens.split(",")]
    except ValueError:
        parser.error(f"--tokens {args.tokens!r}: expected comma-separated integers")
    if min(token_counts) < 1:
        parser.error(f"--tokens {args.tokens!r}: every count must be >= 1")
    torch.set_num_threads(args.threads)
    directories = [args.target] if args.target else [DEMO_TARGET, DEMO_DRAFT]
    shapes = list(dict.fromkeys(s for d in directories for s in projection_shapes(load_config(d / "config.json"))))
    print(f"F.linear on CPU, {args.threads} thread(s), {args.rounds} interleaved rounds")
    print(f"{'in':>6} {'out':>6} {'tokens':>6} {'(out,in) us':>12} {'(in,out) us':>12} {'ratio':>6}")
    with torch.inference_mode():
        for in_features, out_features in shapes:
            for tokens in token_counts:
                row = measure(in_features, out_features, tokens, args.rounds)
                print(f"{in_features:>6} {out_features:>6} {tokens:>6} {row['usual_us']:>12.1f} "
                      f"{row['transposed_us']:>12.1f} {row['ratio']:>6.2f}")


if __name__ == "__main__":
    main()
