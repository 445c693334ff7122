"""`table` and `query` say when a choice sits just past a kernel step, and what k - 1 would give up."""
from __future__ import annotations

import re

import pytest

from specbatch.perfmodel.fit import fit_profile
from specbatch.perfmodel.kernel_notes import describe, step_edge, table_step_notes
from specbatch.perfmodel.model import choose_acceptance, compute_table, query_strategies, step_model
from specbatch.perfmodel.profile import profile_from_json
from specbatch.perfmodel.query import chain_answer
from perfmodel_fixtures import build_profile, roofline_latency

ROOFLINE = roofline_latency()


def fitted_with_step(height: float, batch_sizes=tuple(range(1, 49)), after: int = 128):
    """A 7B-class target whose passes get `height` slower past `after` tokens (a GEMM tile step), and its draft."""
    def latency(role, b, n, L):
        return ROOFLINE(role, b, n, L) * (1 + height * (b * n > after) if role == "target" else 1)

    profile = profile_from_json(build_profile(latency, batch_sizes=batch_sizes, context_lens=(256, 1024), max_k=8,
                                              noise=0.005, seed=1, acceptance=[0.8] * 8))
    fitted = fit_profile(profile)
    return fitted, choose_acceptance(fitted, None)


@pytest.fixture(scope="module")
def six_percent():
    return fitted_with_step(0.06)


def test_a_choice_past_the_step_is_said_with_what_k_minus_1_gives_up(six_percent):
    fitted, acceptance = six_percent
    table = compute_table(fitted, acceptance, 48, [256], strategies="chain")
    notes = table_step_notes(fitted, table, step_model(fitted, acceptance))
    edges = [e for e in table.buckets[0].entries if e.k > 0 and e.batch_size * e.k <= 128 < e.batch_size * (e.k + 1)]
    assert edges, "the constructed step must put some choice past it"
    first, last = edges[0].batch_size, edges[-1].batch_size
    k = edges[0].k
    assert notes[0].startswith(f"k = {k} at b = {first}-{last} (context 256): its verify pass of "
                               f"{first * (k + 1)}-{last * (k + 1)} tokens is past the step after 128 tokens (+")
    height = int(re.search(r"128 tokens \(\+(\d+) %\)", notes[0]).group(1))
    assert 5 <= height <= 7  # the step's fitted height over k - 1's verify pass: 6 % of the pass, noise 0.5 %
    # what k - 1 gives up, from the ranking query makes (independent of the note's own arithmetic)
    behind = []
    for b in (first, last):
        by_k = {c.k: c.tokens_per_s for c in query_strategies(fitted, acceptance, b, 256, strategies="chain").ranked}
        behind.append(100 * (1 - by_k[k - 1] / by_k[k]))
    low, high = re.search(r"is (\d+\.\d)-?(\d+\.\d)? % behind", notes[0]).groups()
    assert float(low) == pytest.approx(min(behind), abs=0.051)
    assert float(high or low) == pytest.approx(max(behind), abs=0.051)


def test_query_says_it_at_one_batch_size(six_percent):
    fitted, acceptance = six_percent
    table = compute_table(fitted, acceptance, 48, [256], strategies="chain")
    entry = next(e for e in table.buckets[0].entries if e.k and e.batch_size * e.k <= 128 < e.batch_size * (e.k + 1))
    answer = chain_answer(fitted, acceptance, entry.batch_size, 256)
    expected = f"k = {entry.k} at b = {entry.batch_size} (context 256): its verify pass of"
    assert any(note.startswith(expected) for note in answer.notes), answer.notes
    before = chain_answer(fitted, acceptance, 8, 256)  # 8 rows x (k + 1) tokens: nowhere near the step
    assert not any("past the step" in note for note in before.notes)


def test_no_note_where_the_choice_stays_before_a_big_step():
    fitted, acceptance = fitted_with_step(0.2)
    table = compute_table(fitted, acceptance, 48, [256], strategies="chain")
    assert not any(e.batch_size * e.k <= 128 < e.batch_size * (e.k + 1) for e in table.buckets[0].entries if e.k)
    assert table_step_notes(fitted, table, step_model(fitted, acceptance)) == []


def test_a_verify_pass_in_an_unresolved_gap_is_interpolated():
    """Powers of two: a step past 200 tokens lies between the measured 192 (32 x 6) and 224 (32 x 7), a gap no
    point resolves; a verify pass of 210 tokens (b = 30, k = 6) is interpolated there."""
    fitted, acceptance = fitted_with_step(0.3, batch_sizes=(1, 2, 4, 8, 16, 32), after=200)
    staircase = fitted.roles["target"].model.staircase
    gap = staircase.interpolating_gap(tokens=210, rows=30)
    assert gap is not None and (gap.after, gap.until) == (192.0, 224.0)
    edge = step_edge(fitted, step_model(fitted, acceptance), _chain(6), 30, 256)
    assert edge is not None and edge.interpolating
    note = describe(edge)
    assert "interpolating" in note and "between the measured 192 and 224 tokens" in note


def _chain(k: int):
    from specbatch.perfmodel.tree import Strategy

    return Strategy.from_k(k)


def test_a_batch_size_inside_an_unresolved_attention_step_is_said_to_be_interpolated():
    """Powers of two and a wave past 6 rows: the fit ramps across 4-8, and a query at b = 6 says so."""
    def latency(role, b, n, L):
        return ROOFLINE(role, b, n, L) + (0.8 * (L + n) / 1000 * (b > 6) if role == "target" else 0.0)

    profile = profile_from_json(build_profile(latency, batch_sizes=(1, 2, 4, 8, 16, 32), context_lens=(256, 1024),
                                              max_k=8, noise=0.003, seed=2, acceptance=[0.8] * 8))
    fitted = fit_profile(profile)
    acceptance = choose_acceptance(fitted, None)
    at_6 = chain_answer(fitted, acceptance, 6, 256).notes
    assert any("between the measured 4 and 8: batch sizes inside are interpolated" in note for note in at_6), at_6
    assert not any("interpolated" in note for note in chain_answer(fitted, acceptance, 8, 256).notes)
