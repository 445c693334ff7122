"""Logit parity with `transformers`, family by family, for prefill, cached decoding and ragged rows.

The oracle is the `transformers` implementation's full (uncached) forward pass on the same checkpoint:
tiny random models are built with `transformers`, given large random weights (so that a wrong formula
moves the logits by far more than the 1e-4 tolerance), saved with `save_pretrained` and read back with
`runtime.checkpoint.load_checkpoint`.
"""
from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from specbatch.runtime.checkpoint import load_checkpoint  # noqa: E402
from torch_fixtures import tune_cpu  # noqa: E402

TOL = 1e-4
V = 96
SPECIAL = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}


def _llama_tied():
    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, rms_norm_eps=1e-6,
        **SPECIAL)
    return transformers.LlamaForCausalLM(config)


def _llama3_rope():
    # head_dim 16: wavelengths 6.3, 20, 63, 200, ... so with original_max_position_embeddings 64 the
    # Llama-3 rule keeps the high frequencies, blends the medium ones and divides the low ones by 8
    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=128, rope_scaling=dict(LLAMA3_ROPE),
        tie_word_embeddings=False, **SPECIAL)
    return transformers.LlamaForCausalLM(config)


def _llama_bias_head_dim():
    # Llama's attention_bias (q, k, v and o) and mlp_bias; head_dim 16 != hidden_size / heads = 8
    config = transformers.LlamaConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, attention_bias=True, mlp_bias=True, max_position_embeddings=64,
        **SPECIAL)
    return transformers.LlamaForCausalLM(config)


def _mistral():
    config = transformers.MistralConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, sliding_window=4, max_position_embeddings=64, rope_theta=1000.0, **SPECIAL)
    return transformers.MistralForCausalLM(config)


def _qwen2():
    config = transformers.Qwen2Config(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, **SPECIAL)
    return transformers.Qwen2ForCausalLM(config)


def _gpt2():
    config = transformers.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                     bos_token_id=1, eos_token_id=2)
    return transformers.GPT2LMHeadModel(config)


def _opt_pre_ln():
    config = transformers.OPTConfig(
        vocab_size=V, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, do_layer_norm_before=True, word_embed_proj_dim=32, **SPECIAL)
    return transformers.OPTForCausalLM(config)


def _opt_350m_style():
    config = transformers.OPTConfig(
        vocab_size=V, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, do_layer_norm_before=False, word_embed_proj_dim=16, **SPECIAL)
    return transformers.OPTForCausalLM(config)


FAMILIES = {
    "llama_tied": _llama_tied,
    "llama3_rope": _llama3_rope,
    "llama_bias_head_dim": _llama_bias_head_dim,
    "mistral_gqa_window": _mistral,
    "qwen2_bias_gqa": _qwen2,
    "gpt2": _gpt2,
    "opt_pre_ln": _opt_pre_ln,
    "opt_350m_style": _opt_350m_style,
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, randomize):
    """name -> (transformers model, directory) for every family, saved as model.safetensors."""
    out = {}
    for i, (name, make) in enumerate(FAMILIES.items()):
        torch.manual_seed(i)
        model = randomize(make(), seed=100 + i)
        directory = tmp_path_factory.mktemp(name)
        model.save_pretrained(str(directory))
        out[name] = (model, directory)
    return out


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def _sequences(batch: int, length: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, V, (batch, length), generator=gen)


@torch.no_grad()
def _hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a.float() - b.float()).abs().max())


def _assert_close(ours: torch.Tensor, expected: torch.Tensor) -> None:
    diff = _maxdiff(ours, expected)
    assert diff <= TOL, f"max abs logit difference {diff:.3g} > {TOL:g}"


