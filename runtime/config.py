"""Model configuration: one frozen dataclass built from a Hugging Face `config.json`.

Every family the runtime supports is described by the same fields, so `model.py` can stay a single
config-driven module. Reading is strict: a missing field is an error that names it.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specbatch.perfmodel.errors import SpecbatchError, UsageError

# mixture-of-experts families the runtime runs: Llama-shaped blocks whose MLP routes each token to a few experts
MOE_FAMILY = ("qwen3_moe", "mixtral", "glm4_moe")
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "phi3") + MOE_FAMILY
SUPPORTED_MODEL_TYPES = LLAMA_FAMILY + ("gpt2", "opt")
# the other mixture-of-experts families: refused by name (their routers, attention or expert MLPs differ from
# what model.py computes)
MOE_MODEL_TYPES = ("qwen2_moe", "deepseek_v2", "deepseek_v3", "phimoe", "dbrx", "granitemoe", "olmoe", "jamba",
                   "gpt_oss", "llama4")
# and any other family whose config counts experts (transformers' names for the count, by family)
EXPERT_COUNT_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts")
ROUTERS = ("softmax", "sigmoid")
# transformers' ACT2FN names that `model.ACTIVATIONS` computes (the rest are refused by name)
ACTIVATIONS = ("silu", "swish", "gelu", "gelu_python", "gelu_new", "gelu_pytorch_tanh", "gelu_python_tanh",
               "gelu_fast", "gelu_accurate", "gelu_10", "quick_gelu", "relu", "relu2", "relu6", "leaky_relu",
               "tanh", "sigmoid", "mish", "linear")
ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")


class ConfigError(SpecbatchError):
    """A config file the runtime cannot use; the message names the file and the problem."""


@dataclass(frozen=True)
class ModelConfig:
    model_type: str  # as written in config.json: one of SUPPORTED_MODEL_TYPES
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # < num_heads means grouped-query attention
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float = 1e-5
    activation: str = "silu"  # a transformers ACT2FN name (ACTIVATIONS); the Llama family gates with it
    tie_word_embeddings: bool = False
    # Llama family
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": linear | yarn | llama3 | longrope, its parameters}
    qkv_bias: bool = False  # Qwen2 has biases on q, k, v only
    o_bias: bool = False  # Llama's attention_bias puts a bias on o_proj too
    mlp_bias: bool = False
    sliding_window: int | None = None  # Mistral: each query sees at most this many keys
    sliding_layers: tuple[bool, ...] = ()  # which layers use the window (Qwen2: from max_window_layers on)
    rotary_dim: int | None = None  # Phi-3's partial rotary: only each head's first rotary_dim dims turn
    local_rope_theta: float | None = None  # Gemma 3: the sliding-window layers' own RoPE base ...
    local_rope_scaling: dict | None = None  # ... and scaling
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head's queries and keys before RoPE
    norm_offset: float = 0.0  # Gemma: RMSNorm scales by (1 + weight), computed in float32
    sandwich_norms: bool = False  # Gemma 3: norms after attention and MLP too, before the residual add
    embed_scale: float | None = None  # Gemma: embeddings times sqrt(hidden_size), in the weights' dtype
    query_scale: float | None = None  # attention scores' scale; None: 1 / sqrt(head_dim)
    final_logit_softcap: float | None = None  # Gemma: logits = cap * tanh(logits / cap)
    # mixture of experts (Qwen3-MoE, Mixtral, GLM-4.5): num_experts 0 is a dense model
    num_experts: int = 0
    experts_per_token: int = 0  # the router's top-k
    expert_intermediate_size: int = 0  # each expert's gated MLP width (intermediate_size stays the dense layers')
    expert_layers: tuple[bool, ...] = ()  # which layers route to experts; the others keep a dense MLP
    router: str = "softmax"  # softmax: top-k of softmax(logits) (Qwen3-MoE, Mixtral); sigmoid: GLM-4.5's (below)
    normalize_expert_weights: bool = False  # norm_topk_prob: the chosen experts' weights rescaled to sum to 1
    # sigmoid routing: experts chosen by sigmoid(logits) + a learned score-correction bias, only within the
    # `expert_groups_per_token` best of `expert_groups` groups (a group scored by its two best experts); weighted
    # by the sigmoid scores without the bias, times routed_scaling_factor
    expert_groups: int = 1
    expert_groups_per_token: int = 1
    routed_scaling_factor: float = 1.0
    shared_expert_intermediate_size: int = 0  # GLM-4.5: an always-on gated MLP beside the routed experts
    mtp_layers: int = 0  # GLM-4.5: multi-token-prediction layers stored after the decoder's, not run by a pass
    # OPT
    do_layer_norm_before: bool = True  # False: post-LN blocks (opt-350m)
    word_embed_proj_dim: int | None = None  # opt-350m embeds in 512 and projects to 1024
    enable_bias: bool = True
    final_layer_norm: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    pad_token_id: int | None = None

    @property
    def family(self) -> str:
        return "llama" if self.model_type in LLAMA_FAMILY else self.model_type

    def routes_experts(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts (a model with fewer layers than its config's
        list, as a draft cut from a target, reads the list's first entries)."""
        return bool(self.num_experts) and (not self.expert_layers or self.expert_layers[layer])

    def parameter_count(self) -> int:
        """Parameters of the model this config builds (tied embeddings counted once; every expert counted)."""
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.family == "llama":
            attn = d * q_out + 2 * d * kv_out + q_out * d
            attn += (q_out + 2 * kv_out) * self.qkv_bias + d * self.o_bias
            attn += 2 * self.head_dim * self.qk_norm
            mlp = 3 * d * f + (2 * f + d) * self.mlp_bias
            norms = (4 if self.sandwich_norms else 2) * d
            routed = sum(self.routes_experts(i) for i in range(self.num_layers))
            experts = (self.num_experts * (3 * d * self.expert_intermediate_size + d)
                       + self.num_experts * (self.router == "sigmoid") + 3 * d * self.shared_expert_intermediate_size)
            total = self.num_layers * (attn + norms) + (self.num_layers - routed) * mlp + routed * experts + v * d + d
            return total + (0 if self.tie_word_embeddings else v * d)
        bias = 1 if self.enable_bias else 0
        attn = 4 * d * d + 4 * d * bias
        mlp = 2 * d * f + (f + d) * bias
        per_layer = attn + mlp + 4 * d
        if self.family == "gpt2":
            return self.num_layers * per_layer + v * d + self.max_position_embeddings * d + 2 * d
        embed_dim = self.word_embed_proj_dim or d
        total = self.num_layers * per_layer + v * embed_dim + (self.max_position_embeddings + 2) * d
        if embed_dim != d:
            total += 2 * d * embed_dim
        if self.final_layer_norm:
            total += 2 * d
        return total + (0 if self.tie_word_embeddings else v * embed_dim)

    def kv_bytes_per_token(self, bytes_per_element: int) -> int:
        """KV-cache bytes one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * bytes_per_element

    def to_dict(self) -> dict:
        return asdict(self)


def _require(raw: dict, source: str, *names: str):
    """The sizes `names`, each present and a positive integer."""
    missing = [n for n in names if n not in raw or raw[n] is None]
    if missing:
        raise ConfigError(f"{source}: missing field(s) {', '.join(missing)}")
    for name in names:
        if isinstance(raw[name], bool) or not isinstance(raw[name], int) or raw[name] < 1:
            raise ConfigError(f"{source}: {name} must be a positive integer, found {raw[name]!r}")
    return [raw[n] for n in names]


def _eos_ids(value) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_parameters(raw: dict, layer_type: str | None = None) -> dict:
    """One set of RoPE parameters with `rope_theta` in it, from transformers 5's `rope_parameters` (flat, or
    per layer type for Gemma 3) or the classic `rope_theta` + `rope_scaling` keys."""
    params = raw.get("rope_parameters") or {}
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        return dict(params[layer_type])
    if layer_type is not None and ("full_attention" in params or "sliding_attention" in params):
        params = {}  # this layer type has none of its own
    if params and "full_attention" not in params:
        return dict(params)
    if layer_type == "sliding_attention":  # Gemma 3's classic keys: local layers are never scaled
        return {"rope_type": "default", "rope_theta": raw.get("rope_local_base_freq", 10000.0)}
    scaling = dict(raw.get("rope_scaling") or {})
    default_theta = 1000000.0 if layer_type == "full_attention" else 10000.0
    scaling.setdefault("rope_theta", raw.get("rope_theta", default_theta))
    return scaling


def _rope(raw: dict, source: str, rotary_dim: int, layer_type: str | None = None) -> tuple[float, dict | None]:
    """rope_theta, and the scaling as {"rope_type", its parameters} or None when the frequencies are the
    default ones. Every type transformers' RoPE init offers for these families is computed, or refused by name."""
    params = _rope_parameters(raw, layer_type)
    theta = float(params.get("rope_theta") or 10000.0)
    kind = params.get("rope_type", params.get("type")) or "default"
    if raw.get("model_type") == "phi3" and kind in ("su", "yarn"):  # transformers reads both as longrope
        kind = "longrope"
    if kind not in ROPE_TYPES:
        raise ConfigError(f"{source}: rope scaling type {kind!r} is not supported "
                          f"(supported: {', '.join(ROPE_TYPES)})")
    # `dynamic` (NTK) changes the frequencies only past max_position_embeddings, which the runtime never
    # reaches: within it transformers uses the default ones
    if kind in ("default", "dynamic"):
        return theta, None
    scaling = {key: value for key, value in params.items() if key not in ("rope_theta", "type")}
    scaling["rope_type"] = kind
    needs = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
             "yarn": (), "longrope": ("short_factor", "long_factor")}[kind]
    missing = [key for key in needs if scaling.get(key) is None]
    if missing:
        raise ConfigError(f"{source}: rope scaling {kind!r} needs {', '.join(missing)} (transformers has no "
                          "default for it)")
    if kind in ("llama3", "yarn", "longrope"):  # transformers' fallback; Phi-3's top-level field comes first
        scaling["original_max_position_embeddings"] = (
            raw.get("original_max_position_embeddings") if kind == "longrope" else None) or scaling.get(
            "original_max_position_embeddings") or raw.get("max_position_embeddings")
    if kind == "longrope":
        for key in ("short_factor", "long_factor"):
            if len(scaling[key]) != rotary_dim // 2:
                raise ConfigError(f"{source}: rope scaling {key} has {len(scaling[key])} values, the rotary "
                                  f"dimension {rotary_dim} needs {rotary_dim // 2}")
    if kind in ("yarn", "longrope") and scaling.get("factor") is None:
        scaling["factor"] = raw.get("max_position_embeddings", 1) / scaling["original_max_position_embeddings"]
    if kind == "longrope" and scaling.get("attention_factor") is None:
        factor, original = scaling["factor"], scaling["original_max_position_embeddings"]
        scaling["attention_factor"] = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    for key in ("factor", "low_freq_factor", "high_freq_factor", "attention_factor"):
        value = scaling.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
            raise ConfigError(f"{source}: rope scaling {key} must be a positive number, found {value!r}")
    return theta, scaling


