"""The error decomposition sums to the prediction and to the measurement: a constructed step model and a
stats fixture whose terms are computed by hand below."""
import pytest

from specbatch.perfmodel.acceptance import acceptance_from_user
from specbatch.perfmodel.errors import PerfModelError
from specbatch.perfmodel.explain import MeasuredSteps, PassTally, explain, measured_from_stats
from specbatch.perfmodel.overhead import OverheadModel
from specbatch.perfmodel.strategy import StepModel
from specbatch.perfmodel.tree import Strategy


def latency_ms(role: str, b: int, n: int, L: int) -> float:
    return 1.0 + n if role == "draft" else 10.0 + 2 * n  # draft n=1: 2 ms, n=2: 3 ms; target n=3: 16 ms


MODEL = StepModel(latency_ms, OverheadModel(((2, 2, 0.5),)), acceptance_from_user([0.5]))

# 4 steps at b = 2 and one tail step at b = 1 (ignored); k = 2 throughout
STATS = {
    "batch_size_per_step": [2, 2, 2, 2, 1],
    "step_s": [0.020, 0.022, 0.024, 0.022, 0.015],  # full batch: 88 ms over 4 steps = 22 ms
    "step_tokens": [4, 3, 2, 4, 2],  # full batch: 13 tokens / (4 steps x 2 rows) = 1.625
    "step_tokens_drawn": [4, 4, 2, 4, 2],  # before the cut: 14 / 8 = 1.75; per row 2, 2, 1, 2
    "draft_passes": [[2, 1], [2, 1], [2, 2], [2, 1], [2, 1], [2, 1], [2, 2], [2, 1], [1, 2], [1, 1]],
    "draft_pass_s": [.002, .002, .004, .002, .002, .002, .004, .002, .003, .001],
    "target_passes": [[2, 3], [2, 3], [2, 3], [2, 3], [1, 3]],
    "target_pass_s": [.015, .016, .017, .016, .010],
}


def test_measured_steps_keep_the_full_batch_only():
    measured = measured_from_stats(STATS, 2)
    assert (measured.steps, measured.tokens) == (4, 13)
    assert measured.step_ms == pytest.approx(22.0)
    assert measured.tokens_per_step == pytest.approx(1.625)
    tallies = {(p.role, p.new_tokens): (p.count, p.seconds) for p in measured.passes}
    assert tallies[("draft", 1)] == (6, pytest.approx(0.012))
    assert tallies[("draft", 2)] == (2, pytest.approx(0.008))
    assert tallies[("target", 3)] == (4, pytest.approx(0.064))
    assert measured_from_stats(STATS, 4) is None


def test_decomposition_sums_to_prediction_and_measurement():
    # predicted, b = 2, alpha = 0.5, k = 2: P(a row accepts both) = 0.25, P(catch-up pass of 2) =
    # 1 - 0.75^2 = 0.4375; draft n=1: 0.5625 + 1 = 1.5625 passes x 2 ms = 3.125; n=2: 0.4375 x 3 = 1.3125;
    # target 16; overhead 0.5: S_p = 20.9375 ms; E_p = 1 + 0.5 + 0.25 = 1.75
    # measured per step: draft n=1 1.5 x 2 ms = 3.0; n=2 0.5 x 4 ms = 2.0; target 16; overhead 22 - 21 = 1.0
    result = explain(MODEL, Strategy.from_k(2), measured_from_stats(STATS, 2), context_len=64)
    terms = {t.name: t for t in result.terms}
    assert list(terms) == ["draft n=1", "draft n=2", "target n=3", "overhead"]
    assert sum(t.predicted_ms for t in result.terms) == pytest.approx(result.predicted_step_ms)
    assert result.predicted_step_ms == pytest.approx(20.9375)
    assert sum(t.measured_ms for t in result.terms) == pytest.approx(result.measured_step_ms)
    assert result.measured_step_ms == pytest.approx(22.0)
    assert terms["draft n=1"].predicted_ms == pytest.approx(3.125)
    assert terms["draft n=1"].measured_ms == pytest.approx(3.0)
    assert terms["draft n=1"].mix_ms == pytest.approx((1.5625 - 1.5) * 2)
    assert terms["draft n=1"].time_ms == pytest.approx(0.0)
    assert terms["draft n=2"].mix_ms == pytest.approx((0.4375 - 0.5) * 3)
    assert terms["draft n=2"].time_ms == pytest.approx(0.5 * (3 - 4))
    assert terms["overhead"].measured_ms == pytest.approx(1.0)
    # goodput: G_p / G_m = (E_p / E_m) / (S_p / S_m) exactly
    assert result.predicted_tokens_per_step == pytest.approx(1.75)
    assert result.error == pytest.approx((1.75 / 1.625) / (20.9375 / 22.0) - 1)
    assert result.culprit == ("cut at max new tokens", pytest.approx(1.75 / 1.625 - 1))  # E drawn = E_p
    effects = dict(result.effects())
    assert effects["overhead"] == pytest.approx(0.5 / 22)
    assert effects["draft n=2: pass time"] == pytest.approx(0.5 / 22)


