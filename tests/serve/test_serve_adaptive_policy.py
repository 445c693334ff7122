"""The load test's adaptive policy: what each server is started with (the flags are the oracle)."""
from __future__ import annotations

import pytest

from specbatch.serve.loadtest import LoadtestError, server_command_args


def test_each_policy_gets_its_own_flags_and_only_the_table_its_table():
    shared = ("--max-batch-size", "8", "--table", "t.json", "--threads", "1")
    assert server_command_args(shared, "table") == list(shared)
    assert server_command_args(shared, "adaptive=m.json") == ["--max-batch-size", "8", "--threads", "1",
                                                              "--adaptive", "m.json"]
    fixed = server_command_args(shared, "k=0")
    assert fixed[-2:] == ["--k", "0"] and "--table" not in fixed
    with pytest.raises(LoadtestError, match="adaptive=MODEL.json"):
        server_command_args(shared, "bandit")
