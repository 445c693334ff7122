"""Passes of equal tokens that touch few or many experts (docs/results.md `moe-routing`): the expert term on a CPU.

    python benchmarks/moe_routing.py [--quick] [--write-docs]

A random mixture of experts (qwen3_moe: 64 experts of width 256 at hidden 512, top-4, 2 routed layers, float32)
runs one pass of b = 16 rows x 1 new token on 64 cached tokens, with its router replaced by one that sends the 16
tokens to exactly D distinct experts a layer (token t to experts (4t + j) mod D, j < 4), for D = 4 .. 64. Same
tokens, same attention, same FLOPs: only the experts read differ. perfmodel's expert term says such a pass reads
the dense part plus D experts a layer (perfmodel.experts), so on a memory-bound pass its time is affine in D with
a slope of one expert's bytes x routed layers / the bandwidth the weights stream at. The script measures the
times (configurations interleaved, one torch thread), fits the line, and sets the bandwidth its slope implies
beside the machine's copy bandwidth, measured apart (one layer's experts copied: bytes read and written).
Then the model's own router (random weights) runs the same pass: its distinct experts, counted, put on the line.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from specbatch.perfmodel.experts import uniform_distinct_experts
from specbatch.perfmodel.jsonio import write_text_atomic
from specbatch.runtime.config import config_from_dict
from specbatch.runtime.experts import RoutedExperts
from specbatch.runtime.model import CausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the scripts' own shared modules
from docs_sections import replace_section  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results.md"
EXPERTS, TOP_K, HIDDEN, WIDTH, LAYERS = 64, 4, 512, 256, 2
ROWS, CONTEXT = 16, 64
TOUCHED = (4, 8, 16, 32, 48, 64)
CONFIG = dict(model_type="qwen3_moe", vocab_size=1024, hidden_size=HIDDEN, intermediate_size=1024,
              moe_intermediate_size=WIDTH, num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=2,
              head_dim=64, num_experts=EXPERTS, num_experts_per_tok=TOP_K, norm_topk_prob=True,
              max_position_embeddings=256, bos_token_id=1, eos_token_id=2)


def build() -> CausalLM:
    torch.manual_seed(0)
    model = CausalLM(config_from_dict(CONFIG, source="benchmarks/moe_routing.py"))
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.05)
    return model.eval()


def forced_route(module: RoutedExperts, touched: int):
    """A router that sends token t to experts (k t + j) mod `touched`: exactly `touched` distinct experts a layer
    once the tokens cover them, each token's k experts distinct, equal weights."""
    def route(x: torch.Tensor):
        tokens = x.shape[0]
        experts = (TOP_K * torch.arange(tokens)[:, None] + torch.arange(TOP_K)[None, :]) % touched
        return experts, torch.full((tokens, TOP_K), 1.0 / TOP_K, dtype=x.dtype)
    return route


