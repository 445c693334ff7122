"""Model configuration: one frozen dataclass built from a Hugging Face `config.json`.

Every family the runtime supports is described by the same fields, so `model.py` can stay a single
config-driven module. Reading is strict: a missing field is an error that names it.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specbatch.perfmodel.errors import SpecbatchError, UsageError

LLAMA_FAMILY = ("llama", "mistral", "qwen2")
SUPPORTED_MODEL_TYPES = LLAMA_FAMILY + ("gpt2", "opt")


class ConfigError(SpecbatchError):
    """A config file the runtime cannot use; the message names the file and the problem."""


@dataclass(frozen=True)
class ModelConfig:
    model_type: str  # as written in config.json: llama | mistral | qwen2 | gpt2 | opt
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # < num_heads means grouped-query attention
    head_dim: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float = 1e-5
    activation: str = "silu"  # silu (SwiGLU) | gelu_new | gelu | relu
    tie_word_embeddings: bool = False
    # Llama family
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # Llama-3 style: {"rope_type": "llama3", "factor", ...}
    qkv_bias: bool = False  # Qwen2 has biases on q, k, v only
    o_bias: bool = False  # Llama's attention_bias puts a bias on o_proj too
    mlp_bias: bool = False
    sliding_window: int | None = None  # Mistral: each query sees at most this many keys
    sliding_layers: tuple[bool, ...] = ()  # which layers use the window (Qwen2: from max_window_layers on)
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

    def parameter_count(self) -> int:
        """Parameters of the model this config builds (tied embeddings counted once)."""
        d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
        q_out, kv_out = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self.family == "llama":
            attn = d * q_out + 2 * d * kv_out + q_out * d
            attn += (q_out + 2 * kv_out) * self.qkv_bias + d * self.o_bias
            mlp = 3 * d * f + (2 * f + d) * self.mlp_bias
            per_layer = attn + mlp + 2 * d
            total = self.num_layers * per_layer + v * d + d
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


def _rope(raw: dict) -> tuple[float, dict | None]:
    """rope_theta and rope_scaling, from either the classic keys or transformers 5's rope_parameters."""
    params = raw.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = raw.get("rope_scaling") or None
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            scaling = None
        elif kind != "llama3":
            raise ConfigError(f"rope scaling type {kind!r} is not supported (supported: llama3)")
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


def _config_from_dict(raw: dict, source: str) -> ModelConfig:
    model_type = raw.get("model_type")
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
        vocab, d, layers, heads, ffn, max_pos = _require(
            raw, source, "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "intermediate_size", "max_position_embeddings",
        )
        theta, scaling = _rope(raw)
        window = raw.get("sliding_window")
        if model_type == "qwen2" and not raw.get("use_sliding_window", False):
            window = None
        sliding_layers: tuple[bool, ...] = ()
        if window:
            if raw.get("layer_types"):
                sliding_layers = tuple(kind == "sliding_attention" for kind in raw["layer_types"])
            else:
                first = raw.get("max_window_layers", 0) if model_type == "qwen2" else 0
                sliding_layers = tuple(i >= first for i in range(layers))
            if not any(sliding_layers):
                window, sliding_layers = None, ()
        attention_bias = bool(raw.get("attention_bias", False))
        return ModelConfig(
            vocab_size=vocab, hidden_size=d, num_layers=layers, num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or d // heads,
            intermediate_size=ffn, max_position_embeddings=max_pos,
            norm_eps=float(raw.get("rms_norm_eps", 1e-6)), activation=raw.get("hidden_act", "silu"),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            rope_theta=theta, rope_scaling=scaling,
            qkv_bias=model_type == "qwen2" or attention_bias, o_bias=attention_bias,
            mlp_bias=bool(raw.get("mlp_bias", False)), sliding_window=window,
            sliding_layers=sliding_layers, **common,
        )
    if model_type == "gpt2":
        vocab, d, layers, heads, max_pos = _require(raw, source, "vocab_size", "n_embd", "n_layer", "n_head",
                                                    "n_positions")
        if raw.get("scale_attn_by_inverse_layer_idx") or raw.get("scale_attn_weights") is False:
            raise ConfigError(f"{source}: GPT-2 attention scaling variants are not supported")
        return ModelConfig(
            vocab_size=vocab, hidden_size=d, num_layers=layers, num_heads=heads, num_kv_heads=heads,
            head_dim=d // heads, intermediate_size=raw.get("n_inner") or 4 * d, max_position_embeddings=max_pos,
            norm_eps=float(raw.get("layer_norm_epsilon", 1e-5)),
            activation=raw.get("activation_function", "gelu_new"),
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
        activation=raw.get("activation_function", "relu"),
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
