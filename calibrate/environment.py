"""The device being calibrated: which one, how much memory it has free, and its metadata."""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch

from specbatch.perfmodel.profile import DeviceInfo

from .errors import CalibrationError

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
REPO_ROOT = Path(__file__).resolve().parent.parent


def resolve_device(name: str | None) -> str:
    """'cpu', 'cuda' or 'cuda:N'; default: cuda when available."""
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    kind, _, index = name.partition(":")
    if kind not in ("cpu", "cuda") or (index and (kind == "cpu" or not index.isdigit())):
        raise CalibrationError(f"--device: {name!r} is not one of cpu, cuda, cuda:N")
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise CalibrationError("--device cuda: CUDA is not available on this machine")
        if index and int(index) >= torch.cuda.device_count():
            raise CalibrationError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return name


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES[dtype]


def _meminfo_bytes(field: str) -> int | None:
    """A field of /proc/meminfo ('MemAvailable', 'MemTotal') in bytes; None where there is none."""
    try:
        with open("/proc/meminfo") as file:
            for line in file:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024  # the kernel reports kB
    except OSError:
        pass
    return None


def available_memory_bytes(device: str) -> int:
    """Memory a calibration may use now: free CUDA memory, or the RAM the kernel could hand out."""
    if device.startswith("cuda"):
        free_bytes, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free_bytes)
    available = _meminfo_bytes("MemAvailable")
    if available is None:  # not Linux: free pages, which undercounts reclaimable cache
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(available)


def total_memory_bytes(device: str) -> int:
    if device.startswith("cuda"):
        return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)
    total = _meminfo_bytes("MemTotal")
    return int(total if total is not None else os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def device_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    try:
        with open("/proc/cpuinfo") as file:
            for line in file:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def git_revision() -> str | None:
    """The commit of this checkout, '+dirty' when files differ from it; None outside a git checkout."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "") if head else None


def device_info(device: str, dtype: torch.dtype) -> DeviceInfo:
    return DeviceInfo(kind="cuda" if device.startswith("cuda") else "cpu", name=device_name(device),
                      memory_bytes=total_memory_bytes(device), dtype=dtype_name(dtype),
                      torch_version=torch.__version__, cpu_threads=torch.get_num_threads(),
                      git_revision=git_revision())


def synchronizer(device: str):
    """The barrier to put around timed regions: CUDA runs kernels asynchronously, the CPU does not."""
    return torch.cuda.synchronize if device.startswith("cuda") else None
