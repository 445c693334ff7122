"""Every config.json field the runtime reads is honoured as transformers honours it, or refused in one line.

Oracle: transformers' forward on the same tiny checkpoint (logits within 1e-4 in float32), and its ACT2FN
for the activations. Refusals: a ConfigError / CheckpointError of one line naming the file and the value.
"""
from __future__ import annotations

import json
import pickle

import pytest
import torch

transformers = pytest.importorskip("transformers")

from specbatch.runtime.checkpoint import CheckpointError, load_checkpoint  # noqa: E402
from specbatch.runtime.config import ACTIVATIONS, ConfigError, config_from_dict, load_config  # noqa: E402
from specbatch.runtime.model import ACTIVATIONS as COMPUTED  # noqa: E402

TOL = 1e-4
V = 64
SPECIAL = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)
LLAMA = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, **SPECIAL)


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


def _ids(length: int = 14, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, V, (2, length), generator=torch.Generator().manual_seed(seed))


def _saved(hf, directory, randomize, seed=1):
    randomize(hf, seed=seed).save_pretrained(str(directory))
    return hf


def _assert_parity(hf, directory, length: int = 14):
    ids = _ids(length)
    expected = hf(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()
    diff = float((load_checkpoint(directory).model(ids).float() - expected).abs().max())
    assert diff <= TOL, f"max abs logit difference {diff:.3g}"


def _write(tmp_path, raw: dict):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(raw))
    return path


def _one_line_error(exc_type, call, *needles):
    with pytest.raises(exc_type) as error:
        call()
    message = str(error.value)
    assert "\n" not in message, message
    for needle in needles:
        assert str(needle) in message, (needle, message)
    return message


# ---------------------------------------------------------------------------------------------- activations
def test_every_accepted_activation_computes_transformers_act2fn():
    from transformers.activations import ACT2FN

    assert set(COMPUTED) == set(ACTIVATIONS)
    x = torch.linspace(-12, 12, 2001, dtype=torch.float32)
    for name in ACTIVATIONS:
        diff = float((COMPUTED[name](x.clone()) - ACT2FN[name](x.clone())).abs().max())
        assert diff <= 1e-6, (name, diff)


@pytest.mark.parametrize("act", ["gelu_pytorch_tanh", "relu", "gelu", "quick_gelu", "relu2", "tanh"])
def test_llama_hidden_act_is_honoured(act, tmp_path, randomize):
    hf = _saved(transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA, hidden_act=act)), tmp_path,
                randomize)
    _assert_parity(hf, tmp_path)


@pytest.mark.parametrize("family,act", [("gpt2", "gelu_fast"), ("gpt2", "quick_gelu"), ("gpt2", "relu"),
                                        ("opt", "gelu"), ("opt", "silu")])
def test_gpt2_and_opt_activation_function_is_honoured(family, act, tmp_path, randomize):
    if family == "gpt2":
        hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64, activation_function=act))
    else:
        hf = transformers.OPTForCausalLM(transformers.OPTConfig(
            vocab_size=V, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=64, word_embed_proj_dim=32, activation_function=act, **SPECIAL))
    _saved(hf, tmp_path, randomize)
    _assert_parity(hf, tmp_path)


@pytest.mark.parametrize("key,model_type", [("hidden_act", "llama"), ("activation_function", "gpt2"),
                                            ("hidden_activation", "gemma3_text")])
def test_an_activation_we_do_not_compute_is_refused(key, model_type, tmp_path):
    raw = dict(LLAMA, model_type=model_type, n_embd=32, n_layer=2, n_head=4, n_positions=64)
    raw[key] = "prelu"  # a module with learned weights: not a plain function of the input
    path = _write(tmp_path, raw)
    _one_line_error(ConfigError, lambda: load_config(path), path, "prelu", key)


