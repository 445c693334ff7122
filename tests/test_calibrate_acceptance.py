"""The acceptance estimator: hand-computed sequences, and pairs whose acceptance is known exactly."""
from __future__ import annotations

import json

import pytest
import torch

from calibrate.acceptance import (conditional_acceptance, measure_acceptance, parse_acceptance, parse_sampling,
                                  read_prompts, tokens_per_step)
from calibrate.errors import CalibrationError
from runtime.checkpoint import build_model
from runtime.config import ModelConfig
from perfmodel.acceptance import expected_tokens
from runtime.generator import SpeculativeGenerator
from runtime.policy import FixedK
from runtime.sampling import Sampling

V = 8  # vocabulary of the constructed pairs


# ---------------------------------------------------------------- the estimator on hand-made sequences
def test_estimator_on_a_hand_computed_sequence():
    # m = 1 1 0 1: alpha_1 = 3/4 (3 of 4 starts); position 2 is reached from starts 0, 1 (m_t = 1, t <= 2)
    # and accepted from start 0 only (1/2); position 3 is reached from start 0 (m_0 m_1 = 1), rejected (0/1)
    alphas, reached = conditional_acceptance([[1, 1, 0, 1]], max_k=3)
    assert alphas == [0.75, 0.5, 0.0] and reached == [4.0, 2.0, 1.0]


def test_estimator_pools_rows_by_counts_not_by_averaging_rates():
    # row A: 1 0 (alpha_1 1/2), row B: 1 1 1 1 (alpha_1 4/4): pooled 5/6, not (1/2 + 1) / 2
    alphas, reached = conditional_acceptance([[1, 0], [1, 1, 1, 1]], max_k=2)
    assert alphas[0] == pytest.approx(5 / 6) and reached[0] == 6
    # position 2: A reaches it from start 0 (m_0 = 1) and fails; B reaches it 3 times and succeeds 3 times
    assert alphas[1] == pytest.approx(3 / 4) and reached[1] == 4


def test_estimator_with_probabilities_is_the_ratio_of_expected_counts():
    # sampling: m_j = beta_j; alpha_2 = (b0 b1 + b1 b2) / (b0 + b1)
    b = [0.5, 0.8, 0.25]
    alphas, reached = conditional_acceptance([b], max_k=2)
    assert alphas[0] == pytest.approx(sum(b) / 3)
    assert alphas[1] == pytest.approx((b[0] * b[1] + b[1] * b[2]) / (b[0] + b[1]))
    assert reached == pytest.approx([3.0, b[0] + b[1]])


def test_positions_beyond_every_sequence_are_never_reached():
    alphas, reached = conditional_acceptance([[1, 1]], max_k=4)
    assert alphas == [1.0, 1.0, 0.0, 0.0] and reached == [2.0, 1.0, 0.0, 0.0]


# ---------------------------------------------------------------- pairs with known acceptance
def zero_layer_model(lm_head: torch.Tensor):
    """A model whose next-token logits depend only on the current token: no layers, one-hot embeddings
    (RMSNorm scales e_i to sqrt(V) e_i), so the logits after token i are sqrt(V) * lm_head[:, i]."""
    config = ModelConfig(model_type="llama", vocab_size=V, hidden_size=V, num_layers=0, num_heads=1,
                         num_kv_heads=1, head_dim=V, intermediate_size=V, max_position_embeddings=128)
    model = build_model(config)
    with torch.no_grad():
        model.embed.weight.copy_(torch.eye(V))
        model.lm_head.weight.copy_(lm_head)
    return model


def successor_head(exceptions: dict[int, int] | None = None) -> torch.Tensor:
    """lm_head with argmax after token i = i + 1 mod V, except where `exceptions` says otherwise."""
    head = torch.zeros(V, V)
    for token in range(V):
        head[(exceptions or {}).get(token, (token + 1) % V), token] = 1.0
    return head


def test_greedy_pair_disagreeing_after_one_token_in_eight():
    """The target counts 0, 1, ..., 7, 0, ...; the draft agrees except after token 0 (it says 5, not 1).

    Every prompt ends in token 1, so the contexts of the 32 scored positions are 1, 2, ..., 7, 0, 1, ...:
    runs of 7 agreements then one disagreement. A run of 7 holds 8 - i windows of length i, so
    alpha_i = (8 - i) / (9 - i): 7/8 at position 1 (the agreement rate), then 6/7, ..., 1/2, and 0
    at position 8 (no run of 8). Each position is reached 4 (9 - i) times (4 periods)."""
    target = zero_layer_model(successor_head())
    draft = zero_layer_model(successor_head({0: 5}))
    prompts = [[1], [4, 1], [7, 7, 1]]  # different lengths: padding must not matter
    entry = measure_acceptance(target, draft, prompts, Sampling(), max_k=8, new_tokens=32)
    assert entry.per_position == pytest.approx([(8 - i) / (9 - i) for i in range(1, 9)], abs=1e-12)
    assert entry.trials == tuple(3 * 4 * (9 - i) for i in range(1, 9))
    assert (entry.mode, entry.source, entry.prompt_count) == ("greedy", "measured", 3)


