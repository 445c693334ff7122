"""Our heads against `speculators`' own models: tiny random EAGLE-3 and MTP heads that `speculators` builds and
saves, loaded by `runtime.heads.load_head`, give the same logits within 1e-4 (float32) for every draft step.

`speculators` pins an older transformers than the suite's, so these tests run in their own environment
(.ci/run makes it: `.venv-speculators`); elsewhere they skip.

EAGLE-3 is compared over three steps of `speculators`' test-time training forward (teacher-forced tokens): its
step t at index i attends to step 0's keys up to i and its own steps' keys at i, which is exactly our cache after
a first pass over positions 0..i and t one-token passes. MTP is compared over its first step (speculators'
later MTP steps re-run causal attention over their own step, a training-only schedule).
"""
from __future__ import annotations

import pytest
import torch

speculators = pytest.importorskip("speculators")

from speculators.config import SpeculatorsConfig, VerifierConfig  # noqa: E402
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig  # noqa: E402
from speculators.models.mtp import MTPDraftModel, MTPSpeculatorConfig  # noqa: E402
from speculators.proposals.greedy import GreedyTokenProposalConfig  # noqa: E402
from transformers import LlamaConfig, Qwen3Config  # noqa: E402

from specbatch.runtime.checkpoint import build_model  # noqa: E402
from specbatch.runtime.config import ModelConfig  # noqa: E402
from specbatch.runtime.heads import load_head  # noqa: E402

VOCAB, HIDDEN, DRAFT_VOCAB, STEPS, TOKENS = 96, 32, 40, 3, 11
SIZES = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, max_position_embeddings=128, rms_norm_eps=1e-6)
LAYER_CONFIGS = {"llama": lambda: LlamaConfig(**SIZES), "qwen3": lambda: Qwen3Config(**SIZES)}


def _target(model_type: str):
    config = ModelConfig(model_type=model_type, vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=4, num_heads=4,
                         num_kv_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=128,
                         norm_eps=1e-6, qk_norm=model_type == "qwen3")
    return build_model(config, seed=3)


def _speculators_config(kind: str, layer, **fields):
    spec = SpeculatorsConfig(algorithm=kind, proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=STEPS)],
                             default_proposal_method="greedy",
                             verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"]))
    if kind == "eagle3":
        return Eagle3SpeculatorConfig(transformer_layer_config=layer, speculators_config=spec, **fields)
    return MTPSpeculatorConfig(transformer_layer_config=layer, speculators_config=spec, **fields)


def _randomize(model, seed: int) -> None:
    """Large random weights (a wrong formula moves the logits a lot); norms 1 +- 0.2."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.2 * noise if param.dim() == 1 else 0.3 * noise)


def _capture_logits(module) -> list[torch.Tensor]:
    seen: list[torch.Tensor] = []
    module.register_forward_hook(lambda _module, _inputs, output: seen.append(output.detach().clone()))
    return seen


@pytest.mark.parametrize("layer_type", ["llama", "qwen3"])
@pytest.mark.parametrize("switches", [dict(), dict(norm_before_residual=True), dict(fc_norm=True, norm_output=True)],
                         ids=["plain", "norm_before_residual", "fc_norm+norm_output"])
def test_eagle3_head_logits_equal_speculators(tmp_path, layer_type, switches):
    layer = LAYER_CONFIGS[layer_type]()
    layer._attn_implementation = "eager"
    config = _speculators_config("eagle3", layer, draft_vocab_size=DRAFT_VOCAB,
                                 eagle_aux_hidden_state_layer_ids=[1, 2, 4], **switches)
    oracle = Eagle3DraftModel(config)
    chosen = torch.sort(torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1))[:DRAFT_VOCAB]).values
    t2d = torch.zeros(VOCAB, dtype=torch.bool)
    t2d[chosen] = True
    oracle.load_vocab_mappings(t2d, chosen - torch.arange(DRAFT_VOCAB))
    _randomize(oracle, seed=2)
    oracle.eval()
    oracle.save_pretrained(str(tmp_path))

    target = _target(layer_type)
    head = load_head(tmp_path, target)
    assert head.own_embed is not None  # speculators saves its embeddings: the head drafts with them
    gen = torch.Generator().manual_seed(4)
    features = torch.randn(1, TOKENS, 3 * HIDDEN, generator=gen)
    tokens = torch.randint(0, VOCAB, (1, TOKENS), generator=gen)
    seen = _capture_logits(oracle.lm_head)
    with torch.no_grad():
        oracle(features, tokens, torch.zeros_like(tokens), ttt_steps=STEPS)
        ours = _our_eagle3_steps(head, tokens, features)
    assert len(seen) == STEPS
    for step in range(STEPS):
        usable = TOKENS - step  # speculators pads the teacher-forced tokens past the end
        torch.testing.assert_close(ours[step][:, :usable], seen[step][:, :usable], rtol=1e-4, atol=1e-4)
    # and the head's logits over the target's vocabulary put the same scores at the mapped ids, -inf elsewhere
    full = head.logits(torch.randn(1, 1, HIDDEN))
    assert torch.isinf(full[..., ~t2d]).all() and torch.isfinite(full[..., t2d]).all()


def _our_eagle3_steps(head, tokens, features) -> list[torch.Tensor]:
    """Draft-vocabulary logits (1, T, draft vocab) of each step, computed as the runtime drafts: a first pass over
    the positions up to index i, then passes of one token on that cache."""
    _, outputs = head(tokens, features, head.new_cache(1, TOKENS), last=0)
    steps = [head.draft_logits(outputs)]
    later = [torch.zeros_like(steps[0]) for _ in range(STEPS - 1)]
    for i in range(TOKENS):
        cache = head.new_cache(1, TOKENS + STEPS)  # a first pass over positions 0..i (later passes overwrite i + 1..)
        _, prefix = head(tokens[:, :i + 1], features[:, :i + 1], cache, last=0)
        hidden = prefix[:, i:i + 1]
        for step in range(1, STEPS):
            if i + step >= TOKENS:
                break
            token = tokens[:, i + step:i + step + 1]  # speculators' teacher forcing: the true next token
            logits, hidden = head(token, hidden, cache, last=1, from_target=False)
            later[step - 1][:, i] = head.draft_logits(hidden)[:, 0]
    return steps + later


@pytest.mark.parametrize("layer_type", ["qwen3"])
def test_mtp_head_logits_equal_speculators(tmp_path, layer_type):
    layer = LAYER_CONFIGS[layer_type]()
    layer._attn_implementation = "eager"
    oracle = MTPDraftModel(_speculators_config("mtp", layer))
    _randomize(oracle, seed=5)
    oracle.eval()
    oracle.save_pretrained(str(tmp_path))

    target = _target(layer_type)
    with torch.no_grad():  # the MTP head uses its target's embeddings and LM head
        oracle.embed_tokens.weight.copy_(target.embed.weight)
        oracle.lm_head.weight.copy_(target.lm_head.weight)
    head = load_head(tmp_path, target)
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(1, TOKENS, HIDDEN, generator=gen)
    tokens = torch.randint(0, VOCAB, (1, TOKENS), generator=gen)
    with torch.no_grad():
        logits, _, _ = oracle(tokens, hidden)
        # speculators' step 0 at position t reads token t + 1 and the hidden state at t
        valid = logits[0].shape[1]
        cache = head.new_cache(1, TOKENS + 1)
        ours, _ = head(tokens[:, 1:1 + valid], hidden[:, :valid], cache)
    torch.testing.assert_close(ours, logits[0], rtol=1e-4, atol=1e-4)
