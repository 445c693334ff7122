"""Does this machine's CPU change speed by itself, and do its cores change together?

    python benchmarks/cpu_spells.py --seconds 60
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import time

import numpy as np

WINDOW_S = 0.5
SLOW = 1.2  # a window this much slower than the core's fastest counts as slow


def _time_core(core: int, seconds: float, queue) -> None:
    import torch

    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    a = torch.randn(64, 64)
    samples, end = [], time.time() + seconds
    while time.time() < end:
        started = time.perf_counter()
        for _ in range(20):
            torch.mm(a, a)
        samples.append((time.time(), (time.perf_counter() - started) * 1e3))
    queue.put((core, samples))


def window_medians(samples: list[tuple[float, float]], start: float, stop: float) -> np.ndarray:
    """Median sample (ms) of every WINDOW_S window from `start` to `stop` (NaN where a window is empty)."""
    times, values = np.array(samples).T
    edges = np.arange(start, stop, WINDOW_S)
    index = np.digitize(times, edges)
    return np.array([np.median(values[index == i]) if np.any(index == i) else np.nan for i in range(1, len(edges))])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="One process per core (pinned, one torch thread each) times the same small matrix products back "
               "to back; each core's samples are summarized in 0.5 s windows: its fastest window, the share of "
               "windows over 1.2x slower, and the correlation of the two cores' windows (near 1: the machine "
               "slows as a whole; near 0: each core on its own). Linux only (CPU affinity).")
    parser.add_argument("--seconds", type=float, default=60.0, help="how long each core is timed")
    args = parser.parse_args(argv)
    if args.seconds <= 2 * WINDOW_S:
        parser.error(f"--seconds must be more than {2 * WINDOW_S:g} (two windows), got {args.seconds:g}")
    cores = sorted(os.sched_getaffinity(0))[:2]
    queue = multiprocessing.get_context("spawn").Queue()
    workers = [multiprocessing.get_context("spawn").Process(target=_time_core, args=(core, args.seconds, queue))
               for core in cores]
    for worker in workers:
        worker.start()
    results = dict(queue.get() for _ in workers)
    for worker in workers:
        worker.join()
    start = max(samples[0][0] for samples in results.values())
    stop = min(samples[-1][0] for samples in results.values())
    medians = {core: window_medians(samples, start, stop) for core, samples in results.items()}
    for core, values in medians.items():
        fastest = np.nanmin(values)
        slow = values[values > SLOW * fastest]
        print(f"core {core}: fastest window {fastest:.3f} ms, median window {np.nanmedian(values):.3f} ms, "
              f"{np.nanmean(values > SLOW * fastest):.0%} of {len(values)} windows over {SLOW:g}x slower"
              + (f" (their median {np.median(slow) / fastest:.2f}x the fastest)" if len(slow) else ""))
    if len(medians) == 2:
        a, b = medians.values()
        both = ~np.isnan(a) & ~np.isnan(b)
        r = np.corrcoef(a[both], b[both])[0, 1]
        print(f"correlation of the two cores' {WINDOW_S:g} s window medians: r = {r:+.2f}")


if __name__ == "__main__":
    main()
