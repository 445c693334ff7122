"""Greedy losslessness for Qwen3, Gemma 3, Phi-3 and the mixture-of-experts Qwen3-MoE, Mixtral and GLM-4.5
targets: speculative output (chains k = 1..6 and a tree,
both attention backends) equals target-only greedy output token for token, at b = 1, 8 and 32 with ragged
prompts longer than the sliding windows; a draft of another family sharing the vocabulary works, and a
vocabulary mismatch is refused before any work.

Oracles: target-only decoding (k = 0) and a naive uncached argmax loop. The families' logits themselves are
checked against transformers in test_runtime_families.py.
"""
from __future__ import annotations

import json

import pytest
import torch

from specbatch.perfmodel.errors import UsageError
from specbatch.perfmodel.tree import Strategy, parse_tree
from specbatch.runtime.checkpoint import build_model
from specbatch.runtime.config import config_from_dict
from specbatch.runtime.generator import SpeculativeGenerator
from specbatch.runtime.policy import FixedK, FixedStrategy
from lossless_helpers import naive_greedy

V = 64
N_NEW = 12
WINDOW = 5
_SMALL = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, bos_token_id=1, eos_token_id=2)
RAW = {
    "qwen3": dict(_SMALL, model_type="qwen3", num_hidden_layers=2, head_dim=16, tie_word_embeddings=True,
                  use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, rope_theta=1000.0),
    "gemma3": dict(_SMALL, model_type="gemma3_text", num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24,
                   sliding_window=WINDOW, sliding_window_pattern=2, rope_theta=10000.0, rope_local_base_freq=100.0,
                   final_logit_softcapping=30.0),
    "phi3": dict(_SMALL, model_type="phi3", num_hidden_layers=2, max_position_embeddings=256,
                 original_max_position_embeddings=96, partial_rotary_factor=0.75, sliding_window=7,
                 rope_scaling={"type": "longrope", "short_factor": [1.0, 1.5, 3.0], "long_factor": [2.0, 4.0, 9.0]}),
    # mixtures of experts, 8 experts top-2 (the one-layer drafts cut from them: Qwen3-MoE's and Mixtral's first
    # layer routes, GLM-4.5's is dense)
    "qwen3_moe": dict(_SMALL, model_type="qwen3_moe", num_hidden_layers=3, head_dim=16, num_experts=8,
                      num_experts_per_tok=2, moe_intermediate_size=16, mlp_only_layers=[1], norm_topk_prob=True,
                      use_sliding_window=True, sliding_window=WINDOW),
    "mixtral": dict(_SMALL, model_type="mixtral", num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2,
                    intermediate_size=16, sliding_window=WINDOW),
    "glm4_moe": dict(_SMALL, model_type="glm4_moe", num_hidden_layers=3, head_dim=16, n_routed_experts=8,
                     num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1, n_group=4, topk_group=2,
                     routed_scaling_factor=2.5),
}


@pytest.fixture(scope="module")
def pairs(peaked, make_noisy_copy):
    """family -> (target with peaked logits, a noisy one-layer draft that agrees part of the time)."""
    out = {}
    for i, (name, raw) in enumerate(RAW.items()):
        target = peaked(build_model(config_from_dict(raw, name), seed=40 + i), 8.0)
        out[name] = (target, make_noisy_copy(target, num_layers=1, noise=0.3, seed=50 + i))
    return out


@pytest.fixture(scope="module")
def prompts32():
    """32 ragged prompts, 1 to 40 tokens: most longer than the windows."""
    gen = torch.Generator().manual_seed(7)
    lengths = torch.randint(1, 41, (32,), generator=gen).tolist()
    return [torch.randint(3, V, (n,), generator=gen).tolist() for n in lengths]


BATCHES = {1: [5], 8: list(range(8)), 32: list(range(32))}


@pytest.fixture(scope="module")
def reference(pairs, prompts32):
    """family -> target-only greedy output of all 32 prompts, checked against the naive argmax loop."""
    out = {}
    for name, (target, _) in pairs.items():
        plain = SpeculativeGenerator(target, None).generate(prompts32, N_NEW, FixedK(0)).token_ids
        for row in (0, 5, 17, 31):
            assert plain[row] == naive_greedy(target, prompts32[row], N_NEW), (name, row)
        out[name] = plain
    return out



