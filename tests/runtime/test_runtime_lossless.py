"""Greedy losslessness: speculative output equals target-only greedy output, token for token.

Oracles: a naive uncached argmax loop over the target, the generator with no draft (k = 0), and
`transformers` `generate(do_sample=False)` on the same checkpoint. Drafts: the target itself (every
token accepted), a noisy smaller copy (accepted some of the time) and the target with a permuted LM
head (never accepted).
"""
from __future__ import annotations

import pytest
import torch

from specbatch.runtime.generator import SpeculativeGenerator
from specbatch.runtime.policy import FixedK
from lossless_helpers import naive_greedy

N_NEW = 16
BATCHES = {1: [4], 3: [0, 1, 2], 8: list(range(8))}  # batch size -> indices into prompts8


@pytest.fixture(scope="module")
def reference(greedy_target, prompts8):
    """Target-only greedy output (k = 0, no draft) for each batch of prompts."""
    out = {}
    for size, index in BATCHES.items():
        result = SpeculativeGenerator(greedy_target, None).generate([prompts8[i] for i in index], N_NEW, FixedK(0))
        assert result.stats.k_per_step == [0] * result.stats.steps
        out[size] = result.token_ids
    return out



def test_target_only_equals_naive_greedy(greedy_target, prompts8, reference):
    expected = [naive_greedy(greedy_target, p, N_NEW) for p in prompts8]
    assert reference[8] == expected
    assert reference[3] == expected[:3]
    assert reference[1] == [expected[4]]
    assert all(len(t) == N_NEW for t in expected)