SIZE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
               "intermediate_size", "max_position_embeddings")


def _check_sizes(config: ModelConfig, raw: dict, source: str) -> ModelConfig:
    """Every size a positive integer and the heads consistent: a negative or fractional size would fail
    deep inside torch (a tensor of negative dimension), or build a model of another shape."""
    names = {"num_layers": ("num_hidden_layers", "n_layer"), "num_heads": ("num_attention_heads", "n_head"),
             "num_kv_heads": ("num_key_value_heads",), "hidden_size": ("hidden_size", "n_embd"),
             "intermediate_size": ("intermediate_size", "ffn_dim", "n_inner"),
             "max_position_embeddings": ("max_position_embeddings", "n_positions")}
    for name in SIZE_FIELDS:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            written = next((key for key in names.get(name, (name,)) if key in raw), name)
            raise ConfigError(f"{source}: {written} must be a positive integer, found {value!r}")
    if config.num_heads % config.num_kv_heads:
        raise ConfigError(f"{source}: {config.num_heads} attention heads cannot be shared by {config.num_kv_heads} "
                          "key-value heads (the first must be a multiple of the second)")
    return config


def config_from_dict(raw: dict, source: str = "config.json") -> ModelConfig:
    """A ModelConfig from a config.json's fields; a missing, negative or inconsistent size is a
    ConfigError naming the file and the field."""
    return _check_sizes(_config_from_dict(raw, source), raw, source)


