"""Mixture-of-experts targets (Qwen3-MoE, Mixtral, GLM-4.5): logit parity with `transformers` on both attention
backends, and a pass that reads only the experts its tokens route to.

The oracle is transformers' full (uncached) forward pass over the same checkpoint: tiny random models built with
transformers' own classes (8 experts, top-2), given large random weights (router included, and GLM-4.5's
score-correction bias, a buffer `randomize` leaves at zero), saved as sharded safetensors in the Hub's per-expert
layout and read back with `runtime.checkpoint.load_checkpoint`. Sequences are longer than the sliding windows.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from specbatch.runtime.checkpoint import CheckpointError, load_checkpoint  # noqa: E402
from specbatch.runtime.experts import RoutedExperts  # noqa: E402
from test_runtime_families import _assert_close, _hf_logits, _sequences  # noqa: E402 - the same tolerance, vocabulary
from torch_fixtures import tune_cpu  # noqa: E402

TOL = 1e-4
V = 96
SPECIAL = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
WINDOW = 5
_SMALL = dict(vocab_size=V, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, **SPECIAL)


def _qwen3_moe_sparse_step():
    # every layer routes but layer 1 (mlp_only_layers); normalised top-k weights; a window on every layer
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **_SMALL, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3, head_dim=16, num_experts=8,
        num_experts_per_tok=2, mlp_only_layers=[1], norm_topk_prob=True, use_sliding_window=True,
        sliding_window=WINDOW, rope_theta=1000.0))


def _qwen3_moe_every_other():
    # decoder_sparse_step 2: layers 1 and 3 route, 0 and 2 dense; raw (unnormalised) top-k probabilities
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **_SMALL, intermediate_size=40, moe_intermediate_size=24, num_hidden_layers=4, head_dim=8, num_experts=8,
        num_experts_per_tok=3, decoder_sparse_step=2, norm_topk_prob=False, tie_word_embeddings=True))


def _mixtral():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **_SMALL, intermediate_size=16, num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=WINDOW, rope_theta=10000.0))


def _glm4_moe():
    # GLM-4.5-Air's shape in small: the first layer dense, then routed layers with a shared expert; sigmoid
    # routing with the score-correction bias inside the 2 best of 4 groups, scaled weights; half-rotary heads,
    # q/k/v biases, q/k norms
    return transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(
        **_SMALL, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3, head_dim=16,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=4,
        topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True, use_qk_norm=True))


FAMILIES = {"qwen3_moe_sparse_step": _qwen3_moe_sparse_step, "qwen3_moe_every_other": _qwen3_moe_every_other,
            "mixtral_window": _mixtral, "glm4_moe": _glm4_moe}


def _randomized(model, randomize, seed: int):
    randomize(model, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # a buffer: randomize leaves it at zero
                buffer.copy_(0.5 * torch.randn(buffer.shape, generator=gen))
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, randomize):
    """name -> (transformers model, directory), each saved as several safetensors shards and an index."""
    out = {}
    for i, (name, make) in enumerate(FAMILIES.items()):
        torch.manual_seed(i)
        model = _randomized(make(), randomize, seed=500 + i)
        directory = tmp_path_factory.mktemp(name)
        model.save_pretrained(str(directory), max_shard_size="20KB")
        assert (directory / "model.safetensors.index.json").is_file(), name
        out[name] = (model, directory)
    return out


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def _expert_modules(model) -> list[RoutedExperts]:
    return [layer.experts for layer in model.layers if layer.experts is not None]


@pytest.mark.parametrize("grouped", [False, True], ids=["per-expert", "grouped-gemm"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_match_transformers_uncached_cached_and_incremental(checkpoints, name, grouped):
    """Both expert paths: one product per touched expert (the CPU's), and torch's grouped GEMM (CUDA's in
    bfloat16, run here through torch's CPU kernel in float32: the same arithmetic, not the GPU's speed)."""
    hf, directory = checkpoints[name]
    loaded = load_checkpoint(directory)
    assert loaded.config.model_type == hf.config.model_type
    for experts in _expert_modules(loaded.model):
        experts.grouped_products = grouped
    ids = _sequences(2, 20, seed=1)
    expected = _hf_logits(hf, ids)
    _assert_close(loaded.model(ids), expected)
    cache = loaded.model.new_cache(2, 24)
    pieces = [loaded.model(ids[:, :7], cache)] + [loaded.model(ids[:, t:t + 1], cache) for t in range(7, 10)]
    pieces.append(loaded.model(ids[:, 10:16], cache))
    pieces.append(loaded.model(ids[:, 16:20], cache))
    _assert_close(torch.cat(pieces, dim=1), expected)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_packed_prefill_ragged_rows_and_rollback_on_each_backend(checkpoints, name, backend, monkeypatch):
    """Rows of 40, 3 and 9 tokens: a packed prefill, a 3-token pass, a rollback of one row and a 1-token pass;
    every row's logits equal transformers' over that row alone (routing is per token: the rows' tokens share
    passes, and each other's experts, without changing a logit)."""
    tune_cpu(monkeypatch, sdpa_call_keys=8)
    hf, directory = checkpoints[name]
    model = load_checkpoint(directory).model
    model.attention_backend = backend
    lengths = [40, 3, 9]
    rows = [_sequences(1, 46, seed=20 + i)[0] for i in range(3)]
    cache = model.new_cache(3, 48)
    first = model(torch.cat([row[:n] for row, n in zip(rows, lengths)]), cache, last=1, new_tokens=lengths)
    chunk = model(torch.stack([row[n:n + 3] for row, n in zip(rows, lengths)]), cache)
    after = [n + 3 for n in lengths[:2]] + [lengths[2] + 2]
    cache.set_lengths(None, after)  # row 2 rolls back one token
    one = model(torch.stack([row[n:n + 1] for row, n in zip(rows, after)]), cache)
    for i, (row, n) in enumerate(zip(rows, lengths)):
        expected = _hf_logits(hf, row[None, :n + 3])[0]
        _assert_close(first[i, 0], expected[n - 1])
        _assert_close(chunk[i], expected[n:n + 3])
        _assert_close(one[i, 0], _hf_logits(hf, row[None, :after[i] + 1])[0, -1])


def test_configs_read_as_transformers_reads_them(checkpoints):
    sparse = load_checkpoint(checkpoints["qwen3_moe_sparse_step"][1])
    cfg = sparse.config
    assert (cfg.num_experts, cfg.experts_per_token, cfg.expert_intermediate_size) == (8, 2, 16)
    assert [layer.experts is not None for layer in sparse.model.layers] == [True, False, True]
    assert cfg.normalize_expert_weights and cfg.qk_norm and cfg.sliding_window == WINDOW
    every_other = load_checkpoint(checkpoints["qwen3_moe_every_other"][1]).model
    assert [layer.experts is not None for layer in every_other.layers] == [False, True, False, True]
    mixtral = load_checkpoint(checkpoints["mixtral_window"][1]).config
    assert mixtral.expert_intermediate_size == 16 and mixtral.normalize_expert_weights
    assert mixtral.sliding_layers == (True, True)
    glm = load_checkpoint(checkpoints["glm4_moe"][1])
    cfg = glm.config
    assert [layer.experts is not None for layer in glm.model.layers] == [False, True, True]
    assert (cfg.router, cfg.expert_groups, cfg.expert_groups_per_token) == ("sigmoid", 4, 2)
    assert cfg.rotary_dim == 8 and cfg.qkv_bias and not cfg.o_bias and cfg.shared_expert_intermediate_size == 16
    assert cfg.routed_scaling_factor == 2.5 and cfg.sliding_window is None
    # the parameters counted are the parameters built (every expert)
    for name in FAMILIES:
        loaded = load_checkpoint(checkpoints[name][1])
        assert loaded.config.parameter_count() == sum(p.numel() for p in loaded.model.parameters()), name
    # and every layer's MLP is eager (the fused kernels are for dense gated MLPs)
    assert not any(layer.fusable for layer in glm.model.layers[1:])


def test_the_tiny_configs_exercise_their_features(checkpoints):
    """Each routing feature the configs claim changes transformers' logits by far more than the tolerance, so the
    parity above would catch its omission."""
    ids = _sequences(1, 20, seed=5)
    cases = [("qwen3_moe_sparse_step", "norm_topk_prob", False), ("qwen3_moe_every_other", "num_experts_per_tok", 2),
             ("mixtral_window", "sliding_window", 64), ("glm4_moe", "routed_scaling_factor", 1.0),
             ("glm4_moe", "topk_group", 4), ("glm4_moe", "norm_topk_prob", False),
             ("glm4_moe", "e_score_correction_bias", 0.0)]
    for name, field, value in cases:
        hf = checkpoints[name][0]
        state = hf.state_dict()
        if field == "e_score_correction_bias":
            state = {k: (torch.full_like(v, value) if k.endswith(field) else v) for k, v in state.items()}
            other = type(hf)(hf.config).eval()
        else:
            other = type(hf)(hf.config.__class__.from_dict({**hf.config.to_dict(), field: value})).eval()
        other.load_state_dict(state)
        diff = float((_hf_logits(other, ids) - _hf_logits(hf, ids)).abs().max())
        assert diff > 100 * TOL, (name, field, diff)


@pytest.mark.parametrize("grouped", [False, True], ids=["per-expert", "grouped-gemm"])
@pytest.mark.parametrize("name, tokens", [("qwen3_moe_sparse_step", 1), ("glm4_moe", 1), ("mixtral_window", 4)])
def test_a_pass_reads_only_the_experts_its_tokens_route_to(checkpoints, name, tokens, grouped, monkeypatch):
    """A decode pass (one token) and a verify pass (4 tokens) with every expert no token routes to poisoned
    (NaN weights): the logits are finite and unchanged, so no product read those experts. The same poison makes a
    dense pass over every expert NaN, so the check can fail."""
    model = load_checkpoint(checkpoints[name][1]).model
    modules = _expert_modules(model)
    for experts in modules:
        experts.grouped_products = grouped
    routed: dict[int, set[int]] = {}
    route = RoutedExperts.route

    def recording(self, x):
        chosen, weights = route(self, x)
        routed.setdefault(id(self), set()).update(chosen.flatten().tolist())
        return chosen, weights

    monkeypatch.setattr(RoutedExperts, "route", recording)
    ids = _sequences(1, 12 + tokens, seed=8)
    cache = model.new_cache(1, 16)
    model(ids[:, :12], cache, last=0)
    routed.clear()  # from here on: the experts the pass below touches
    before = model(ids[:, 12:], cache)
    for experts in modules:
        untouched = sorted(set(range(experts.config.num_experts)) - routed[id(experts)])
        assert untouched, "every expert was touched: the poison would test nothing"
        experts.gate_up.data[untouched] = float("nan")
        experts.down.data[untouched] = float("nan")
    cache.set_lengths(None, [12])
    after = model(ids[:, 12:], cache)
    assert torch.isfinite(after).all()
    assert torch.equal(after, before)
    # the control: a dense pass over every expert (each expert's output weighted by its routing weight, 0 for
    # the unchosen) reads the poison
    experts = modules[0]
    x = torch.randn(tokens, experts.config.hidden_size)
    chosen, weights = route(experts, x)
    dense_weights = torch.zeros(tokens, experts.config.num_experts).scatter_(1, chosen, weights.float())
    every = torch.einsum("edi,tei->ted", experts.down, experts._gated(torch.einsum("eid,td->tei", experts.gate_up, x)))
    assert not torch.isfinite(torch.einsum("te,ted->td", dense_weights, every)).all()


def test_glm4_moe_multi_token_prediction_layers_are_skipped_and_a_layer_beyond_them_refused(checkpoints, tmp_path):
    """GLM-4.5 stores its MTP layer after the decoder's (layers.N for N layers): a target pass does not run it,
    so its tensors are skipped; a tensor of a layer past the MTP layers is still one the config does not use."""
    from safetensors.torch import load_file, save_file

    hf, directory = checkpoints["glm4_moe"]
    state = {}
    for shard in sorted(directory.glob("model-*.safetensors")):
        state.update(load_file(str(shard)))
    (tmp_path / "config.json").write_text((directory / "config.json").read_text())
    layers = hf.config.num_hidden_layers
    mtp = {f"model.layers.{layers}.eh_proj.weight": torch.ones(32, 64),
           f"model.layers.{layers}.enorm.weight": torch.ones(32)}
    save_file({**state, **mtp}, str(tmp_path / "model.safetensors"))
    ids = _sequences(2, 20, seed=9)
    _assert_close(load_checkpoint(tmp_path).model(ids), _hf_logits(hf, ids))
    save_file({**state, **mtp, f"model.layers.{layers + 1}.enorm.weight": torch.ones(32)},
              str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=f"layers.{layers + 1}.enorm"):
        load_checkpoint(tmp_path)
