"""What the device script (calibrate/gpu_reference.sh) asks of a device before calibrating on it: torch's
and CUDA's versions, the attention kernel torch picks for each model's shapes, and one step's passes timed
two ways: wall time around a pass with a barrier on each side (what a harness that synchronizes measures)
and the device's own time between two events (what calibrate records: runtime.clock). A second generation
with calibrate's step recorder gives the steps' wall time with nothing synchronized inside them. Every
step figure comes for each execution mode asked for (`--modes eager,cuda-graphs`, in one run); then each
model's isolated passes (b of --batch-sizes, n = 1 and k + 1) eager and graphed side by side, with the kernel
launches a pass makes, counted by torch's profiler on CUDA (a replayed graph is one launch).

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
PASS_SAMPLES = 21


def launches_of(run, device: str) -> int | None:
    """Kernel (and graph) launches `run()` makes, as torch's profiler sees the CUDA runtime's calls; None off
    CUDA."""
    if not device.startswith("cuda"):
        return None
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        run()
        torch.cuda.synchronize()
    return sum(event.count for event in profiler.key_averages() if event.key in LAUNCHES)


def pass_line(role: str, model, batch_size: int, new_tokens: int, context_len: int, device: str) -> str:
    """One isolated pass of `model` over (batch_size, new_tokens) on `context_len` cached tokens, eager and
    graphed side by side, as calibrate times it (calibrate.benchmarks: events around the pass; graphed at
    b's bucket, captured before the samples): median event ms and launches per pass."""
    from specbatch.runtime.cuda_graphs import GraphedModel, bucket_for

    from .benchmarks import forward_sampler, random_tokens

    tokens = random_tokens(model.config.vocab_size, batch_size, new_tokens, device, seed=1)
    last = 1 if role == "draft" else None
    figures = []
    for graphed in (False, True):
        runner = GraphedModel(model) if graphed else model
        rows = bucket_for(batch_size, 10**9) if graphed else batch_size
        cache = runner.new_cache(rows, context_len + new_tokens).rows(0, batch_size)
        sample = forward_sampler(runner, cache, tokens, context_len, DeviceClock(device), last)
        sample()  # warm-up (and the capture)
        median = statistics.median(sample() for _ in range(PASS_SAMPLES))
        launches = launches_of(sample, device)
        figures.append(f"{median:8.3f} ms" + ("" if launches is None else f" {launches:4d} launches"))
        del cache, sample, runner
    return (f"  pass {role:6} b={batch_size:<3} n={new_tokens:<2} L={context_len}: eager {figures[0]}   "
            f"cuda-graphs {figures[1]}")


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
        print(f"isolated passes, median event time of {PASS_SAMPLES} (and launches a pass, CUDA):", flush=True)
        for role, model in (("target", pair.target), ("draft", pair.draft)):
            for batch_size in sizes:
                for n in sorted({1, args.k + 1}):
                    print(pass_line(role, model, batch_size, n, args.context_len, device), flush=True)

if __name__ == "__main__":
    main()