def _activation(raw: dict, source: str, key: str, default: str) -> str:
    name = raw.get(key) or default
    if name not in ACTIVATIONS:
        raise ConfigError(f"{source}: {key} {name!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    return name


def _sliding(raw: dict, source: str, model_type: str, layers: int) -> tuple[int | None, tuple[bool, ...]]:
    """The window and which layers use it, as transformers' forward for the family honours them: Llama
    ignores `sliding_window` (GLM-4.5 too); Qwen2/3 use it only with `use_sliding_window`, from `max_window_layers`
    on (Qwen3-MoE on every layer); Mixtral, as Mistral, on every layer;
    Gemma 3 interleaves local and global layers (`layer_types`, else every `sliding_window_pattern`-th global)."""
    if model_type in ("llama", "glm4_moe"):
        return None, ()
    window = raw.get("sliding_window")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 0):
        raise ConfigError(f"{source}: sliding_window must be a positive integer or null, found {window!r}")
    kinds = raw.get("layer_types")
    if kinds is not None and (not isinstance(kinds, list) or len(kinds) != layers):
        raise ConfigError(f"{source}: layer_types must list one type per layer ({layers}), found {kinds!r}")
    if model_type == "gemma3_text":  # the layer types also pick each layer's RoPE, window or not
        pattern = raw.get("sliding_window_pattern", 6)
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern < 1:
            raise ConfigError(f"{source}: sliding_window_pattern must be a positive integer, found {pattern!r}")
        kinds = kinds or ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
        return (window or None), tuple(kind == "sliding_attention" for kind in kinds)
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and not raw.get("use_sliding_window", False):
        window = None
    if not window:
        return None, ()
    if kinds:
        sliding = tuple(kind == "sliding_attention" for kind in kinds)
    else:
        first = raw.get("max_window_layers", 0) if model_type in ("qwen2", "qwen3") else 0
        sliding = tuple(i >= first for i in range(layers))
    if not any(sliding):
        return None, ()
    return window, sliding


