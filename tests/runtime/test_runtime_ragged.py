"""Ragged batches: rows finish at their own time and leave; k follows the batch size step by step.

Oracles: target-only greedy output (truncated after EOS), and, for a draft that always agrees (every
row gains exactly k + 1 tokens per step), the batch size of every step predicted from each row's output
length alone.
"""
from __future__ import annotations

import warnings

import pytest

from specbatch.calibrate.pass_clock import StepRecorder
from specbatch.runtime.generator import SpeculativeGenerator
from specbatch.runtime.policy import FixedK

N_NEW = 16


@pytest.fixture(scope="module")
def reference(greedy_target, prompts8):
    return SpeculativeGenerator(greedy_target, None).generate(prompts8, N_NEW, FixedK(0)).token_ids


def _truncate(outputs, eos: set[int]):
    out = []
    for tokens in outputs:
        cut = next((i + 1 for i, t in enumerate(tokens) if t in eos), len(tokens))
        out.append(tokens[:cut])
    return out


def _spread_eos(outputs) -> int:
    """The token that, as EOS, makes the most rows stop at distinct lengths (>= 3) before N_NEW."""
    best, best_score = None, 0
    for token in sorted({t for tokens in outputs for t in tokens}):
        lengths = [len(t) for t in _truncate(outputs, {token})]
        if min(lengths) < 3:
            continue
        score = len({n for n in lengths if n < N_NEW})
        if score > best_score and any(n == N_NEW for n in lengths):
            best, best_score = token, score
    assert best is not None and best_score >= 3, "reference outputs offer no EOS that spreads the rows"
    return best


def _first_token_eos(outputs) -> int:
    """A row's first token that no other row emits in its first 3 tokens: that row ends at prefill."""
    for tokens in outputs:
        if all(tokens[0] not in other[:3] for other in outputs if other is not tokens):
            return tokens[0]
    raise AssertionError("no row has a first token unique enough")


class MapPolicy:
    """k as a function of the batch size, recording every call."""

    def __init__(self, mapping: dict[int, int]):
        self.mapping = mapping
        self.max_k = max(mapping.values())
        self.calls: list[tuple[int, int]] = []

    def __call__(self, batch_size: int, context_len: int) -> int:
        self.calls.append((batch_size, context_len))
        return self.mapping[batch_size]


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("which", ["spread", "first_token"])
def test_rows_leave_at_predicted_steps(which, k, greedy_target, prompts8, reference):
    eos = {"spread": _spread_eos, "first_token": _first_token_eos}[which](reference)
    expected = _truncate(reference, {eos})
    lengths = [len(t) for t in expected]
    assert len(set(lengths)) >= 2
    # the draft is the target: each active row gains k + 1 tokens per step after its first token
    steps_needed = [-(-(n - 1) // (k + 1)) for n in lengths]
    predicted_sizes = [sum(1 for s in steps_needed if s > step) for step in range(max(steps_needed))]
    result = SpeculativeGenerator(greedy_target, greedy_target, eos_token_ids=(eos,)).generate(
        prompts8, N_NEW, FixedK(k))
    assert result.token_ids == expected
    assert result.stats.batch_size_per_step == predicted_sizes
    if which == "spread":
        assert predicted_sizes[-1] < predicted_sizes[0]
    else:
        assert predicted_sizes[0] < len(prompts8)  # a row finished at prefill and never took a step


def test_every_row_stops_at_eos_or_max_new_tokens(greedy_target, greedy_draft_sometimes, prompts8, reference):
    eos = _spread_eos(reference)
    result = SpeculativeGenerator(greedy_target, greedy_draft_sometimes, eos_token_ids=(eos,)).generate(
        prompts8, N_NEW, FixedK(4))
    assert result.token_ids == _truncate(reference, {eos})
    for tokens in result.token_ids:
        assert len(tokens) <= N_NEW
        assert eos not in tokens[:-1]
        assert tokens[-1] == eos or len(tokens) == N_NEW
    sizes = result.stats.batch_size_per_step
    assert all(a >= b for a, b in zip(sizes, sizes[1:])) and sizes[-1] < sizes[0]


@pytest.mark.parametrize("draft_kind", ["always", "sometimes"])
def test_k_follows_batch_size(draft_kind, greedy_target, greedy_draft_sometimes, prompts8, reference):
    """k = 0 while all 8 rows run (the draft falls behind), then a different k for every batch size."""
    eos = _spread_eos(reference)
    expected = _truncate(reference, {eos})
    policy = MapPolicy({8: 0, 7: 3, 6: 1, 5: 2, 4: 4, 3: 1, 2: 2, 1: 3})
    draft = greedy_target if draft_kind == "always" else greedy_draft_sometimes
    recorder = StepRecorder("cpu")
    result = SpeculativeGenerator(greedy_target, draft, eos_token_ids=(eos,)).generate(prompts8, N_NEW, policy,
                                                                                      observer=recorder)
    assert result.token_ids == expected
    stats = result.stats
    assert [b for b, _ in policy.calls] == stats.batch_size_per_step
    assert stats.k_per_step == [policy.mapping[b] for b in stats.batch_size_per_step]
    assert len(set(stats.k_per_step)) >= 3 and stats.k_per_step[0] == 0
    # the policy sees the context attention spans: the longest active row (prompt + generated)
    assert policy.calls[0][1] == max(len(p) + 1 for p in prompts8)
    # the first draft pass after j steps with k = 0 catches up j + 1 tokens per row
    zero_steps = next(i for i, k in enumerate(stats.k_per_step) if k > 0)
    assert recorder.pass_shapes("draft")[0] == (stats.batch_size_per_step[zero_steps], zero_steps + 1)


def test_k_zero_between_speculative_steps(greedy_target, greedy_draft_sometimes, prompts8, reference):
    """k alternating between 0 and > 0 as the batch shrinks keeps the output exact."""
    eos = _spread_eos(reference)
    policy = MapPolicy({8: 2, 7: 0, 6: 5, 5: 0, 4: 1, 3: 0, 2: 3, 1: 0})
    result = SpeculativeGenerator(greedy_target, greedy_draft_sometimes, eos_token_ids=(eos,)).generate(
        prompts8, N_NEW, policy)
    assert result.token_ids == _truncate(reference, {eos})
    assert 0 in result.stats.k_per_step and any(k > 0 for k in result.stats.k_per_step)


def test_table_policy_follows_the_table(greedy_target, greedy_draft_sometimes, prompts8, reference, write_table):
    pytest.importorskip("specbatch.perfmodel.table")
    from specbatch.runtime.policy import TableK

    mapping = {1: 4, 2: 4, 3: 3, 4: 2, 5: 2, 6: 1}  # batch sizes 7 and 8 lie beyond: the last entry (k=1)
    policy = TableK(write_table(mapping))
    assert policy.max_k == 4
    eos = _spread_eos(reference)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = SpeculativeGenerator(greedy_target, greedy_draft_sometimes, eos_token_ids=(eos,)).generate(
            prompts8, N_NEW, policy)
    assert result.token_ids == _truncate(reference, {eos})
    stats = result.stats
    assert stats.k_per_step == [mapping[min(b, 6)] for b in stats.batch_size_per_step]
    assert len(set(stats.k_per_step)) >= 2
    assert sum(b > 6 for b in stats.batch_size_per_step) >= 2
    beyond = [w for w in caught if "beyond" in str(w.message)]
    assert len(beyond) == 1, "a batch size beyond the table is reported once"
