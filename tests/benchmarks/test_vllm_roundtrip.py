"""The round trip's bookkeeping without vLLM: a generation's decode-phase goodput, which fixed K go on to the paired
phase, the best fixed K in hindsight, each schedule's paired regret against it and the check that vLLM looked up
the table's k (constructed runs; tests/bench/test_bench_vllm_calibrate.py runs it in vLLM)."""
from __future__ import annotations

import pytest

from vllm_roundtrip import Run, decode_rate, paired_contenders, summarize
from vllm_helpers import table_of


def test_steady_state_goodput_is_the_full_batch_steps_with_spikes_bounded():
    prefill = [{"wall_s": 0.4, "prefill": True, "requests": 8, "generated": 8}]
    full = [{"wall_s": 0.05, "prefill": False, "requests": 8, "generated": 24}] * 18 + [
        {"wall_s": 0.20, "prefill": False, "requests": 8, "generated": 24}]  # a spike: counted as 1.5 x 0.05
    tail = [{"wall_s": 0.02, "prefill": False, "requests": 3, "generated": 9}] * 4  # the batch thinning: left out
    answer = {"token_ids": [[1] * 64] * 8, "wall_s": 2.0, "steps": prefill + full + tail}
    steady, decode, wall = decode_rate(answer, 8)
    assert steady == pytest.approx(19 * 24 / (18 * 0.05 + 0.075))
    assert decode == pytest.approx(8 * 63 / (18 * 0.05 + 0.20 + 4 * 0.02)) and wall == pytest.approx(8 * 64 / 2.0)


def test_the_screening_s_two_best_fixed_k_go_on_with_the_schedules():
    screening = {"vllm-costs": 1.0, "ours-costs": 2.0, "K=0": 90.0, "K=1": 95.0, "K=2": 99.0, "K=3": 97.0}
    assert paired_contenders(screening) == ["vllm-costs", "ours-costs", "K=2", "K=3"]


def runs_of(rates: dict[str, float], phase: str, rounds: int, lookups=None) -> list[Run]:
    runs = []
    for r in range(rounds):
        machine = 1.0 + 0.3 * r  # the machine's speed moves between rounds: pairing cancels it
        runs += [Run(8, r, name, phase, rate * machine, rate, rate, (lookups or {}).get(name, []))
                 for name, rate in rates.items()]
    return runs


def test_regret_is_paired_against_the_best_fixed_k_of_the_paired_rounds():
    screening = runs_of({"vllm-costs": 150.0, "ours-costs": 120.0, "K=0": 100.0, "K=1": 150.0, "K=2": 160.0,
                         "K=3": 158.0}, "screening", 3) + [Run(8, -1, "K=0", "screening", 1.0, 1.0, 1.0, [])]
    # paired: K=3 turns out the faster of the two the screening ranked best
    paired = runs_of({"vllm-costs": 152.0, "ours-costs": 120.0, "K=2": 158.0, "K=3": 160.0}, "paired", 4,
                     {"vllm-costs": [[8, 2], [7, 2]], "ours-costs": [[8, 4]]})
    tables = {"vllm-costs": table_of([4, 3, 3, 3, 2, 2, 2, 2]), "ours-costs": table_of([4] * 8)}
    result = summarize(8, screening + paired, tables)
    assert result.screening_tokens_per_s["K=2"] == pytest.approx(160.0 * 1.3)  # the median round's
    assert result.screening_tokens_per_s["K=0"] == pytest.approx(100.0 * 1.3)  # the warm-up is not counted
    assert set(result.median_tokens_per_s) == {"vllm-costs", "ours-costs", "K=2", "K=3"}
    assert result.best_fixed == "K=3"
    assert result.regret["vllm-costs"]["regret"] == pytest.approx(1 - 152 / 160)
    assert result.regret["ours-costs"]["regret"] == pytest.approx(1 - 120 / 160)
    assert result.regret["vllm-costs"]["ci95"] == pytest.approx([1 - 152 / 160] * 2)  # identical ratios every round
    assert result.regret["vllm-costs"]["per_k"] == pytest.approx({"K=2": 1 - 152 / 158, "K=3": 1 - 152 / 160})
    assert result.schedule_k == {"vllm-costs": 2, "ours-costs": 4}
    assert result.lookup_mismatches == {"vllm-costs": [], "ours-costs": []}