def _count(raw: dict, source: str, key: str, default: int, least: int = 1) -> int:
    """An integer field of at least `least`, or its default when absent."""
    value = raw.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ConfigError(f"{source}: {key} must be an integer of at least {least}, found {value!r}")
    return value


def _experts(raw: dict, source: str, model_type: str, layers: int) -> dict:
    """The mixture-of-experts fields of ModelConfig, as transformers' modeling code for the family reads them:
    which layers route (Qwen3-MoE: every `decoder_sparse_step`-th layer not in `mlp_only_layers`; GLM-4.5: from
    `first_k_dense_replace` on; Mixtral: all), the expert count and width, and the router."""
    if model_type == "mixtral":
        experts = _count(raw, source, "num_local_experts", 8)
        fields = dict(expert_intermediate_size=_require(raw, source, "intermediate_size")[0],
                      expert_layers=(True,) * layers, router="softmax", normalize_expert_weights=True)
    elif model_type == "qwen3_moe":  # Qwen3MoeConfig names the count num_experts, and saves it as num_local_experts
        key = "num_experts" if raw.get("num_experts") is not None else "num_local_experts"
        experts = _count(raw, source, key, 128, least=0)
        step = _count(raw, source, "decoder_sparse_step", 1)
        dense = raw.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
            raise ConfigError(f"{source}: mlp_only_layers must be a list of layer indices, found {dense!r}")
        fields = dict(expert_intermediate_size=_count(raw, source, "moe_intermediate_size", 768),
                      expert_layers=tuple(experts > 0 and i not in dense and (i + 1) % step == 0
                                          for i in range(layers)),
                      router="softmax", normalize_expert_weights=bool(raw.get("norm_topk_prob", False)))
    else:  # glm4_moe
        experts = _count(raw, source, "n_routed_experts", 128)
        first_routed = _count(raw, source, "first_k_dense_replace", 1, least=0)
        width = _count(raw, source, "moe_intermediate_size", 1408)
        scaling = raw.get("routed_scaling_factor", 1.0)
        if isinstance(scaling, bool) or not isinstance(scaling, (int, float)) or not scaling > 0:
            raise ConfigError(f"{source}: routed_scaling_factor must be a positive number, found {scaling!r}")
        fields = dict(expert_intermediate_size=width, expert_layers=tuple(i >= first_routed for i in range(layers)),
                      router="sigmoid", normalize_expert_weights=bool(raw.get("norm_topk_prob", True)),
                      expert_groups=_count(raw, source, "n_group", 1),
                      expert_groups_per_token=_count(raw, source, "topk_group", 1),
                      routed_scaling_factor=float(scaling),
                      shared_expert_intermediate_size=width * _count(raw, source, "n_shared_experts", 1, least=0),
                      mtp_layers=_count(raw, source, "num_nextn_predict_layers", 0, least=0))
        groups, chosen = fields["expert_groups"], fields["expert_groups_per_token"]
        if experts % groups or experts // groups < 2:
            raise ConfigError(f"{source}: n_group {groups} must divide n_routed_experts {experts} into groups of at "
                              "least 2 experts (a group is scored by its two best)")
        if chosen > groups:
            raise ConfigError(f"{source}: topk_group {chosen} is more than the n_group {groups} groups")
    top_k = _count(raw, source, "num_experts_per_tok", 2 if model_type == "mixtral" else 8)
    if experts and top_k > experts * fields.get("expert_groups_per_token", 1) // fields.get("expert_groups", 1):
        raise ConfigError(f"{source}: num_experts_per_tok {top_k} is more than the {experts} experts a token can "
                          "be routed to")
    if not experts:  # transformers builds every layer dense
        fields["expert_layers"] = ()
    return dict(fields, num_experts=experts, experts_per_token=top_k if experts else 0)


