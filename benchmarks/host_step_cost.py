"""What the host does per speculative step when the passes replay CUDA graphs, measured on a CPU.

    OMP_NUM_THREADS=1 python benchmarks/host_step_cost.py [--batch-sizes 1,64] [--ks 0,4] [--new-tokens 32]

With graphs, a pass's kernels run on the GPU from one replay call; what stays on the host is Python and the
small ops between passes (picking tokens, comparing, committing): if the host took longer than the GPU's
passes, the GPU would wait for it, and capturing more of the step (the draft's k passes as one graph) would
pay. This runs the demo pair's generator as on CUDA (CUDA's device record: bookkeeping in tensors, graphs
on), with every graph replay replaced by what a replay does to the host's state (the cache lengths it
advances), and reports per full-batch step the host's wall time and the ops it issues (each a kernel
launch on a GPU, counted by bench.step_ops). On a GPU each launch costs the host a few microseconds more
than a tiny CPU op does: read the ops column with that in mind. Compare with the GPU's pass times from
`calibrate/gpu_reference.sh` (probe.txt).
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace


def graphs_replayed_as_host_state() -> None:
    """Graphs whose replay only advances the cache lengths (the device side a real replay leaves for the
    host), eligible on any backend; the CPU runs by CUDA's record, synchronously."""
    from specbatch.runtime import cuda_graphs, devices

    def capture(run, reset, cache, pool):
        reset()
        before = cache.host_lengths.copy()
        output = run()  # the pass once, for its output's shape; the capture puts the lengths back after
        advanced = int((cache.host_lengths - before).max())

        def replay():
            cache.lengths.add_(advanced)

        return replay, output, None

    cuda_graphs.capture_cuda_graph = capture
    cuda_graphs.GraphedModel.eligible = (lambda self, cache, tree, new_tokens: cache is not None and tree is None
                                         and new_tokens is None and cache.start == 0)
    devices.KINDS["cpu"] = replace(devices.KINDS["cuda"], name="cpu", asynchronous=False)


class StepTimes:
    """A generation observer: each step's host wall time and its batch size."""

    def __init__(self):
        self.steps: list[tuple[int, float]] = []

    def run_pass(self, role, model, tokens, cache, attention=None, last=None):
        return model(tokens, cache, attention, last)

    def step_started(self) -> None:
        self.started_s = time.perf_counter()

    def step_finished(self, record) -> None:
        self.steps.append((record.batch_size, time.perf_counter() - self.started_s))


def measure(generator, batch_size: int, k: int, new_tokens: int) -> tuple[float, float]:
    """(median host ms a full-batch step, median ops issued a step) of one generation after a warm-up."""
    from specbatch.bench.step_ops import OpCounter, StepCounts, counting
    from specbatch.runtime.policy import FixedK
    from specbatch.runtime.sampling import Sampling

    prompts = [[1 + (row + i) % 50 for i in range(8)] for row in range(batch_size)]
    generator.generate(prompts, new_tokens, FixedK(k), Sampling(), 0)  # captures, warms the pools
    times = StepTimes()
    generator.generate(prompts, new_tokens, FixedK(k), Sampling(), 0, observer=times)
    counter = OpCounter()
    counts = StepCounts(counter)
    with counting(counter):
        generator.generate(prompts, new_tokens, FixedK(k), Sampling(), 0, observer=counts)
    host_ms = statistics.median(1e3 * s for b, s in times.steps if b == batch_size)
    ops = statistics.median(c["launches"] for b, c in counts.steps if b == batch_size)
    return host_ms, ops


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", default="1,64")
    parser.add_argument("--ks", default="0,4", help="chain lengths (0: plain decoding)")
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args(argv)
    try:
        batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
        ks = [int(k) for k in args.ks.split(",")]
    except ValueError:
        parser.error("--batch-sizes and --ks take comma lists of integers")
    if min(batch_sizes) < 1 or min(ks) < 0 or args.new_tokens < 2:
        parser.error("need batch sizes >= 1, ks >= 0 and --new-tokens >= 2")
    import torch

    from specbatch.runtime.assembly import load_named_pair
    from specbatch.runtime.generator import SpeculativeGenerator

    graphs_replayed_as_host_state()
    pair = load_named_pair(None, None, "cpu", "float32")
    generator = SpeculativeGenerator(pair.target, pair.draft, cuda_graphs=True)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s); demo pair, greedy, "
          f"{args.new_tokens} new tokens a row; replays stubbed (GPU work not run)")
    print(f"{'b':>4} {'k':>3} {'host ms a step':>15} {'ops issued a step':>18}")
    for batch_size in batch_sizes:
        for k in ks:
            host_ms, ops = measure(generator, batch_size, k, args.new_tokens)
            print(f"{batch_size:>4} {k:>3} {host_ms:>15.3f} {ops:>18.0f}")


if __name__ == "__main__":
    main()