def test_a_lookup_that_is_not_the_table_s_k_is_reported():
    runs = runs_of({"vllm-costs": 100.0, "ours-costs": 100.0, "K=1": 100.0}, "paired", 2,
                   {"vllm-costs": [[4, 3], [3, 1]]})
    tables = {"vllm-costs": table_of([2, 2, 2, 3]), "ours-costs": table_of([1])}
    result = summarize(4, [Run(4, r.round, r.contender, r.phase, 1.0, 1.0, 1.0, r.k_per_step) for r in runs], tables)
    assert result.lookup_mismatches["vllm-costs"] == [[3, 1, 2], [3, 1, 2]]  # b = 3 looked up 1, the table says 2
    assert result.schedule_k["ours-costs"] == 1  # past the table's last entry: its edge, as vLLM carries it on


def test_steps_after_a_lockstep_switch_are_left_out_of_the_steady_state_only():
    steps = [{"wall_s": 0.09 if i % 8 == 0 else 0.05, "prefill": False, "requests": 4, "generated": 12,
              "after_switch": i % 8 == 0} for i in range(16)]
    steady, decode, _ = decode_rate({"token_ids": [[1] * 49] * 4, "wall_s": 1.0, "steps": steps}, 4)
    assert steady == pytest.approx(14 * 12 / (14 * 0.05))  # the two cold steps are not the engine's steady state
    assert decode == pytest.approx(4 * 48 / (2 * 0.09 + 14 * 0.05))  # the decode phase keeps every step


class FakeWorker:
    """A run of `length` engine steps (the first a prefill, then decode steps); logs who stepped when."""

    def __init__(self, name: str, log: list, length: int):
        self.name, self.log, self.length = name, log, length

    def start(self, batch, max_new_tokens, schedule, cap):
        self.done, self.steps = 0, []

    def step(self):
        self.done += 1
        self.log.append(self.name)
        record = {"wall_s": 0.01, "prefill": self.done == 1, "requests": 2, "generated": 2}
        self.steps.append(record)
        return {"step": record, "done": self.done == self.length}

    def finish(self):
        return {"token_ids": [[1] * self.length] * 2, "steps": self.steps, "k_per_step": []}


class FakeEngines:
    def __init__(self, lengths: dict[int, int], log: list):
        self.workers = {i: FakeWorker(f"spec{i}", log, n) for i, n in lengths.items() if i >= 0}
        self.plain = FakeWorker("none", log, lengths[-1])

    def spec(self, index):
        return self.workers[index]

    def none(self):
        return self.plain


def test_lockstep_advances_each_contender_a_block_at_a_time_and_marks_each_block_s_first_step():
    from vllm_roundtrip import lockstep

    log: list[str] = []
    engines = FakeEngines({0: 10, 1: 6, -1: 7}, log)
    answers = lockstep(engines, ["vllm-costs", "K=2", "K=0"], {}, [[1], [2]], 8, 0, block_steps=4)
    # turns of up to 4 steps each (runs of 10, 6 and 7 steps), the order reversed every other turn, a finished
    # contender dropping out: turn 0 spec0 spec1 none, turn 1 none (3, done) spec1 (2, done) spec0, turn 2 spec0
    assert log == ["spec0"] * 4 + ["spec1"] * 4 + ["none"] * 4 + ["none"] * 3 + ["spec1"] * 2 + ["spec0"] * 6
    for answer in answers.values():
        marked = [i for i, step in enumerate(answer["steps"]) if step.get("after_switch")]
        assert marked == list(range(0, len(answer["steps"]), 4))
        assert answer["wall_s"] == pytest.approx(0.01 * len(answer["steps"]))
