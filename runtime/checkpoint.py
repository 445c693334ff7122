"""Reading (and writing) Hugging Face model directories.

A directory holds `config.json`, weights (`model.safetensors`, a sharded
`model.safetensors.index.json`, or `pytorch_model.bin` read with `weights_only=True`),
optionally `generation_config.json` (EOS ids) and `tokenizer.json` (read with `tokenizers`).
Each family's tensor names are mapped onto the internal names of `model.CausalLM`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from specbatch.perfmodel.errors import SpecbatchError

from .config import ConfigError, ModelConfig, load_config
from .model import CausalLM, rope_inverse_frequencies


class CheckpointError(SpecbatchError):
    """A model directory the runtime cannot use; the message names the path and the problem."""


@dataclass
class Tokenizer:
    """Thin wrapper over a `tokenizers.Tokenizer` read from `tokenizer.json`."""

    backend: object
    vocab_size: int

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text).ids

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=True)


@dataclass
class LoadedModel:
    path: Path
    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer | None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.config.eos_token_ids


def default_dtype(device: str) -> torch.dtype:
    """float32 on CPU (fast and exact there); bfloat16 on CUDA."""
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


def parse_dtype(name: str | None, device: str) -> torch.dtype:
    if name is None or name == "auto":
        return default_dtype(device)
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise CheckpointError(f"--dtype {name!r} is not one of float32, bfloat16, float16")
    return table[name]


def _read_weight_files(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    single = directory / "model.safetensors"
    index = directory / "model.safetensors.index.json"
    legacy = directory / "pytorch_model.bin"
    try:
        if single.is_file():
            return load_file(str(single))
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            tensors: dict[str, torch.Tensor] = {}
            for shard in sorted(set(weight_map.values())):
                tensors.update(load_file(str(directory / shard)))
            return tensors
        if legacy.is_file():
            return torch.load(str(legacy), map_location="cpu", weights_only=True)
    except (OSError, KeyError, ValueError, RuntimeError, SafetensorError) as error:  # e.g. a truncated file
        raise CheckpointError(f"{directory}: weights are not readable ({error})") from None
    raise CheckpointError(
        f"{directory}: no weights (expected model.safetensors, model.safetensors.index.json or pytorch_model.bin)"
    )


def _strip_prefix(name: str) -> str:
    for prefix in ("model.decoder.", "decoder.", "model.", "transformer."):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def hf_to_internal(config: ModelConfig, hf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Map a family's Hugging Face tensor names onto `CausalLM`'s names (fusing qkv and gate/up)."""
    src = {_strip_prefix(k): v for k, v in hf.items()}
    out: dict[str, torch.Tensor] = {}
    taken: set[str] = set()

    def take(name: str) -> torch.Tensor:
        if name not in src:
            raise CheckpointError(f"weights: tensor {name!r} is missing")
        taken.add(name)
        return src[name]

    family = config.family
    for i in range(config.num_layers):
        dst = f"layers.{i}."
        if family == "llama":
            p = f"layers.{i}."
            for part in ("weight", "bias") if config.qkv_bias else ("weight",):
                out[dst + "qkv." + part] = torch.cat([take(f"{p}self_attn.{x}_proj.{part}") for x in "qkv"])
            out[dst + "o.weight"] = take(p + "self_attn.o_proj.weight")
            if config.o_bias:
                out[dst + "o.bias"] = take(p + "self_attn.o_proj.bias")
            out[dst + "gate_up.weight"] = torch.cat([take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
            out[dst + "down.weight"] = take(p + "mlp.down_proj.weight")
            if config.mlp_bias:
                out[dst + "gate_up.bias"] = torch.cat([take(p + "mlp.gate_proj.bias"), take(p + "mlp.up_proj.bias")])
                out[dst + "down.bias"] = take(p + "mlp.down_proj.bias")
            out[dst + "attn_norm.weight"] = take(p + "input_layernorm.weight")
            out[dst + "mlp_norm.weight"] = take(p + "post_attention_layernorm.weight")
        elif family == "gpt2":
            p = f"h.{i}."
            # GPT-2 stores Conv1D weights as (in, out): transpose to nn.Linear's (out, in)
            out[dst + "qkv.weight"] = take(p + "attn.c_attn.weight").t().contiguous()
            out[dst + "qkv.bias"] = take(p + "attn.c_attn.bias")
            out[dst + "o.weight"] = take(p + "attn.c_proj.weight").t().contiguous()
            out[dst + "o.bias"] = take(p + "attn.c_proj.bias")
            out[dst + "up.weight"] = take(p + "mlp.c_fc.weight").t().contiguous()
            out[dst + "up.bias"] = take(p + "mlp.c_fc.bias")
            out[dst + "down.weight"] = take(p + "mlp.c_proj.weight").t().contiguous()
            out[dst + "down.bias"] = take(p + "mlp.c_proj.bias")
            for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
                out[dst + ours + ".weight"] = take(p + theirs + ".weight")
                out[dst + ours + ".bias"] = take(p + theirs + ".bias")
        else:  # opt
            p = f"layers.{i}."
            parts = ("weight", "bias") if config.enable_bias else ("weight",)
            for part in parts:
                out[dst + "qkv." + part] = torch.cat([take(f"{p}self_attn.{x}_proj.{part}") for x in "qkv"])
                out[dst + "o." + part] = take(f"{p}self_attn.out_proj.{part}")
                out[dst + "up." + part] = take(f"{p}fc1.{part}")
                out[dst + "down." + part] = take(f"{p}fc2.{part}")
            for ours, theirs in (("attn_norm", "self_attn_layer_norm"), ("mlp_norm", "final_layer_norm")):
                out[dst + ours + ".weight"] = take(p + theirs + ".weight")
                out[dst + ours + ".bias"] = take(p + theirs + ".bias")
    if family == "llama":
        out["embed.weight"] = take("embed_tokens.weight")
        out["final_norm.weight"] = take("norm.weight")
    elif family == "gpt2":
        out["embed.weight"] = take("wte.weight")
        out["pos_embed.weight"] = take("wpe.weight")
        out["final_norm.weight"], out["final_norm.bias"] = take("ln_f.weight"), take("ln_f.bias")
    else:
        out["embed.weight"] = take("embed_tokens.weight")
        out["pos_embed.weight"] = take("embed_positions.weight")
        if config.final_layer_norm:
            out["final_norm.weight"] = take("final_layer_norm.weight")
            out["final_norm.bias"] = take("final_layer_norm.bias")
        if "project_in.weight" in src:
            out["project_in.weight"] = take("project_in.weight")
            out["project_out.weight"] = take("project_out.weight")
    if config.tie_word_embeddings:
        out["lm_head.weight"] = out["embed.weight"]
    else:
        out["lm_head.weight"] = take("lm_head.weight")
    unused = sorted(name for name in set(src) - taken if not _ignorable(name, config))
    if unused:  # e.g. a config with fewer layers than the weights: it would load and generate garbage
        raise CheckpointError(f"weights: {len(unused)} tensor(s) the config does not use, e.g. {unused[:3]}; "
                              f"config.json does not describe these weights ({config.num_layers} layers)")
    return out


def _ignorable(name: str, config: ModelConfig) -> bool:
    """Tensors a checkpoint may carry that the model recomputes or shares: RoPE's inverse frequencies,
    GPT-2's causal-mask buffers, and a tied LM head stored anyway."""
    return (name.endswith(("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias"))
            or (name == "lm_head.weight" and config.tie_word_embeddings))


def internal_to_hf_llama(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """The inverse map for the Llama family (used to ship the demo pair in Hugging Face layout)."""
    out = {"model.embed_tokens.weight": state["embed.weight"], "model.norm.weight": state["final_norm.weight"]}
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    for i in range(config.num_layers):
        s, p = f"layers.{i}.", f"model.layers.{i}."
        wq, wk, wv = state[s + "qkv.weight"].split((q, kv, kv))
        out.update({p + "self_attn.q_proj.weight": wq, p + "self_attn.k_proj.weight": wk,
                    p + "self_attn.v_proj.weight": wv, p + "self_attn.o_proj.weight": state[s + "o.weight"]})
        gate, up = state[s + "gate_up.weight"].chunk(2)
        out.update({p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
                    p + "mlp.down_proj.weight": state[s + "down.weight"],
                    p + "input_layernorm.weight": state[s + "attn_norm.weight"],
                    p + "post_attention_layernorm.weight": state[s + "mlp_norm.weight"]})
    if not config.tie_word_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def _eos_from_generation_config(directory: Path) -> tuple[int, ...] | None:
    path = directory / "generation_config.json"
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{path}: not readable JSON ({error})") from None
    if value is None:
        return None
    return (value,) if isinstance(value, int) else tuple(value)


def load_tokenizer(directory: Path) -> Tokenizer | None:
    path = directory / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer as Backend

    try:
        backend = Backend.from_file(str(path))
    except Exception as error:  # tokenizers raises a bare Exception subclass
        raise CheckpointError(f"{path}: not a readable tokenizer ({error})") from None
    return Tokenizer(backend=backend, vocab_size=backend.get_vocab_size(with_added_tokens=True))


def build_model(config: ModelConfig, device: str = "cpu", dtype: torch.dtype | None = None,
                state: dict[str, torch.Tensor] | None = None, seed: int = 0) -> CausalLM:
    """Build a model; random weights (seeded, small) when `state` is None, as for shape presets."""
    dtype = dtype or default_dtype(device)
    torch.manual_seed(seed)
    with torch.device("meta" if state is not None else device):
        model = CausalLM(config)
    if state is None:
        for param in model.parameters():
            torch.nn.init.normal_(param, std=0.02) if param.dim() > 1 else torch.nn.init.ones_(param)
        return _finish(model, config, device, dtype)
    model = model.to_empty(device=device)
    expected = set(model.state_dict())
    missing = expected - set(state)
    if missing:
        raise CheckpointError(f"weights: tensors missing for {sorted(missing)[:3]}")
    for name, param in model.named_parameters(remove_duplicate=False):
        src = state[name]
        if tuple(src.shape) != tuple(param.shape):
            raise CheckpointError(f"weights: {name} has shape {tuple(src.shape)}, config implies {tuple(param.shape)}")
        with torch.no_grad():
            param.copy_(src.to(dtype))
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight
    return _finish(model, config, device, dtype)


def _finish(model: CausalLM, config: ModelConfig, device: str, dtype: torch.dtype) -> CausalLM:
    model = model.to(dtype=dtype).eval()
    if config.family == "llama":  # RoPE frequencies stay float32 whatever the weights' dtype
        model.inv_freq = rope_inverse_frequencies(config).to(device)
    return model


def load_checkpoint(path: str | Path, device: str = "cpu", dtype: torch.dtype | None = None) -> LoadedModel:
    """Load a Hugging Face model directory onto `device` (float32 on CPU unless told otherwise)."""
    directory = Path(path)
    if not directory.is_dir():
        raise CheckpointError(f"{directory}: not a directory (expected a Hugging Face model directory)")
    try:
        config = load_config(directory / "config.json")
    except ConfigError as error:
        raise CheckpointError(str(error)) from None
    eos = _eos_from_generation_config(directory)
    if eos is not None:
        config = replace(config, eos_token_ids=eos)
    tensors = _read_weight_files(directory)
    state = hf_to_internal(config, tensors)
    model = build_model(config, device, dtype, state)
    return LoadedModel(path=directory, config=config, model=model, tokenizer=load_tokenizer(directory))

