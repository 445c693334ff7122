"""Generation statistics agree with each other and with the step schedule the runtime promises.

Schedule of a step with k >= 1 and batch b: k draft passes of batch b, the first of width equal to the
largest draft lag (1 on the first step; 1 or 2 after a speculative step: 2 when some row accepted all k;
one more per preceding step with k = 0), the others of width 1; then one target pass of width k + 1.
A step with k = 0 is one target pass of width 1 and no draft pass. The passes are seen by the step
recorder bench and calibrate attach (calibrate.pass_clock), which runs them.
"""
from __future__ import annotations

import json
import random

import pytest
import torch

from specbatch.calibrate.pass_clock import StepRecorder
from specbatch.runtime.acceptance import count_acceptance
from specbatch.runtime.generator import SpeculativeGenerator
from specbatch.runtime.policy import FixedK
from specbatch.runtime.sampling import Sampling

N_NEW = 14


class MapPolicy:
    def __init__(self, mapping):
        self.mapping, self.max_k = mapping, max(mapping.values())

    def __call__(self, batch_size, context_len):
        return self.mapping[batch_size]


def _generate(generator, prompts, n_new, policy, *args, **kwargs):
    """The generation's result and its step recorder."""
    recorder = StepRecorder(generator.device)
    return generator.generate(prompts, n_new, policy, *args, observer=recorder, **kwargs), recorder


def _check_schedule(stats, recorder, first_widths=None):
    """Passes and step records match k_per_step / batch_size_per_step; returns the width of each step's
    first draft pass."""
    assert stats.steps == len(stats.k_per_step) == len(stats.batch_size_per_step) == len(recorder.steps)
    assert recorder.per_step("k") == recorder.per_step("nodes") == recorder.per_step("draft_passes") == stats.k_per_step
    assert recorder.per_step("batch_size") == stats.batch_size_per_step
    assert recorder.pass_shapes("target") == [(b, k + 1) for b, k in zip(stats.batch_size_per_step, stats.k_per_step)]
    draft_passes = recorder.pass_shapes("draft")
    assert len(draft_passes) == sum(stats.k_per_step)
    widths, i = [], 0
    for b, k in zip(stats.batch_size_per_step, stats.k_per_step):
        if k == 0:
            continue
        passes = draft_passes[i:i + k]
        i += k
        assert all(batch == b for batch, _ in passes)
        assert all(width == 1 for _, width in passes[1:])
        widths.append(passes[0][1])
    if first_widths is not None:
        assert widths == first_widths
    return widths


def _check_acceptance_counts(stats, result, fixed_k=None):
    acc, trials = stats.accepted_per_position, stats.trials_per_position
    assert len(acc) == len(trials) == max(stats.k_per_step, default=0)
    # position 1 is tried once per row per speculative step
    assert trials[0] == sum(b for b, k in zip(stats.batch_size_per_step, stats.k_per_step) if k >= 1)
    for i in range(len(acc)):
        assert 0 <= acc[i] <= trials[i]
    for i in range(len(acc) - 1):
        assert acc[i + 1] <= acc[i]
        if fixed_k is not None:  # every step has k >= i + 2: position i + 2 is tried exactly when i + 1 was accepted
            assert trials[i + 1] == acc[i]
        else:
            assert trials[i + 1] <= acc[i]
    assert stats.acceptance_per_position == [a / t if t else 0.0 for a, t in zip(acc, trials)]


def _check_token_accounting(stats, result, n_new, max_k, recorder=None):
    """Tokens produced by the steps (each row: accepted + 1 per step) cover every output token after the
    first, overshooting by at most k per row (cut at max_new_tokens or EOS on the last step)."""
    produced = sum(stats.batch_size_per_step) + sum(stats.accepted_per_position)
    kept = sum(len(t) - 1 for t in result.token_ids)
    assert 0 <= produced - kept <= max_k * len(result.token_ids)
    if recorder is not None:  # the steps' own figures: what they drew, and what max_new_tokens let them keep
        assert sum(recorder.per_step("tokens_drawn")) == produced
        assert kept <= sum(recorder.per_step("tokens")) <= produced
    assert stats.generated_tokens == sum(len(t) for t in result.token_ids)
    assert stats.first_tokens == len(result.token_ids)
    assert all(1 <= len(t) <= n_new for t in result.token_ids)


