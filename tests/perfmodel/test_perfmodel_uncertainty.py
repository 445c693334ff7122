"""Acceptance with its uncertainty: intervals shrink as 1/sqrt(n) on a constructed pair with known
acceptance, the profile's optional fields load (and older profiles without them), ties in a table."""
import math

import pytest

from specbatch.perfmodel.acceptance import AcceptanceModel, acceptance_from_user
from specbatch.perfmodel.table import Bucket, Table, TableEntry
from specbatch.perfmodel.tree import Strategy
from specbatch.perfmodel.uncertainty import (
    Z95,
    alpha_half_width,
    expected_tokens_se,
    is_tie,
    ratio_standard_error,
    table_tie_notes,
    tokens_per_step_se,
)


def test_alpha_interval_shrinks_as_one_over_sqrt_n():
    # alpha = 0.75 from n trials: 1.96 * sqrt(0.75 * 0.25 / n)
    assert alpha_half_width(0.75, 100) == pytest.approx(Z95 * math.sqrt(0.1875 / 100))
    assert alpha_half_width(0.75, 400) == pytest.approx(alpha_half_width(0.75, 100) / 2)
    assert alpha_half_width(0.75, 0) is None


def test_expected_tokens_se_by_the_delta_method_shrinks_as_one_over_sqrt_n():
    # alpha = 0.5 at both positions, k = 2: dE/da1 = (0.5 + 0.25) / 0.5 = 1.5, dE/da2 = 0.25 / 0.5 = 0.5;
    # Var = (1.5^2 + 0.5^2) * 0.25 / n = 0.625 / n
    assert expected_tokens_se([0.5, 0.5], [100, 100], 2) == pytest.approx(math.sqrt(0.625 / 100))
    assert expected_tokens_se([0.5, 0.5], [400, 400], 2) == pytest.approx(math.sqrt(0.625 / 100) / 2)
    assert expected_tokens_se([0.5], [100], 2) == pytest.approx(math.sqrt(0.625 / 100))  # last position reused
    assert expected_tokens_se([0.5], [0], 1) is None and expected_tokens_se([0.5], [10], 0) == 0.0


def test_ratio_standard_error_across_prompts():
    # two prompt kinds, 3 and 1 tokens per step over 2 steps each: R = (6 + 2) / 4 = 2, residuals +2, -2
    x, y = [6, 2], [2, 2]
    assert ratio_standard_error(x, y) == pytest.approx(math.sqrt(2 * 8) / 4)
    # the same pair measured on 4x the prompts: n / (n - 1) goes from 2 to 8/7, sums of squares x4, totals x4
    big = ratio_standard_error(x * 4, y * 4)
    assert big == pytest.approx(math.sqrt(8 / 7 * 32) / 16)
    assert big == pytest.approx(ratio_standard_error(x, y) / 2 * math.sqrt((8 / 7) / 2))
    assert ratio_standard_error([3], [1]) == 0.0


def _model(tokens_per_step=None, se=None, trials=None):
    return AcceptanceModel("profile", "greedy", None, (0.5, 0.5), acceptance_from_user([0.5]).constant,
                           tokens_per_step=tokens_per_step, trials=trials, tokens_per_step_se=se)


def test_the_prediction_uses_the_measured_e_and_its_own_se():
    model = _model((1.0, 1.4, 1.6), (0.0, 0.02, 0.03), (100, 50))
    assert tokens_per_step_se(model, Strategy.from_k(2)) == 0.03
    assert tokens_per_step_se(_model(trials=(100, 100)), Strategy.from_k(2)) == pytest.approx(math.sqrt(0.00625))
    assert tokens_per_step_se(_model(), Strategy.from_k(2)) is None  # no sample size: no interval
    again = AcceptanceModel.from_json(model.to_json(), "test")
    assert (again.trials, again.tokens_per_step_se) == ((100, 50), (0.0, 0.02, 0.03))


def test_older_acceptance_without_the_fields_loads():
    obj = _model().to_json()
    del obj["trials"], obj["tokens_per_step_se"]
    loaded = AcceptanceModel.from_json(obj, "old")
    assert loaded.trials is None and loaded.tokens_per_step_se is None


def test_ties_within_the_combined_uncertainty():
    assert is_tie(100.0, 99.0, 0.01, 0.01)  # 1.96 * hypot(1.0, 0.99) = 1.96 > 1
    assert not is_tie(100.0, 97.0, 0.01, 0.01)
    assert not is_tie(100.0, 99.9, None, 0.01)


