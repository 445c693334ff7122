"""Device synchronizations and kernel launches per speculative step, counted by intercepting torch calls.

    python -m specbatch.bench.step_ops [--batch-size 8] [--k 4] [--tree 0,1,2,0.0,0.1,1.0,0.0.0] [--steps 16]

Runs the demo pair (or --target/--draft) on the CPU and counts, between the start and the end of every
step, what each torch call would cost on a GPU:
- syncs: calls that make the host wait for the device: reading a tensor's values (`item`, `int()`,
  `bool()`, `tolist`, `numpy`; aten ops tagged data-dependent), and ops whose output shape depends on the
  data (`nonzero`, boolean indexing: the host must learn the size), and `multinomial`, which waits for the
  device twice on CUDA (it checks the distribution);
- launches: aten ops that compute (every op but views and bare allocations), a kernel each on a GPU;
- uploads: host-to-device copies of host-planned layouts (`runtime.kv_cache.upload`; queued without
  waiting on CUDA).
A barrier of the device clock (`runtime.clock.DeviceClock.now`, a synchronize on CUDA) counts as a sync
whatever the device.
Two configurations: as the CPU runs (small greedy trees keep their bookkeeping on the host, a read-back
per draft round, free on a CPU) and as CUDA runs (bookkeeping in tensors). Greedy and sampled (a seeded
generator) chains and trees, and a staged tree (the demo n-gram as second stage; it reads back once per
draft round: which slots to feed again), on random prompts.
"""
from __future__ import annotations

import argparse
import statistics
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ALLOCATIONS = {"empty", "empty_strided", "empty_like", "lift_fresh"}  # no kernel: memory only
BOOLEAN = (torch.bool, torch.uint8)
KNOWN_SYNCS = {"multinomial": 2}  # ops that wait for the device on CUDA without a tag saying so: waits per call


class OpCounter(TorchDispatchMode):
    """Counts syncs, launches and uploads into `counts` (a dict the caller resets between steps)."""

    def __init__(self):
        super().__init__()
        self.counts = {"syncs": 0, "launches": 0, "uploads": 0}
        self.sync_ops: dict[str, int] = {}

    def note_sync(self, name: str) -> None:
        self.counts["syncs"] += 1
        self.sync_ops[name] = self.sync_ops.get(name, 0) + 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        tags = set(func.tags)
        if name in KNOWN_SYNCS:
            for _ in range(KNOWN_SYNCS[name]):
                self.note_sync(name)
        elif torch.Tag.data_dependent_output in tags:
            self.note_sync(name)
        elif torch.Tag.dynamic_output_shape in tags:
            indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
            if name not in ("index", "index_put", "index_put_") or any(
                    isinstance(i, torch.Tensor) and i.dtype in BOOLEAN for i in indices):
                self.note_sync(name)
            else:
                self.counts["launches"] += 1
        elif not func.is_view and name not in ALLOCATIONS:
            self.counts["launches"] += 1
        result = func(*args, **kwargs)
        if func.is_view and _copied(result, args):
            self.counts["launches"] += 1  # a "view" op that had to copy (under inference mode, aten.reshape)
        return result


def _copied(result, args) -> bool:
    """Whether a view op's result is a copy: its storage is not its input's."""
    source = args[0] if args and isinstance(args[0], torch.Tensor) else None
    return (source is not None and isinstance(result, torch.Tensor)
            and result.untyped_storage().data_ptr() != source.untyped_storage().data_ptr())


@contextmanager
def counting(counter: OpCounter):
    """The counter active, and the host reads that do not go through the dispatcher counted too."""
    from specbatch.runtime import kv_cache
    from specbatch.runtime.clock import DeviceClock

    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy")}
    upload, barrier = kv_cache.upload, DeviceClock.now

    def counted_barrier(clock):
        counter.note_sync("synchronize")
        return barrier(clock)

    def reading(name):
        def read(tensor, *args, **kwargs):
            counter.note_sync(name)
            return originals[name](tensor, *args, **kwargs)
        return read

    def counted_upload(*args, **kwargs):
        counter.counts["uploads"] += 1
        return upload(*args, **kwargs)

    modules = [module for module in _runtime_modules() if getattr(module, "upload", None) is upload]
    try:
        for name in originals:
            setattr(torch.Tensor, name, reading(name))
        for module in modules:
            module.upload = counted_upload
        DeviceClock.now = counted_barrier
        with counter:
            yield counter
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        for module in modules:
            module.upload = upload
        DeviceClock.now = barrier


