"""Sampling losslessness: speculative sampling draws from exactly the target's distribution.

Oracle: on a 6-token vocabulary, the exact distribution of the first three generated tokens under
target-only sampling, computed from the target's probabilities (`runtime.sampling.probabilities`, with
the same temperature / top-k / top-p) over all 6**2 prefixes. The empirical distribution of thousands
of rows of speculative sampling (one `generate` call, identical prompts) must pass a chi-square test at
ALPHA; the same test, at the same sample size, must reject the distributions of wrong implementations
(draft tokens accepted blindly, a greedy draft as in transformers issue #32867, rejection resampled from
p instead of norm(max(0, p - q))), so a wrong runtime could not pass.

`accept` itself is checked exactly: with the uniform draws replaced by a grid and the final sampling
recorded, the probability of every outcome is enumerated in rational steps and equals p.

`parse_sampling` reads the --sampling option into the same settings, or says in one line what is wrong.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

scipy_stats = pytest.importorskip("scipy.stats")

from specbatch.runtime import acceptance as acceptance_module  # noqa: E402
from specbatch.runtime.checkpoint import build_model  # noqa: E402
from specbatch.runtime.acceptance import accept  # noqa: E402
from specbatch.runtime.generator import SpeculativeGenerator  # noqa: E402
from specbatch.runtime.policy import FixedK  # noqa: E402
from specbatch.runtime.sampling import Sampling, SamplingError, parse_sampling, probabilities  # noqa: E402

V = 6
ROWS = 5000
ALPHA = 1e-3
PROMPT = [1, 4, 2, 5]
CASES = [  # (k, sampling)
    (1, Sampling(temperature=1.2, top_p=0.8)),  # k = 1: the bonus token is sampled from p
    (2, Sampling(temperature=1.0)),
    (3, Sampling(temperature=0.7, top_k=4)),
]


@pytest.fixture(scope="module")
def pair(llama_config_factory, peaked, make_noisy_copy):
    """A 6-token target with varied, non-degenerate distributions and a smaller, different draft
    (acceptance about 0.6)."""
    config = llama_config_factory(vocab_size=V, hidden_size=16, num_heads=2, num_kv_heads=1, intermediate_size=32)
    target = peaked(build_model(config, seed=21), 15.0)
    draft = make_noisy_copy(target, num_layers=1, noise=0.8, seed=22)
    return target, draft


@torch.no_grad()
def _exact(model, sampling: Sampling):
    """p1 (V,), p2 (V, V) = P(t2 | t1), p3 (V, V, V) = P(t3 | t1, t2): every prefix in one uncached pass."""
    seqs = torch.tensor([PROMPT + [a, b] for a in range(V) for b in range(V)])
    probs = probabilities(model(seqs), sampling).double()  # (V*V, len, V)
    n = len(PROMPT)
    return probs[0, n - 1], probs[::V, n], probs[:, n + 1].reshape(V, V, V)


def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-square goodness of fit; cells of probability 0 must be empty; cells with an expected count
    below 5 are pooled (smallest first) until the pool reaches 5."""
    counts, probs = counts.ravel().astype(float), probs.ravel().astype(float)
    zero = probs <= 0
    assert counts[zero].sum() == 0, "a token of probability 0 was generated"
    counts, probs = counts[~zero], probs[~zero] / probs[~zero].sum()
    expected = probs * counts.sum()
    order = np.argsort(expected)
    pooled, cut = 0.0, 0
    while cut < len(order) and (expected[order[cut]] < 5 or 0 < pooled < 5):
        pooled += expected[order[cut]]
        cut += 1
    small, big = order[:cut], order[cut:]
    obs = np.append(counts[big], counts[small].sum()) if cut else counts[big]
    exp = np.append(expected[big], expected[small].sum()) if cut else expected[big]
    assert len(obs) >= 2
    return float(scipy_stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


def _rejects(counts: np.ndarray, probs: np.ndarray) -> bool:
    """Whether the goodness-of-fit test rejects `probs` for `counts` (a count in a cell of probability 0
    is an outright rejection)."""
    if counts[probs <= 0].sum() > 0:
        return True
    return _chi2_pvalue(counts, probs) < ALPHA


def _counts(token_ids, n_tokens: int) -> np.ndarray:
    arr = np.array([t[:n_tokens] for t in token_ids])
    out = np.zeros((V,) * n_tokens)
    np.add.at(out, tuple(arr[:, i] for i in range(n_tokens)), 1)
    return out


def _wrong_second_token(p2: torch.Tensor, q2: torch.Tensor, kind: str) -> torch.Tensor:
    """P(t2 | t1) (V, V) under a wrong first-draft-position rule."""
    if kind == "accept_all":  # every draft token accepted: t2 comes from the draft
        return q2
    accept_ratio = torch.minimum(torch.ones_like(p2), p2 / q2.clamp_min(1e-300))
    if kind == "greedy_draft":  # draft proposes its argmax, accepted with min(1, p/q), else the residual
        g = q2.argmax(-1)
        rows = torch.arange(V)
        a = accept_ratio[rows, g]
        residual = (p2 - q2).clamp_min(0)
        residual = residual / residual.sum(-1, keepdim=True).clamp_min(1e-300)
        out = (1 - a)[:, None] * residual
        out[rows, g] += a
        return out
    if kind == "resample_from_p":  # correct accept test, but a rejection resamples from p itself
        accepted_mass = torch.minimum(p2, q2)
        return accepted_mass + (1 - accepted_mass.sum(-1, keepdim=True)) * p2
    raise ValueError(kind)


# ---------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("k,sampling", CASES, ids=[f"k{k}-{s.describe()}" for k, s in CASES])
def test_speculative_sampling_matches_exact_target_distribution(pair, k, sampling):
    target, draft = pair
    p1, p2, p3 = _exact(target, sampling)
    joint3 = (p1[:, None, None] * p2[:, :, None] * p3).numpy()
    result = SpeculativeGenerator(target, draft).generate([PROMPT] * ROWS, 3, FixedK(k), sampling, seed=1234)
    assert all(len(t) == 3 for t in result.token_ids)
    stats = result.stats
    assert stats.k_per_step and set(stats.k_per_step) == {k}
    assert 0.2 < stats.acceptance_per_position[0] < 0.95  # the draft really differs from the target
    counts3 = _counts(result.token_ids, 3)
    assert _chi2_pvalue(counts3, joint3) > ALPHA
    assert _chi2_pvalue(counts3.sum((1, 2)), p1.numpy()) > ALPHA
    assert _chi2_pvalue(counts3.sum(2), (p1[:, None] * p2).numpy()) > ALPHA

    # the same test, at the same sample size, rejects what wrong implementations would produce
    _, q2, _ = _exact(draft, sampling)
    joint2 = (p1[:, None] * p2).numpy()
    counts2 = counts3.sum(2)
    rng = np.random.default_rng(0)
    for kind in ("accept_all", "greedy_draft", "resample_from_p"):
        wrong = (p1[:, None] * _wrong_second_token(p2, q2, kind)).numpy()
        wrong = wrong / wrong.sum()
        assert np.abs(wrong - joint2).sum() > 0.02, kind
        # what the runtime produced is far from the wrong distribution ...
        assert _rejects(counts2, wrong), kind
        # ... and a sample of the wrong distribution fails the test the runtime passes
        fake = rng.multinomial(ROWS, wrong.ravel()).reshape(V, V)
        assert _rejects(fake, joint2), kind


@pytest.fixture(scope="module")
def gemma_pair(peaked, make_noisy_copy):
    """A 6-token Gemma 3 target (query scale, window 3 on the first layer, soft-capped logits) and a draft of
    another family (Qwen3) over the same vocabulary."""
    from specbatch.runtime.config import config_from_dict

    small = dict(vocab_size=V, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=8, max_position_embeddings=64)
    target = peaked(build_model(config_from_dict(dict(
        small, model_type="gemma3_text", num_hidden_layers=2, query_pre_attn_scalar=12, sliding_window=3,
        sliding_window_pattern=2, final_logit_softcapping=20.0)), seed=23), 4.0)
    draft = peaked(build_model(config_from_dict(dict(small, model_type="qwen3", num_hidden_layers=1)), seed=24), 4.0)
    return target, draft


def test_speculative_sampling_of_a_gemma3_target_with_a_qwen3_draft(gemma_pair):
    """The exact test above, for a new family (and a prompt longer than its window) with a cross-family draft."""
    _assert_sampled_exactly(*gemma_pair, seed=4321)


def _assert_sampled_exactly(target, draft, seed: int) -> None:
    """k = 2 at temperature 1 over ROWS copies of PROMPT: the drafts are accepted and rejected, the first three
    tokens follow the target's exact joint distribution, and a verifier that accepted every draft is rejected."""
    sampling = Sampling(temperature=1.0)
    p1, p2, p3 = _exact(target, sampling)
    result = SpeculativeGenerator(target, draft).generate([PROMPT] * ROWS, 3, FixedK(2), sampling, seed=seed)
    assert 0.1 < result.stats.acceptance_per_position[0] < 0.95
    joint3 = (p1[:, None, None] * p2[:, :, None] * p3).numpy()
    assert _chi2_pvalue(_counts(result.token_ids, 3), joint3) > ALPHA
    _, q2, _ = _exact(draft, sampling)
    wrong = (p1[:, None] * _wrong_second_token(p2, q2, "accept_all")).numpy()
    assert _rejects(_counts(result.token_ids, 3).sum(2), wrong / wrong.sum())


@pytest.fixture(scope="module")
def moe_pair(peaked, make_noisy_copy):
    """A 6-token GLM-4.5 mixture-of-experts target (a dense first layer, then 8 experts top-2 under sigmoid grouped
    routing with a shared expert; half-rotary heads) and a Mixtral draft (8 experts top-2) over the same vocabulary.
    Routing is per token, so rows sharing a pass (5000 identical prompts, verify passes of k + 1 tokens) touch
    each other's experts without changing any row's distribution."""
    from specbatch.runtime.config import config_from_dict

    small = dict(vocab_size=V, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=8, max_position_embeddings=64, num_experts_per_tok=2)
    target = peaked(build_model(config_from_dict(dict(
        small, model_type="glm4_moe", num_hidden_layers=3, n_routed_experts=8, moe_intermediate_size=16,
        first_k_dense_replace=1, n_group=4, topk_group=2, routed_scaling_factor=2.5)), seed=25), 15.0)
    with torch.no_grad():  # routers that pick different experts for different tokens
        for layer in target.layers[1:]:
            layer.experts.router.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(26))
    draft = peaked(build_model(config_from_dict(dict(
        small, model_type="mixtral", num_hidden_layers=1, num_local_experts=8, intermediate_size=16)), seed=27), 4.0)
    return target, draft