def _check_times(stats, recorder):
    assert stats.prefill_s >= 0 and stats.total_s >= 0 and all(s >= 0 for s in recorder.step_s)
    passes_s = sum(seconds for rows in recorder.passes.values() for *_, seconds in rows)
    assert 0 <= passes_s <= sum(recorder.step_s) + 1e-9 and recorder.overhead_s() >= -1e-9
    assert stats.prefill_s + sum(recorder.step_s) <= stats.total_s + 1e-3
    reported = json.loads(json.dumps(stats.to_dict()))
    assert reported["wall_tokens_per_s"] == pytest.approx(stats.generated_tokens / stats.total_s)
    assert "tokens_per_s" not in reported  # perfmodel's name for the steady goodput b E / S, another quantity


@pytest.mark.parametrize("k", [1, 2, 4])
def test_schedule_draft_always_agrees(greedy_target, prompts8, k):
    result, recorder = _generate(SpeculativeGenerator(greedy_target, greedy_target), prompts8, N_NEW, FixedK(k))
    stats = result.stats
    # every row accepts all k, so from the second step on the draft lags by 2 (the bonus token and d_k)
    _check_schedule(stats, recorder, first_widths=[1] + [2] * (stats.steps - 1))
    _check_acceptance_counts(stats, result, fixed_k=k)
    assert stats.accepted_per_position == [sum(stats.batch_size_per_step)] * k
    _check_token_accounting(stats, result, N_NEW, k, recorder)
    _check_times(stats, recorder)


@pytest.mark.parametrize("k", [1, 3])
def test_schedule_draft_never_agrees(greedy_target, greedy_draft_never, prompts8, k):
    result, recorder = _generate(SpeculativeGenerator(greedy_target, greedy_draft_never), prompts8, N_NEW, FixedK(k))
    stats = result.stats
    _check_schedule(stats, recorder, first_widths=[1] * stats.steps)  # nothing accepted: lag stays 1
    _check_acceptance_counts(stats, result, fixed_k=k)
    assert stats.accepted_per_position == [0] * k
    _check_token_accounting(stats, result, N_NEW, k, recorder)
    # every row gains exactly one token per step: produced == kept
    assert sum(stats.batch_size_per_step) == sum(len(t) - 1 for t in result.token_ids)


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=1.0, top_k=20)], ids=["greedy", "sampled"])
def test_schedule_and_counts_draft_sometimes(greedy_target, greedy_draft_sometimes, prompts8, sampling):
    result, recorder = _generate(SpeculativeGenerator(greedy_target, greedy_draft_sometimes, eos_token_ids=(4,)),
                                 prompts8, N_NEW, FixedK(3), sampling, seed=3)
    stats = result.stats
    widths = _check_schedule(stats, recorder)
    assert widths[0] == 1 and set(widths) <= {1, 2}
    _check_acceptance_counts(stats, result, fixed_k=3)
    assert 0 < stats.accepted_per_position[0] < stats.trials_per_position[0]
    _check_token_accounting(stats, result, N_NEW, 3, recorder)
    _check_times(stats, recorder)
    sizes = stats.batch_size_per_step
    assert all(a >= b for a, b in zip(sizes, sizes[1:]))


def test_schedule_with_k_changing_and_zero(greedy_target, prompts8):
    """Draft = target, k by batch size with k = 0 steps in between: the catch-up width after j steps with
    k = 0 is j + 1 (first speculative step) or j + 2 (after a step where every row accepted all k)."""
    policy = MapPolicy({8: 2, 7: 2, 6: 0, 5: 0, 4: 3, 3: 0, 2: 1, 1: 4})
    result, recorder = _generate(SpeculativeGenerator(greedy_target, greedy_target, eos_token_ids=(4,)),
                                 prompts8, N_NEW, policy)
    stats = result.stats
    assert stats.k_per_step == [policy.mapping[b] for b in stats.batch_size_per_step]
    expected_widths, zeros, seen_speculative = [], 0, False
    for k in stats.k_per_step:
        if k == 0:
            zeros += 1
            continue
        expected_widths.append(zeros + (2 if seen_speculative else 1))
        zeros, seen_speculative = 0, True
    _check_schedule(stats, recorder, first_widths=expected_widths)
    assert 3 in expected_widths and len(set(stats.k_per_step)) >= 3 and stats.k_per_step[0] > 0
    _check_acceptance_counts(stats, result)
    _check_token_accounting(stats, result, N_NEW, policy.max_k, recorder)


