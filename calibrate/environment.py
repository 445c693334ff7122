"""The device being calibrated, described: name, memory (total and free now), metadata for the profile, the
attention kernel torch picks for our shapes, and the GPU's clocks, power and temperature through NVML.
Which device a name means is `runtime.loading.resolve_device`'s."""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

import torch

from specbatch.perfmodel.profile import DeviceInfo
from specbatch.perfmodel.profile.device_state import DeviceReading


DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
REPO_ROOT = Path(__file__).resolve().parent.parent  # the package directory: the repository root in a checkout


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
    """The commit of the checkout this package runs from, '+dirty' when files differ from it; None for an
    installed package (no .git beside it, even when its site-packages sits inside some other checkout)."""
    if not (REPO_ROOT / ".git").exists():
        return None
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


def attention_kernel(device: str, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> str:
    """The attention kernel the runtime's cached passes run on `device` (runtime.attention): VARLEN where its
    varlen backend runs (CUDA, half precision: no mask, no scores materialized); elsewhere the
    scaled-dot-product-attention kernel torch chooses for a boolean mask over the keys (grouped-query when
    kv_heads < heads): FLASH_ATTENTION, EFFICIENT_ATTENTION, CUDNN_ATTENTION or MATH (which materializes the
    scores). The choice depends on the device, dtype, head counts and head size, not on the lengths, so tiny
    tensors ask it."""
    from torch.nn.attention import SDPBackend

    from specbatch.runtime.devices import attention_backend

    if attention_backend(device, dtype) == "varlen":
        return "VARLEN"
    query = torch.zeros(1, heads, 2, head_dim, device=device, dtype=dtype)  # (b, heads, n, hd)
    keys = torch.zeros(1, kv_heads, 8, head_dim, device=device, dtype=dtype)  # (b, kv_heads, key_len, hd)
    mask = torch.ones(1, 1, 2, 8, device=device, dtype=torch.bool)
    choice = torch._fused_sdp_choice(query, keys, keys, attn_mask=mask, enable_gqa=kv_heads != heads)
    return SDPBackend(choice).name


# NVML's clock-event reason bits (nvmlClocksEventReason*), named as the profile records them
CLOCK_EVENT_REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
                       0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
                       0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting"}


class NvmlReader:
    """Clocks, power and temperature of one GPU through NVML (`nvml`: the `pynvml` module of the
    `nvidia-ml-py` package, the optional `gpu` extra). Every reading is None where NVML refuses it."""

    def __init__(self, nvml, index: int):
        nvml.nvmlInit()
        self.nvml, self.handle = nvml, nvml.nvmlDeviceGetHandleByIndex(index)

    def _ask(self, name: str, *args):
        try:
            return getattr(self.nvml, name)(self.handle, *args)
        except (self.nvml.NVMLError, AttributeError):
            return None

    def reading(self, elapsed_s: float) -> DeviceReading | None:
        sm = self._ask("nvmlDeviceGetClockInfo", self.nvml.NVML_CLOCK_SM)
        memory = self._ask("nvmlDeviceGetClockInfo", self.nvml.NVML_CLOCK_MEM)
        power_mw = self._ask("nvmlDeviceGetPowerUsage")
        temperature = self._ask("nvmlDeviceGetTemperature", self.nvml.NVML_TEMPERATURE_GPU)
        if None in (sm, memory, power_mw, temperature):
            return None
        reasons = self._ask("nvmlDeviceGetCurrentClocksEventReasons")
        if reasons is None:  # drivers before the rename
            reasons = self._ask("nvmlDeviceGetCurrentClocksThrottleReasons") or 0
        names = tuple(name for bit, name in CLOCK_EVENT_REASONS.items() if reasons & bit)
        return DeviceReading(round(elapsed_s, 3), int(sm), int(memory), round(power_mw / 1000.0, 1), int(temperature),
                             names)

    def max_sm_clock_mhz(self) -> int | None:
        value = self._ask("nvmlDeviceGetMaxClockInfo", self.nvml.NVML_CLOCK_SM)
        return None if value is None else int(value)

    def power_limit_w(self) -> float | None:
        value = self._ask("nvmlDeviceGetEnforcedPowerLimit")
        return None if value is None else round(value / 1000.0, 1)

    def close(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError:
            pass


def open_nvml(device: str) -> NvmlReader | None:
    """A reader for `device` when it is a CUDA device and NVML answers; None otherwise (no `nvidia-ml-py`,
    no driver, a CPU): the profile then has no clocks, and nothing else changes."""
    if not device.startswith("cuda"):
        return None
    try:
        import pynvml
    except ImportError:
        return None
    try:  # NVML numbers the GPUs of the machine; CUDA those of CUDA_VISIBLE_DEVICES
        index = torch.cuda._get_nvml_device_index(torch.device(device))
    except (RuntimeError, ValueError, AttributeError, OSError):
        index = torch.device(device).index or 0
    try:
        return NvmlReader(pynvml, index)
    except pynvml.NVMLError:
        return None
