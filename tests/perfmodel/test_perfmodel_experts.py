"""The expert term: distinct experts per pass (uniform prior and fitted routing), the bytes and FLOPs of a
mixture-of-experts pass, the routing contract, and a table whose k rises with b before it falls."""
from __future__ import annotations

import json

import numpy as np
import pytest

from specbatch.perfmodel import latency as lat
from specbatch.perfmodel.acceptance import acceptance_from_user
from specbatch.perfmodel.errors import PerfModelError
from specbatch.perfmodel.experts import MEASURED, RANDOM_WEIGHTS, UNIFORM, RoutingFit, fit_routing, \
    routing_fit_from_json, uniform_distinct_experts
from specbatch.perfmodel.overhead import OverheadModel
from specbatch.perfmodel.profile.routing import ExpertShape, RoutingRow, routing_from_json
from specbatch.perfmodel.strategy import StepModel, candidate_strategies


def test_uniform_routing_of_128_experts_top_8_over_4_tokens_touches_29_1():
    # 128 (1 - (1 - 8/128)^4) = 128 (1 - 0.9375^4) = 128 (1 - 0.77248) = 29.12
    assert uniform_distinct_experts(128, 8, 4) == pytest.approx(29.12, abs=0.005)
    assert uniform_distinct_experts(128, 8, 1) == pytest.approx(8.0)  # one token: exactly its top-k
    assert uniform_distinct_experts(8, 2, 10_000) == pytest.approx(8.0)  # many tokens: every expert


SMALL = ExpertShape(num_experts=8, experts_per_token=2, moe_layers=2, expert_parameters=50, expert_bytes=100)


def small_shape(routing: RoutingFit = RoutingFit()) -> lat.RoleShape:
    # 5000 bytes of weights, 1600 of them experts (2 layers x 8 x 100); 2500 parameters, 800 of them experts
    return lat.RoleShape(parameters=2500, weight_bytes=5000, kv_bytes_per_token=10, layers=2, attention_width=4,
                         experts=SMALL, routing=routing)


def test_a_pass_reads_the_dense_part_and_the_touched_experts():
    shape = small_shape()
    # one token: the 3400 dense bytes + 2 layers x 2 experts x 100
    assert shape.weights_read_bytes(1, 1) == pytest.approx(3800.0)
    # 3 rows of one token, uniform: 8 (1 - 0.75^3) = 4.625 experts a layer
    assert shape.weights_read_bytes(3, 1) == pytest.approx(3400.0 + 200.0 * 4.625)
    # with KV: b (L + n) tokens of 10 bytes
    assert lat.memory_bytes(shape, 3, 1, 7) == pytest.approx(3400.0 + 200.0 * 4.625 + 10 * 3 * 8)
    # FLOPs over the active parameters: 2500 - 2 layers x 6 idle experts x 50 = 1900
    assert shape.active_parameters == 1900
    assert lat.pass_flops(shape, 3, 1, 0) == pytest.approx(2.0 * 1900 * 3 + 4.0 * 2 * 4 * 3 * 1)


def test_a_dense_shape_is_unchanged_by_the_expert_term():
    dense = lat.RoleShape(parameters=2500, weight_bytes=5000, kv_bytes_per_token=10, layers=2, attention_width=4)
    assert dense.weights_read_bytes(64, 9) == 5000
    assert dense.active_parameters == 2500
    roofline = lat.RooflineParams(0.1, 1.0, 1e-3, 4.0)
    assert roofline.ridge_tokens(dense) == pytest.approx((5000 / 1e9) / (2 * 2500 / 1e9))


def test_the_moe_ridge_is_where_compute_meets_the_touched_experts():
    shape = small_shape()
    roofline = lat.RooflineParams(0.1, 1.0, 1e-3, 4.0)
    ridge = roofline.ridge_tokens(shape)
    # at the ridge: tokens x 2 x active parameters / FLOP rate = bytes read / bandwidth
    assert ridge * 2 * 1900 / 1e9 == pytest.approx(float(shape.weights_read_bytes(ridge, 1)) / 1e9, rel=1e-6)


