"""The scripts of benchmarks/ import each other by file name (they run as `python benchmarks/x.py`, with
benchmarks/ first on sys.path): the tests import them the same way."""
from __future__ import annotations

import sys
from pathlib import Path

BENCHMARKS = str(Path(__file__).resolve().parents[2] / "benchmarks")
if BENCHMARKS not in sys.path:
    sys.path.insert(0, BENCHMARKS)
