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
    "gpt2": 124, "gpt2-large": 774, "gemma-3-1b": 1000, "phi-4-mini": 3800,
}
# Qwen3's cards give the parameters without the embedding table(s), to two figures
PUBLISHED_NON_EMBEDDING_M = {"qwen3-0.6b": 440, "qwen3-1.7b": 1400, "qwen3-8b": 6950, "qwen3-14b": 13200}


def test_every_required_preset_exists_with_its_published_size():
    assert set(PUBLISHED_PARAMETERS_M) <= set(PRESET_NAMES)
    for name, millions in PUBLISHED_PARAMETERS_M.items():
        assert preset_config(name).parameter_count() / 1e6 == pytest.approx(millions, rel=0.01), name
    for name, millions in PUBLISHED_NON_EMBEDDING_M.items():
        config = preset_config(name)
        tables = (1 if config.tie_word_embeddings else 2) * config.vocab_size * config.hidden_size
        assert (config.parameter_count() - tables) / 1e6 == pytest.approx(millions, rel=0.01), name


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
    qwen3 = preset_config("qwen3-8b")
    assert (qwen3.head_dim, qwen3.qk_norm, qwen3.sliding_window, qwen3.tie_word_embeddings) == (128, True, None, False)
    gemma = preset_config("gemma-3-12b")
    assert gemma.sliding_layers == tuple((i + 1) % 6 != 0 for i in range(48)) and gemma.sliding_window == 1024
    assert gemma.rope_scaling == {"rope_type": "linear", "factor": 8.0} and gemma.local_rope_theta == 10000.0
    phi = preset_config("phi-4-mini")
    assert (phi.head_dim, phi.rotary_dim, phi.num_kv_heads, phi.tie_word_embeddings) == (128, 96, 8, True)


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
    assert first.running() == {"target": (target.source, target.fingerprint),
                               "draft": (draft.source, draft.fingerprint), "drafter": "draft_model"}
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


# ---------------------------------------------------------------- weights: straight to the device, checked
def _write_tiny(directory: Path, edit=None, dtype=torch.float32) -> Path:
    """A one-file Llama checkpoint of TINY's shape; `edit(tensors)` changes it before it is written."""
    from safetensors.torch import save_file

    from specbatch.runtime.checkpoint import build_model, internal_to_hf_llama
    from specbatch.runtime.config import load_config

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(TINY))
    config = load_config(directory / "config.json")
    state = build_model(config, seed=3).state_dict()
    tensors = {k: v.to(dtype) for k, v in internal_to_hf_llama(state, config).items()}
    if edit is not None:
        edit(tensors)
    save_file(tensors, str(directory / "model.safetensors"))
    return directory


@pytest.mark.parametrize("value, where", [(float("nan"), ""), (float("inf"), "")])
def test_non_finite_weights_are_refused_naming_the_file_and_tensor(tmp_path, value, where):
    from specbatch.runtime.checkpoint import CheckpointError, load_checkpoint

    def poison(tensors):
        tensors["model.layers.1.mlp.down_proj.weight"][3, 5] = value

    directory = _write_tiny(tmp_path / "m", poison)
    with pytest.raises(CheckpointError, match=rf"^{directory / 'model.safetensors'}: tensor "
                                              r"model.layers.1.mlp.down_proj.weight has non-finite values \(NaN or "
                                              r"inf\)$"):
        load_checkpoint(directory)


def test_a_weight_that_overflows_the_target_dtype_is_refused_as_such(tmp_path):
    from specbatch.runtime.checkpoint import CheckpointError, load_checkpoint

    def huge(tensors):
        tensors["model.norm.weight"][0] = 1e6  # beyond float16's 65504

    directory = _write_tiny(tmp_path / "m", huge)
    assert load_checkpoint(directory).model.final_norm.weight[0] == 1e6  # float32: fine
    with pytest.raises(CheckpointError, match=r"tensor model.norm.weight has non-finite values \(NaN or inf\) "
                                              r"once converted to float16$"):
        load_checkpoint(directory, dtype=torch.float16)


def test_integer_weights_are_refused_with_the_dtype_found_and_expected(tmp_path):
    from specbatch.runtime.checkpoint import CheckpointError, load_checkpoint

    def quantized(tensors):
        name = "model.layers.0.self_attn.q_proj.weight"
        tensors[name] = tensors[name].mul(100).to(torch.int8)

    directory = _write_tiny(tmp_path / "m", quantized)
    with pytest.raises(CheckpointError, match=rf"^{directory / 'model.safetensors'}: tensor model.layers.0.self_attn"
                                              r".q_proj.weight is int8, expected a floating-point weight \(float32, "
                                              r"float16 or bfloat16\)$"):
        load_checkpoint(directory)


def test_half_precision_files_load_into_the_requested_dtype(tmp_path):
    from specbatch.runtime.checkpoint import load_checkpoint

    directory = _write_tiny(tmp_path / "m", dtype=torch.float16)
    model = load_checkpoint(directory, dtype=torch.float32).model
    assert all(p.dtype == torch.float32 for p in model.parameters()) and model.inv_freq.dtype == torch.float32


def _host_memory_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def test_a_sharded_checkpoint_loads_a_shard_at_a_time_within_one_shard_of_the_model(tmp_path):
    """Peak host memory (the kernel's VmHWM, reset before loading) grows by the model plus about one shard,
    not by the whole checkpoint again and its fused copies; and the sharded load equals the one-file load."""
    import gc

    transformers = pytest.importorskip("transformers")
    from specbatch.runtime.checkpoint import load_checkpoint

    config = transformers.LlamaConfig(vocab_size=8192, hidden_size=256, intermediate_size=1024, num_hidden_layers=8,
                                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=256,
                                      tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config)
    model_bytes = sum(p.numel() * 4 for p in hf.parameters())
    hf.save_pretrained(str(tmp_path / "sharded"), max_shard_size="8MB")
    hf.save_pretrained(str(tmp_path / "single"), max_shard_size="10GB")
    del hf
    gc.collect()
    shards = sorted((tmp_path / "sharded").glob("*.safetensors"))
    assert len(shards) >= 5 and not (tmp_path / "single" / "model.safetensors.index.json").exists()
    largest_shard = max(path.stat().st_size for path in shards)
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")  # resets VmHWM (peak resident memory) to what is resident now
    except OSError:
        pytest.skip("this kernel does not let a process reset its peak resident memory")
    before_kib = _host_memory_kib("VmRSS")
    sharded = load_checkpoint(tmp_path / "sharded")
    grown = (_host_memory_kib("VmHWM") - before_kib) * 1024
    assert grown <= model_bytes + 1.5 * largest_shard + 8 * 2**20, (grown / 2**20, model_bytes / 2**20)
    single = load_checkpoint(tmp_path / "single")
    tokens = torch.tensor([[1, 5, 9, 200, 7]])
    assert torch.equal(sharded.model(tokens), single.model(tokens))
