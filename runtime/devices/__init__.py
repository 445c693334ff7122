"""What differs between device kinds, in one place: one record per kind (`DeviceKind`) in its own module.

The model, attention and cache code is device-agnostic; where a device needs another path or a number fitted
on it, the code asks `device_kind(device)` and reads the record. Each record says where each fitted number
came from (`sources`). This is the only place in runtime/ that compares device types: a test greps for
others. The records are plain data and import no torch (runtime/__init__.py reads the CPU's before torch
loads); backend probing that needs torch lives in the kind's module, imported on use.
"""
from __future__ import annotations

from specbatch.perfmodel.errors import UsageError

from .kind import DeviceKind


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


def host_bookkeeping_by_default(device) -> bool:
    """Whether tree steps keep their drafting bookkeeping (and a second stage's guesses) on the host, a
    read-back per draft round: where the record allows any (the CPU, where reading back is free), never on
    CUDA (runtime.generator's default; calibration times the second stage's queries where they run)."""
    return device_kind(device).host_bookkeeping_max_cells > 0


HALF_PRECISION = ("float16", "bfloat16")  # what the flash varlen kernel takes, so what a graph can capture


def graphs_by_default(device, dtype) -> bool:
    """Whether passes replay CUDA graphs unless told otherwise (`--eager`): on CUDA in half precision they are
    how the runtime runs (a pass otherwise waits on the host's kernel launches). A float32 pass takes sdpa,
    which no graph captures (runtime.cuda_graphs), so it runs eager and a profile says so; elsewhere there
    are none. `dtype`: a torch dtype or its name ('bfloat16', as a profile records it)."""
    return device_kind(device).graphs_by_default and str(dtype).removeprefix("torch.") in HALF_PRECISION


def capturing_graph(device) -> bool:
    """Whether a CUDA graph is being captured on the current stream of `device` (never on other kinds)."""
    if kind_name(device) != "cuda":
        return False
    import torch

    return torch.cuda.is_current_stream_capturing()


def why_layers_unfused(device) -> str | None:
    """Why cache passes on `device` run the eager layer rather than the fused kernels (runtime.fused), or None:
    the record says whether to fuse, and the kind's module whether its compiler toolchain is there."""
    kind = device_kind(device)
    if not kind.fused_layers:
        return f"{kind.name} runs the eager layer (its record: fused_layers off)"
    from importlib import import_module

    return import_module(f"{__package__}.{kind.name}").why_no_compiler()


def execution_on(device, dtype, cuda_graphs: bool | None = None) -> str:
    """How passes run on `device` (a device or its kind) in `dtype`, as a profile records it
    (perfmodel.execution): 'cuda-graphs' or 'eager'; `cuda_graphs` None: the default (graphs_by_default).
    Torch-free: fit and table ask it."""
    graphs = graphs_by_default(device, dtype) if cuda_graphs is None else cuda_graphs
    return "cuda-graphs" if graphs else "eager"


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


def synchronize(device) -> None:
    """Wait for the work queued on `device` (a no-op where work is not queued)."""
    if device_kind(device).asynchronous:
        import torch

        torch.cuda.synchronize(device)
