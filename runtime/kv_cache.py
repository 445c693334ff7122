"""The KV cache: one preallocated slot per row, with each row's length on the device and on the host.

Layout `[layers, slots, max_len, kv_heads, head_dim]`: a layer's slot is one contiguous run of tokens, what
flash varlen reads and what a CPU pass views without a copy. Lengths live on the device (`lengths`: a pass
computes positions and writes from them, never waiting for the host) and on the host (`host_lengths`: a
pass plans its attention from them, never reading the device); `set_lengths`/`advance` keep them equal, and
views (`rows`) share both with their parent. Where the device's record says `lazy_cache` (the CPU) the cache
starts uninitialised and `clean` counts each row's leading finite slots: a pass that reads beyond them
zeroes first (a masked key still meets its zero weight, and 0 x NaN is NaN). docs/runtime.md has more.
"""
from __future__ import annotations

import numpy as np
import torch

from .config import ModelConfig
from .devices import device_kind


class KVCache:
    """Preallocated keys and values with one length per row."""

    def __init__(self, config: ModelConfig, batch_size: int, max_len: int, device, dtype):
        shape = (config.num_layers, batch_size, max_len, config.num_kv_heads, config.head_dim)
        kind = device_kind(device)
        lazy = kind.lazy_cache
        self.zero_ahead_slots = kind.cache_zero_ahead_slots
        self.keys = (torch.empty if lazy else torch.zeros)(shape, device=device, dtype=dtype)
        self.values = (torch.empty if lazy else torch.zeros)(shape, device=device, dtype=dtype)
        self._lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.host_lengths = np.zeros(batch_size, dtype=np.int64)
        self.clean = np.full(batch_size, 0 if lazy else max_len, dtype=np.int64)  # leading finite slots per row
        self.max_len = max_len
        self.root, self.start = self, 0  # the cache this one is a view of, and its first row there

    @property
    def batch_size(self) -> int:
        return self.keys.shape[1]

    @property
    def device(self) -> torch.device:
        return self.keys.device

    # ------------------------------------------------------------------ lengths
    @property
    def lengths(self) -> torch.Tensor:
        """Each row's cached tokens (b,), on the device. Assigning a tensor copies it in place and reads it
        back to the host mirror (tests and calibration; the generator uses `set_lengths`)."""
        return self._lengths

    @lengths.setter
    def lengths(self, value: torch.Tensor) -> None:
        self.set_lengths(value, torch.as_tensor(value).tolist())

    def set_lengths(self, device_lengths: torch.Tensor | None, host_lengths) -> None:
        """Set every row's length: on the device from `device_lengths` (None: upload `host_lengths`), on the
        host from `host_lengths`; both in place, so views and their parent stay one cache."""
        host = np.asarray(host_lengths, dtype=np.int64).reshape(self.batch_size)
        if device_lengths is None:
            device_lengths = upload(host, self.device)
        self._lengths.copy_(device_lengths)
        self.host_lengths[:] = host
        self.readable_to(0, self.batch_size, host)  # a no-op unless the lengths pass what was written

    def advance(self, n: int) -> None:
        """Every row grew by n tokens (a pass of n tokens per row)."""
        self._lengths.add_(n)
        self.host_lengths += n
        self.written(self.host_lengths)  # the pass wrote its n tokens per row before advancing

    # ------------------------------------------------------------------ finite slots
    def written(self, ends: np.ndarray) -> None:
        """Every row's slots up to `ends` (one per row) now hold what a pass wrote."""
        np.maximum(self.clean, ends, out=self.clean)

    def readable_to(self, start: int, end: int, key_len) -> None:
        """Rows start..end-1 are about to be read up to `key_len` slots (one count, or one per row): zero
        whatever of that is not clean yet (and ahead of it, to a multiple of the device's zero-ahead slots)."""
        clean = self.clean[start:end]
        needed = np.broadcast_to(np.asarray(key_len, dtype=np.int64), clean.shape)
        if (needed <= clean).all():
            return
        low = int(clean.min())
        ahead = max(1, self.zero_ahead_slots)
        high = min(self.max_len, -(-int(needed.max()) // ahead) * ahead)
        stale = torch.from_numpy(np.arange(low, high)[None, :] >= clean[:, None])  # (rows, slots) to zero
        stale = stale.to(self.device)[None, :, :, None, None]
        for tensor in (self.keys, self.values):
            tensor[:, start:end, low:high].masked_fill_(stale, 0)
        np.maximum(clean, high, out=clean)

    def longest(self) -> int:
        """The longest row's cached tokens, from the host mirror (no device read)."""
        return int(self.host_lengths.max()) if self.batch_size else 0

    # ------------------------------------------------------------------ rows
    def rows(self, start: int, count: int) -> KVCache:
        """Rows start..start+count-1 as a cache of their own sharing this one's keys, values and both
        lengths (a pass through the view writes here; no copy)."""
        view = KVCache.__new__(KVCache)
        view.keys, view.values = self.keys.narrow(1, start, count), self.values.narrow(1, start, count)
        view._lengths = self._lengths.narrow(0, start, count)
        view.host_lengths = self.host_lengths[start:start + count]
        view.clean = self.clean[start:start + count]
        view.max_len, view.zero_ahead_slots = self.max_len, self.zero_ahead_slots
        view.root, view.start = self.root, self.start + start
        return view

    def move_row(self, source: int, destination: int) -> None:
        """Copy row `source` onto `destination`: its live entries only (the host knows how many)."""
        live = int(self.host_lengths[source])
        self.keys[:, destination, :live] = self.keys[:, source, :live]
        self.values[:, destination, :live] = self.values[:, source, :live]
        self._lengths[destination] = self._lengths[source]
        self.host_lengths[destination] = self.host_lengths[source]
        self.clean[destination] = max(self.clean[destination], live)


def upload(values, device, dtype=torch.long) -> torch.Tensor:
    """Host values (a list or numpy array) as a tensor on `device`. On a device that queues work (CUDA) the
    copy is staged in pinned memory and queued without waiting (a pageable copy would synchronize the stream)."""
    tensor = torch.tensor(np.asarray(values), dtype=dtype)  # a copy: the host array may change later
    if not device_kind(device).asynchronous:
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
