"""The paired regret and its bootstrap interval on constructed round data (hand-computed figures)."""
import math

import pytest

from specbatch.bench.regret import paired_regret, rates_by_round
from specbatch.bench.results import RunRecord


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


def _record(round_index: int, policy: str, rate: float) -> RunRecord:
    # one second per run: tokens/s == rate; steady_tokens_per_s is what regret and ranking use
    return RunRecord(batch_size=4, round=round_index, policy=policy, generated_tokens=int(rate), seconds=1.0,
                     steady_tokens_per_s=rate)


def _straddling_rounds() -> list[RunRecord]:
    """5 rounds where the table / k=4 ratio swings 0.90-1.05: the interval straddles 3 %."""
    runs = []
    for r, ratio in enumerate([0.90, 1.00, 1.05, 0.99, 0.95]):
        runs += [_record(r, "k=0", 60.0), _record(r, "k=4", 100.0), _record(r, "table", 100.0 * ratio)]
    return runs


def test_extra_paired_rounds_run_until_the_regret_is_resolved():
    from specbatch.bench.config import BenchConfig
    from specbatch.bench.regret import resolve_regret

    runs, pairs = _straddling_rounds(), []

    def run_pair(round_index, names):  # a machine where the table now equals k=4 exactly
        pairs.append((round_index, tuple(names)))
        runs.extend(_record(round_index, name, 100.0) for name in names)

    notes = resolve_regret(4, runs, BenchConfig(rounds=5, resolve_rounds=30), (0, 4), run_pair)
    assert pairs and all(names == ("table", "k=4") for _, names in pairs)
    assert [r for r, _ in pairs] == list(range(5, 5 + len(pairs)))  # numbered after the regular rounds
    assert len(pairs) < 30 and "settled the paired regret: met" in notes[0]
    found = paired_regret(rates_by_round(runs, 4, "table"), {"k=4": rates_by_round(runs, 4, "k=4")}, "k=4")
    assert found.verdict == "met" and found.settled and found.rounds == 5 + len(pairs)


def test_extra_paired_rounds_stop_at_the_cap_and_say_so():
    from specbatch.bench.config import BenchConfig
    from specbatch.bench.regret import resolve_regret

    runs, calls = _straddling_rounds(), []

    def run_pair(round_index, names):  # the swing goes on: never resolved
        calls.append(round_index)
        ratio = (0.90, 1.05)[round_index % 2]
        runs.extend([_record(round_index, "table", 100.0 * ratio), _record(round_index, "k=4", 100.0)])

    notes = resolve_regret(4, runs, BenchConfig(rounds=5, resolve_rounds=3), (0, 4), run_pair)
    assert calls == [5, 6, 7] and "still not resolved after 3 extra paired rounds" in notes[0]
    assert "straddles the 3 % goal" in notes[0]

    # a batch size's own cap (the harness's, above b = 8) stops it sooner, never later than --resolve-rounds
    runs, calls = _straddling_rounds(), []
    notes = resolve_regret(4, runs, BenchConfig(rounds=5, resolve_rounds=30), (0, 4), run_pair, max_extra=2)
    assert calls == [5, 6] and "still not resolved after 2 extra paired rounds" in notes[0]
    runs, calls = _straddling_rounds(), []
    resolve_regret(4, runs, BenchConfig(rounds=5, resolve_rounds=1), (0, 4), run_pair, max_extra=15)
    assert calls == [5]


def test_no_extra_rounds_when_the_regret_is_already_resolved():
    from specbatch.bench.config import BenchConfig
    from specbatch.bench.regret import resolve_regret

    runs = []
    for r in range(5):
        runs += [_record(r, "k=0", 60.0), _record(r, "k=4", 100.0), _record(r, "table", 99.0)]
    assert resolve_regret(4, runs, BenchConfig(rounds=5), (0, 4), lambda *_: pytest.fail("ran a round")) == []


def test_a_verdict_from_a_wide_interval_is_not_settled_and_gets_extra_rounds():
    from specbatch.bench.config import BenchConfig
    from specbatch.bench.regret import resolve_regret

    # the table 8-20 % behind k=4 in every round: "missed", but the interval is wider than ±3 %
    runs = []
    for r, ratio in enumerate([0.80, 0.92, 0.85, 0.90, 0.82]):
        runs += [_record(r, "k=4", 100.0), _record(r, "table", 100.0 * ratio)]
    first = paired_regret(rates_by_round(runs, 4, "table"), {"k=4": rates_by_round(runs, 4, "k=4")}, "k=4")
    assert first.verdict == "missed" and not first.settled and (first.high - first.low) / 2 > 0.03
    calls = []

    def run_pair(round_index, names):  # the machine settles: the table is 10 % behind in every round
        calls.append(round_index)
        runs.extend([_record(round_index, "table", 90.0), _record(round_index, "k=4", 100.0)])

    notes = resolve_regret(4, runs, BenchConfig(rounds=5, resolve_rounds=30), (4,), run_pair)
    assert 0 < len(calls) < 30 and "settled the paired regret: missed" in notes[0]

    stuck = [r for r in runs if r.round < 5]
    notes = resolve_regret(4, stuck, BenchConfig(rounds=5, resolve_rounds=2), (4,),
                           lambda r, names: stuck.extend([_record(r, "table", 80.0), _record(r, "k=4", 100.0)]))
    assert notes[0].startswith("b = 4: missed, but after 2 extra paired rounds the 95 % interval")
