"""Shape presets: published Hugging Face `config.json` contents, for timing before the weights exist.

A preset gives a shape, not weights: calibrating one builds random weights (forward-pass time does
not depend on the values) and needs `--acceptance`, because random weights say nothing about how
often a real draft agrees with a real target. Names are exact keys; nothing is fuzzy-matched.
Only the fields the runtime reads are kept; each entry names the repository it was copied from. calibrate
and bench count a preset's weights against the free memory before building any.
"""
from __future__ import annotations

from specbatch.perfmodel.errors import UsageError

from .config import MOE_FAMILY, ModelConfig, config_from_dict

_OPT = dict(model_type="opt", vocab_size=50272, max_position_embeddings=2048, activation_function="relu",
            do_layer_norm_before=True, enable_bias=True, tie_word_embeddings=True,
            bos_token_id=2, eos_token_id=2, pad_token_id=1)
_LLAMA3_ROPE = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0,
                    original_max_position_embeddings=8192)
_GPT2 = dict(model_type="gpt2", vocab_size=50257, n_positions=1024, activation_function="gelu_new",
             layer_norm_epsilon=1e-5, bos_token_id=50256, eos_token_id=50256)

_QWEN3 = dict(model_type="qwen3", vocab_size=151936, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
              rms_norm_eps=1e-6, rope_theta=1000000.0, hidden_act="silu", attention_bias=False,
              use_sliding_window=False, sliding_window=None, max_window_layers=28,
              bos_token_id=151643, eos_token_id=151645)
_QWEN3_MOE = dict(model_type="qwen3_moe", vocab_size=151936, num_key_value_heads=4, head_dim=128,
                  max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, hidden_act="silu",
                  attention_bias=False, use_sliding_window=False, sliding_window=None, decoder_sparse_step=1,
                  mlp_only_layers=[], num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                  tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645)
# gpt-oss's alternating layer types (sliding_window 128 on even layers) are left out: the shape is refused anyway
_GPT_OSS = dict(model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                num_attention_heads=64, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                num_experts_per_tok=4, attention_bias=True, sliding_window=128, swiglu_limit=7.0, rms_norm_eps=1e-5,
                rope_theta=150000.0, rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0,
                                                       original_max_position_embeddings=4096, truncate=False),
                hidden_act="silu", tie_word_embeddings=False, eos_token_id=200002, pad_token_id=199999)
_GEMMA3 = dict(model_type="gemma3_text", head_dim=256, query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh",
               rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0, sliding_window_pattern=6,
               final_logit_softcapping=None, attn_logit_softcapping=None, tie_word_embeddings=True,
               bos_token_id=2, eos_token_id=[1, 106], pad_token_id=0)

