"""What the device script (calibrate/gpu_reference.sh) asks of a device before calibrating on it: torch's
and CUDA's versions, the attention kernel torch picks for each model's shapes, and one step's passes timed
two ways: wall time around a pass with a barrier on each side (what a harness that synchronizes measures)
and the device's own time between two events (what calibrate records: runtime.clock). A second generation
with calibrate's step recorder gives the steps' wall time with nothing synchronized inside them. Every
figure comes for each execution mode asked for (`--modes eager,cuda-graphs`, side by side in one run), with
the kernel launches a pass makes, counted by torch's profiler (a replayed graph is one launch).

    python -m specbatch.calibrate.device_probe --target llama-3.1-8b --draft llama-3.2-1b --batch-sizes 1,64
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from specbatch.runtime.checkpoint import parse_dtype
from specbatch.runtime.clock import DeviceClock
from specbatch.runtime.generator import SpeculativeGenerator
from specbatch.runtime.loading import load_pair, resolve_device, resolve_pair
from specbatch.runtime.policy import FixedK

from .environment import attention_kernel, device_name
from .pass_clock import StepRecorder


class BarrierAndEvents:
    """A step observer that times every pass both ways: barrier, wall clock and events around it."""

    def __init__(self, device: str):
        self.clock = DeviceClock(device)
        self.rows: list[tuple[str, int, int, float, float]] = []  # role, b, n, wall ms, event ms

    def run_pass(self, role, model, tokens, cache, attention=None, last=None):
        self.clock.now()  # the barrier before: the pass starts on an idle device
        started_s, start = time.perf_counter(), self.clock.mark()
        out = model(tokens, cache, attention, last)
        end = self.clock.mark()
        wall_ms = (self.clock.now() - started_s) * 1000.0  # the barrier after
        self.rows.append((role, int(tokens.shape[0]), int(tokens.shape[1]), wall_ms,
                          self.clock.elapsed_s(start, end) * 1000.0))
        return out

    def step_started(self) -> None: ...

    def step_finished(self, record) -> None: ...


def versions(device: str, dtype: torch.dtype, pair) -> list[str]:
    lines = [f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}",
             f"device {device}: {device_name(device)}, dtype {str(dtype).removeprefix('torch.')}"]
    for role, model in (("target", pair.target), ("draft", pair.draft)):
        config = model.config
        kernel = attention_kernel(device, dtype, config.num_heads, config.num_kv_heads, config.head_dim)
        lines.append(f"attention kernel ({role}: {config.num_heads} heads, {config.num_kv_heads} KV heads of "
                     f"{config.head_dim}): {kernel}")
    return lines


LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaGraphLaunch", "cuGraphLaunch")


def launches_per_pass(model, batch_size: int, new_tokens: int, context_len: int, device: str) -> int:
    """Kernel (and graph) launches of one pass of `model` (a CausalLM, or its GraphedModel) over
    (batch_size, new_tokens) on `context_len` cached tokens, as torch's profiler sees them (after a pass that
    captures, when graphed)."""
    from .benchmarks import random_tokens

    cache = model.new_cache(batch_size, context_len + new_tokens)
    tokens = random_tokens(model.config.vocab_size, batch_size, new_tokens, device, seed=1)

    def one_pass():
        cache.set_lengths(None, [context_len] * batch_size)
        model(tokens, cache, None, None)

    one_pass()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        one_pass()
        torch.cuda.synchronize()
    return sum(event.count for event in profiler.key_averages() if event.key in LAUNCHES)


def probe(pair, device: str, batch_size: int, k: int, context_len: int, new_tokens: int,
          cuda_graphs: bool = False) -> list[str]:
    generator = SpeculativeGenerator(pair.target, pair.draft, eos_token_ids=(), cuda_graphs=cuda_graphs)
    vocab = min(pair.target.config.vocab_size, pair.draft.config.vocab_size)
    prompts = torch.randint(vocab, (batch_size, context_len), generator=torch.Generator().manual_seed(0)).tolist()
    generator.generate(prompts, new_tokens, FixedK(k), synthetic_acceptance=0.8)  # warm-up: kernels, allocator
    both = BarrierAndEvents(device)
    generator.generate(prompts, new_tokens, FixedK(k), synthetic_acceptance=0.8, observer=both)
    recorder = StepRecorder(device)
    generator.generate(prompts, new_tokens, FixedK(k), synthetic_acceptance=0.8, observer=recorder)
    groups = defaultdict(list)
    for role, b, n, wall_ms, event_ms in both.rows:
        if b == batch_size:  # the full batch: the last steps run with fewer rows
            groups[(role, b, n)].append((wall_ms, event_ms))
    mode = "cuda-graphs" if cuda_graphs else "eager"
    lines = [f"[{mode}] b={batch_size} k={k} context {context_len}: per pass, median of its passes in the step loop"]
    for (role, b, n), values in sorted(groups.items()):
        wall = statistics.median(v[0] for v in values)
        event = statistics.median(v[1] for v in values)
        lines.append(f"  {role:6} b={b:<3} n={n:<2} wall {wall:8.3f} ms (barriers around it)   "
                     f"events {event:8.3f} ms   wall/events {wall / event:5.2f}   passes {len(values)}")
    steps = [s for s, r in zip(recorder.step_s, recorder.steps) if r.batch_size == batch_size]
    pass_ms = 1000.0 * sum(s for rows in recorder.passes.values() for *_, s in rows) / max(len(recorder.steps), 1)
    lines.append(f"  step (no barrier inside): wall {1000.0 * statistics.median(steps):.3f} ms median over "
                 f"{len(steps)} full-batch steps; passes' event time {pass_ms:.3f} ms a step on average")
    return lines


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True, help="preset, config.json or model directory")
    parser.add_argument("--draft", required=True)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--context-len", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--modes", default="eager,cuda-graphs", help="execution modes, side by side")
    parser.add_argument("--launches", action="store_true", help="count kernel launches per pass (CUDA, profiler)")
    args = parser.parse_args(argv)
    try:
        sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        parser.error(f"--batch-sizes {args.batch_sizes!r}: expected integers separated by commas")
    device = resolve_device(args.device)
    dtype = parse_dtype(args.dtype, device)
    target, draft = resolve_pair(args.target, args.draft)
    pair = load_pair(target, draft, device, dtype)
    print("\n".join(versions(device, dtype, pair)), flush=True)
    modes = [mode.strip() for mode in args.modes.split(",") if mode.strip()]
    if not modes or any(mode not in ("eager", "cuda-graphs") for mode in modes):
        parser.error(f"--modes {args.modes!r}: expected eager and/or cuda-graphs")
    with torch.inference_mode():
        for batch_size in sizes:
            for mode in modes:
                print("\n".join(probe(pair, device, batch_size, args.k, args.context_len, args.new_tokens,
                                      cuda_graphs=mode == "cuda-graphs")), flush=True)
        if args.launches and device.startswith("cuda"):
            from specbatch.runtime.cuda_graphs import GraphedModel

            for role, model in (("target", pair.target), ("draft", pair.draft)):
                for batch_size in sizes:
                    for n in sorted({1, args.k + 1}):
                        eager = launches_per_pass(model, batch_size, n, args.context_len, device)
                        graphed = launches_per_pass(GraphedModel(model), batch_size, n, args.context_len, device)
                        print(f"launches per pass: {role} b={batch_size} n={n}: eager {eager}, cuda-graphs "
                              f"{graphed}", flush=True)


if __name__ == "__main__":
    main()