TREE = Strategy(parse_tree("0,1,2,0.0,0.1,1.0,0.0.0"), stage2=False)


@pytest.mark.parametrize("name", list(RAW))
@pytest.mark.parametrize("size", list(BATCHES))
def test_chains_and_a_tree_equal_target_only_greedy(name, size, pairs, prompts32, reference):
    target, draft = pairs[name]
    prompts = [prompts32[i] for i in BATCHES[size]]
    expected = [reference[name][i] for i in BATCHES[size]]
    accepted = 0
    for k in range(1, 7):
        result = SpeculativeGenerator(target, draft).generate(prompts, N_NEW, FixedK(k))
        assert result.token_ids == expected, (name, size, k)
        accepted += result.stats.accepted_per_position[0]
    assert accepted > 0  # the draft is really used
    tree = SpeculativeGenerator(target, draft).generate(prompts, N_NEW, FixedStrategy(TREE))
    assert tree.token_ids == expected


@pytest.mark.parametrize("name", list(RAW))
def test_varlen_backend_chain_and_tree_are_lossless(name, backend, monkeypatch, caplog, pairs, prompts32,
                                                    reference):
    """The varlen backend's code (run through the CPU reference of its kernel): windows per layer, Gemma's
    query scale folded into the queries, a tree under a window on the exact sdpa path, said once."""
    from specbatch.runtime import model as model_module

    monkeypatch.setattr(model_module, "_said", set())
    caplog.set_level("INFO", logger="specbatch.runtime")
    target, draft = pairs[name]
    for model in (target, draft):
        monkeypatch.setattr(model, "attention_backend", backend)
    prompts = [prompts32[i] for i in BATCHES[8]]
    expected = [reference[name][i] for i in BATCHES[8]]
    assert SpeculativeGenerator(target, draft).generate(prompts, N_NEW, FixedK(3)).token_ids == expected
    assert SpeculativeGenerator(target, draft).generate(prompts, N_NEW, FixedStrategy(TREE)).token_ids == expected
    notes = [record for record in caplog.records if "sliding-window" in record.getMessage()]
    assert len(notes) == (1 if backend == "varlen" and target.config.sliding_window else 0)  # GLM-4.5: no window


def test_a_draft_of_another_family_sharing_the_vocabulary(pairs, prompts32, reference):
    """A Gemma 3 draft for a Qwen3 target, a Phi-3 draft for a Gemma 3 target, a dense Qwen3 draft for a Qwen3-MoE
    target and a mixture-of-experts draft (Mixtral's) for a GLM-4.5 target: the target's own output."""
    prompts = [prompts32[i] for i in BATCHES[8]]
    for target_name, draft_name in (("qwen3", "gemma3"), ("gemma3", "phi3"), ("qwen3_moe", "qwen3"),
                                    ("glm4_moe", "mixtral")):
        target, draft = pairs[target_name][0], pairs[draft_name][1]
        result = SpeculativeGenerator(target, draft).generate(prompts, N_NEW, FixedK(2))
        assert result.token_ids == [reference[target_name][i] for i in BATCHES[8]]


def test_a_vocabulary_mismatch_is_one_line_before_any_work(tmp_path):
    from specbatch.runtime.loading import resolve_pair

    target, draft = tmp_path / "target.json", tmp_path / "draft.json"
    target.write_text(json.dumps(RAW["qwen3"]))
    draft.write_text(json.dumps(dict(RAW["gemma3"], vocab_size=V + 8)))
    with pytest.raises(UsageError) as error:
        resolve_pair(str(target), str(draft))
    message = str(error.value)
    assert "\n" not in message and str(draft.resolve()) in message and f"{V + 8}" in message and f"{V}" in message
    draft.write_text(json.dumps(RAW["gemma3"]))  # the same vocabulary: a pair
    target_spec, draft_spec = resolve_pair(str(target), str(draft))
    assert (target_spec.config.model_type, draft_spec.config.model_type) == ("qwen3", "gemma3_text")
