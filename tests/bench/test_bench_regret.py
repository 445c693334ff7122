"""The paired regret and its bootstrap interval on constructed round data (hand-computed figures)."""
import math

import pytest

from bench.regret import paired_regret, rates_by_round
from bench.results import RunRecord


def test_pairing_removes_a_shared_slowdown():
    # the machine's speed swings 100 -> 150 -> 80 between rounds; within a round the table is 2 % slower
    fixed = {"k=2": {0: 100.0, 1: 150.0, 2: 80.0}}
    table = {r: 0.98 * rate for r, rate in fixed["k=2"].items()}
    found = paired_regret(table, fixed, "k=2")
    assert found.regret == pytest.approx(0.02)
    assert (found.low, found.high) == (pytest.approx(0.02), pytest.approx(0.02))  # every resample: 0.98
    assert found.verdict == "met" and found.rounds == 3


def test_an_interval_that_straddles_the_goal_is_not_resolved():
    ratios = [0.90, 1.00, 1.05, 0.99]
    fixed = {"k=3": {r: 100.0 for r in range(4)}, "k=1": {r: 50.0 for r in range(4)}}
    table = {r: 100.0 * ratio for r, ratio in enumerate(ratios)}
    found = paired_regret(table, fixed, "k=3")
    assert found.regret == pytest.approx(1 - math.exp(sum(map(math.log, ratios)) / 4))  # 0.01652
    # a resample is 4 of the ratios: its regret lies between all-1.05 (-5 %) and all-0.90 (+10 %)
    assert -0.05 <= found.low < 0.03 < found.high <= 0.10
    assert found.verdict == "not resolved"
    assert found.per_k["k=1"] == pytest.approx(1 - math.exp(sum(math.log(2 * x) for x in ratios) / 4))


def test_a_regret_above_the_goal_in_every_resample_is_missed():
    table = {0: 90.0, 1: 92.0, 2: 90.0}
    found = paired_regret(table, {"k=4": {0: 100.0, 1: 100.0, 2: 100.0}}, "k=4")
    assert 0.08 - 1e-12 <= found.low <= found.regret <= found.high <= 0.10 + 1e-12
    assert found.verdict == "missed"
    assert paired_regret(table, {"k=4": {5: 1.0}}, "k=4") is None  # no common round


def test_rates_by_round_prefer_the_steady_state_and_skip_warmups():
    runs = [RunRecord(2, -1, "table", 10, 1.0, steady_tokens_per_s=99.0),
            RunRecord(2, 0, "table", 10, 1.0, steady_tokens_per_s=20.0),
            RunRecord(2, 1, "table", 10, 2.0),
            RunRecord(4, 0, "table", 10, 1.0)]
    assert rates_by_round(runs, 2, "table") == {0: 20.0, 1: 5.0}