def _llama_family(raw: dict, source: str, model_type: str, common: dict) -> ModelConfig:
    """Llama, Mistral, Qwen2/3, Gemma 3 (text) and Phi-3: the same block with a few switches. Every field
    transformers' forward for the type reads is honoured here or refused; fields it ignores are ignored."""
    vocab, d, layers, heads, ffn, max_pos = _require(
        raw, source, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
        "intermediate_size", "max_position_embeddings",
    )
    gemma = model_type == "gemma3_text"
    head_dim = raw.get("head_dim") or d // heads
    if gemma:
        head_dim = raw.get("head_dim") or 256  # Gemma3TextConfig's default
    params = raw.get("rope_parameters") or {}
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor")) or (
        0.5 if model_type == "glm4_moe" else 1.0)  # Glm4MoeConfig's default: half of each head turns
    if partial != 1.0 and model_type not in ("phi3", "glm4_moe"):
        raise ConfigError(f"{source}: partial_rotary_factor {partial!r} is not supported for {model_type} "
                          "(transformers' forward for it rotates whole heads)")
    if isinstance(partial, bool) or not isinstance(partial, (int, float)) or not 0 < partial <= 1:
        raise ConfigError(f"{source}: partial_rotary_factor must be in (0, 1], found {partial!r}")
    rotary_dim = int(head_dim * partial)
    theta, scaling = _rope(raw, source, rotary_dim, "full_attention" if gemma else None)
    if scaling is not None and scaling["rope_type"] == "longrope":
        # transformers switches every position to the long factors once a sequence passes the original
        # length (re-encoding the whole cache); within it the short factors hold: the runtime's context
        max_pos = min(max_pos, int(scaling["original_max_position_embeddings"]))
    window, sliding_layers = _sliding(raw, source, model_type, layers)
    attention_bias = bool(raw.get("attention_bias", False)) and model_type in (
        "llama", "qwen3", "gemma3_text", "qwen3_moe", "glm4_moe")
    activation = _activation(raw, source, "hidden_activation" if gemma else "hidden_act",
                             "gelu_pytorch_tanh" if gemma else "silu")
    extra: dict = {}
    if gemma:
        for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
            if raw.get(key):
                raise ConfigError(f"{source}: {key} {raw[key]!r} is not supported (causal attention without "
                                  "a score soft-cap only)")
        local_theta, local_scaling = _rope(raw, source, rotary_dim, "sliding_attention")
        extra = dict(local_rope_theta=local_theta, local_rope_scaling=local_scaling, qk_norm=True,
                     norm_offset=1.0, sandwich_norms=True, embed_scale=math.sqrt(d),
                     query_scale=float(raw.get("query_pre_attn_scalar", 256)) ** -0.5,
                     final_logit_softcap=raw.get("final_logit_softcapping") or None)
    elif model_type in ("qwen3", "qwen3_moe"):
        extra = dict(qk_norm=True)
    elif model_type == "glm4_moe":
        extra = dict(qk_norm=bool(raw.get("use_qk_norm", False)))
    if model_type in MOE_FAMILY:
        extra.update(_experts(raw, source, model_type, layers))
    return ModelConfig(
        vocab_size=vocab, hidden_size=d, num_layers=layers, num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads, head_dim=head_dim,
        intermediate_size=ffn, max_position_embeddings=max_pos,
        norm_eps=float(raw.get("rms_norm_eps", 1e-5 if model_type in ("phi3", "mixtral", "glm4_moe") else 1e-6)),
        activation=activation,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
        rope_theta=theta, rope_scaling=scaling, rotary_dim=rotary_dim if rotary_dim != head_dim else None,
        qkv_bias=model_type == "qwen2" or attention_bias, o_bias=attention_bias and model_type != "glm4_moe",
        mlp_bias=bool(raw.get("mlp_bias", False)) and model_type == "llama", sliding_window=window,
        sliding_layers=sliding_layers, **extra, **common,
    )


