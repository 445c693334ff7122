"""Root of the test tree: torch-free, so `pytest tests/perfmodel` runs where torch is not installed.

Tests mirror the packages (perfmodel/, calibrate/, runtime/, bench/, cli/); each torch-using folder's
conftest.py brings the tiny-model fixtures of `torch_fixtures.py`. Shared helper modules live here
(`perfmodel_fixtures.py`, `cli_helpers.py`) and are importable from every folder.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# An explicit thread count (torch's own default, shared among pytest-xdist's workers: two workers on two cores get
# a thread each, never four threads on two cores): the CLI's busy-machine choice of one thread
# (console/options.set_threads) would otherwise depend on what else runs beside the tests.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // WORKERS)))

# This folder first: its shared helper modules. The repository root stays off sys.path: the code is imported
# as the installed package `specbatch` only, so a bare `import runtime` fails here as it fails installed.
ROOT = Path(__file__).resolve().parent.parent
HERE = str(Path(__file__).resolve().parent)
for path in (HERE, str(ROOT)):
    while path in sys.path:
        sys.path.remove(path)
sys.path.insert(0, HERE)

import specbatch.runtime  # noqa: E402,F401 - bounds OpenMP's spinning before any test imports torch (runtime/__init__.py)
