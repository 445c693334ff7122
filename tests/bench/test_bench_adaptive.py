"""bench with the adaptive policy and the two-population workloads (mixed, switch).

Oracles: the workload's own definition (which population each row of each round comes from), counted
on the prompts the generator really got; the run records' own timings (decision time within step time).
"""
from __future__ import annotations

import json

import pytest

from specbatch.bench.config import BenchConfig, BenchError
from specbatch.bench.harness import run_bench
from specbatch.bench.policies import ADAPTIVE_POLICY, policy_family
from specbatch.bench.workload import Workload
from specbatch.perfmodel.fit import fit_profile
from specbatch.perfmodel.model import save_model
from specbatch.perfmodel.profile import profile_from_json
from perfmodel_fixtures import CPU_MODELS, build_profile, cpu_like_latency

A = tuple((1, 2, i) for i in range(10))  # population A: prompts starting 1, 2
B = tuple((7, 7, 7, i) for i in range(10))  # population B: prompts starting 7, 7, 7


def population(prompt) -> str:
    return "A" if list(prompt[:2]) == [1, 2] else "B"


def test_mixed_puts_half_of_each_population_in_every_batch():
    workload = Workload("mixed", A, B)
    for b in (2, 4, 8):
        for slot in range(4):
            rows = [population(p) for p in workload.batch(b, slot, 1, 3)]
            assert rows.count("A") == rows.count("B") == b // 2
    assert [population(workload.batch(1, slot, 1, 4)[0]) for slot in range(4)] == ["A", "B", "A", "B"]


def test_switch_changes_population_half_way_through_the_timed_rounds():
    workload = Workload("switch", A, B)
    # one warm-up round, then 4 timed rounds: warm-up and the first 2 from A, the last 2 from B
    assert [{population(p) for p in workload.batch(3, slot, 1, 4)} for slot in range(5)] == \
        [{"A"}, {"A"}, {"A"}, {"B"}, {"B"}]
    assert Workload("heldout", A).prompts == [list(p) for p in A]


def test_workload_options_are_checked():
    with pytest.raises(BenchError, match="--workload 'bursty'"):
        BenchConfig(workload="bursty")
    with pytest.raises(BenchError, match="--second-prompts"):
        BenchConfig(second_prompts_path="x.jsonl")


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    """A fitted model of a CPU-like machine (the pair's fingerprints are absent: any pair may use it)."""
    profile = build_profile(cpu_like_latency, models=CPU_MODELS, batch_sizes=(1, 2, 4), context_lens=(64, 256),
                            max_k=4, acceptance=[0.8, 0.7, 0.7, 0.6], device_kind="cpu")
    path = tmp_path_factory.mktemp("model") / "model.json"
    save_model(path, fit_profile(profile_from_json(profile, "profile")))
    return path


def test_bench_runs_adaptive_beside_the_table_on_a_mixed_workload(tiny_pair, table_path, model_file, tmp_path):
    config = BenchConfig(batch_sizes=(2,), ks=(1, 2), max_new_tokens=6, rounds=2, warmup_rounds=1,
                         synthetic_acceptance=0.7, table_path=table_path, adaptive_path=model_file, workload="mixed")
    seen = []
    result = run_bench(config, tiny_pair, Workload("mixed", A, B), on_run=lambda record, *_: seen.append(record))
    batch = result.batches[0]
    assert [p.policy for p in batch.policies] == ["k=0", "k=1", "k=2", "table", ADAPTIVE_POLICY]
    adaptive = batch.policy(ADAPTIVE_POLICY)
    assert adaptive.rounds == 2 and adaptive.strategy == "adaptive" and policy_family(ADAPTIVE_POLICY) == "adaptive"
    runs = [r for r in result.runs if r.policy == ADAPTIVE_POLICY]
    assert len(runs) == 3 and all(0 < r.decision_seconds < r.step_seconds for r in runs)
    from specbatch.bench.outputs import bench_json

    doc = json.loads(json.dumps(bench_json(result)))
    assert doc["config"]["workload"] == "mixed" and doc["config"]["adaptive"] == str(model_file)
    assert all("decision_seconds" in run for run in doc["runs"])
    # adaptive against the table and the best fixed k, paired per round (bench.regret.paired_ratio)
    found = doc["batch_sizes"][0]["adaptive"]
    steady = {name: {r.round: r.steady_tokens_per_s for r in result.runs if r.policy == name and not r.warmup}
              for name in (ADAPTIVE_POLICY, "table")}
    a, t = steady[ADAPTIVE_POLICY], steady["table"]
    expected = (a[0] / t[0] * a[1] / t[1]) ** 0.5
    assert found["vs_table"]["ratio"] == pytest.approx(expected) and found["vs_table"]["rounds"] == 2
    low, high = found["vs_table"]["ci95"]
    assert low <= found["vs_table"]["ratio"] <= high
    assert found["vs_best_fixed"]["against"] == f"k={batch.best_k}"
    shares = sorted(r.decision_seconds / r.step_seconds for r in runs if not r.warmup)
    assert found["decision_share"]["max"] == pytest.approx(shares[-1])


def test_paired_ratio_is_the_geometric_mean_of_the_rounds_ratios_and_switch_splits_it_by_phase():
    from types import SimpleNamespace

    from specbatch.bench.regret import add_adaptive_comparison, paired_ratio

    assert paired_ratio({0: 2.0, 1: 8.0, 5: 1.0}, {0: 1.0, 1: 2.0}) == \
        {"rounds": 2, "ratio": pytest.approx(8 ** 0.5), "ci95": [pytest.approx(2.0), pytest.approx(4.0)]}
    assert paired_ratio({0: 1.0}, {1: 1.0}) is None
    run = lambda r, policy, rate: SimpleNamespace(batch_size=4, round=r, policy=policy, warmup=False,  # noqa: E731
                                                  steady_tokens_per_s=rate, wall_tokens_per_s=rate,
                                                  decision_seconds=0.01 * (r + 1), step_seconds=1.0)
    runs = [run(r, "adaptive", a) for r, a in enumerate((110, 120, 90, 80))] + \
        [run(r, "table", 100) for r in range(4)] + [run(r, "k=0", 50) for r in range(4)]
    batch = SimpleNamespace(batch_size=4, best_k=0, adaptive=None)
    add_adaptive_comparison([batch], runs, "adaptive", "table", {0: "k=0"}, first_phase_rounds=2)
    assert batch.adaptive["vs_table_by_phase"]["first"]["ratio"] == pytest.approx((1.1 * 1.2) ** 0.5)
    assert batch.adaptive["vs_table_by_phase"]["second"]["ratio"] == pytest.approx((0.9 * 0.8) ** 0.5)
    assert batch.adaptive["vs_best_fixed"]["ratio"] == pytest.approx((2.2 * 2.4 * 1.8 * 1.6) ** 0.25)
    assert batch.adaptive["decision_share"] == {"median": pytest.approx(0.025), "max": pytest.approx(0.04)}
