"""The one loader (runtime.loading): shape presets, what --target/--draft/--device name, the pair's shared
vocabulary, seeded random weights for shapes, the bundled pair with its tokenizer, and n-gram files."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specbatch.perfmodel.errors import UsageError
from specbatch.perfmodel.jsonio import directory_fingerprint
from specbatch.runtime.loading import load_ngram, load_pair, resolve_device, resolve_model, resolve_pair
from specbatch.runtime.presets import PRESET_NAMES, PRESETS, preset_config

MODELS = Path(__file__).resolve().parents[2] / "data" / "models"
TINY = dict(model_type="llama", vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128, eos_token_id=1)


# ---------------------------------------------------------------- presets
# Parameter counts published on the model cards (millions): an oracle independent of our formula.
PUBLISHED_PARAMETERS_M = {
    "opt-125m": 125, "opt-350m": 331, "opt-1.3b": 1316, "opt-6.7b": 6658, "llama-68m": 68, "llama-160m": 162,
    "llama-2-7b": 6738, "llama-3.2-1b": 1236, "llama-3.1-8b": 8030, "qwen2.5-0.5b": 494, "qwen2.5-7b": 7616,
    "gpt2": 124, "gpt2-large": 774,
}


def test_every_required_preset_exists_with_its_published_size():
    assert set(PUBLISHED_PARAMETERS_M) <= set(PRESET_NAMES)
    for name, millions in PUBLISHED_PARAMETERS_M.items():
        assert preset_config(name).parameter_count() / 1e6 == pytest.approx(millions, rel=0.01), name


def test_preset_shapes_that_are_easy_to_get_wrong():
    opt350 = preset_config("opt-350m")
    assert (opt350.word_embed_proj_dim, opt350.do_layer_norm_before, opt350.final_layer_norm) == (512, False, False)
    small = preset_config("llama-3.2-1b")
    assert (small.num_kv_heads, small.head_dim, small.tie_word_embeddings) == (8, 64, True)
    assert small.rope_scaling["factor"] == 32.0 and small.rope_theta == 500000.0
    assert preset_config("llama-3.1-8b").rope_scaling["factor"] == 8.0
    qwen = preset_config("qwen2.5-0.5b")
    assert (qwen.num_heads, qwen.num_kv_heads, qwen.qkv_bias, qwen.tie_word_embeddings) == (14, 2, True, True)
    assert preset_config("llama-68m").num_layers == 2


def test_unknown_preset_lists_the_valid_names():
    with pytest.raises(UsageError) as error:
        preset_config("llama2-7b")
    assert all(name in str(error.value) for name in PRESETS)


# ---------------------------------------------------------------- resolving --target / --draft
def test_a_preset_and_a_config_file_mean_random_weights(tmp_path):
    spec = resolve_model("opt-125m", "target")
    assert spec.random_weights and spec.source == "opt-125m"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(PRESETS["llama-68m"]))
    spec = resolve_model(str(path), "draft")
    assert spec.random_weights and spec.config == preset_config("llama-68m")


def test_a_config_without_needed_fields_names_them(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "vocab_size": 100, "hidden_size": 64}))
    with pytest.raises(UsageError, match="--target: .*missing field.*num_hidden_layers, num_attention_heads"):
        resolve_model(str(path), "target")


def test_a_directory_needs_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["llama-68m"]))
    with pytest.raises(UsageError, match="no weights.*name .*config.json itself"):
        resolve_model(str(tmp_path), "draft")
    (tmp_path / "model.safetensors").write_bytes(b"")  # existence is what resolve checks; loading comes later
    assert not resolve_model(str(tmp_path), "draft").random_weights


def test_a_missing_path_that_is_no_preset_says_both():
    with pytest.raises(UsageError, match="--draft 'nowhere/model': no such model directory.*presets: opt-125m"):
        resolve_model("nowhere/model", "draft")


def test_pair_with_another_vocabulary_is_refused_naming_the_draft():
    with pytest.raises(UsageError, match="^--draft llama-68m: a vocabulary of 32000 tokens, the target's has 50257; "
                                         "draft and target must share one tokenizer$"):
        resolve_pair("gpt2", "llama-68m")
    target, draft = resolve_pair("gpt2", None)
    assert target.source == "gpt2" and draft is None


# ---------------------------------------------------------------- --device
def test_device_names_are_checked_against_this_machine():
    assert resolve_device(None) == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == "cpu"
    for name in ("tpu", "cpu:0", "cuda:x"):
        with pytest.raises(UsageError, match=f"^--device: '{name}' is not one of cpu, cuda, cuda:N$"):
            resolve_device(name)
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="--device cuda: CUDA is not available on this machine"):
            resolve_device("cuda")
    else:
        with pytest.raises(UsageError, match="CUDA device"):
            resolve_device(f"cuda:{torch.cuda.device_count()}")


# ---------------------------------------------------------------- loading
def test_shapes_load_with_seeded_random_weights_target_and_draft_apart(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    target, draft = resolve_pair(str(config), str(config))
    first, second = load_pair(target, draft, "cpu", torch.float32), load_pair(target, draft, "cpu", torch.float32)
    assert first.tokenizer is None and first.eos_token_ids == (1,)
    assert torch.equal(first.target.lm_head.weight, second.target.lm_head.weight)  # seeded: the same each time
    assert not torch.equal(first.target.lm_head.weight, first.draft.lm_head.weight)  # but target != draft
    assert first.running() == {"target": (target.source, target.fingerprint), "draft": (draft.source,
                                                                                         draft.fingerprint)}
    alone = load_pair(target, None, "cpu", torch.float32)
    assert alone.draft is None and alone.running() == {"target": (target.source, target.fingerprint)}


def test_the_bundled_pair_loads_with_its_tokenizer_and_fingerprints():
    target, draft = resolve_pair(str(MODELS / "demo-target"), str(MODELS / "demo-draft"))
    pair = load_pair(target, draft, "cpu", torch.float32)
    assert pair.tokenizer is not None and pair.tokenizer.decode(pair.tokenizer.encode("def f(x):")) == "def f(x):"
    assert pair.target.config.vocab_size == pair.draft.config.vocab_size == 259
    assert pair.running()["draft"] == (str((MODELS / "demo-draft").resolve()),
                                       directory_fingerprint(MODELS / "demo-draft"))


def test_ngram_files_are_checked_against_the_target_naming_the_option(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY))
    shape, _ = resolve_pair(str(config), None)
    ngram = MODELS / "demo-ngram.safetensors"
    with pytest.raises(UsageError, match=f"^--stage2 {ngram}: a vocabulary of 259 tokens, the target's has 64;"):
        load_ngram(ngram, "--stage2", shape)
    with pytest.raises(UsageError, match="^--draft: .*absent.safetensors: no such n-gram file$"):
        load_ngram(tmp_path / "absent.safetensors", "--draft", shape)
    demo, _ = resolve_pair(str(MODELS / "demo-target"), None)
    assert load_ngram(ngram, "--stage2", demo).vocab_size == 259
