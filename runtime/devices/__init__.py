"""What differs between device kinds, in one place: one record per kind (`DeviceKind`) in its own module.

The model, attention and cache code is device-agnostic; where a device needs another path or a number fitted
on it, the code asks `device_kind(device)` and reads the record. Each record says where each fitted number
came from (`sources`). This is the only place in runtime/ that compares device types: a test greps for
others. The records are plain data and import no torch (runtime/__init__.py reads the CPU's before torch
loads); backend probing that needs torch lives in the kind's module, imported on use.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from specbatch.perfmodel.errors import UsageError


@dataclass(frozen=True)
class DeviceKind:
    """How the runtime runs on one kind of device. Counts are in tokens, keys or slots, as named."""

    name: str
    default_dtype: str  # when --dtype is auto
    asynchronous: bool  # work is queued: time it with events, stage uploads in pinned memory, never read back mid-step
    lazy_cache: bool  # KV caches start uninitialised; only the slots a padded pass reads are zeroed
    cache_zero_ahead_slots: int  # a lazy cache zeroes ahead in multiples of this many slots
    transposed_projections: bool  # linear weights stored (in, out)-contiguous (runtime.model.lay_out_for_matmul)
    prefill_pass_tokens: int | None  # a prefill runs in passes of whole rows of at most this many tokens; None: one
    host_bookkeeping_max_cells: int  # greedy tree steps of at most this many (row, node) cells keep their
    # drafting bookkeeping on the host, a read-back a round; 0: never
    # the sdpa backend (runtime.attention): a call over `rows` rows spanning `keys` keys costs
    # sdpa_call_keys + rows * (sdpa_row_keys + keys) row-keys; None: one call, every row padded to the longest
    sdpa_call_keys: int | None
    sdpa_row_keys: int | None
    slice_write_spans: int  # a pass writes the cache by slice copies when rows fall in at most this many spans of
    # one length each (else one scatter); 0: always the scatter, which a captured graph replays
    prefill_padding: float  # a fresh prefill's rows are padded together up to this factor over their own tokens
    alone_prefill_tokens: int | None  # ... and gathered into a padded batch only up to this length; None: always
    graphs_by_default: bool  # decode, draft and verify passes replay captured graphs unless --eager
    sources: Mapping[str, str] = field(default_factory=dict)  # fitted field -> where its value came from

    def __post_init__(self):
        fitted = {"cache_zero_ahead_slots", "prefill_pass_tokens", "host_bookkeeping_max_cells", "sdpa_call_keys",
                  "sdpa_row_keys", "slice_write_spans", "prefill_padding", "alone_prefill_tokens"}
        missing = sorted(fitted - set(self.sources))
        if missing:
            raise ValueError(f"device kind {self.name}: no source given for {', '.join(missing)}")


def _kinds() -> dict[str, DeviceKind]:
    from .cpu import CPU
    from .cuda import CUDA

    return {CPU.name: CPU, CUDA.name: CUDA}


KINDS: dict[str, DeviceKind] = _kinds()


def kind_name(device) -> str:
    """'cpu', 'cuda', ... of a torch.device, a device string ('cuda:1') or a tensor's device."""
    return getattr(device, "type", None) or str(device).partition(":")[0]


def device_kind(device) -> DeviceKind:
    """The record of `device`'s kind (a torch.device or a string); an unknown kind is a UsageError."""
    name = kind_name(device)
    found = KINDS.get(name)
    if found is None:
        raise UsageError(f"device {device!s}: specbatch runs on {', '.join(KINDS)}, not {name}")
    return found


def is_cpu(device) -> bool:
    return kind_name(device) == "cpu"


def attention_backend(device, dtype) -> str:
    """The attention backend a pass on `device` in `dtype` takes by default: flash varlen on CUDA in half
    precision where it is usable (runtime.devices.cuda), sdpa everywhere else."""
    if kind_name(device) != "cuda":
        return "sdpa"
    from .cuda import attention_backend as cuda_backend

    return cuda_backend(str(dtype) in ("torch.float16", "torch.bfloat16"), device)


def resolve_device(name: str | None) -> str:
    """'cpu', 'cuda' or 'cuda:N' as given, checked against this machine; None: cuda when available."""
    import torch

    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind, _, index = name.partition(":")
    if kind not in KINDS or (index and (kind == "cpu" or not index.isdigit())):
        raise UsageError(f"--device: {name!r} is not one of cpu, cuda, cuda:N")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {name}: CUDA is not available on this machine")
        if index and int(index) >= torch.cuda.device_count():
            raise UsageError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return name