def test_table_notes_name_the_indistinguishable_choices():
    acceptance = _model((1.0, 1.5, 1.75, 1.875), (0.0, 0.02, 0.03, 0.03))
    # E(2) = 1.75 +- 0.03 (1.7 %), E(3) = 1.875 +- 0.03 (1.6 %): goodputs 1 % apart are a tie, 10 % are not
    entries = (TableEntry(1, 3, 100.0, 2.0, 2, 0.01), TableEntry(2, 3, 180.0, 1.9, 2, 0.01),
               TableEntry(3, 2, 250.0, 1.5, 3, 0.10))
    table = Table("t", "d", "cpu", "now", 3, acceptance.to_json(), (Bucket(128, entries),))
    notes = table_tie_notes(table, acceptance)
    assert notes == [notes[0]] and notes[0].startswith("b = 1-2: k = 3 or k = 2: indistinguishable")


def test_table_notes_group_the_ties_of_several_buckets():
    acceptance = _model((1.0, 1.5, 1.75, 1.875), (0.0, 0.02, 0.03, 0.03))
    tied_everywhere = TableEntry(1, 3, 100.0, 2.0, 2, 0.01)
    apart = TableEntry(2, 3, 180.0, 1.9, 2, 0.10)
    short = (tied_everywhere, apart, TableEntry(3, 2, 250.0, 1.5, 3, 0.01))
    long = (tied_everywhere, apart, TableEntry(3, 2, 250.0, 1.5, 3, 0.10))
    table = Table("t", "d", "cpu", "now", 3, acceptance.to_json(), (Bucket(128, short), Bucket(512, long)))
    notes = table_tie_notes(table, acceptance)
    # b = 1 ties in both buckets: one note for both; b = 3 ties at context 128 only
    assert len(notes) == 2 and notes[0].startswith("b = 1 k = 3 or k = 2 (every context): indistinguishable")
    assert notes[1].startswith("context 128: indistinguishable") and notes[1].endswith("at b = 3 k = 2 or k = 3")


def test_the_paired_difference_uses_each_prompts_counts():
    from specbatch.perfmodel.uncertainty import choices_tie, paired_difference_se

    # 3 prompts; k = 1: (tokens, steps) = (4, 2), (4, 4), (6, 4): E1 = 14/10; k = 2: (6, 2), (4, 4), (7, 4): E2 = 17/10
    counts = (((4.0, 2.0), (4.0, 4.0), (6.0, 4.0)), ((6.0, 2.0), (4.0, 4.0), (7.0, 4.0)))
    acceptance = _model((1.0, 1.4, 1.7), (0.0, 0.1, 0.1))
    acceptance = AcceptanceModel(**{**acceptance.__dict__, "step_counts_by_prompt": counts})
    g2, g1 = 110.0, 100.0  # k = 2 predicted best
    d = [g2 / 1.7 * (t2 - 1.7 * s2) / 10 - g1 / 1.4 * (t1 - 1.4 * s1) / 10
         for (t1, s1), (t2, s2) in zip(*counts)]
    expected = math.sqrt(3 / 2 * sum(x * x for x in d))  # 13.15
    assert paired_difference_se(acceptance, g2, 2, g1, 1) == pytest.approx(expected)
    tie, width = choices_tie(acceptance, Strategy.from_k(2), g2, Strategy.from_k(1), g1)
    assert tie and width == pytest.approx(Z95 * expected / g2)
    assert choices_tie(acceptance, Strategy.from_k(2), g2, Strategy.from_k(2, True), g1) == (False, None)
    assert paired_difference_se(_model(), g2, 2, g1, 1) is None  # no per-prompt counts: the unpaired fallback


def test_query_notes_list_every_candidate_tied_with_the_best():
    from types import SimpleNamespace

    from specbatch.perfmodel.uncertainty import choice_tie_notes

    acceptance = _model((1.0, 1.5, 1.75, 1.875), (0.0, 0.02, 0.03, 0.03))

    def candidate(k, goodput):
        return SimpleNamespace(strategy=Strategy.from_k(k), tokens_per_s=goodput)

    ranked = (candidate(3, 100.0), candidate(2, 99.0), candidate(1, 80.0))
    choice = SimpleNamespace(batch_size=4, best=ranked[0], ranked=ranked)
    assert choice_tie_notes(choice, acceptance) == [
        "b = 4: k = 3 or k = 2: indistinguishable (goodputs within the acceptance uncertainty)"]
