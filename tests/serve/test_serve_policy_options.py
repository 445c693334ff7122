"""`serve`'s policy options are refused in one line before anything loads (the messages are the oracle)."""
from __future__ import annotations

from pathlib import Path

import pytest

from specbatch.serve.server import ServeError, ServeOptions, choose_policy

TARGET = Path(__file__).resolve().parents[2] / "data" / "models" / "demo-target"


@pytest.mark.parametrize("options, message", [
    (ServeOptions(k=2, table=Path("t.json")), "mutually exclusive"),
    (ServeOptions(k=-1), "--k must be >= 0"),
])
def test_policy_options_are_refused_in_one_line(options, message):
    with pytest.raises(ServeError, match=message) as refused:
        choose_policy(options, TARGET, None, "cpu", 1)
    assert "\n" not in str(refused.value)
