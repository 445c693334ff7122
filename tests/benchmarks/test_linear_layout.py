"""benchmarks/linear_layout.py, the timing behind runtime/model.py's transposed projections: it answers for
every projection shape of the demo pair and refuses a bad token count in one line."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "linear_layout.py"


def test_linear_layout_benchmark_reports_every_projection_shape():
    result = subprocess.run([sys.executable, str(SCRIPT), "--tokens", "1",
                             "--rounds", "1"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines()[2:]]
    # the demo target's four projection shapes and the draft's four, one token count each
    assert len(rows) == 8 and all(float(row[-1]) > 0 for row in rows)
    bad = subprocess.run([sys.executable, str(SCRIPT), "--tokens", "0"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--tokens" in bad.stderr