def rows_from(fit: RoutingFit, shape: ExpertShape, batch_sizes, new_tokens) -> list[RoutingRow]:
    return [RoutingRow("target", b, n, tuple(float(fit.distinct(shape, b, n)) for _ in range(shape.moe_layers)), 64)
            for b in batch_sizes for n in new_tokens]


def test_the_routing_fit_recovers_the_exponents_that_made_its_rows():
    shape = ExpertShape(128, 8, 4, 10, 20)
    truth = RoutingFit(0.8, 0.5)
    fit = fit_routing(shape, rows_from(truth, shape, (1, 2, 4, 8, 16, 32), (1, 2, 4, 8)), random_weights=False)
    assert fit.row_exponent == pytest.approx(0.8, abs=0.02)
    assert fit.token_exponent == pytest.approx(0.5, abs=0.02)
    assert fit.source == MEASURED and fit.rows == 24
    assert fit.mape_pct < 1.0 and fit.cv_mape_pct < 2.0


def test_without_rows_the_routing_is_the_uniform_prior_and_one_token_rows_leave_the_token_exponent_at_one():
    shape = ExpertShape(128, 8, 4, 10, 20)
    assert fit_routing(shape, (), random_weights=False) == RoutingFit()
    assert RoutingFit().source == UNIFORM and not RoutingFit().is_models
    fit = fit_routing(shape, rows_from(RoutingFit(0.7, 1.0), shape, (1, 4, 16, 64), (1,)), random_weights=True)
    assert fit.token_exponent == pytest.approx(1.0, abs=1e-3)  # nothing measured it: the prior holds
    assert fit.row_exponent == pytest.approx(0.7, abs=0.03)
    assert fit.source == RANDOM_WEIGHTS and not fit.is_models


def test_a_routing_fit_round_trips_and_a_bad_one_is_named():
    fit = RoutingFit(0.8, 0.5, MEASURED, 12, 1.5, 2.5)
    assert routing_fit_from_json(json.loads(json.dumps(fit.to_json())), "m") == fit
    with pytest.raises(PerfModelError, match=r"m\.token_exponent: 1\.5 > 1"):
        routing_fit_from_json(dict(fit.to_json(), token_exponent=1.5), "m")


def test_routing_rows_above_what_the_tokens_can_touch_are_refused():
    from specbatch.perfmodel.profile.routing import check_routing

    section = routing_from_json({"source": "prompts", "prompts": "p.jsonl", "prompt_count": 3, "rows": [
        {"model": "target", "batch_size": 1, "new_tokens": 2, "distinct_experts": [5.0, 3.0], "windows": 8}]}, "r")
    with pytest.raises(PerfModelError, match=r"rows\[0\]\.distinct_experts: 5 experts, but 2 tokens of top-2 "
                                             r"routing among 8 touch at most 4"):
        check_routing(section, {"target": SMALL}, "p.json")
    with pytest.raises(PerfModelError, match="the target has no experts"):
        check_routing(section, {"draft": SMALL}, "p.json")
    with pytest.raises(PerfModelError, match="3 counts for 2 routed layers"):
        check_routing(routing_from_json({"source": "prompts", "prompts": None, "prompt_count": 0, "rows": [
            {"model": "target", "batch_size": 1, "new_tokens": 1, "distinct_experts": [2, 2, 2], "windows": 1}]},
            "r"), {"target": SMALL}, "p.json")


