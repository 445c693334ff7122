"""The one clock every timing in specbatch reads.

Two kinds of reading, one interface on every device:

- `mark()` / `elapsed_s(start, end)`: the time of work queued on the device between two marks. On CUDA a
  mark is a `torch.cuda.Event(enable_timing=True)` recorded on the current stream, so a timed region
  adds no synchronization and no device->host read: the stream runs on as it would untimed, and the
  figure is read back later, once the caller's own readback (the step's accept counts, the end of a
  point) has waited for the work anyway. On the CPU a mark is `time.perf_counter()`, as before.
- `now()`: `time.perf_counter()` once the device has run everything queued (a barrier on CUDA), for the
  wall time of whole runs; `host_s()` (and calling the clock) reads `time.perf_counter()` with no
  barrier: budgets, and host-only work such as the n-gram's table look-ups.

An event times the device's stream: gaps where the GPU waited for the host to launch the next kernel are
inside it (they are the pass's cost too), host work that launches nothing is not.
"""
from __future__ import annotations

import time
from typing import Union

import torch

from .devices import device_kind

Mark = Union[float, "torch.cuda.Event"]  # perf_counter seconds on the CPU, a recorded event on CUDA


class DeviceClock:
    """`mark()` and `elapsed_s()` time device work without syncs; `now()` is a barrier, then the time."""

    def __init__(self, device: torch.device | str = "cpu"):
        device = torch.device(device)
        self.device = device if device_kind(device).asynchronous else None  # a device that queues work

    @property
    def uses_events(self) -> bool:
        return self.device is not None

    def mark(self) -> Mark:
        """A point on the device's timeline: an event recorded on the current stream (CUDA), or now (CPU)."""
        if self.device is None:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def elapsed_s(self, start: Mark, end: Mark) -> float:
        """Seconds between two marks. On CUDA this reads the events back: call it after a readback that
        waited for `end` (then it waits for nothing); otherwise it waits for `end` here, outside the region."""
        if self.device is None:
            return end - start
        end.synchronize()  # a no-op once the caller's own readback has passed `end`
        return start.elapsed_time(end) / 1000.0

    def now(self) -> float:
        """`time.perf_counter()` after everything queued on the device has run (whole runs, not regions)."""
        if self.device is not None:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @staticmethod
    def host_s() -> float:
        """`time.perf_counter()`, no barrier: budgets and host-only work."""
        return time.perf_counter()

    __call__ = host_s  # a `calibrate.timing.Clock` (budgets, intervals): any callable returning seconds