def test_sampling_pair_with_overlap_one_half_everywhere():
    """Target: uniform over {2, 3} after every token; draft: uniform over {3, 4}. With top_k = 2 the
    distributions are exactly these, beta = min(.5, 0) + min(.5, .5) + min(0, .5) = 1/2 at every
    position, so every conditional acceptance is exactly 1/2, whatever path the target samples."""
    target_head, draft_head = torch.zeros(V, V), torch.zeros(V, V)
    target_head[[2, 3]] = 1.0
    draft_head[[3, 4]] = 1.0
    sampling = Sampling(temperature=1.0, top_k=2)
    entry = measure_acceptance(zero_layer_model(target_head), zero_layer_model(draft_head), [[0], [5, 6]],
                               sampling, max_k=4, new_tokens=10, seed=3)
    assert entry.per_position == (0.5, 0.5, 0.5, 0.5)
    assert (entry.mode, entry.temperature, entry.top_k, entry.top_p) == ("sampling", 1.0, 2, None)
    # expected times reached: sum over starts of 0.5^(i-1), 10 positions per prompt
    assert entry.trials == tuple(round(2 * (11 - i) * 0.5 ** (i - 1)) for i in range(1, 5))


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=0.8, top_p=0.9)])
def test_a_draft_identical_to_the_target_is_always_accepted(sampling):
    config = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=128)
    target = build_model(config, seed=4)
    twin = build_model(config, seed=4)
    prompts = [[3, 9, 27], [5], [1, 2, 3, 4, 5, 6]]
    entry = measure_acceptance(target, twin, prompts, sampling, max_k=5, new_tokens=12)
    assert entry.per_position == pytest.approx([1.0] * 5, abs=1e-6)
    assert entry.trials[0] == 3 * 12


# ---------------------------------------------------------------- options and prompts
def test_acceptance_option_extends_the_last_value():
    assert parse_acceptance("0.8", 3) == (0.8, 0.8, 0.8)
    assert parse_acceptance("0.9,0.7", 4) == (0.9, 0.7, 0.7, 0.7)
    for bad, message in (("1.5", "outside"), ("x", "not a number"), ("0.9,0.8,0.7", "more than --max-k")):
        with pytest.raises(CalibrationError, match=f"--acceptance.*{message}"):
            parse_acceptance(bad, 2)


def test_sampling_option():
    assert parse_sampling("greedy") == Sampling()
    assert parse_sampling("T=0.7,top_k=40") == Sampling(temperature=0.7, top_k=40)
    for bad in ("T=0", "hot", "T=0.7,top_q=1"):
        with pytest.raises(CalibrationError, match="--sampling"):
            parse_sampling(bad)


def test_prompts_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps("def f(x):\n") + "\n\nplain text line\n")
    assert read_prompts(path) == ["def f(x):\n", "plain text line"]
    path.write_text("\n  \n")
    with pytest.raises(CalibrationError, match="holds no prompts"):
        read_prompts(path)
    path.write_text('{"prompt": "x"}\n')
    with pytest.raises(CalibrationError, match="prompts.jsonl:1: a JSON line must be a string"):
        read_prompts(path)


# ---------------------------------------------------------------- tokens per step, step-aligned
def test_tokens_per_step_on_a_hand_computed_sequence():
    # m = 1 1 0 1. k = 1: steps start at 0 (accept, +1 bonus: 2 tokens), 2 (reject: 1), 3 (accept: 2) -> 5/3.
    # k = 2: a step at 0 accepts both (3 tokens); the next would start at 3, whose window leaves the row.
    assert tokens_per_step([[1, 1, 0, 1]], 2) == pytest.approx([1.0, 5 / 3, 3.0])


def test_tokens_per_step_differs_from_the_all_starts_formula_when_failures_cluster():
    # runs of 3 agreements then one disagreement: a step starting at a run's head accepts 3 at k = 3,
    # the runtime always starts there, while the all-starts alphas also average in starts mid-run
    row = [1, 1, 1, 0] * 8
    per_step = tokens_per_step([row], 3)
    assert per_step[3] == pytest.approx(4.0)  # every step: 3 accepted + the target's token
    alphas, _ = conditional_acceptance([row], 3)
    assert expected_tokens(alphas, 3) < per_step[3]  # here the formula under-counts; clustering decides


def test_tokens_per_step_matches_the_formula_for_independent_acceptance():
    # with the same probability everywhere both views agree: E(k) = 1 + b + ... + b^k
    per_step = tokens_per_step([[0.6] * 50], 4)
    assert per_step == pytest.approx([sum(0.6 ** i for i in range(k + 1)) for k in range(5)])


def test_tokens_per_step_equals_the_runtimes_own_count():
    """The estimator against the runtime: a pair with a known agreement pattern, generated with FixedK(k)
    from the same prompt; the runtime's tokens per step over the steps inside the continuation."""
    target = zero_layer_model(successor_head())
    draft = zero_layer_model(successor_head({0: 5, 3: 6}))  # disagrees after tokens 0 and 3
    prompts = [[1]]
    entry = measure_acceptance(target, draft, prompts, Sampling(), max_k=4, new_tokens=64)
    generator = SpeculativeGenerator(target, draft)
    for k in range(1, 5):
        stats = generator.generate(prompts, 64, FixedK(k)).stats
        runtime = sum(stats.step_tokens[:-2]) / len(stats.step_tokens[:-2])  # drop the truncated last steps
        assert entry.tokens_per_step[k] == pytest.approx(runtime, rel=0.05)