def test_speculative_sampling_of_a_mixture_of_experts_target(moe_pair):
    """The exact test above for a mixture-of-experts target with a mixture-of-experts draft."""
    _assert_sampled_exactly(*moe_pair, seed=2468)


def test_target_only_sampling_matches_exact_distribution(pair):
    target, _ = pair
    sampling = Sampling(temperature=0.9, top_k=5, top_p=0.95)
    p1, p2, p3 = _exact(target, sampling)
    result = SpeculativeGenerator(target, None).generate([PROMPT] * ROWS, 3, FixedK(0), sampling, seed=99)
    assert _chi2_pvalue(_counts(result.token_ids, 3), (p1[:, None, None] * p2[:, :, None] * p3).numpy()) > ALPHA


def test_sampling_is_seeded(pair):
    target, draft = pair
    sampling = Sampling(temperature=1.0)
    runs = [SpeculativeGenerator(target, draft).generate([PROMPT] * 20, 6, FixedK(2), sampling, seed=s).token_ids
            for s in (7, 7, 8)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


# ------------------------------------------------------------------------- probabilities(), the oracle
def test_probabilities_by_hand():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log()
    assert torch.allclose(probabilities(logits, Sampling(temperature=1.0)), logits.exp(), atol=1e-6)
    # nucleus 0.75: 0.5 and 0.3 are kept (the mass ranked above 0.15 is already 0.8)
    assert torch.allclose(probabilities(logits, Sampling(temperature=1.0, top_p=0.75)),
                          torch.tensor([0.625, 0.375, 0.0, 0.0]), atol=1e-6)
    assert torch.allclose(probabilities(logits, Sampling(temperature=1.0, top_k=3)),
                          torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95, atol=1e-6)
    squared = torch.tensor([0.25, 0.09, 0.0225, 0.0025])  # temperature 0.5 squares the probabilities
    assert torch.allclose(probabilities(logits, Sampling(temperature=0.5)), squared / squared.sum(), atol=1e-6)


@pytest.mark.parametrize("sampling", [
    Sampling(temperature=0.7), Sampling(temperature=1.3, top_k=5), Sampling(temperature=1.0, top_p=0.9),
    Sampling(temperature=0.8, top_k=10, top_p=0.7), Sampling(temperature=1.0, top_p=0.3),
], ids=lambda s: s.describe())
def test_probabilities_match_transformers_warpers(sampling):
    """temperature, then top-k, then top-p, as transformers' sampling applies them."""
    lp = pytest.importorskip("transformers.generation.logits_process")
    logits = 3.0 * torch.randn(16, 32, generator=torch.Generator().manual_seed(0))
    scores = lp.TemperatureLogitsWarper(sampling.temperature)(None, logits.clone())
    if sampling.top_k:
        scores = lp.TopKLogitsWarper(sampling.top_k)(None, scores)
    if sampling.top_p < 1.0:
        scores = lp.TopPLogitsWarper(sampling.top_p)(None, scores)
    expected = torch.softmax(scores, dim=-1)
    ours = probabilities(logits, sampling)
    assert torch.allclose(ours, expected, atol=1e-6)
    assert ((ours > 0) == (expected > 0)).all()


# ------------------------------------------------------------------------------ accept(), enumerated
GRID = 8  # uniform draws at the midpoints of 8 equal cells: exact for ratios p/q that are multiples of 1/8


def _grid_rand(k: int):
    """A stand-in for torch.rand((b, k)): row r gets the r-th point of a GRID**k midpoint grid."""
    points = (torch.arange(GRID, dtype=torch.float32) + 0.5) / GRID
    grid = torch.cartesian_prod(*([points] * k)).reshape(-1, k)

    def fake_rand(size, generator=None, device=None, **kwargs):
        b, kk = size
        assert kk == k and b % len(grid) == 0
        return grid.repeat(b // len(grid), 1)

    return fake_rand


def _enumerate_accept(monkeypatch, p: torch.Tensor, q: torch.Tensor):
    """Run accept() on every draft proposal (all V**k token tuples) x every grid point of the uniforms,
    recording the distribution each row's final token is drawn from. Returns, per row: the proposal
    tuple, its probability under q, the accepted count and the final distribution."""
    k, vocab = q.shape
    proposals = torch.cartesian_prod(*([torch.arange(vocab)] * k)).reshape(-1, k)  # (vocab**k, k)
    per = GRID ** k
    draft_tokens = proposals.repeat_interleave(per, dim=0)  # (rows, k)
    rows = draft_tokens.shape[0]
    recorded = []

    def fake_sample(probs, generator):
        recorded.append(probs.clone())
        return torch.zeros(probs.shape[:-1], dtype=torch.long)

    monkeypatch.setattr(acceptance_module.torch, "rand", _grid_rand(k))
    monkeypatch.setattr(acceptance_module, "sample", fake_sample)
    logits = p.log().expand(rows, k + 1, vocab)  # softmax(log p) = p at temperature 1
    draft_probs = q.expand(rows, k, vocab)
    accepted, _ = accept(draft_tokens, draft_probs, logits, Sampling(temperature=1.0), None)
    monkeypatch.undo()
    assert len(recorded) == 1
    weight = q[torch.arange(k), draft_tokens].prod(-1) / per  # P(proposal) x P(grid cell)
    return draft_tokens, weight.double(), accepted, recorded[0].double()


def test_accept_k1_outcome_distribution_is_exactly_p(monkeypatch):
    p = torch.tensor([[0.5, 0.25, 0.25], [0.125, 0.375, 0.5]])  # position 1, bonus position 2
    q = torch.tensor([[0.25, 0.5, 0.25]])  # p/q = 2, 0.5, 1
    tokens, weight, accepted, final = _enumerate_accept(monkeypatch, p, q)
    # acceptance rate of draft token x is exactly min(1, p/q)
    for x, rate in enumerate((1.0, 0.5, 1.0)):
        assert float(accepted[tokens[:, 0] == x].float().mean()) == rate
    first = torch.zeros(3, dtype=torch.float64)  # P(first output token)
    second_given_all = torch.zeros(3, dtype=torch.float64)
    for r in range(tokens.shape[0]):
        if accepted[r] == 1:
            first[tokens[r, 0]] += weight[r]
            second_given_all += weight[r] * final[r]  # the bonus token: drawn from p at position 2
        else:
            first += weight[r] * final[r]  # rejection: drawn from norm(max(0, p - q))
    assert torch.allclose(first, p[0].double(), atol=1e-6)
    assert torch.allclose(second_given_all / second_given_all.sum(), p[1].double(), atol=1e-6)
    # the residual after rejecting token 1 is norm(max(0, p - q)) = (1, 0, 0)
    rejected = accepted == 0
    assert torch.allclose(final[rejected], torch.tensor([1.0, 0.0, 0.0], dtype=torch.float64), atol=1e-6)


def test_accept_k2_joint_of_two_tokens_is_exactly_p(monkeypatch):
    """k = 2 with position-wise distributions (a 'model' whose p does not depend on the prefix): the joint
    of the first two output tokens equals p1 x p2, counting for rows that stop after one token the next
    step's token, which (by the k = 1 result) is distributed as p2."""
    p = torch.tensor([[0.5, 0.25, 0.25], [0.25, 0.25, 0.5], [0.375, 0.375, 0.25]])
    q = torch.tensor([[0.25, 0.5, 0.25], [0.5, 0.25, 0.25]])  # ratios 2, .5, 1 and .5, 1, 2
    tokens, weight, accepted, final = _enumerate_accept(monkeypatch, p, q)
    joint = torch.zeros(3, 3, dtype=torch.float64)
    for r in range(tokens.shape[0]):
        a = int(accepted[r])
        if a == 0:  # first token from the residual, second from the next step (p2)
            joint += weight[r] * torch.outer(final[r], p[1].double())
        elif a == 1:  # first token is draft token 1, second from the residual at position 2
            joint[tokens[r, 0]] += weight[r] * final[r]
        else:  # both draft tokens accepted (the bonus token is the third)
            joint[tokens[r, 0], tokens[r, 1]] += weight[r]
    assert torch.allclose(joint, torch.outer(p[0], p[1]).double(), atol=1e-6)
    assert abs(float(weight.sum()) - 1.0) < 1e-9


def test_accept_greedy():
    logits = torch.tensor([[[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]],
                           [[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]],
                           [[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]]])
    draft = torch.tensor([[1, 0], [1, 2], [0, 0]])
    accepted, nxt = accept(draft, None, logits, Sampling(), None)
    assert accepted.tolist() == [2, 1, 0]
    assert nxt.tolist() == [2, 0, 1]


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=1.0)])
def test_per_position_synthetic_acceptance_draws_the_exact_accepted_counts(sampling):
    """Synthetic acceptance (0.9, 0.5) at k = 3: position 1 accepted with 0.9, positions 2 and 3 with 0.5
    each given the ones before (the last value repeats), so P(0, 1, 2, 3 accepted) = 0.1, 0.45, 0.225,
    0.225 exactly; 40,000 rows pass a chi-square test, and one probability for all positions (0.9) would not."""
    rows, k = 40_000, 3
    rng = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, k + 1, V, generator=rng)
    draft_tokens = torch.randint(0, V, (rows, k), generator=rng)
    draft_probs = torch.softmax(torch.randn(rows, k, V, generator=rng), -1)
    accepted, _ = accept(draft_tokens, draft_probs, logits, sampling, rng, (0.9, 0.5))
    counts = np.bincount(accepted.numpy(), minlength=k + 1)
    exact = np.array([0.1, 0.45, 0.225, 0.225])
    assert scipy_stats.chisquare(counts, rows * exact).pvalue > ALPHA
    constant = np.array([0.1, 0.09, 0.081, 0.729])
    assert scipy_stats.chisquare(counts, rows * constant).pvalue < ALPHA


