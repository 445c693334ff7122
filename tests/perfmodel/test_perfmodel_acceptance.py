"""E(k), the constant-alpha fit and the what-if overrides, against hand-computed values."""
from __future__ import annotations

import math

import pytest

from specbatch.perfmodel.acceptance import (acceptance_from_user, expected_tokens, extend_alphas, fit_constant_alpha,
                                  parse_acceptance_option)
from specbatch.perfmodel.errors import PerfModelError


def test_expected_tokens_by_hand():
    assert expected_tokens([0.8], 0) == 1.0
    assert expected_tokens([0.8], 1) == pytest.approx(1.8)
    assert expected_tokens([0.8], 3) == pytest.approx(1 + 0.8 + 0.64 + 0.512)
    # per position: 1 + 0.9 + 0.9*0.5 + 0.9*0.5*0.2
    assert expected_tokens([0.9, 0.5, 0.2], 3) == pytest.approx(2.44)
    assert expected_tokens([1.0], 4) == 5.0  # every token accepted: k + 1
    assert expected_tokens([0.0, 0.9], 2) == 1.0  # position 1 never accepted: nothing after it counts


def test_constant_alpha_closed_form():
    for alpha in (0.3, 0.75, 0.95):
        for k in range(7):
            assert expected_tokens([alpha], k) == pytest.approx((1 - alpha ** (k + 1)) / (1 - alpha))


def test_positions_beyond_the_list_repeat_the_last_value():
    assert extend_alphas([0.9, 0.6], 4) == (0.9, 0.6, 0.6, 0.6)
    assert extend_alphas([0.9, 0.6, 0.5], 2) == (0.9, 0.6)
    assert expected_tokens([0.9, 0.6], 4) == pytest.approx(1 + 0.9 + 0.54 + 0.324 + 0.1944)


def test_constant_fit_recovers_a_constant_alpha_exactly():
    fit = fit_constant_alpha([0.7] * 6)
    assert fit.alpha == pytest.approx(0.7, abs=1e-6)
    assert fit.rmse == pytest.approx(0.0, abs=1e-6)
    assert fit.r_squared == pytest.approx(1.0, abs=1e-6)


def test_constant_fit_reports_a_poor_fit():
    # acceptance that collapses after position 2 is not one alpha: the fit must say so
    decaying = fit_constant_alpha([0.95, 0.95, 0.1, 0.1, 0.1])
    steady = fit_constant_alpha([0.8, 0.79, 0.81, 0.8, 0.8])
    assert decaying.rmse > 10 * steady.rmse
    assert decaying.r_squared < steady.r_squared
    assert fit_constant_alpha([0.6]).r_squared is None  # one point has no variance to explain


def test_fit_weights_the_cumulative_products():
    # alphas (0.9, 0.5): products 0.9, 0.45. Least squares on a^1, a^2 against them, by brute force.
    grid = [i / 100000 for i in range(1, 100001)]
    best = min(grid, key=lambda a: (a - 0.9) ** 2 + (a * a - 0.45) ** 2)
    assert fit_constant_alpha([0.9, 0.5]).alpha == pytest.approx(best, abs=1e-4)


def test_acceptance_option_parsing():
    assert parse_acceptance_option("0.8") == (0.8,)
    assert parse_acceptance_option("0.9, 0.85,0.8") == (0.9, 0.85, 0.8)
    assert parse_acceptance_option("1") == (1.0,)


@pytest.mark.parametrize("text", ["0", "1.2", "-0.5", "0.9,1.01", "nan"])
def test_acceptance_outside_open_unit_interval_is_refused(text):
    with pytest.raises(PerfModelError, match=r"--acceptance: acceptance .* is outside \(0, 1\]"):
        parse_acceptance_option(text)


def test_acceptance_option_that_is_not_a_number():
    with pytest.raises(PerfModelError, match="--acceptance: 'high' is not a number"):
        parse_acceptance_option("0.9,high")


def test_user_acceptance_model():
    model = acceptance_from_user([0.9, 0.8])
    assert model.source == "user"
    assert model.alphas(3) == (0.9, 0.8, 0.8)
    assert model.expected_tokens(2) == pytest.approx(1 + 0.9 + 0.72)
    assert 0.8 < model.constant.alpha < 0.9
    assert not math.isnan(model.constant.rmse)
