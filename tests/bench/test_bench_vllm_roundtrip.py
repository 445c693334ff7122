"""The round trip's bookkeeping without vLLM: a generation's decode-phase goodput, the best fixed K in hindsight,
each schedule's paired regret against it and the check that vLLM looked up the table's k (constructed runs;
tests/bench/test_bench_vllm_calibrate.py runs it in vLLM)."""
from __future__ import annotations

import math

import pytest

from specbatch.bench.vllm.roundtrip import Run, decode_rate, summarize
from vllm_helpers import table_of


def test_decode_phase_goodput_leaves_prefill_and_each_row_s_first_token_out():
    answer = {"token_ids": [[1] * 64] * 8, "wall_s": 2.0, "steps": [
        {"wall_s": 0.4, "prefill": True}] + [{"wall_s": 0.05, "prefill": False}] * 20}
    decode, wall = decode_rate(answer, 8)
    assert decode == pytest.approx(8 * 63 / 1.0) and wall == pytest.approx(8 * 64 / 2.0)


def test_regret_is_paired_against_the_best_fixed_k_in_hindsight():
    rounds = range(4)
    speed = {"K=0": 100.0, "K=1": 150.0, "K=2": 160.0}  # K=2 best in hindsight
    runs = []
    for r in rounds:
        machine = 1.0 + 0.3 * r  # the machine's speed moves between rounds: pairing cancels it
        runs += [Run(8, r, name, rate * machine, rate, []) for name, rate in speed.items()]
        runs += [Run(8, r, "vllm-costs", 152.0 * machine, 0.0, [[8, 2], [7, 2]]),
                 Run(8, r, "ours-costs", 120.0 * machine, 0.0, [[8, 4]])]
    runs.append(Run(8, -1, "vllm-costs", 1.0, 0.0, []))  # the warm-up round counts for nothing
    tables = {"vllm-costs": table_of([4, 3, 3, 3, 2, 2, 2, 2]), "ours-costs": table_of([4] * 8)}
    result = summarize(8, runs, ["vllm-costs", "ours-costs", "K=0", "K=1", "K=2"], tables)
    assert result.best_fixed == "K=2"
    assert result.regret["vllm-costs"]["regret"] == pytest.approx(1 - 152 / 160)
    assert result.regret["ours-costs"]["regret"] == pytest.approx(1 - 120 / 160)
    assert result.regret["vllm-costs"]["ci95"] == pytest.approx([1 - 152 / 160] * 2)  # identical ratios every round
    assert result.regret["vllm-costs"]["per_k"]["K=0"] == pytest.approx(1 - 152 / 100)
    assert result.schedule_k == {"vllm-costs": 2, "ours-costs": 4}
    assert result.lookup_mismatches == {"vllm-costs": [], "ours-costs": []}
    assert math.isclose(result.median_tokens_per_s["K=2"], 160.0 * (1 + 0.3 * 1.5))


def test_a_lookup_that_is_not_the_table_s_k_is_reported():
    runs = [Run(4, r, name, 100.0, 100.0, [[4, 3], [3, 1]] if name == "vllm-costs" else []) for r in range(2)
            for name in ("vllm-costs", "ours-costs", "K=1")]
    tables = {"vllm-costs": table_of([2, 2, 2, 3]), "ours-costs": table_of([1])}
    result = summarize(4, runs, ["vllm-costs", "ours-costs", "K=1"], tables)
    assert result.lookup_mismatches["vllm-costs"] == [[3, 1, 2], [3, 1, 2]]  # b = 3 looked up 1, the table says 2
    assert result.schedule_k["ours-costs"] == 1  # past the table's last entry: its edge, as vLLM carries it on