# ---------------------------------------------------------------------------------------------- fields
def test_llama_ignores_sliding_window_as_transformers_does(tmp_path, randomize):
    """LlamaConfig has no window: a `sliding_window` key in a Llama config.json changes nothing there."""
    hf = _saved(transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)), tmp_path, randomize)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(raw, sliding_window=3)))
    assert load_checkpoint(tmp_path).config.sliding_window is None
    _assert_parity(hf, tmp_path)


@pytest.mark.parametrize("model_type", ["mistral", "qwen2"])
def test_bias_flags_that_the_family_ignores_are_ignored(model_type, tmp_path, randomize):
    """Mistral's and Qwen2's attention and MLP take no `attention_bias` / `mlp_bias` in transformers."""
    make = {"mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[model_type]
    hf = _saved(make[1](make[0](**LLAMA)), tmp_path, randomize)
    raw = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(raw, attention_bias=True, mlp_bias=True)))
    _assert_parity(hf, tmp_path)


def test_norm_eps_is_honoured(tmp_path, randomize):
    hf = _saved(transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA, rms_norm_eps=0.5)), tmp_path,
                randomize)
    assert load_checkpoint(tmp_path).config.norm_eps == 0.5
    _assert_parity(hf, tmp_path)


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "factor": 3.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 8, "beta_slow": 2},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "attention_factor": 1.3},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 16},
], ids=lambda rope: rope["rope_type"] + ("_af" if "attention_factor" in rope else ""))
def test_rope_scaling_types_match_transformers(rope, tmp_path, randomize):
    config = transformers.LlamaConfig(**dict(LLAMA, num_key_value_heads=4, hidden_size=64, head_dim=16),
                                      rope_parameters=dict(rope, rope_theta=10000.0))
    hf = _saved(transformers.LlamaForCausalLM(config), tmp_path, randomize)
    _assert_parity(hf, tmp_path, length=40)


def test_llama3_rope_without_low_freq_factor_is_one_line(tmp_path):
    path = _write(tmp_path, dict(LLAMA, model_type="llama", rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16}))
    _one_line_error(ConfigError, lambda: load_config(path), path, "llama3", "low_freq_factor")


@pytest.mark.parametrize("kind", ["mrope", "proportional", "ntk-by-parts"])
def test_an_unknown_rope_type_is_refused_by_name(kind, tmp_path):
    path = _write(tmp_path, dict(LLAMA, model_type="qwen3", rope_scaling={"rope_type": kind, "factor": 2.0}))
    _one_line_error(ConfigError, lambda: load_config(path), path, repr(kind), "longrope")


def test_partial_rotary_outside_phi3_is_refused(tmp_path):
    path = _write(tmp_path, dict(LLAMA, model_type="llama", partial_rotary_factor=0.5))
    _one_line_error(ConfigError, lambda: load_config(path), path, "partial_rotary_factor")


@pytest.mark.parametrize("key,value", [("attn_logit_softcapping", 50.0), ("use_bidirectional_attention", True)])
def test_gemma3_features_the_runtime_lacks_are_refused(key, value, tmp_path):
    path = _write(tmp_path, dict(LLAMA, model_type="gemma3_text", **{key: value}))
    _one_line_error(ConfigError, lambda: load_config(path), path, key)


@pytest.mark.parametrize("raw, named", [(dict(model_type="gpt_oss", num_local_experts=32), "gpt_oss"),
                                        (dict(model_type="qwen2_moe", num_experts=8), "qwen2_moe"),
                                        (dict(model_type="deepseek_v3", n_routed_experts=16), "deepseek_v3"),
                                        (dict(model_type="qwen3", num_experts=8), "num_experts = 8"),
                                        (dict(model_type="mistral", num_local_experts=8), "num_local_experts = 8")],
                         ids=lambda value: value["model_type"] if isinstance(value, dict) else None)