@pytest.mark.parametrize("k", [1, 2, 5])
@pytest.mark.parametrize("size", [1, 3, 8])
@pytest.mark.parametrize("kind", ["always", "sometimes", "never"])
def test_speculative_greedy_equals_target_only(kind, size, k, greedy_target, greedy_draft_sometimes,
                                               greedy_draft_never, prompts8, reference):
    draft = {"always": greedy_target, "sometimes": greedy_draft_sometimes, "never": greedy_draft_never}[kind]
    prompts = [prompts8[i] for i in BATCHES[size]]
    result = SpeculativeGenerator(greedy_target, draft).generate(prompts, N_NEW, FixedK(k))
    assert result.token_ids == reference[size]
    stats = result.stats
    assert stats.k_per_step == [k] * stats.steps
    assert len(stats.accepted_per_position) == len(stats.trials_per_position) == k
    if kind == "always":  # the draft is the target: every draft token at every position is accepted
        assert all(t > 0 for t in stats.trials_per_position[:min(k, 2)])
        assert stats.accepted_per_position == stats.trials_per_position
        assert all(a == 1.0 for a, t in zip(stats.acceptance_per_position, stats.trials_per_position) if t)
        # every row gains k + 1 tokens per step: ceil((N - 1) / (k + 1)) steps
        assert stats.steps == -(-(N_NEW - 1) // (k + 1))
    elif kind == "never":  # the first draft token is always rejected, so later positions are never tried
        assert stats.accepted_per_position == [0] * k
        assert stats.trials_per_position == [sum(stats.batch_size_per_step)] + [0] * (k - 1)
        assert stats.steps == N_NEW - 1
    assert stats.generated_tokens == sum(len(t) for t in result.token_ids) == size * N_NEW


def test_sometimes_draft_is_really_partial(greedy_target, greedy_draft_sometimes, prompts8, reference):
    """The "sometimes" draft agrees neither always nor never, at more than one position."""
    result = SpeculativeGenerator(greedy_target, greedy_draft_sometimes).generate(prompts8, N_NEW, FixedK(5))
    assert result.token_ids == reference[8]
    rates = result.stats.acceptance_per_position
    assert 0.2 < rates[0] < 0.8, rates
    assert 0 < result.stats.accepted_per_position[1] < result.stats.trials_per_position[1]
    # rows accepted different numbers of tokens: more steps than all-accept, fewer than none
    assert -(-(N_NEW - 1) // 6) < result.stats.steps < N_NEW - 1


def test_short_prompts_and_tiny_budgets(greedy_target, greedy_draft_sometimes):
    """One-token prompts next to a long one; max_new_tokens of 1 (prefill only) and 2."""
    prompts = [[7], [9, 10], [3] * 20, [5]]
    reference = SpeculativeGenerator(greedy_target, None).generate(prompts, 10, FixedK(0)).token_ids
    assert reference == [naive_greedy(greedy_target, p, 10) for p in prompts]
    for k in (1, 3, 6):
        result = SpeculativeGenerator(greedy_target, greedy_draft_sometimes).generate(prompts, 10, FixedK(k))
        assert result.token_ids == reference
    for n in (1, 2):
        result = SpeculativeGenerator(greedy_target, greedy_draft_sometimes).generate(prompts, n, FixedK(3))
        assert result.token_ids == [r[:n] for r in reference]
        assert result.stats.steps == n - 1


def test_eos_row_stops_and_leaves_the_batch(greedy_target, greedy_draft_sometimes, prompts8, reference):
    """Pick an EOS id that one row's greedy output contains (not as its first token) and some other row's
    output lacks: that row stops there, EOS included; the others go on to max_new_tokens."""
    outputs = reference[8]
    eos, stop_row = None, None
    for row, tokens in enumerate(outputs):
        for pos in range(2, N_NEW - 4):
            candidate = tokens[pos]
            if candidate not in tokens[:pos] and any(candidate not in other for other in outputs):
                eos, stop_row = candidate, row
                break
        if eos is not None:
            break
    assert eos is not None, "no usable EOS candidate in the reference outputs"
    expected = [t[:t.index(eos) + 1] if eos in t else t for t in outputs]
    assert len(expected[stop_row]) < N_NEW and any(len(t) == N_NEW for t in expected)

    target_only = SpeculativeGenerator(greedy_target, None, eos_token_ids=(eos,)).generate(prompts8, N_NEW, FixedK(0))
    assert target_only.token_ids == expected
    for k in (1, 3):
        result = SpeculativeGenerator(greedy_target, greedy_draft_sometimes, eos_token_ids=(eos,)).generate(
            prompts8, N_NEW, FixedK(k))
        assert result.token_ids == expected
        sizes = result.stats.batch_size_per_step
        assert sizes[0] == sum(1 for t in expected if len(t) > 1)
        assert all(a >= b for a, b in zip(sizes, sizes[1:]))
        assert sizes[-1] < sizes[0]


# ------------------------------------------------------------------------------- against transformers
@pytest.fixture(scope="module")
def hf_pair(tmp_path_factory, randomize, make_noisy_copy):
    """A transformers Llama target (peaked logits) saved to disk, loaded both ways, plus a noisy draft."""
    transformers = pytest.importorskip("transformers")
    from specbatch.runtime.checkpoint import load_checkpoint

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    hf = randomize(transformers.LlamaForCausalLM(config), seed=7)
    with torch.no_grad():
        hf.lm_head.weight.mul_(8.0)
    directory = tmp_path_factory.mktemp("hf_target")
    hf.save_pretrained(str(directory))
    ours = load_checkpoint(directory)
    assert ours.eos_token_ids == (2,)
    draft = make_noisy_copy(ours.model, num_layers=1, noise=0.3, seed=5)
    return hf, ours, draft


@torch.no_grad()
def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                      min_new_tokens=0, num_beams=1)
    return out[0, len(prompt):].tolist()


def test_matches_transformers_generate(hf_pair, prompts8):
    hf, ours, draft = hf_pair
    prompts = [prompts8[i] for i in (1, 2, 4)]  # 3, 9 and 17 tokens
    expected = [_hf_greedy(hf, p, N_NEW) for p in prompts]
    assert len({tuple(e) for e in expected}) == 3
    eos = ours.eos_token_ids
    for p, e in zip(prompts, expected):  # batch size 1, per prompt
        assert SpeculativeGenerator(ours.model, None, eos).generate([p], N_NEW, FixedK(0)).token_ids == [e]
        for k in (1, 4):
            assert SpeculativeGenerator(ours.model, draft, eos).generate([p], N_NEW, FixedK(k)).token_ids == [e]
    for k in (2, 5):  # batch size 3, prompts of different lengths
        result = SpeculativeGenerator(ours.model, draft, eos).generate(prompts, N_NEW, FixedK(k))
        assert result.token_ids == expected
        assert 0 < result.stats.accepted_per_position[0] < result.stats.trials_per_position[0]


def _hf_family(name):
    transformers = pytest.importorskip("transformers")
    special = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if name == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=128, bos_token_id=1, eos_token_id=2))
    if name == "opt_350m_style":
        return transformers.OPTForCausalLM(transformers.OPTConfig(
            vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=128, do_layer_norm_before=False, word_embed_proj_dim=16, **special))
    if name == "mistral_window":
        return transformers.MistralForCausalLM(transformers.MistralConfig(
            vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=1, sliding_window=5, max_position_embeddings=128, **special))
    raise ValueError(name)