def _runtime_modules():
    from specbatch.runtime import attention, batch, engine, generator, kv_cache, model, tree_decoding

    return [attention, batch, engine, generator, kv_cache, model, tree_decoding]


class StepCounts:
    """A generation observer that cuts the counter's tallies at every step's start and end."""

    def __init__(self, counter: OpCounter):
        self.counter, self.steps = counter, []

    def run_pass(self, role, model, tokens, cache, attention=None, last=None):
        return model(tokens, cache, attention, last)

    def step_started(self) -> None:
        self.counter.counts.update(syncs=0, launches=0, uploads=0)

    def step_finished(self, record) -> None:
        self.steps.append((record.batch_size, dict(self.counter.counts)))


def count_steps(generator, prompts, policy, new_tokens: int, sampling=None, seed: int = 0) -> list[dict[str, int]]:
    """The counts of every full-batch step of one generation (greedy unless `sampling`, a runtime Sampling)."""
    from specbatch.runtime.sampling import Sampling

    counter = OpCounter()
    observer = StepCounts(counter)
    with counting(counter):
        generator.generate(prompts, new_tokens, policy, sampling or Sampling(), seed, observer=observer)
    return [counts for batch_size, counts in observer.steps if batch_size == len(prompts)]


def summary(steps: list[dict[str, int]]) -> dict[str, float]:
    return {name: statistics.median(step[name] for step in steps) for name in ("syncs", "launches", "uploads")}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--k", type=int, default=4, help="the chain's draft tokens per step")
    parser.add_argument("--tree", default="0,1,2,0.0,0.1,1.0,0.0.0", help="the tree (perfmodel.tree syntax)")
    parser.add_argument("--steps", type=int, default=16, help="steps generated (new tokens per row)")
    parser.add_argument("--target", default=None)
    parser.add_argument("--draft", default=None)
    args = parser.parse_args(argv)
    if args.batch_size < 1 or args.k < 1 or args.steps < 2:
        parser.error("need --batch-size >= 1, --k >= 1 and --steps >= 2")
    from specbatch.perfmodel.tree import Strategy, parse_tree
    from specbatch.runtime.assembly import DEMO_NGRAM, load_named_pair
    from specbatch.runtime.generator import SpeculativeGenerator
    from specbatch.runtime.ngram import NGramModel
    from specbatch.runtime.policy import FixedK, FixedStrategy
    from specbatch.runtime.sampling import Sampling

    torch.set_num_threads(1)
    pair = load_named_pair(args.target, args.draft, "cpu", None)
    generator_rng = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, pair.target.config.vocab_size, (16 + r,), generator=generator_rng).tolist()
               for r in range(args.batch_size)]
    tree = parse_tree(args.tree)
    sampled = Sampling(temperature=1.0)
    ngram = NGramModel.load(DEMO_NGRAM) if args.target is None and DEMO_NGRAM.is_file() else None
    rows = [("plain (k = 0)", FixedK(0), None, None), (f"chain k = {args.k}", FixedK(args.k), None, None),
            (f"tree {args.tree}", FixedStrategy(Strategy(tree)), None, None),
            (f"chain k = {args.k}, sampled", FixedK(args.k), sampled, None),
            (f"tree {args.tree}, sampled", FixedStrategy(Strategy(tree)), sampled, None)]
    if ngram is not None:
        rows.append((f"tree {args.tree} +ngram", FixedStrategy(Strategy(tree, stage2=True)), None, ngram))
    print(f"per step, median over full-batch steps; b = {args.batch_size}, {pair.target.config.model_type} pair on "
          "the CPU")
    print(f"{'strategy':<40} {'bookkeeping':<12} {'syncs':>6} {'launches':>9} {'uploads':>8}")
    for name, policy, sampling, stage2 in rows:
        for where, host in (("as on CPU", True), ("as on CUDA", False)):
            generator = SpeculativeGenerator(pair.target, pair.draft, host_bookkeeping=host, stage2=stage2)
            figures = summary(count_steps(generator, prompts, policy, args.steps, sampling, seed=1))
            print(f"{name:<40} {where:<12} {figures['syncs']:>6g} {figures['launches']:>9g} {figures['uploads']:>8g}")


if __name__ == "__main__":
    main()