def test_mixture_of_experts_outside_the_runtimes_families_is_refused_naming_them(raw, named, tmp_path):
    """gpt-oss, DeepSeek and the rest, or a dense family's name with an expert count: refused in one line that
    names what made the config a mixture of experts and the families the runtime does run."""
    path = _write(tmp_path, dict(LLAMA, **raw))
    _one_line_error(ConfigError, lambda: load_config(path), path, named, "mixture-of-experts",
                    "qwen3_moe, mixtral, glm4_moe", "gemma3_text", "phi3")


MOE = dict(LLAMA, moe_intermediate_size=16, num_experts_per_tok=2)


@pytest.mark.parametrize("raw, named", [
    (dict(MOE, model_type="glm4_moe", n_routed_experts=8, n_group=3), "n_group 3 must divide n_routed_experts 8"),
    (dict(MOE, model_type="glm4_moe", n_routed_experts=8, n_group=8), "groups of at least 2 experts"),
    (dict(MOE, model_type="glm4_moe", n_routed_experts=8, n_group=2, topk_group=3), "topk_group 3"),
    (dict(MOE, model_type="glm4_moe", n_routed_experts=8, n_group=4, topk_group=1, num_experts_per_tok=3),
     "num_experts_per_tok 3"),
    (dict(MOE, model_type="glm4_moe", n_routed_experts=8, routed_scaling_factor=0), "routed_scaling_factor"),
    (dict(MOE, model_type="qwen3_moe", num_experts=8, num_experts_per_tok=9), "num_experts_per_tok 9"),
    (dict(MOE, model_type="qwen3_moe", num_experts=8, decoder_sparse_step=0), "decoder_sparse_step"),
    (dict(MOE, model_type="qwen3_moe", num_experts=8, mlp_only_layers="1"), "mlp_only_layers"),
    (dict(MOE, model_type="mixtral", num_local_experts=-2), "num_local_experts"),
], ids=lambda value: value if isinstance(value, str) else None)
def test_impossible_routing_fields_are_one_line(raw, named, tmp_path):
    path = _write(tmp_path, raw)
    _one_line_error(ConfigError, lambda: load_config(path), path, named)


def test_mixture_of_experts_layers_as_transformers_builds_them(tmp_path):
    """Qwen3-MoE: every decoder_sparse_step-th layer not in mlp_only_layers routes (no experts: all dense);
    GLM-4.5: from first_k_dense_replace on, half-rotary heads by default; Mixtral: every layer."""
    def layers(raw):
        config = load_config(_write(tmp_path, dict(MOE, num_hidden_layers=6, **raw)))
        return [config.routes_experts(i) for i in range(6)], config

    routed, _ = layers(dict(model_type="qwen3_moe", num_experts=8, decoder_sparse_step=2, mlp_only_layers=[3]))
    assert routed == [False, True, False, False, False, True]
    routed, config = layers(dict(model_type="qwen3_moe", num_experts=0))
    assert routed == [False] * 6 and config.experts_per_token == 0
    routed, config = layers(dict(model_type="glm4_moe", n_routed_experts=8, first_k_dense_replace=2, head_dim=16))
    assert routed == [False, False, True, True, True, True] and config.rotary_dim == 8
    assert config.shared_expert_intermediate_size == 16 and config.mtp_layers == 0
    routed, config = layers(dict(model_type="mixtral", num_local_experts=4))
    assert routed == [True] * 6 and config.expert_intermediate_size == LLAMA["intermediate_size"]


def test_a_multimodal_gemma3_loads_its_text_tower(tmp_path, randomize):
    """A `gemma3` (image + text) checkpoint: its text tower is read, the vision tower's tensors skipped; on
    text the logits are the full model's."""
    text = transformers.Gemma3TextConfig(
        vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=4,
        layer_types=["sliding_attention", "full_attention"], **SPECIAL)
    vision = transformers.SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, image_size=16, patch_size=8)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                       image_token_index=V - 1, boi_token_index=V - 2, eoi_token_index=V - 3)
    hf = _saved(transformers.Gemma3ForConditionalGeneration(config), tmp_path, randomize)
    assert load_checkpoint(tmp_path).config.model_type == "gemma3_text"
    ids = torch.randint(3, V - 4, (2, 12), generator=torch.Generator().manual_seed(3))
    expected = hf(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()
    assert float((load_checkpoint(tmp_path).model(ids) - expected).abs().max()) <= TOL


# ---------------------------------------------------------------------------------------------- weight files
@pytest.fixture
def llama_dir(tmp_path, randomize):
    hf = _saved(transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)), tmp_path / "model", randomize)
    return hf, tmp_path / "model"