@pytest.mark.parametrize("name", ["gpt2", "opt_350m_style", "mistral_window"])
def test_other_families_match_transformers_generate(name, tmp_path, randomize, make_noisy_copy, prompts8):
    """Learned positions (GPT-2, OPT's offset) and Mistral's sliding window through cached generation:
    target-only and speculative output equal transformers' greedy generate."""
    from specbatch.runtime.checkpoint import load_checkpoint

    torch.manual_seed(0)
    hf = randomize(_hf_family(name), seed=17)
    with torch.no_grad():
        hf.get_output_embeddings().weight.mul_(4.0)
    hf.save_pretrained(str(tmp_path))
    ours = load_checkpoint(tmp_path)
    prompts = [prompts8[i] for i in (1, 4, 6)]  # 3, 17 and 12 tokens
    expected = [_hf_greedy(hf, p, N_NEW) for p in prompts]
    eos = ours.eos_token_ids
    assert SpeculativeGenerator(ours.model, None, eos).generate(prompts, N_NEW, FixedK(0)).token_ids == expected
    draft = make_noisy_copy(ours.model, num_layers=2, noise=0.2, seed=5)
    result = SpeculativeGenerator(ours.model, draft, eos).generate(prompts, N_NEW, FixedK(3))
    assert result.token_ids == expected
    assert result.stats.accepted_per_position[0] > 0


@pytest.mark.parametrize("policy", ["k=0", "k=3", "tree", "tree+stage2"])
def test_far_apart_prompts_are_lossless_on_every_backend(policy, backend, monkeypatch, greedy_target,
                                                         greedy_draft_sometimes, prompts8):
    """One 70-token prompt among short ones (its rows attend apart, its prefill unpadded): the output equals
    the uncached argmax loop, on the CPU backend and through the varlen backend's code."""
    from specbatch.perfmodel.tree import Strategy, parse_tree
    from specbatch.runtime.policy import FixedStrategy

    class SecondStage:  # guesses the draft's children from nothing useful: every round re-feeds
        vocab_size = greedy_target.config.vocab_size

        def top_tokens_host(self, u, v):
            return (1, 2, 3)

        def top_tokens(self, contexts, count):
            return torch.tensor([[1, 2, 3][:count]] * len(contexts))

    for model in (greedy_target, greedy_draft_sometimes):
        monkeypatch.setattr(model, "attention_backend", backend)
    prompts = [prompts8[4] * 4 + [5, 6]] + prompts8[1:]
    assert len(prompts[0]) >= 70
    expected = [naive_greedy(greedy_target, p, N_NEW) for p in prompts]
    tree = Strategy(parse_tree("0,1,2,0.0,0.1,1.0,0.0.0"), stage2=policy == "tree+stage2")
    chosen = {"k=0": FixedK(0), "k=3": FixedK(3)}.get(policy) or FixedStrategy(tree)
    generator = SpeculativeGenerator(greedy_target, greedy_draft_sometimes,
                                     stage2=SecondStage() if policy == "tree+stage2" else None)
    assert generator.generate(prompts, N_NEW, chosen).token_ids == expected
