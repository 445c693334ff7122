"""The hindsight arithmetic of a bench run against hand-made timings: medians, best k, regret, speedup,
peer ratios, the chain / tree / staged comparison; and the pure helpers (rotation, prompt cycling,
policy names)."""
from __future__ import annotations

import pytest

from specbatch.bench.plan import balanced_order
from specbatch.bench.workload import cycled_prompts
from specbatch.bench.policies import HF_GREEDY, TABLE_POLICY, bench_policies
from specbatch.bench.results import RunRecord, summarize_batch, summarize_policy


def test_balanced_order_and_prompt_cycling_helpers():
    from collections import Counter

    for n in range(1, 9):
        items = [chr(ord("a") + i) for i in range(n)]
        rounds = 2 * n if n % 2 else n  # an odd n needs the reversed rows too
        orders = [balanced_order(items, r) for r in range(rounds)]
        for position in range(n):  # every policy equally often in every position
            assert Counter(order[position] for order in orders) == Counter(items * (rounds // n))
        pairs = Counter((x, y) for order in orders for x, y in zip(order, order[1:]))
        if n > 1:  # every ordered pair, x run just before y, equally often
            assert len(pairs) == n * (n - 1) and len(set(pairs.values())) == 1
    assert balanced_order(["a", "b", "c"], -1) == balanced_order(["a", "b", "c"], 5)  # warm-up: the last row
    assert cycled_prompts([[1], [2]], 5) == [[1], [2], [1], [2], [1]]
    assert cycled_prompts([[1], [2], [3]], 2, offset=2) == [[3], [1]]  # the next round takes the next prompts


# ---------------------------------------------------------------------------------------------- arithmetic
def _records(policy: str, wall_tokens_per_s: list[float], k: int | None = None) -> list[RunRecord]:
    """Hand-made timings: 100 tokens in 100 / rate seconds per round."""
    return [RunRecord(batch_size=4, round=i, policy=policy, generated_tokens=100, seconds=100 / rate, steps=10,
                      full_batch_steps=10, k_counts_full_batch={k: 10} if k is not None else {})
            for i, rate in enumerate(wall_tokens_per_s)]


def test_best_k_regret_and_speedup_from_medians():
    policies = [summarize_policy("k=0", 0, _records("k=0", [100, 110, 90])),
                summarize_policy("k=1", 1, _records("k=1", [150, 140, 160])),
                summarize_policy("k=2", 2, _records("k=2", [150, 120, 300])),  # median 150: ties k=1
                summarize_policy(TABLE_POLICY, 2, _records(TABLE_POLICY, [135, 135, 135], k=2))]
    batch = summarize_batch(4, 64, policies, (0, 1, 2), has_peers=False)
    assert batch.best_k == 1  # ties go to the smaller k
    assert batch.best_tokens_per_s == pytest.approx(150)
    assert batch.table_regret == pytest.approx(0.1)  # 1 - 135 / 150
    assert batch.table_speedup == pytest.approx(1.35)  # 135 / 100
    assert policies[2].p10_wall_tokens_per_s == pytest.approx(126)
    assert policies[2].max_wall_tokens_per_s == pytest.approx(300)


def test_peer_ratios_compare_medians():
    policies = [summarize_policy("k=0", 0, _records("k=0", [100])),
                summarize_policy("k=1", 1, _records("k=1", [150])),
                summarize_policy(HF_GREEDY, None, _records(HF_GREEDY, [50]))]
    batch = summarize_batch(4, 64, policies, (0, 1), has_peers=True)
    assert [(r.ours, r.theirs, r.ratio) for r in batch.peer_ratios] == [("k=0", HF_GREEDY, 2.0),
                                                                       ("k=1", HF_GREEDY, 3.0)]


def test_comparison_picks_the_best_of_each_family():
    def summary(name, rates, k):
        return summarize_policy(name, k, _records(name, rates))

    policies = [summary("k=0", [100, 100, 100], 0), summary("k=1", [150, 160, 140], 1),
                summary("k=2", [170, 170, 170], 2), summary("tree:0,1,0.0", [180, 180, 180], 2),
                summary("tree:0,1,2,0.0", [220, 230, 210], 2), summary("k=2+ngram", [190, 190, 190], 2),
                summary("tree:0,1,0.0+ngram", [255, 255, 255], 2), summary("tree:0,1,2,0.0+ngram", [240, 250, 260], 2),
                summary(TABLE_POLICY, [400, 400, 400], 2)]  # the table has its own regret: never compared here
    comparison = summarize_batch(1, 64, policies, (0, 1, 2), has_peers=False).strategy_comparison
    assert comparison["best_chain"]["policy"] == "k=2"
    assert comparison["best_chain"]["vs_plain"] == pytest.approx(1.7)
    assert comparison["best_chain"]["vs_best_chain"] == 1.0
    assert comparison["best_tree"]["policy"] == "tree:0,1,2,0.0"
    assert comparison["best_tree"]["steady_tokens_per_s"] == pytest.approx(220)
    assert comparison["best_tree"]["vs_best_chain"] == pytest.approx(220 / 170)
    # ranked by median: 255 beats the other staged tree's 250 (despite its p90 of 260) and the staged chain's 190
    assert comparison["best_staged"]["policy"] == "tree:0,1,0.0+ngram"
    assert comparison["best_staged"]["vs_plain"] == pytest.approx(2.55)
    assert comparison["best_staged"]["vs_best_chain"] == pytest.approx(255 / 170)


def test_comparison_ties_go_to_the_policy_run_first():
    policies = [summarize_policy(name, k, _records(name, [rate])) for name, k, rate in
                [("k=0", 0, 100), ("k=1", 1, 120), ("tree:0,1", 1, 130), ("tree:0,1,2", 1, 130)]]
    comparison = summarize_batch(1, 64, policies, (0, 1), has_peers=False).strategy_comparison
    assert comparison["best_tree"]["policy"] == "tree:0,1" and comparison["best_staged"] is None


def test_long_tree_specs_give_short_unique_names():
    from specbatch.perfmodel.tree import parse_tree

    wide = ",".join(str(r) for r in range(16))  # 37 characters: one more path passes the 40 of a name
    first, second = parse_tree(wide + ",0.0"), parse_tree(wide + ",1.0")
    names = list(bench_policies((0,), trees=[first, second, first], stage2=True))
    assert names == ["k=0", f"tree:{wide},...(17 nodes)", f"tree:{wide},...(17 nodes) #2",
                     f"tree:{wide},...(17 nodes)+ngram", f"tree:{wide},...(17 nodes) #2+ngram"]
