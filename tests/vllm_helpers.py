"""Shared by the tests that run vLLM (its CPU build in its own environment, bench/vllm/setup.sh) and those that
check what is handed to it: where it lives, whether it can run here, and a table of given k."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from specbatch.perfmodel.table import Bucket, Table, TableEntry

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "bench" / "vllm" / "run.sh"
TARGET, DRAFT = ROOT / "data" / "models" / "demo-target", ROOT / "data" / "models" / "demo-draft"


def vllm_importable() -> bool:
    probe = subprocess.run(["bash", str(RUN), "-c", "import importlib.util, sys; "
                            "sys.exit(importlib.util.find_spec('vllm') is None)"], capture_output=True)
    return probe.returncode == 0


def needs_vllm() -> list:
    """The marks of a test module that runs vLLM: slow, and skipped where vLLM cannot be imported (CI)."""
    return [pytest.mark.slow,
            pytest.mark.skipif(not vllm_importable(), reason="vLLM is not importable: bash bench/vllm/setup.sh")]


def table_of(ks: list[int], context_len: int = 128) -> Table:
    """A chain table of the demo pair with k = ks[b - 1] at batch sizes 1..len(ks)."""
    entries = tuple(TableEntry(b, k, 100.0 * b, 1.5, None, None) for b, k in enumerate(ks, start=1))
    return Table(str(TARGET), str(DRAFT), "cpu", "2026-11-30T01:00:00Z", max(ks), {}, (Bucket(context_len, entries),))
