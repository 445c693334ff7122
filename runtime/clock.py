"""The one clock every timing in specbatch reads: seconds of `time.perf_counter`, taken after the device
has run what was queued on it (CUDA runs kernels asynchronously; without the barrier a clock measures
the launch, not the work). On the CPU it is `time.perf_counter` itself.
"""
from __future__ import annotations

import time

import torch


class DeviceClock:
    """`clock.now()` (or `clock()`): synchronize the device, then read `time.perf_counter`."""

    def __init__(self, device: torch.device | str = "cpu"):
        device = torch.device(device)
        self.device = device if device.type == "cuda" else None  # only CUDA queues work asynchronously

    def now(self) -> float:
        if self.device is not None:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    __call__ = now  # a `calibrate.timing.Clock`: any callable returning seconds