# ---------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("name", list(FAMILIES))
def test_prefill_matches_transformers(checkpoints, name):
    hf, directory = checkpoints[name]
    loaded = load_checkpoint(directory)
    assert loaded.config.model_type == hf.config.model_type
    ids = _sequences(2, 12, seed=1)
    expected = _hf_logits(hf, ids)
    ours = loaded.model(ids).float()  # no cache
    _assert_close(ours, expected)
    cache = loaded.model.new_cache(2, 16)
    ours_cached = loaded.model(ids, cache).float()  # prefill into the cache
    _assert_close(ours_cached, expected)
    assert cache.lengths.tolist() == [12, 12]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_cached_incremental_decoding_matches_transformers(checkpoints, name):
    """Prefill 5 tokens, then 3 single tokens, a chunk of 3, and 1 more: the logits of every position
    equal those of transformers' full forward over the whole sequence."""
    hf, directory = checkpoints[name]
    model = load_checkpoint(directory).model
    ids = _sequences(2, 12, seed=2)
    expected = _hf_logits(hf, ids)
    cache = model.new_cache(2, 20)
    pieces = [model(ids[:, :5], cache)]
    for t in range(5, 8):
        pieces.append(model(ids[:, t:t + 1], cache))
    pieces.append(model(ids[:, 8:11], cache))
    pieces.append(model(ids[:, 11:12], cache))
    assert cache.lengths.tolist() == [12, 12]
    _assert_close(torch.cat(pieces, dim=1).float(), expected)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_ragged_rows_match_each_row_alone(checkpoints, name):
    """Two rows whose caches hold different lengths (set through `cache.lengths`, as the generator does
    after a right-padded prefill and after rollbacks) give each row's own logits."""
    hf, directory = checkpoints[name]
    model = load_checkpoint(directory).model
    a = _sequences(1, 11, seed=3)[0]
    b = _sequences(1, 10, seed=4)[0]
    len_a, len_b = 6, 3
    cache = model.new_cache(2, 24)
    prefill = torch.zeros(2, len_a, dtype=torch.long)
    prefill[0], prefill[1, :len_b] = a[:len_a], b[:len_b]
    prefill[1, len_b:] = 5  # right padding: written into the cache but beyond row 1's length
    first = model(prefill, cache)
    cache.lengths = torch.tensor([len_a, len_b])
    chunk = model(torch.stack([a[len_a:len_a + 3], b[len_b:len_b + 3]]), cache)  # 3 tokens per row
    assert cache.lengths.tolist() == [len_a + 3, len_b + 3]
    # row 0 rolls back one token (a rejected suffix): a length reset; then one token per row
    cache.lengths = torch.tensor([len_a + 2, len_b + 3])
    one = model(torch.stack([a[len_a + 2:len_a + 3], b[len_b + 3:len_b + 4]]), cache)
    cache.lengths = torch.tensor([len_a + 3, len_b + 4])
    two = model(torch.stack([a[len_a + 3:len_a + 5], b[len_b + 4:len_b + 6]]), cache)

    full_a = _hf_logits(hf, a[None, :len_a + 5])[0]
    full_b = _hf_logits(hf, b[None, :len_b + 6])[0]
    _assert_close(first[0].float(), full_a[:len_a])
    _assert_close(first[1, :len_b].float(), full_b[:len_b])
    _assert_close(chunk[0].float(), full_a[len_a:len_a + 3])
    _assert_close(chunk[1].float(), full_b[len_b:len_b + 3])
    _assert_close(one[0, 0].float(), full_a[len_a + 2])
    _assert_close(one[1, 0].float(), full_b[len_b + 3])
    _assert_close(two[0].float(), full_a[len_a + 3:len_a + 5])
    _assert_close(two[1].float(), full_b[len_b + 4:len_b + 6])

    # and each row alone, through our own model with a batch of one
    for seq, n0, got in ((a, len_a, chunk[0]), (b, len_b, chunk[1])):
        alone = model.new_cache(1, 24)
        model(seq[None, :n0], alone)
        _assert_close(model(seq[None, n0:n0 + 3], alone)[0], got)


def test_tied_embeddings_share_one_tensor(checkpoints):
    model = load_checkpoint(checkpoints["llama_tied"][1]).model
    assert model.lm_head.weight.data_ptr() == model.embed.weight.data_ptr()


def test_tests_are_sensitive_to_rope_scaling_and_sliding_window(checkpoints):
    """The tiny configs exercise what they claim: dropping Llama-3 rope scaling or Mistral's window
    changes transformers' logits by far more than the tolerance."""
    ids = _sequences(1, 12, seed=5)
    for name, field, value in (("llama3_rope", "rope_parameters", {"rope_type": "default", "rope_theta": 10000.0}),
                               ("mistral_gqa_window", "sliding_window", None)):
        hf = checkpoints[name][0]
        config = hf.config.__class__.from_dict({**hf.config.to_dict(), field: value})
        other = type(hf)(config).eval()
        other.load_state_dict(hf.state_dict())
        assert _maxdiff(_hf_logits(other, ids), _hf_logits(hf, ids)) > 100 * TOL, name
    loaded = load_checkpoint(checkpoints["llama3_rope"][1])
    assert loaded.config.rope_scaling is not None and loaded.config.rope_scaling["factor"] == 8.0
    assert loaded.config.sliding_window is None
    assert load_checkpoint(checkpoints["mistral_gqa_window"][1]).config.sliding_window == 4


def test_classic_rope_scaling_keys(checkpoints, tmp_path):
    """A transformers-4 style config.json (`rope_theta` + `rope_scaling`) reads the same as transformers 5's
    `rope_parameters`."""
    hf, directory = checkpoints["llama3_rope"]
    raw = json.loads((directory / "config.json").read_text())
    params = raw.pop("rope_parameters")
    raw["rope_theta"] = params.pop("rope_theta")
    raw["rope_scaling"] = params
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "model.safetensors").symlink_to(directory / "model.safetensors")
    ids = _sequences(2, 10, seed=6)
    _assert_close(load_checkpoint(tmp_path).model(ids), _hf_logits(hf, ids))