PRESETS: dict[str, dict] = {
    # facebook/opt-*
    "opt-125m": dict(_OPT, hidden_size=768, num_hidden_layers=12, num_attention_heads=12, ffn_dim=3072,
                     word_embed_proj_dim=768),
    "opt-350m": dict(_OPT, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, ffn_dim=4096,
                     word_embed_proj_dim=512, do_layer_norm_before=False),  # post-LN, 512-wide embeddings
    "opt-1.3b": dict(_OPT, hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, ffn_dim=8192,
                     word_embed_proj_dim=2048),
    "opt-6.7b": dict(_OPT, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, ffn_dim=16384,
                     word_embed_proj_dim=4096),
    # JackFram/llama-68m and JackFram/llama-160m: the drafts of SpecInfer
    "llama-68m": dict(model_type="llama", vocab_size=32000, hidden_size=768, num_hidden_layers=2,
                      num_attention_heads=12, num_key_value_heads=12, intermediate_size=3072,
                      max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                      bos_token_id=0, eos_token_id=2, pad_token_id=1),
    "llama-160m": dict(model_type="llama", vocab_size=32000, hidden_size=768, num_hidden_layers=12,
                       num_attention_heads=12, num_key_value_heads=12, intermediate_size=3072,
                       max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       bos_token_id=0, eos_token_id=2, pad_token_id=1),
    # meta-llama/Llama-2-7b-hf
    "llama-2-7b": dict(model_type="llama", vocab_size=32000, hidden_size=4096, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=32, intermediate_size=11008,
                       max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False,
                       bos_token_id=1, eos_token_id=2),
    # meta-llama/Llama-3.2-1B
    "llama-3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, intermediate_size=8192,
                         max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
                         rope_theta=500000.0, rope_scaling=dict(_LLAMA3_ROPE, factor=32.0),
                         bos_token_id=128000, eos_token_id=128001),
    # meta-llama/Llama-3.1-8B
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=14336,
                         max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         rope_theta=500000.0, rope_scaling=dict(_LLAMA3_ROPE, factor=8.0),
                         bos_token_id=128000, eos_token_id=128001),
    # Qwen/Qwen2.5-0.5B and Qwen/Qwen2.5-7B (base models)
    "qwen2.5-0.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=896, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
                         max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
                         rope_theta=1000000.0, use_sliding_window=False,
                         bos_token_id=151643, eos_token_id=151643),
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, intermediate_size=18944,
                       max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=False,
                       rope_theta=1000000.0, use_sliding_window=False,
                       bos_token_id=151643, eos_token_id=151643),
    # Qwen/Qwen3-0.6B, -1.7B, -8B and -14B (dense; one tokenizer across the family)
    "qwen3-0.6b": dict(_QWEN3, hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, intermediate_size=3072,
                       tie_word_embeddings=True),
    "qwen3-1.7b": dict(_QWEN3, hidden_size=2048, num_hidden_layers=28, num_attention_heads=16, intermediate_size=6144,
                       tie_word_embeddings=True),
    "qwen3-8b": dict(_QWEN3, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, intermediate_size=12288,
                     tie_word_embeddings=False),
    "qwen3-14b": dict(_QWEN3, hidden_size=5120, num_hidden_layers=40, num_attention_heads=40,
                      intermediate_size=17408, tie_word_embeddings=False),
    # google/gemma-3-1b-it (gemma3_text) and the text tower of google/gemma-3-12b-it (its text_config); their
    # embedding tables differ (262144 and 262208 rows), so the runtime cannot pair them (one vocabulary)
    "gemma-3-1b": dict(_GEMMA3, vocab_size=262144, hidden_size=1152, num_hidden_layers=26, num_attention_heads=4,
                       num_key_value_heads=1, intermediate_size=6912, max_position_embeddings=32768,
                       sliding_window=512),
    "gemma-3-12b": dict(_GEMMA3, vocab_size=262208, hidden_size=3840, num_hidden_layers=48, num_attention_heads=16,
                        num_key_value_heads=8, intermediate_size=15360, max_position_embeddings=131072,
                        sliding_window=1024, rope_scaling=dict(rope_type="linear", factor=8.0)),
    # microsoft/Phi-4-mini-instruct; its longrope factors (48 short, 48 long) are left out: they change no
    # pass's cost, and without them the preset's context is the full 131072 positions
    "phi-4-mini": dict(model_type="phi3", vocab_size=200064, hidden_size=3072, num_hidden_layers=32,
                       num_attention_heads=24, num_key_value_heads=8, intermediate_size=8192,
                       max_position_embeddings=131072, original_max_position_embeddings=4096,
                       partial_rotary_factor=0.75, rope_theta=10000.0, sliding_window=262144, rms_norm_eps=1e-5,
                       hidden_act="silu", tie_word_embeddings=True,
                       bos_token_id=199999, eos_token_id=199999, pad_token_id=199999),
    # openai-community/gpt2 and gpt2-large
    "gpt2": dict(_GPT2, n_embd=768, n_layer=12, n_head=12),
    "gpt2-large": dict(_GPT2, n_embd=1280, n_layer=36, n_head=20),
    # mixtures of experts (docs/models.md): every expert is counted in the weights, a token multiplies its top-k
    # Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B (the original releases: 40960 positions, rope_theta 1e6)
    "qwen3-30b-a3b": dict(_QWEN3_MOE, hidden_size=2048, intermediate_size=6144, num_hidden_layers=48,
                          num_attention_heads=32, moe_intermediate_size=768),
    "qwen3-235b-a22b": dict(_QWEN3_MOE, hidden_size=4096, intermediate_size=12288, num_hidden_layers=94,
                            num_attention_heads=64, moe_intermediate_size=1536),
    # mistralai/Mixtral-8x7B-v0.1
    "mixtral-8x7b": dict(model_type="mixtral", vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         max_position_embeddings=32768, num_local_experts=8, num_experts_per_tok=2,
                         rms_norm_eps=1e-5, rope_theta=1000000.0, sliding_window=None, hidden_act="silu",
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2),
    # zai-org/GLM-4.5-Air: its MTP layer (num_nextn_predict_layers) is stored after the 46 decoder layers
    "glm-4.5-air": dict(model_type="glm4_moe", vocab_size=151552, hidden_size=4096, intermediate_size=10944,
                        num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
                        max_position_embeddings=131072, partial_rotary_factor=0.5, rope_theta=1000000.0,
                        rms_norm_eps=1e-5, hidden_act="silu", attention_bias=True, use_qk_norm=False,
                        moe_intermediate_size=1408, n_routed_experts=128, n_shared_experts=1, num_experts_per_tok=8,
                        first_k_dense_replace=1, n_group=1, topk_group=1, norm_topk_prob=True,
                        routed_scaling_factor=1.0, num_nextn_predict_layers=1, tie_word_embeddings=False,
                        eos_token_id=[151329, 151336, 151338], pad_token_id=151329),
    # openai/gpt-oss-20b and openai/gpt-oss-120b: shapes only (SHAPE_ONLY); 120b differs from 20b in its layers and
    # experts, as transformers' GptOssConfig defaults (36 layers, 128 experts) and the model card give them
    "gpt-oss-20b": dict(_GPT_OSS, num_hidden_layers=24, num_local_experts=32),
    "gpt-oss-120b": dict(_GPT_OSS, num_hidden_layers=36, num_local_experts=128),
}