def _as_bin(directory, state):
    (directory / "model.safetensors").unlink()
    torch.save(state, directory / "pytorch_model.bin")


@pytest.mark.parametrize("kind", ["not_a_zip", "pickled_object", "not_a_dict"])
def test_a_bad_pytorch_model_bin_is_one_line_naming_the_file(kind, llama_dir):
    _, directory = llama_dir
    (directory / "model.safetensors").unlink()
    path = directory / "pytorch_model.bin"
    if kind == "not_a_zip":
        path.write_bytes(b"this is not a checkpoint at all" * 10)
    elif kind == "pickled_object":
        with open(path, "wb") as file:
            pickle.dump({"model.embed_tokens.weight": torch.zeros(2), "extra": ConfigError("x")}, file, protocol=2)
    else:
        torch.save([torch.zeros(2)], path)
    message = _one_line_error(CheckpointError, lambda: load_checkpoint(directory), path)
    assert "weights_only" not in message


def test_a_peft_prefix_is_stripped_when_the_rest_matches(llama_dir):
    hf, directory = llama_dir
    _as_bin(directory, {"base_model.model." + k: v.clone() for k, v in hf.state_dict().items()})
    _assert_parity(hf, directory)


def test_unmerged_lora_tensors_are_named(llama_dir):
    hf, directory = llama_dir
    state = {"base_model.model." + k: v.clone() for k, v in hf.state_dict().items()}
    state["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight"] = torch.zeros(4, 32)
    _as_bin(directory, state)
    _one_line_error(CheckpointError, lambda: load_checkpoint(directory), "PEFT", "lora_A", "merge")


def test_a_missing_tensor_names_the_directory_the_role_and_a_foreign_prefix(llama_dir):
    hf, directory = llama_dir
    _as_bin(directory, {"wrapper." + k: v.clone() for k, v in hf.state_dict().items()})
    message = _one_line_error(CheckpointError, lambda: load_checkpoint(directory, role="draft"), directory,
                              "the draft", "is missing", "'wrapper.")
    assert message.count("wrapper") >= 1
    raw = json.loads((directory / "config.json").read_text())
    assert config_from_dict(raw).model_type == "llama"


@pytest.mark.parametrize("model_type,key,value", [
    ("gemma3_text", "sliding_window_pattern", 0), ("gemma3_text", "layer_types", ["full_attention"]),
    ("qwen3", "layer_types", "sliding_attention"), ("mistral", "sliding_window", -4),
    ("phi3", "partial_rotary_factor", 1.5)])
def test_malformed_window_and_rotary_fields_are_one_line(model_type, key, value, tmp_path):
    path = _write(tmp_path, dict(LLAMA, model_type=model_type, use_sliding_window=True, **{key: value}))
    _one_line_error(ConfigError, lambda: load_config(path), path, key)


@pytest.mark.parametrize("raw, published", [
    (dict(model_type="qwen3_moe", vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
          num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
          num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True,
          decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False), 30.5e9),  # Qwen3-30B-A3B
    (dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
          num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768, num_local_experts=8,
          num_experts_per_tok=2, tie_word_embeddings=False), 46.7e9),  # Mixtral-8x7B
], ids=["qwen3-30b-a3b", "mixtral-8x7b"])
def test_a_mixture_of_experts_counts_every_expert_as_published(raw, published):
    """The published configs count the parameters their model cards state (every expert, not the active ones)."""
    assert config_from_dict(raw).parameter_count() == pytest.approx(published, rel=0.005)