def test_passes_the_model_never_predicted_are_all_mix():
    measured = MeasuredSteps(1, 2, 0.050, 4, (PassTally("target", 1, 2, 0.030),))
    result = explain(MODEL, Strategy(None), measured, context_len=64)  # k = 0: target n=1 at 12 ms
    assert [t.name for t in result.terms] == ["target n=1", "overhead"]
    assert result.terms[0].time_ms == pytest.approx(12.0 - 15.0)
    measured = MeasuredSteps(1, 2, 0.050, 4, (PassTally("target", 2, 2, 0.030),))
    odd = {t.name: t for t in explain(MODEL, Strategy(None), measured, 64).terms}
    assert odd["target n=1"].mix_ms == pytest.approx(12.0) and odd["target n=2"].mix_ms == pytest.approx(-14.0)


def test_pooling_rounds_adds_counts_and_refuses_other_batch_sizes():
    one = measured_from_stats(STATS, 2)
    both = one.merged(one)
    assert (both.steps, both.tokens, both.step_ms) == (8, 26, pytest.approx(22.0))
    with pytest.raises(PerfModelError, match="batch sizes 2 and 1"):
        one.merged(MeasuredSteps(1, 1, 0.01, 1, ()))


def test_drawn_tokens_their_interval_and_the_cut():
    # drawn per row per step 2, 2, 1, 2: mean 1.75, sample variance (13 - 4 x 1.75^2) / 3 = 0.25, so the
    # 95 % half-width is 1.96 x 0.5 / 2 = 0.49
    measured = measured_from_stats(STATS, 2)
    assert (measured.drawn_tokens, measured.drawn_square_sum) == (14, pytest.approx(13.0))
    assert measured.drawn_tokens_per_step == pytest.approx(1.75)
    assert measured.drawn_halfwidth() == pytest.approx(1.959964 * 0.5 / 2)
    result = explain(MODEL, Strategy.from_k(2), measured, context_len=64)
    # the model's own spread is larger: T = 1, 2, 3 with 0.5, 0.25, 0.25, Var 0.6875, over 2 rows 0.34375
    half = 1.959964 * (0.34375 / 4) ** 0.5
    assert result.drawn_halfwidth == pytest.approx(half)
    effects = dict(result.effects())
    assert effects["tokens per step"] == pytest.approx(0.0)  # E_p = 1.75 = E drawn
    assert effects["cut at max new tokens"] == pytest.approx(1.75 / 1.625 - 1)
    assert result.error == pytest.approx((1.75 / 1.625) / (20.9375 / 22.0) - 1)  # the product is unchanged
    assert result.tokens_interval == pytest.approx((1.75 / (1.75 + half) - 1, 1.75 / (1.75 - half) - 1))
    assert result.tokens_within_noise is True
    doubled = measured.merged(measured)  # the same spread over twice the steps: the interval shrinks
    assert doubled.drawn_halfwidth() == pytest.approx(1.959964 * (0.25 * 6 / 7 / 8) ** 0.5)  # (26 - 8 x 1.75^2) / 7
    older = measured_from_stats({k: v for k, v in STATS.items() if k != "step_tokens_drawn"}, 2)
    assert older.drawn_tokens is None and older.drawn_halfwidth() is None
    assert explain(MODEL, Strategy.from_k(2), older, 64).tokens_within_noise is None
    assert "cut at max new tokens" not in dict(explain(MODEL, Strategy.from_k(2), older, 64).effects())