@pytest.mark.parametrize("name", ["qwen2_bias_gqa", "gpt2"])
def test_sharded_safetensors_checkpoint(checkpoints, tmp_path, name):
    hf = checkpoints[name][0]
    hf.save_pretrained(str(tmp_path), max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert not (tmp_path / "model.safetensors").exists()
    assert len(list(tmp_path.glob("model-*.safetensors"))) >= 2
    ids = _sequences(2, 9, seed=7)
    _assert_close(load_checkpoint(tmp_path).model(ids), _hf_logits(hf, ids))


@pytest.mark.parametrize("name", ["opt_350m_style", "llama_tied"])
def test_pytorch_model_bin_checkpoint(checkpoints, tmp_path, name):
    """transformers 5 ignores `safe_serialization=False`, so write `pytorch_model.bin` ourselves (the
    state dict transformers would have pickled, tied LM head included)."""
    hf = checkpoints[name][0]
    hf.config.save_pretrained(str(tmp_path))
    torch.save({k: v.clone() for k, v in hf.state_dict().items()}, tmp_path / "pytorch_model.bin")
    assert not list(tmp_path.glob("*.safetensors"))
    ids = _sequences(2, 9, seed=8)
    _assert_close(load_checkpoint(tmp_path).model(ids), _hf_logits(hf, ids))


def test_qwen2_window_ignored_unless_use_sliding_window(checkpoints, tmp_path):
    """Qwen2 checkpoints written by transformers 4 carry `sliding_window` with `use_sliding_window: false`:
    no window then (transformers 5 itself writes null)."""
    hf, directory = checkpoints["qwen2_bias_gqa"]
    raw = json.loads((directory / "config.json").read_text())
    raw.update(sliding_window=3, use_sliding_window=False, max_window_layers=0)
    raw.pop("layer_types", None)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "model.safetensors").symlink_to(directory / "model.safetensors")
    loaded = load_checkpoint(tmp_path)
    assert loaded.config.sliding_window is None
    ids = _sequences(2, 12, seed=9)
    _assert_close(loaded.model(ids), _hf_logits(hf, ids))


@pytest.mark.parametrize("max_window_layers", [0, 1])
def test_qwen2_sliding_window_layers(tmp_path, randomize, max_window_layers):
    """Qwen2 with `use_sliding_window: true` windows only the layers from `max_window_layers` on
    (transformers' `layer_types`); the others attend to the whole context."""
    config = transformers.Qwen2Config(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, use_sliding_window=True, sliding_window=4,
        max_window_layers=max_window_layers, **SPECIAL)
    hf = randomize(transformers.Qwen2ForCausalLM(config), seed=31)
    hf.save_pretrained(str(tmp_path))
    model = load_checkpoint(tmp_path).model
    ids = _sequences(2, 12, seed=10)
    expected = _hf_logits(hf, ids)
    _assert_close(model(ids), expected)
    cache = model.new_cache(2, 12)
    pieces = [model(ids[:, :6], cache)] + [model(ids[:, t:t + 1], cache) for t in range(6, 12)]
    _assert_close(torch.cat(pieces, dim=1), expected)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_packed_prefill_and_far_apart_rows_match_transformers(checkpoints, name, backend, monkeypatch):
    """Rows 56, 3 and 9 tokens long: a packed prefill (one row alone in its padding group), a pass of 3
    tokens whose rows attend in separate runs (the long row cut out: calls made cheap so that the planner
    cuts these short rows), a rollback of one row and a pass of 1: every row's logits equal transformers'
    full pass over that row alone."""
    from specbatch.runtime.attention import plan_runs
    import numpy as np

    kind = tune_cpu(monkeypatch, sdpa_call_keys=8)

    hf, directory = checkpoints[name]
    model = load_checkpoint(directory).model
    model.attention_backend = backend
    lengths = [56, 3, 9]
    rows = [_sequences(1, 62, seed=20 + i)[0] for i in range(3)]
    cache = model.new_cache(3, 64)
    first = model(torch.cat([row[:n] for row, n in zip(rows, lengths)]), cache, last=1, new_tokens=lengths)
    assert len(plan_runs(cache.host_lengths + 3, kind)) > 1  # the uniform pass below splits its rows
    chunk = model(torch.stack([row[n:n + 3] for row, n in zip(rows, lengths)]), cache)
    cache.set_lengths(None, [n + 3 for n in lengths[:2]] + [lengths[2] + 2])  # row 2 rolls back one token
    after = [n + 3 for n in lengths[:2]] + [lengths[2] + 2]
    one = model(torch.stack([row[n:n + 1] for row, n in zip(rows, after)]), cache)
    assert cache.host_lengths.tolist() == [n + 1 for n in after] and np.array_equal(
        cache.lengths.numpy(), cache.host_lengths)
    for i, (row, n) in enumerate(zip(rows, lengths)):
        expected = _hf_logits(hf, row[None, :n + 3])[0]
        _assert_close(first[i, 0], expected[n - 1])
        _assert_close(chunk[i], expected[n:n + 3])
        _assert_close(one[i, 0], _hf_logits(hf, row[None, :after[i] + 1])[0, -1])