def time_passes(model: CausalLM, rounds: int) -> tuple[dict, list[float], float]:
    """Median ms of the pass per forced D, interleaved round by round; the natural router's times and its
    distinct experts per layer."""
    layers = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    tokens = torch.randint(0, CONFIG["vocab_size"], (ROWS, 1), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache(ROWS, CONTEXT + 1)
    natural_counts = []

    def one_pass() -> float:
        cache.set_lengths(None, [CONTEXT] * ROWS)
        start = time.perf_counter()
        model(tokens, cache)
        return (time.perf_counter() - start) * 1e3

    times = {d: [] for d in TOUCHED}
    natural = []
    with torch.inference_mode():
        for round_index in range(rounds + 2):  # two warm-up rounds
            for d in TOUCHED:
                for module in layers:
                    module.route = forced_route(module, d)
                sample = one_pass()
                if round_index >= 2:
                    times[d].append(sample)
            for module in layers:
                if "route" in vars(module):
                    del module.route
            sample = one_pass()
            if round_index >= 2:
                natural.append(sample)
        for module in layers:  # the natural router's distinct experts on these tokens
            original = module.route
            module.route = (lambda original: lambda x: natural_counts.append(len(set(
                original(x)[0].flatten().tolist()))) or original(x))(original)
        one_pass()
        for module in layers:
            del module.route
    return {d: statistics.median(v) for d, v in times.items()}, natural, float(np.mean(natural_counts))


EXPERT_BYTES = 3 * HIDDEN * WIDTH * 4  # gate, up and down, float32


def copy_bandwidth_GBps(model: CausalLM, rounds: int) -> float:
    """The machine's copy rate on one thread: one layer's stacked expert weights copied into a buffer allocated
    and touched beforehand (bytes read + written over the time; a fresh allocation would time its page faults)."""
    layer = next(m for m in model.modules() if isinstance(m, RoutedExperts))
    weights = torch.cat([layer.gate_up.detach().flatten(), layer.down.detach().flatten()])
    into = torch.zeros_like(weights)
    samples = []
    for index in range(rounds + 2):
        start = time.perf_counter()
        into.copy_(weights)
        if index >= 2:
            samples.append(time.perf_counter() - start)
    return 2 * weights.numel() * 4 / statistics.median(samples) / 1e9


def render(results: dict) -> str:
    rows = "\n".join(f"| {d} | {ROWS * TOP_K / d:g} | {ms:.3f} | {fit:.3f} | {100 * (fit / ms - 1):+.1f} % |"
                     for d, ms, fit in results["rows"])
    implied = EXPERT_BYTES / (results["slope_ms"] / LAYERS * 1e-3) / 1e9
    steps = results["rows"]
    first = (steps[1][1] - steps[0][1]) / (steps[1][0] - steps[0][0]) / LAYERS
    last = (steps[-1][1] - steps[-2][1]) / (steps[-1][0] - steps[-2][0]) / LAYERS
    return f"""## A mixture of experts' pass on this CPU: few experts touched against many

Written by `python benchmarks/moe_routing.py --write-docs` ({results['machine']}, one torch thread). One pass of
{ROWS} rows x 1 new token on {CONTEXT} cached tokens through a random qwen3_moe ({EXPERTS} experts of width
{WIDTH} at hidden {HIDDEN}, top-{TOP_K}, {LAYERS} routed layers, float32), with a router forced to send the
{ROWS} tokens to exactly D distinct experts a layer: the same tokens and FLOPs, only the experts read differ.
Medians of {results['rounds']} interleaved rounds.

| experts touched a layer (D) | rows an expert multiplies | pass ms | affine fit ms | fit error |
|---|---|---|---|---|
{rows}

- Touching all {EXPERTS} experts costs {results['ratio']:.2f}x touching {TOUCHED[0]}, at equal tokens and FLOPs.
  The line through the points, {results['intercept_ms']:.3f} ms + {results['slope_ms']:.4f} ms per expert touched
  a layer, misses by at most {results['max_error_pct']:.1f} %.
- Its slope is one expert's {EXPERT_BYTES / 1e6:.2f} MB (x {LAYERS} layers) at {implied:.1f} GB/s; the machine
  copies at {results['copy_GBps']:.1f} GB/s on one thread (read + write: it reads at
  {results['copy_GBps'] / 2:.1f}). The time per expert is not constant:
  {first:.3f} ms a layer between {steps[0][0]} and {steps[1][0]} experts, {last:.3f} ms between {steps[-2][0]} and
  {steps[-1][0]}: an expert multiplies {ROWS * TOP_K // steps[0][0]} rows at D = {steps[0][0]} and one at
  D = {steps[-1][0]}, and the model's expert term, which prices every expert at its bytes and the FLOPs apart,
  leaves that out (the affine line carries it as its misfit).
- The model's own router (random weights) touched {results['natural_distinct']:.1f} experts a layer on these
  {ROWS} tokens (uniform routing's expectation: {results['uniform_distinct']:.1f}); its pass took
  {results['natural_ms']:.3f} ms, and the line at that D says {results['natural_fit_ms']:.3f} ms
  ({100 * (results['natural_fit_ms'] / results['natural_ms'] - 1):+.1f} %)."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke test; not the published figures)")
    parser.add_argument("--write-docs", action="store_true", help="replace the moe-routing section of docs/results.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rounds = 5 if args.quick else 41
    model = build()
    medians, natural, natural_distinct = time_passes(model, rounds)
    d = np.array(TOUCHED, dtype=float)
    ms = np.array([medians[x] for x in TOUCHED])
    slope, intercept = np.polyfit(d, ms, 1)
    fitted = intercept + slope * d
    from specbatch.calibrate.environment import device_info

    results = {
        "machine": device_info("cpu", torch.float32).name, "rounds": rounds,
        "rows": list(zip(TOUCHED, ms.tolist(), fitted.tolist())),
        "intercept_ms": float(intercept), "slope_ms": float(slope),
        "max_error_pct": float(np.max(np.abs(fitted / ms - 1)) * 100), "ratio": float(ms[-1] / ms[0]),
        "copy_GBps": copy_bandwidth_GBps(model, rounds),
        "natural_distinct": natural_distinct, "natural_ms": statistics.median(natural),
        "natural_fit_ms": float(intercept + slope * natural_distinct),
        "uniform_distinct": float(uniform_distinct_experts(EXPERTS, TOP_K, ROWS)),
    }
    text = render(results)
    print(text)
    if args.write_docs:
        write_text_atomic(RESULTS, replace_section(RESULTS.read_text(), "moe-routing", text))
        print(f"wrote the moe-routing section of {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
