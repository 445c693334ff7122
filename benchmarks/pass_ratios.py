"""Does a slow spell of this machine slow a narrow and a wide pass alike?

    OMP_NUM_THREADS=1 python benchmarks/pass_ratios.py --seconds 60
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

WINDOW_S = 2.0
REFERENCE = ("target", 1, 1, 128)  # (role, b, n, L): calibrate's default reference pass
OTHERS = (("target", 32, 5, 256), ("target", 8, 3, 128), ("draft", 1, 1, 128), ("draft", 16, 1, 256))


def sampler(models: dict, shape: tuple[str, int, int, int]):
    from specbatch.calibrate.benchmarks import forward_sampler, random_tokens
    from specbatch.runtime.clock import DeviceClock

    role, b, n, L = shape
    model = models[role]
    cache = model.new_cache(b, L + n)
    return forward_sampler(model, cache, random_tokens(model.config.vocab_size, b, n, "cpu", seed=7), L,
                           DeviceClock("cpu"))


def name(shape: tuple[str, int, int, int]) -> str:
    role, b, n, L = shape
    return f"{role} b={b} n={n} L={L}"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog=f"Interleaves calibrate's reference pass ({name(REFERENCE)}, the one bench and calibrate check "
               "the machine with) with a few other passes of the demo pair, 3 samples each in turn, and "
               f"summarizes them in {WINDOW_S:g} s windows: the reference's spread over windows (max / min) is "
               "what a slow spell does; the spread of each pass's ratio to it is what rescaling by the "
               "reference would leave. Random tokens, CPU.")
    parser.add_argument("--seconds", type=float, default=60.0, help="how long the passes are timed")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.threads < 1:
        parser.error(f"--seconds must be > 0 and --threads >= 1, got {args.seconds:g} and {args.threads}")
    import torch  # after the options: --help and a bad option answer at once

    from specbatch.runtime.assembly import load_named_pair

    torch.set_num_threads(args.threads)
    pair = load_named_pair(None, None, "cpu", None)
    models = {"target": pair.target, "draft": pair.draft}
    reference, others = sampler(models, REFERENCE), {shape: sampler(models, shape) for shape in OTHERS}
    for sample in (reference, *others.values()):
        for _ in range(3):
            sample()  # warm-up
    windows: dict[int, list[tuple[float, tuple, float]]] = defaultdict(list)
    started = time.perf_counter()
    while time.perf_counter() - started < args.seconds:
        window = int((time.perf_counter() - started) / WINDOW_S)
        reference_ms = statistics.median(reference() for _ in range(3))
        for shape, sample in others.items():
            windows[window].append((reference_ms, shape, statistics.median(sample() for _ in range(3))))
    ref_by_window = [statistics.median(r for r, _, _ in rows) for rows in windows.values()]
    spread = max(ref_by_window) / min(ref_by_window)
    print(f"{len(windows)} windows of {WINDOW_S:g} s; reference {name(REFERENCE)}: median "
          f"{statistics.median(ref_by_window):.2f} ms, max / min over windows {spread:.2f}")
    for shape in OTHERS:
        ratios = [statistics.median(ms / r for r, s, ms in rows if s == shape) for rows in windows.values()]
        print(f"{name(shape)} / reference: median {statistics.median(ratios):.3f}, "
              f"max / min over windows {max(ratios) / min(ratios):.2f}")


if __name__ == "__main__":
    main()