def test_plain_generation_is_the_observed_one(greedy_target, greedy_draft_sometimes, prompts8):
    """An observer sees the steps, it changes nothing they produce."""
    generator = SpeculativeGenerator(greedy_target, greedy_draft_sometimes, eos_token_ids=(4,))
    for sampling in (Sampling(), Sampling(temperature=1.0)):
        plain = generator.generate(prompts8, N_NEW, FixedK(3), sampling, seed=5)
        observed, _ = _generate(generator, prompts8, N_NEW, FixedK(3), sampling, seed=5)
        assert observed.token_ids == plain.token_ids
        assert (observed.stats.k_per_step, observed.stats.accepted_per_position, observed.stats.trials_per_position) \
            == (plain.stats.k_per_step, plain.stats.accepted_per_position, plain.stats.trials_per_position)


def test_acceptance_tallies_by_their_definition():
    """Position i (1-based) is tried by every row that accepted i - 1 draft tokens or more, and accepted by
    every row that accepted i or more; a row keeping c tokens accepted c - 1."""
    rng = random.Random(3)
    accepted, trials = [], []
    steps = []
    for _ in range(40):
        depth = rng.randint(1, 6)
        counts = [rng.randint(1, depth + 1) for _ in range(rng.randint(1, 9))]
        steps.append((depth, counts))
        count_acceptance(accepted, trials, counts, depth)
    positions = range(1, max(depth for depth, _ in steps) + 1)
    assert trials == [sum(c - 1 >= i - 1 for d, counts in steps if d >= i for c in counts) for i in positions]
    assert accepted == [sum(c - 1 >= i for d, counts in steps if d >= i for c in counts) for i in positions]


# ------------------------------------------------------------------ against a naive reference implementation
@torch.no_grad()
def _argmax_next(model, seq):
    return int(model(torch.tensor([seq]))[0, -1].argmax())


@torch.no_grad()
def _naive_speculative_row(target, draft, prompt, n_new, k, eos):
    """Greedy speculative decoding of one row, the obvious way: full uncached forward passes, the draft
    proposing k tokens after the committed sequence, the target's argmax over those k + 1 positions.
    Returns the output tokens and the number of draft tokens accepted at every step."""
    seq = list(prompt) + [_argmax_next(target, prompt)]
    out, accepted = seq[len(prompt):], []
    while len(out) < n_new and not (set(out) & eos):
        proposals = []
        for _ in range(k):
            proposals.append(_argmax_next(draft, seq + proposals))
        choices = target(torch.tensor([seq + proposals]))[0, len(seq) - 1:].argmax(-1).tolist()
        a = 0
        while a < k and proposals[a] == choices[a]:
            a += 1
        accepted.append(a)
        seq += proposals[:a] + [choices[a]]
        out += proposals[:a] + [choices[a]]
    cut = next((i + 1 for i, t in enumerate(out) if t in eos), len(out))
    return out[:min(cut, n_new)], accepted


@pytest.mark.parametrize("k,eos", [(2, ()), (4, (4,))])
def test_acceptance_counts_match_naive_reference(greedy_target, greedy_draft_sometimes, prompts8, k, eos):
    """Per-position acceptance counts, steps and batch sizes equal those of a naive per-row reference:
    with a fixed k each row takes the same steps batched or alone, so a draft whose cache holds the wrong
    context (a bad catch-up or rollback) shows up here even though the output stays exact."""
    rows = [_naive_speculative_row(greedy_target, greedy_draft_sometimes, p, N_NEW, k, set(eos)) for p in prompts8]
    result = SpeculativeGenerator(greedy_target, greedy_draft_sometimes, eos_token_ids=eos).generate(
        prompts8, N_NEW, FixedK(k))
    stats = result.stats
    assert result.token_ids == [out for out, _ in rows]
    steps = [len(acc) for _, acc in rows]
    assert stats.batch_size_per_step == [sum(s > i for s in steps) for i in range(max(steps))]
    per_step = [a for _, acc in rows for a in acc]
    assert stats.accepted_per_position == [sum(a >= i for a in per_step) for i in range(1, k + 1)]
    assert stats.trials_per_position == [sum(a >= i - 1 for a in per_step) for i in range(1, k + 1)]
    assert 0 < stats.accepted_per_position[0] < stats.trials_per_position[0]
    assert any(a == k for a in per_step) and any(a < k for a in per_step)  # rows with lags 2 and 1 mix