# ------------------------------------------------------------------------------- the --sampling option
@pytest.mark.parametrize("text, expected", [
    ("greedy", Sampling()), ("T=0.8", Sampling(temperature=0.8)),
    ("T=1,top_k=5,top_p=0.9", Sampling(temperature=1.0, top_k=5, top_p=0.9)),
])
def test_parse_sampling(text, expected):
    assert parse_sampling(text) == expected


@pytest.mark.parametrize("text", ["hot", "T=0", "T=x", "top_k=5", "T=0.8,top_p=2"])
def test_parse_sampling_refuses(text):
    with pytest.raises(SamplingError, match="--sampling"):
        parse_sampling(text)


def test_speculative_sampling_with_a_draft_padded_to_the_targets_vocabulary(pair):
    """A draft over the target's first V - 1 ids (its logits padded with -inf: q is 0 on the last id, which the
    draft reads as its own last when the target produces it): still exactly the target's distribution."""
    target, draft = pair
    small = build_model(replace(draft.config, vocab_size=V - 1), seed=0)
    with torch.no_grad():
        for name, param in small.named_parameters():
            source = dict(draft.named_parameters())[name]
            param.copy_(source[:V - 1] if name in ("embed.weight", "lm_head.weight") else source)
    small.pad_vocabulary_to(V)
    sampling = Sampling(temperature=1.0)
    p1, p2, p3 = _exact(target, sampling)
    result = SpeculativeGenerator(target, small).generate([PROMPT] * ROWS, 3, FixedK(2), sampling, seed=99)
    assert 0.1 < result.stats.acceptance_per_position[0] < 0.95
    counts = _counts(result.token_ids, 3)
    assert counts[V - 1].sum() > 0  # the target did produce the id the draft has no row for
    joint3 = (p1[:, None, None] * p2[:, :, None] * p3).numpy()
    assert _chi2_pvalue(counts, joint3) > ALPHA