PRESET_NAMES: tuple[str, ...] = tuple(PRESETS)
# Families whose presets are shapes only: runtime/config.py refuses them (MOE_MODEL_TYPES), and so does selecting
# the preset, in one line, when its name is resolved. The family is refused before memory is counted: no machine
# runs it, so a line about the memory the weights need would send a user after a machine that would not help.
SHAPE_ONLY = {"gpt_oss": "attention sinks, experts with biases and a clamped SwiGLU, which runtime/model.py does "
                         "not compute"}


def preset_config(name: str) -> ModelConfig:
    """The ModelConfig of a preset; the error for an unknown name lists every valid one, the one for a shape the
    runtime does not run names the presets of its kind that do."""
    if name not in PRESETS:
        raise UsageError(f"unknown preset {name!r}; presets: {', '.join(PRESET_NAMES)} (heads, as --draft: "
                         f"{', '.join(HEAD_PRESETS)})")
    model_type = PRESETS[name]["model_type"]
    if model_type in SHAPE_ONLY:
        running = [other for other, raw in PRESETS.items() if raw["model_type"] in MOE_FAMILY]
        raise UsageError(f"preset {name}: a {model_type} shape the runtime does not run ({SHAPE_ONLY[model_type]}); "
                         f"the mixture-of-experts presets that run: {', '.join(running)}")
    return config_from_dict(PRESETS[name], source=f"preset {name}")


# Heads' shapes, as the `speculators` config of each (runtime.heads.config reads them): timing a head before its
# weights exist. Each names the published head its shape follows; a preset is checked against the --target.
HEAD_PRESETS: dict[str, dict] = {
    # yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: one Llama layer of the target's width, a 32,000-token draft vocabulary
    "eagle3-llama-3.1-8b": dict(
        speculators_model_type="eagle3", draft_vocab_size=32000,
        transformer_layer_config=dict(PRESETS["llama-3.1-8b"], num_hidden_layers=1)),
    # RedHatAI/Qwen3-8B-speculator.eagle3: one layer of Qwen3-8B's shape, a 32,000-token draft vocabulary
    "eagle3-qwen3-8b": dict(
        speculators_model_type="eagle3", draft_vocab_size=32000,
        transformer_layer_config=dict(PRESETS["qwen3-8b"], num_hidden_layers=1)),
    # an MTP layer of Qwen3-8B's shape over the whole vocabulary (the layout of Qwen3-Next's MTP module)
    "mtp-qwen3-8b": dict(
        speculators_model_type="mtp", transformer_layer_config=dict(PRESETS["qwen3-8b"], num_hidden_layers=1)),
}


def head_preset_config(name: str, target: ModelConfig):
    """The HeadConfig of a head preset for `target` (checked against it: one line when it does not fit)."""
    from .heads import HeadError
    from .heads.config import head_config_from_dict

    try:
        return head_config_from_dict(HEAD_PRESETS[name], target, f"head preset {name}")
    except HeadError as error:
        raise UsageError(f"--draft: {error}") from None