def _config_from_dict(raw: dict, source: str) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type == "gemma3" and isinstance(raw.get("text_config"), dict):
        # the multimodal Gemma 3: its text tower is a gemma3_text model (checkpoint.py maps its weights)
        text = dict(raw["text_config"])
        text["model_type"] = "gemma3_text"
        for key in ("bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings"):
            text.setdefault(key, raw.get(key))
        return _config_from_dict({k: v for k, v in text.items() if v is not None}, source)
    moe_signs = ([f"model_type {model_type!r} is a mixture-of-experts family"] if model_type in MOE_MODEL_TYPES
                 else []) + [f"{key} = {raw[key]!r} routes tokens among experts" for key in EXPERT_COUNT_FIELDS
                             if raw.get(key) and model_type not in MOE_FAMILY]
    if moe_signs:  # the fields that made it one are named: a config may be MoE under a dense family's name
        raise ConfigError(f"{source}: {' and '.join(moe_signs)}: the runtime's mixture-of-experts families are "
                          f"{', '.join(MOE_FAMILY)} only; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(
            f"{source}: unsupported model_type {model_type!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    common = dict(
        model_type=model_type,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=_eos_ids(raw.get("eos_token_id")),
        pad_token_id=raw.get("pad_token_id"),
    )
    if model_type in LLAMA_FAMILY:
        return _llama_family(raw, source, model_type, common)
    if model_type == "gpt2":
        vocab, d, layers, heads, max_pos = _require(raw, source, "vocab_size", "n_embd", "n_layer", "n_head",
                                                    "n_positions")
        if raw.get("scale_attn_by_inverse_layer_idx") or raw.get("scale_attn_weights") is False:
            raise ConfigError(f"{source}: GPT-2 attention scaling variants are not supported")
        return ModelConfig(
            vocab_size=vocab, hidden_size=d, num_layers=layers, num_heads=heads, num_kv_heads=heads,
            head_dim=d // heads, intermediate_size=raw.get("n_inner") or 4 * d, max_position_embeddings=max_pos,
            norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
            activation=_activation(raw, source, "activation_function", "gelu_new"),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)), **common,
        )
    vocab, d, layers, heads, ffn, max_pos = _require(
        raw, source, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "ffn_dim",
        "max_position_embeddings",
    )
    if raw.get("layer_norm_elementwise_affine") is False:
        raise ConfigError(f"{source}: OPT without layer-norm affine weights is not supported")
    pre_ln = bool(raw.get("do_layer_norm_before", True))
    return ModelConfig(
        vocab_size=vocab, hidden_size=d, num_layers=layers, num_heads=heads, num_kv_heads=heads,
        head_dim=d // heads, intermediate_size=ffn, max_position_embeddings=max_pos,
        activation=_activation(raw, source, "activation_function", "relu"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        do_layer_norm_before=pre_ln, word_embed_proj_dim=raw.get("word_embed_proj_dim") or d,
        enable_bias=bool(raw.get("enable_bias", True)),
        final_layer_norm=pre_ln and not raw.get("_remove_final_layer_norm", False), **common,
    )


def load_config(path: str | Path) -> ModelConfig:
    """Read `config.json` (or a directory holding one)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path}: no such file")
    try:
        text = path.read_text()
    except OSError as error:
        raise ConfigError(f"{path}: cannot read ({error.strerror or error})") from None
    try:
        raw = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return config_from_dict(raw, str(path))


def check_vocabulary(where: str, vocab_size: int, target_vocab_size: int) -> None:
    """The one check that a draft (model or n-gram) shares the target's vocabulary: the runtime verifies
    draft tokens by id. `where` names the option and the file, e.g. "--draft DIR" or "--stage2 FILE"."""
    if vocab_size != target_vocab_size:
        raise UsageError(f"{where}: a vocabulary of {vocab_size} tokens, the target's has {target_vocab_size}; "
                         "draft and target must share one tokenizer")