# Qwen3-30B-A3B's shape (48 layers, 128 experts of width 768 at hidden 2048, top-8) in 16-bit weights against a
# dense 0.6B draft, on a roofline of a 3 TB/s, 600 TFLOP/s GPU: the step model's k for every batch size.
def moe_table(routing: RoutingFit | None) -> dict[int, int]:
    """routing None: the same weights as a dense model (every pass reads and multiplies all of them)."""
    element, expert = 2, 3 * 2048 * 768
    experts = None if routing is None else ExpertShape(128, 8, 48, expert, expert * element)
    parameters = 1_500_000_000 + 48 * 128 * expert
    target = lat.RoleShape(parameters, parameters * element, 48 * 2 * 4 * 128 * element, 48, 32 * 128, experts,
                           routing)
    draft = lat.RoleShape(600_000_000, 1_200_000_000, 28 * 2 * 8 * 128 * element, 28, 16 * 128)
    roofline = lat.RooflineParams(0.02, 3000.0, 600.0, 4.0)
    models = {"target": lat.LatencyModel(lat.ROOFLINE, target, roofline, None),
              "draft": lat.LatencyModel(lat.ROOFLINE, draft, roofline, None)}
    step = StepModel(lambda role, b, n, L: models[role].latency_ms(b, n, L), OverheadModel(()),
                     acceptance_from_user([0.8] * 8))
    strategies = candidate_strategies(8, family="chain")
    return {b: step.choose(strategies, b, 512).best.k for b in (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)}


def test_on_a_moe_target_the_best_k_rises_with_b_before_it_falls():
    table = moe_table(RoutingFit())
    ks = list(table.values())
    peak = int(np.argmax(ks))
    assert 0 < peak < len(ks) - 1, table  # neither at b = 1 nor at the largest b
    assert ks[0] < ks[peak] and ks[-1] < ks[peak], table
    # the same weights as a dense model: its k only falls with b
    dense = list(moe_table(None).values())
    assert all(later <= earlier for earlier, later in zip(dense, dense[1:])), dense


def test_routing_that_shares_experts_makes_speculation_cheaper_at_small_batch():
    uniform, shared = moe_table(RoutingFit()), moe_table(RoutingFit(0.9, 0.6))
    assert shared[1] > uniform[1]  # a continuation's tokens share experts: verifying them reads fewer
    assert shared[512] == uniform[512]  # at large b every expert is read either way


def test_a_tables_expert_term_round_trips_and_a_bad_count_is_named():
    from specbatch.perfmodel.table import Bucket, Table, TableEntry, table_from_json

    entry = TableEntry(1, 2, 100.0, 1.5, 1, 0.1, experts_touched=5.5)
    table = Table("t", "d", "cpu", "2026-01-01T00:00:00Z", 2, {}, (Bucket(64, (entry,)),),
                  experts={"target": {"num_experts": 8, "experts_per_token": 2, "moe_layers": 2,
                                      "routing": RoutingFit().to_json()}})
    obj = json.loads(json.dumps(table.to_json()))
    again = table_from_json(obj, "t.json")
    assert again.buckets[0].entries[0].experts_touched == 5.5 and again.experts == table.experts
    obj["buckets"][0]["entries"][0]["experts_touched"] = 0.5
    with pytest.raises(PerfModelError, match=r"t\.json: buckets\[0\]\.entries\[0\]\.experts_touched: expected a "
                                             r"number >= 1"):
        table_from_json(obj, "t.json")


def test_a_moe_shape_round_trips_through_the_model_file_and_impossible_experts_are_named():
    shape = small_shape(RoutingFit(0.8, 0.5, MEASURED, 12, 1.5, 2.5))
    again = lat.RoleShape.from_json(json.loads(json.dumps(shape.to_json())), "model.json: roles.target.shape")
    assert again == shape
    dense = lat.RoleShape(2500, 5000, 10, 2, 4)
    assert lat.RoleShape.from_json(dense.to_json(), "m") == dense
    too_big = dict(shape.to_json(), weight_bytes=1600)  # exactly the experts: no room for anything dense
    with pytest.raises(PerfModelError, match=r"m\.experts: 2 x 8 experts of 100 bytes exceed the 1600 bytes"):
        lat.RoleShape.from_json(too_big, "m")
