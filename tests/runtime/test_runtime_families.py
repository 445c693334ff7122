"""Logit parity with `transformers` for Qwen3, Gemma 3 (text) and Phi-3/4, on both attention backends.

The oracle is transformers' full (uncached) forward pass over the same checkpoint. Tiny random models are
built with transformers' own config and model classes, given large random weights (a wrong formula moves the
logits far past the 1e-4 tolerance), saved as sharded safetensors with an index, and read back with
`runtime.checkpoint.load_checkpoint`. Every sequence is longer than the sliding windows.
"""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from specbatch.runtime.checkpoint import load_checkpoint  # noqa: E402
from torch_fixtures import tune_cpu  # noqa: E402

TOL = 1e-4
V = 96
SPECIAL = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
WINDOW = 5


def _qwen3_tied():
    # head_dim 16 != hidden / heads = 8; windowed from layer 1 on (max_window_layers)
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=128, tie_word_embeddings=True,
        use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, rope_theta=1000.0, **SPECIAL))


def _qwen3_untied_yarn():
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=128, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                         "rope_theta": 10000.0}, **SPECIAL))


def _gemma3():
    # query_pre_attn_scalar 24 != head_dim 16; local, global, local layers with their own RoPE (the global
    # one linearly scaled); final logits soft-capped
    return transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, max_position_embeddings=128,
        sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}},
        final_logit_softcapping=30.0, **SPECIAL))


def _phi3_longrope():
    # Phi-4-mini's shape in small: partial rotary (6 of 8 dims), longrope short/long factors, tied, a window
    return transformers.Phi3ForCausalLM(transformers.Phi3Config(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, original_max_position_embeddings=64,
        partial_rotary_factor=0.75, rope_parameters={
            "rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
            "short_factor": [1.0, 1.5, 3.0], "long_factor": [2.0, 4.0, 9.0]},
        sliding_window=7, tie_word_embeddings=True, **SPECIAL))


def _phi3_plain():
    return transformers.Phi3ForCausalLM(transformers.Phi3Config(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=128, original_max_position_embeddings=128,
        tie_word_embeddings=False, **SPECIAL))


FAMILIES = {"qwen3_tied_window": _qwen3_tied, "qwen3_untied_yarn": _qwen3_untied_yarn, "gemma3": _gemma3,
            "phi3_longrope_partial": _phi3_longrope, "phi3_plain": _phi3_plain}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, randomize):
    """name -> (transformers model, directory), each saved as several safetensors shards and an index."""
    out = {}
    for i, (name, make) in enumerate(FAMILIES.items()):
        torch.manual_seed(i)
        model = randomize(make(), seed=300 + i)
        directory = tmp_path_factory.mktemp(name)
        model.save_pretrained(str(directory), max_shard_size="20KB")
        assert (directory / "model.safetensors.index.json").is_file(), name
        out[name] = (model, directory)
    return out


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def _sequences(batch: int, length: int, seed: int) -> torch.Tensor:
    return torch.randint(3, V, (batch, length), generator=torch.Generator().manual_seed(seed))


def _hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()


def _assert_close(ours: torch.Tensor, expected: torch.Tensor) -> None:
    assert ours.shape == expected.shape, (ours.shape, expected.shape)
    diff = float((ours.float() - expected).abs().max())
    assert diff <= TOL, f"max abs logit difference {diff:.3g} > {TOL:g}"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_match_transformers_uncached_cached_and_incremental(checkpoints, name):
    hf, directory = checkpoints[name]
    loaded = load_checkpoint(directory)
    assert loaded.config.model_type == hf.config.model_type
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
    """Rows of 40, 3 and 9 tokens: a packed prefill, a 3-token pass whose rows attend in separate runs, a
    rollback of one row and a 1-token pass; every row's logits equal transformers' over that row alone."""
    tune_cpu(monkeypatch, sdpa_call_keys=8)  # calls made cheap: the planner cuts the short rows apart
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


