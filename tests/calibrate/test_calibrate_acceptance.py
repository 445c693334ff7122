"""The acceptance estimator: hand-computed sequences, pairs whose acceptance is known exactly, and the
runtime's own steps; the per-rank table for trees, against constructed pairs, an exact enumeration of
recursive rejection sampling and the runtime's full-tree steps."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from specbatch.calibrate.acceptance import (_sampled_ranks, conditional_acceptance, entry_from_rows, measure_acceptance,
                                  parse_acceptance, parse_sampling, rank_acceptance, read_prompts, score,
                                  target_continuations, tokens_per_step)
from specbatch.calibrate.errors import CalibrationError
from specbatch.calibrate.pass_clock import StepRecorder
from specbatch.perfmodel.acceptance import expected_tokens
from specbatch.perfmodel.tree import Strategy, make_tree
from specbatch.runtime.checkpoint import build_model
from specbatch.runtime.config import ModelConfig
from specbatch.runtime.generator import SpeculativeGenerator
from specbatch.runtime.policy import FixedK, FixedStrategy
from specbatch.runtime.sampling import Sampling

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
        recorder = StepRecorder("cpu")
        generator.generate(prompts, 64, FixedK(k), observer=recorder)
        kept = recorder.per_step("tokens")[:-2]  # drop the truncated last steps
        runtime = sum(kept) / len(kept)
        assert entry.tokens_per_step[k] == pytest.approx(runtime, rel=0.05)


# ---------------------------------------------------------------- rank acceptance, for trees
def test_rank_table_on_a_hand_computed_sequence():
    # ranks 0, 1, 3, >=4, 0, 0 with D = 2: a step at 0 accepts ranks 0 then 1 (both children exist in
    # the full 4-ary tree), plus the bonus token at 2; the next starts at 3: rank >= 4 ends it; at 4: 0, 0
    one_hot = np.zeros((6, 4))
    for position, rank in enumerate([0, 1, 3, 4, 0, 0]):
        if rank < 4:
            one_hot[position, rank] = 1.0
    table, reached = rank_acceptance([one_hot], 2)
    assert reached == [3.0, 2.0]  # steps at 0, 3, 4; depth 2 reached from 0 and 4
    assert table == [[2 / 3, 0.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]]


@pytest.mark.parametrize("row", [[1, 1, 0, 1, 1, 1, 0, 0, 1], [0.6, 0.9, 0.3, 0.8, 0.7, 0.95, 0.5]])
def test_rank_table_with_one_rank_follows_a_chain(row):
    """With R = 1 (only the draft's first choice) the table's steps are a chain's: its expected length
    is the step-aligned E(max_k), also with sampling's acceptance probabilities."""
    table, _ = rank_acceptance([np.array(row, dtype=float)[:, None]], 3)
    predicted = 1 + sum(np.prod([table[i][0] for i in range(d + 1)]) for d in range(3))
    assert predicted == pytest.approx(tokens_per_step([row], 3)[3], rel=1e-12)


def test_greedy_ranks_of_a_draft_whose_second_choice_is_always_the_targets():
    """Target: successor, i -> i + 1. Draft: the same LM head, shifted so that after i it prefers i + 2
    and then i + 1. The target's token is always the draft's rank-1 child: [0, 1, 0, 0] at every depth
    (a chain never gets past depth 1 with this draft; a tree does, every time)."""
    draft_head = torch.zeros(V, V)
    for token in range(V):
        draft_head[(token + 2) % V, token] = 2.0
        draft_head[(token + 1) % V, token] = 1.0
    target, draft = zero_layer_model(successor_head()), zero_layer_model(draft_head)
    entry = measure_acceptance(target, draft, [[1], [4, 3]], Sampling(), max_k=4, new_tokens=20)
    assert entry.rank_acceptance == ((0.0, 1.0, 0.0, 0.0),) * 4
    assert entry.per_position[0] == 0.0 and entry.tokens_per_step == (1.0,) * 5


def test_sampled_ranks_of_a_pair_with_known_ranks():
    """Target: (almost exactly) certain of token 3; draft: uniform over {3, 4} (top_k = 2). The first
    child is 3 half the time (accepted); else it is 4, rejected (p(4) = 0), and the residuals leave
    p = q = certainty of 3, the second child: accepted. So [1/2, 1/2, 0, 0] at every depth."""
    target_head, draft_head = torch.zeros(V, V), torch.zeros(V, V)
    target_head[3] = 40.0
    draft_head[[3, 4]] = 1.0
    entry = measure_acceptance(zero_layer_model(target_head), zero_layer_model(draft_head), [[0], [5, 6]],
                               Sampling(temperature=1.0, top_k=2), max_k=3, new_tokens=8)
    assert np.array(entry.rank_acceptance) == pytest.approx(np.array([[0.5, 0.5, 0.0, 0.0]] * 3), abs=1e-6)


def _exact_ranks(p: np.ndarray, q: np.ndarray, ranks: int) -> np.ndarray:
    """P(the runtime's recursive rejection sampling accepts child r) by enumerating every ordered draw
    of children without replacement from q (an oracle for the Monte Carlo)."""
    result = np.zeros(ranks)

    def walk(drawn, chance, p_now, q_now, alive):
        r = len(drawn)
        if r == ranks or alive == 0 or q_now.sum() <= 0:
            return
        for x in np.flatnonzero(q_now > 0):
            draw = chance * q_now[x]  # q_now is normalised: the law of the next child
            accept = min(1.0, p_now[x] / q_now[x])
            result[r] += draw * alive * accept
            residual = np.maximum(p_now - q_now, 0.0)
            p_next = residual / residual.sum() if residual.sum() > 0 else p_now
            q_left = q_now.copy()
            q_left[x] = 0.0
            q_next = q_left / q_left.sum() if q_left.sum() > 0 else q_left
            walk(drawn + [x], draw, p_next, q_next, alive * (1.0 - accept))

    walk([], 1.0, p, q, 1.0)
    return result


def test_sampled_ranks_against_an_exact_enumeration():
    rng = np.random.default_rng(5)
    p = rng.dirichlet(np.ones(6), size=3)
    q = rng.dirichlet(np.ones(6) * 0.7, size=3)
    q[0, [1, 4]] = 0.0  # a draft with a support of 4 tokens: a 4th child may be unusable
    q /= q.sum(1, keepdims=True)
    estimate = _sampled_ranks(torch.tensor(p, dtype=torch.float32), torch.tensor(q, dtype=torch.float32),
                              torch.Generator().manual_seed(0), draws=40000).numpy()
    for row in range(3):
        exact = _exact_ranks(p[row], q[row], 4)
        assert estimate[row, 0] == pytest.approx(exact[0], abs=1e-6)  # rank 0 is computed, not sampled
        assert estimate[row, 1:] == pytest.approx(exact[1:], abs=0.01)
        assert estimate[row].sum() <= 1.0 + 1e-9


def test_greedy_rank_table_matches_the_runtimes_full_tree():
    """The estimator against the runtime: a draft close to the target, and the full 4-ary tree of depth
    2 (20 nodes). Along the same greedy path the runtime's steps start where the table's do, so per
    depth the table's total (any rank accepted) is the runtime's count of accepted / reached."""
    config = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=128)
    target, draft = build_model(config, seed=7), build_model(config, seed=7)
    noise = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        target.lm_head.weight.mul_(40.0)  # wide logit gaps: no near-ties for float rounding to flip
        draft.lm_head.weight.copy_(target.lm_head.weight + 0.2 * target.lm_head.weight.std() * noise)
    prompt, new_tokens, depth = [3, 9, 27, 17], 60, 2
    [row] = score(target, draft, [prompt], Sampling(), new_tokens)
    ranks = row.ranks[1:]  # the runtime's first step drafts after the prefill's token
    table, reached = rank_acceptance([ranks], depth)
    assert 0.5 < table[0][0] < 0.9 and table[0][1] > 0.1 and reached[0] > reached[1] > 0  # every kind of step

    tree = make_tree([[r] for r in range(4)] + [[r, s] for r in range(4) for s in range(4)])
    recorder = StepRecorder("cpu")
    result = SpeculativeGenerator(target, draft).generate([prompt], new_tokens + 10, FixedStrategy(Strategy(tree)),
                                                          observer=recorder)
    continuation = target_continuations(target, [prompt], new_tokens, Sampling(), (), 0)[0]
    assert result.token_ids[0][:new_tokens] == continuation  # the same path
    step_tokens = recorder.per_step("tokens")
    starts = np.cumsum([0] + step_tokens[:-1])  # in `ranks` coordinates
    accepted = np.array(step_tokens) - 1
    inside = accepted[starts <= len(ranks) - depth]
    for d in range(depth):
        assert reached[d] == (inside >= d).sum()
        assert sum(table[d]) == pytest.approx((inside >= d + 1).sum() / (inside >= d).sum(), abs=1e-12)


def test_greedy_rank_zero_is_the_chains_acceptance_test():
    """Position by position, rank 0 is exactly the chain's m_j (argmax's tie rule), so its all-positions
    mean is the all-starts alpha_1; the table's depth-1 value is step-aligned and differs on purpose."""
    config = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=128)
    target, draft = build_model(config, seed=4), build_model(config, seed=5)
    prompts = [[3, 9, 27], [5], [1, 2, 3, 4, 5, 6]]
    rows = score(target, draft, prompts, Sampling(), 16)
    for row in rows:
        assert np.array_equal(row.ranks[:, 0], row.agreement)
        assert set(np.unique(row.ranks)) <= {0.0, 1.0} and (row.ranks.sum(1) <= 1).all()
    entry = entry_from_rows(rows, Sampling(), max_k=3, prompt_count=3)
    all_positions = np.concatenate([row.ranks[:, 0] for row in rows]).mean()
    assert entry.per_position[0] == pytest.approx(all_positions, abs=1e-12)
