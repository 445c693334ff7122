"""E(k)'s standard error across prompts, as calibrate writes it into the profile (hand-computed)."""
import math

import numpy as np
import pytest

from specbatch.calibrate.acceptance import ScoredRow, entry_from_rows, step_counts
from specbatch.runtime.sampling import Sampling


def _row(agreement):
    m = np.array(agreement, dtype=float)
    return ScoredRow(m, m[:, None], None, np.full((len(m), 2), -1))


def test_step_counts_of_one_continuation():
    assert step_counts([1, 1, 1, 1], 1) == (4.0, 2.0)  # steps at 0 and 2, two tokens each
    assert step_counts([0, 0, 0, 0], 1) == (4.0, 4.0)


def test_tokens_per_step_se_shrinks_with_the_number_of_prompts():
    # k = 1: prompt A (always accepted) 4 tokens in 2 steps, prompt B (never) 4 in 4: E = 8/6; residuals
    # about R = 4/3: +4/3 and -4/3, so SE = sqrt(2 * 32/9) / 6 = 4/9
    pair = [_row([1, 1, 1, 1]), _row([0, 0, 0, 0])]
    entry = entry_from_rows(pair, Sampling(), 1, len(pair))
    assert entry.tokens_per_step == pytest.approx((1.0, 8 / 6))
    assert entry.tokens_per_step_se == pytest.approx((0.0, 4 / 9))
    many = entry_from_rows(pair * 4, Sampling(), 1, 8)  # 4x the prompts, the same acceptance
    assert many.tokens_per_step == pytest.approx(entry.tokens_per_step)
    assert many.tokens_per_step_se[1] == pytest.approx(4 / 9 / 2 * math.sqrt((8 / 7) / 2))  # 1/sqrt(4), n/(n-1)
    assert entry_from_rows(pair[:1], Sampling(), 1, 1).tokens_per_step_se is None  # one prompt: no spread


def test_per_prompt_counts_are_kept_for_paired_comparisons():
    pair = [_row([1, 1, 1, 1]), _row([0, 0, 0, 0])]
    entry = entry_from_rows(pair, Sampling(), 2, 2)
    assert entry.step_counts_by_prompt == ((step_counts([1, 1, 1, 1], 1), (4.0, 4.0)),
                                           (step_counts([1, 1, 1, 1], 2), step_counts([0, 0, 0, 0], 2)))