def test_the_tiny_configs_exercise_their_features(checkpoints):
    """Each feature the configs claim changes transformers' logits by far more than the tolerance, so the
    parity above would catch its omission: Qwen3's q/k norms and window, Gemma 3's soft-cap, query scale and
    local RoPE base, Phi-3's partial rotary and short factors."""
    ids = _sequences(1, 20, seed=5)
    cases = [("qwen3_tied_window", "self_attn.q_norm.weight", None), ("qwen3_tied_window", "sliding_window", 64),
             ("gemma3", "final_logit_softcapping", None), ("gemma3", "query_pre_attn_scalar", 16),
             ("gemma3", "rope_parameters", {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                            "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                               "rope_theta": 10000.0}}),
             ("phi3_longrope_partial", "partial_rotary_factor", 1.0),
             ("phi3_longrope_partial", "rope_parameters", {"rope_type": "default", "rope_theta": 10000.0})]
    for name, field, value in cases:
        hf = checkpoints[name][0]
        state = hf.state_dict()
        if field.endswith(".weight"):  # a norm weight set to ones: the norm still normalises, so zero it out
            state = {k: (torch.full_like(v, 1.0) if k.endswith(field) else v) for k, v in state.items()}
            other = type(hf)(hf.config).eval()
        else:
            raw = {**hf.config.to_dict(), field: value}
            if field == "partial_rotary_factor":
                raw["rope_parameters"] = {**raw["rope_parameters"], "partial_rotary_factor": 1.0,
                                          "short_factor": [1.0] * 4, "long_factor": [1.0] * 4}
            other = type(hf)(hf.config.__class__.from_dict(raw)).eval()
        other.load_state_dict(state)
        diff = float((_hf_logits(other, ids) - _hf_logits(hf, ids)).abs().max())
        assert diff > 100 * TOL, (name, field, diff)


def test_configs_read_as_transformers_reads_them(checkpoints):
    qwen = load_checkpoint(checkpoints["qwen3_tied_window"][1])
    assert qwen.config.head_dim == 16 and qwen.config.qk_norm and qwen.config.sliding_layers == (False, True)
    assert qwen.model.lm_head.weight.data_ptr() == qwen.model.embed.weight.data_ptr()
    gemma = load_checkpoint(checkpoints["gemma3"][1]).config
    assert gemma.sliding_layers == (True, False, True) and gemma.sliding_window == WINDOW
    assert gemma.local_rope_theta == 100.0 and gemma.rope_scaling["rope_type"] == "linear"
    assert gemma.final_logit_softcap == 30.0 and gemma.query_scale == pytest.approx(24 ** -0.5)
    phi = load_checkpoint(checkpoints["phi3_longrope_partial"][1]).config
    assert phi.rotary_dim == 6 and phi.rope_scaling["rope_type"] == "longrope"
    assert phi.max_position_embeddings == 64  # longrope: the runtime's context is the original one
    assert load_checkpoint(checkpoints["phi3_plain"][1]).config.rotary_dim is None


@pytest.mark.parametrize("name", ["gemma3", "phi3_longrope_partial"])
def test_hub_style_config_keys_read_the_same(checkpoints, tmp_path, name):
    """config.json files on the Hub were written by transformers 4: Gemma 3 with `rope_theta`,
    `rope_local_base_freq`, `rope_scaling` and `sliding_window_pattern`; Phi-3 with `rope_scaling` of type
    "su" and a top-level `partial_rotary_factor`. They give the same logits as transformers 5's keys."""
    import json

    hf, directory = checkpoints[name]
    raw = json.loads((directory / "config.json").read_text())
    params = raw.pop("rope_parameters")
    if name == "gemma3":
        raw.pop("layer_types")  # pattern 2: layers 0 and 2 local, as layer_types said
        raw.update(sliding_window_pattern=2, rope_theta=params["full_attention"]["rope_theta"],
                   rope_local_base_freq=params["sliding_attention"]["rope_theta"],
                   rope_scaling={"rope_type": "linear", "factor": params["full_attention"]["factor"]})
    else:
        raw.update(rope_theta=params["rope_theta"], partial_rotary_factor=params["partial_rotary_factor"],
                   rope_scaling={"type": "su", "short_factor": params["short_factor"],
                                 "long_factor": params["long_factor"]})
    (tmp_path / "config.json").write_text(json.dumps(raw))
    for shard in directory.glob("model*.safetensors*"):
        (tmp_path / shard.name).symlink_to(shard)
    ids = _sequences(2, 20, seed=9)
    _assert_close(load_checkpoint(tmp_path).model(ids), _hf_logits(hf, ids))
