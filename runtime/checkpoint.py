"""Reading (and writing) Hugging Face model directories.

A directory holds `config.json`, weights (`model.safetensors`, a sharded
`model.safetensors.index.json`, or `pytorch_model.bin` read with `weights_only=True`),
optionally `generation_config.json` (EOS ids) and `tokenizer.json` (read with `tokenizers`).
Each family's tensor names are mapped onto the internal names of `model.CausalLM` (`weight_placements`).
Weights load into a model already allocated on the target device in the target dtype, one file and one
tensor at a time (safetensors reads each straight onto the device): host memory stays near one tensor
beyond the mapped file. Only floating-point tensors with finite values are accepted.
"""
from __future__ import annotations

import json
import pickle
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from specbatch.perfmodel.errors import SpecbatchError

from .config import ConfigError, ModelConfig, load_config
from .devices import device_kind
from .model import CausalLM


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
    """The device's own (runtime.devices): float32 on CPU (fast and exact there); bfloat16 on CUDA."""
    return getattr(torch, device_kind(device).default_dtype)


def parse_dtype(name: str | None, device: str) -> torch.dtype:
    if name is None or name == "auto":
        return default_dtype(device)
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise CheckpointError(f"--dtype {name!r} is not one of float32, bfloat16, float16")
    return table[name]


FLOAT_WEIGHT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)  # converted without a scale


@dataclass(frozen=True)
class Placement:
    """Where a Hugging Face tensor goes in `CausalLM`: a parameter, or rows of a fused one (q, k and v in
    `qkv`, gate and up in `gate_up`), transposed for GPT-2's Conv1D weights (stored (in, out)); a mixture of
    experts' per-expert tensors go to their expert's slice of a stacked parameter (then rows of it)."""

    name: str
    start: int | None = None  # first row in the fused parameter; None: the whole parameter
    rows: int | None = None
    transpose: bool = False
    expert: int | None = None  # index along a stacked parameter's first dimension, before `start`


def _llama_layer(config: ModelConfig, i: int) -> dict[str, Placement]:
    """Layer i of the Llama family: Phi-3 stores q, k and v fused (`qkv_proj`) and gate and up fused
    (`gate_up_proj`), as our own parameters are; Qwen3 and Gemma 3 add per-head q/k norms; Gemma 3 norms
    each sublayer's input and output (its `post_attention_layernorm` is the attention's output norm)."""
    plan: dict[str, Placement] = {}
    p = dst = f"layers.{i}."
    q, kv, inter = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, config.intermediate_size
    dense_mlp = not config.routes_experts(i)
    if config.model_type == "phi3":
        plan[p + "self_attn.qkv_proj.weight"] = Placement(dst + "qkv.weight")
        plan[p + "mlp.gate_up_proj.weight"] = Placement(dst + "gate_up.weight")
    else:
        for part in ("weight", "bias") if config.qkv_bias else ("weight",):
            for x, start, rows in (("q", 0, q), ("k", q, kv), ("v", q + kv, kv)):
                plan[f"{p}self_attn.{x}_proj.{part}"] = Placement(dst + "qkv." + part, start, rows)
        for part in (("weight", "bias") if config.mlp_bias else ("weight",)) if dense_mlp else ():
            plan[f"{p}mlp.gate_proj.{part}"] = Placement(dst + "gate_up." + part, 0, inter)
            plan[f"{p}mlp.up_proj.{part}"] = Placement(dst + "gate_up." + part, inter, inter)
    plan[p + "self_attn.o_proj.weight"] = Placement(dst + "o.weight")
    if config.o_bias:
        plan[p + "self_attn.o_proj.bias"] = Placement(dst + "o.bias")
    if dense_mlp:
        plan[p + "mlp.down_proj.weight"] = Placement(dst + "down.weight")
        if config.mlp_bias:
            plan[p + "mlp.down_proj.bias"] = Placement(dst + "down.bias")
    else:
        plan.update(_expert_layer(config, i))
    if config.qk_norm:
        plan[p + "self_attn.q_norm.weight"] = Placement(dst + "q_norm.weight")
        plan[p + "self_attn.k_norm.weight"] = Placement(dst + "k_norm.weight")
    plan[p + "input_layernorm.weight"] = Placement(dst + "attn_norm.weight")
    if config.sandwich_norms:
        plan[p + "post_attention_layernorm.weight"] = Placement(dst + "attn_out_norm.weight")
        plan[p + "pre_feedforward_layernorm.weight"] = Placement(dst + "mlp_norm.weight")
        plan[p + "post_feedforward_layernorm.weight"] = Placement(dst + "mlp_out_norm.weight")
    else:
        plan[p + "post_attention_layernorm.weight"] = Placement(dst + "mlp_norm.weight")
    return plan


def _expert_layer(config: ModelConfig, i: int) -> dict[str, Placement]:
    """A mixture-of-experts layer's tensors as the Hub's checkpoints store them, one set per expert (Mixtral's
    `block_sparse_moe.experts.j.w1/w3/w2` are gate/up/down), stacked into `experts.gate_up` and `experts.down`."""
    p, dst, width = f"layers.{i}.", f"layers.{i}.experts.", config.expert_intermediate_size
    mixtral = config.model_type == "mixtral"
    moe = p + ("block_sparse_moe." if mixtral else "mlp.")
    gate, up, down = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
    plan = {moe + "gate.weight": Placement(dst + "router.weight")}
    for j in range(config.num_experts):
        plan[f"{moe}experts.{j}.{gate}.weight"] = Placement(dst + "gate_up", 0, width, expert=j)
        plan[f"{moe}experts.{j}.{up}.weight"] = Placement(dst + "gate_up", width, width, expert=j)
        plan[f"{moe}experts.{j}.{down}.weight"] = Placement(dst + "down", expert=j)
    if config.router == "sigmoid":
        plan[moe + "gate.e_score_correction_bias"] = Placement(dst + "score_bias")
    if config.shared_expert_intermediate_size:
        shared = config.shared_expert_intermediate_size
        plan[moe + "shared_experts.gate_proj.weight"] = Placement(dst + "shared_gate_up.weight", 0, shared)
        plan[moe + "shared_experts.up_proj.weight"] = Placement(dst + "shared_gate_up.weight", shared, shared)
        plan[moe + "shared_experts.down_proj.weight"] = Placement(dst + "shared_down.weight")
    return plan


def weight_placements(config: ModelConfig) -> dict[str, Placement]:
    """Every tensor a family's checkpoint must hold (names without their prefix) -> where it goes."""
    plan: dict[str, Placement] = {}
    family, hd = config.family, config.head_dim
    q, kv = config.num_heads * hd, config.num_kv_heads * hd
    for i in range(config.num_layers):
        dst = f"layers.{i}."
        if family == "llama":
            plan.update(_llama_layer(config, i))
        elif family == "gpt2":
            p = f"h.{i}."
            for theirs, ours in (("attn.c_attn", "qkv"), ("attn.c_proj", "o"), ("mlp.c_fc", "up"),
                                 ("mlp.c_proj", "down")):
                plan[f"{p}{theirs}.weight"] = Placement(f"{dst}{ours}.weight", transpose=True)
                plan[f"{p}{theirs}.bias"] = Placement(f"{dst}{ours}.bias")
            for ours, theirs in (("attn_norm", "ln_1"), ("mlp_norm", "ln_2")):
                for part in ("weight", "bias"):
                    plan[f"{p}{theirs}.{part}"] = Placement(f"{dst}{ours}.{part}")
        else:  # opt
            p = f"layers.{i}."
            for part in ("weight", "bias") if config.enable_bias else ("weight",):
                for x, start, rows in (("q", 0, q), ("k", q, kv), ("v", q + kv, kv)):
                    plan[f"{p}self_attn.{x}_proj.{part}"] = Placement(dst + "qkv." + part, start, rows)
                for theirs, ours in (("self_attn.out_proj", "o"), ("fc1", "up"), ("fc2", "down")):
                    plan[f"{p}{theirs}.{part}"] = Placement(f"{dst}{ours}.{part}")
            for ours, theirs in (("attn_norm", "self_attn_layer_norm"), ("mlp_norm", "final_layer_norm")):
                for part in ("weight", "bias"):
                    plan[f"{p}{theirs}.{part}"] = Placement(f"{dst}{ours}.{part}")
    if family == "gpt2":
        plan.update({"wte.weight": Placement("embed.weight"), "wpe.weight": Placement("pos_embed.weight"),
                     "ln_f.weight": Placement("final_norm.weight"), "ln_f.bias": Placement("final_norm.bias")})
    else:
        plan["embed_tokens.weight"] = Placement("embed.weight")
        if family == "llama":
            plan["norm.weight"] = Placement("final_norm.weight")
        else:
            plan["embed_positions.weight"] = Placement("pos_embed.weight")
            if config.final_layer_norm:
                plan["final_layer_norm.weight"] = Placement("final_norm.weight")
                plan["final_layer_norm.bias"] = Placement("final_norm.bias")
            if config.word_embed_proj_dim and config.word_embed_proj_dim != config.hidden_size:
                plan["project_in.weight"] = Placement("project_in.weight")
                plan["project_out.weight"] = Placement("project_out.weight")
    if not config.tie_word_embeddings:
        plan["lm_head.weight"] = Placement("lm_head.weight")
    return plan


PEFT_PREFIX = "base_model.model."  # how PEFT saves a wrapped model's state dict
MULTIMODAL_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.")  # Gemma 3's text tower
MULTIMODAL_OTHER = ("model.vision_tower.", "vision_tower.", "model.multi_modal_projector.", "multi_modal_projector.")


def _strip_prefix(name: str) -> str:
    name = name.removeprefix(PEFT_PREFIX)
    for prefix in MULTIMODAL_PREFIXES + ("model.decoder.", "decoder.", "model.", "transformer."):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def _weight_files(directory: Path) -> list[Path]:
    """The weight files of a model directory, in order: one file, the shards of an index, or the legacy bin."""
    single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as error:
            raise CheckpointError(f"{index}: not a readable shard index ({error})") from None
        return [directory / shard for shard in sorted(set(weight_map.values()))]
    if (directory / "pytorch_model.bin").is_file():
        return [directory / "pytorch_model.bin"]
    raise CheckpointError(
        f"{directory}: no weights (expected model.safetensors, model.safetensors.index.json or pytorch_model.bin)")


def _file_tensors(path: Path, device: torch.device):
    """(name, tensor) of every tensor in one weight file, each read when asked: a safetensors file straight
    onto `device` (one tensor at a time), a legacy bin memory-mapped on the host."""
    from safetensors import safe_open

    if path.suffix == ".bin":
        try:
            try:
                state = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # a file of before torch's zip format cannot be memory-mapped
                state = torch.load(str(path), map_location="cpu", weights_only=True)
        except (pickle.UnpicklingError, EOFError, RuntimeError, ValueError, TypeError, AttributeError,
                ImportError, IndexError, KeyError):
            # torch's own message advises weights_only=False, which would run the file's code: not an option
            raise CheckpointError(f"{path}: not a PyTorch file of tensors (not torch.save's format, or it pickles "
                                  "objects other than tensors, which are not loaded); convert it to safetensors"
                                  ) from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise CheckpointError(f"{path}: holds a {type(state).__name__}, not a state dict of named tensors")
        yield from state.items()
        return
    with safe_open(str(path), framework="pt", device=str(device)) as file:
        for name in file.keys():
            yield name, file.get_tensor(name)


def _all_finite(tensor: torch.Tensor, chunk: int = 1 << 24) -> bool:
    """Whether every value is finite, a slice at a time (a whole-tensor check would need a mask as large)."""
    flat = tensor.reshape(-1)
    return all(bool(torch.isfinite(flat[i:i + chunk]).all()) for i in range(0, flat.numel(), chunk))


def _place(param: torch.Tensor, placement: Placement, tensor: torch.Tensor, file: Path, name: str) -> None:
    """Copy one checkpoint tensor into its place, converting it to the parameter's dtype; refuse a tensor that
    is not floating point, has another shape, or is not finite (before or after the conversion)."""
    if tensor.dtype not in FLOAT_WEIGHT_DTYPES:
        raise CheckpointError(f"{file}: tensor {name} is {str(tensor.dtype).removeprefix('torch.')}, expected a "
                              f"floating-point weight (float32, float16 or bfloat16)")
    target = param if placement.expert is None else param[placement.expert]
    target = target if placement.start is None else target.narrow(0, placement.start, placement.rows)
    source = tensor.t() if placement.transpose else tensor
    if tuple(source.shape) != tuple(target.shape):
        raise CheckpointError(f"weights: {name} has shape {tuple(tensor.shape)}, config implies "
                              f"{tuple(target.t().shape if placement.transpose else target.shape)}")
    target.copy_(source)
    if not _all_finite(target):  # NaN or inf in the file, or a value beyond the dtype's range (float16: 65504)
        where = "" if not _all_finite(tensor) else f" once converted to {str(param.dtype).removeprefix('torch.')}"
        raise CheckpointError(f"{file}: tensor {name} has non-finite values (NaN or inf){where}")


def load_weights(model: CausalLM, config: ModelConfig, directory: Path, role: str | None = None) -> None:
    """Fill `model`'s parameters (already on their device, in their dtype) from the directory's weight files,
    one file at a time and one tensor at a time: the host never holds more than one shard's tensors.
    `role` (target, draft) names the model in the errors."""
    from safetensors import SafetensorError

    params = dict(model.named_parameters(remove_duplicate=False))
    placements = weight_placements(config)
    filled: set[str] = set()
    unused: list[str] = []
    where = f"{directory}" + (f" (the {role})" if role else "")
    for path in _weight_files(directory):
        try:
            with torch.no_grad():
                for raw_name, tensor in _file_tensors(path, model.lm_head.weight.device):
                    if raw_name.startswith(PEFT_PREFIX) and ("lora_" in raw_name or ".base_layer." in raw_name):
                        raise CheckpointError(f"{path}: {raw_name} is a PEFT LoRA tensor; merge the adapter into "
                                              "the base model (peft's merge_and_unload) and save that")
                    name = _strip_prefix(raw_name)
                    placement = placements.get(name)
                    if placement is None:
                        if not _ignorable(name, raw_name, config):
                            unused.append(raw_name)
                        continue
                    _place(params[placement.name], placement, tensor, path, raw_name)
                    filled.add(name)
                    del tensor
        except CheckpointError:
            raise
        except (OSError, KeyError, ValueError, RuntimeError, SafetensorError) as error:  # e.g. a truncated file
            raise CheckpointError(f"{directory}: weights are not readable ({error})") from None
    missing = sorted(set(placements) - filled)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        seen = next((name for name in sorted(unused) if name.endswith("." + missing[0])), None)
        hint = (f"; found {seen!r}, whose prefix {seen[:-len(missing[0])]!r} is not one a Hugging Face "
                "checkpoint uses" if seen else "")
        raise CheckpointError(f"{where}: weights: tensor {missing[0]!r} is missing{more}{hint}")
    if unused:  # e.g. a config with fewer layers than the weights: it would load and generate garbage
        raise CheckpointError(f"{where}: weights: {len(unused)} tensor(s) the config does not use, e.g. "
                              f"{sorted(unused)[:3]}; config.json does not describe these weights "
                              f"({config.num_layers} layers)")


def _ignorable(name: str, raw_name: str, config: ModelConfig) -> bool:
    """Tensors a checkpoint may carry that the model recomputes or shares: RoPE's inverse frequencies,
    GPT-2's causal-mask buffers, a tied LM head stored anyway, a multimodal Gemma 3's vision tower, and GLM-4.5's
    multi-token-prediction layers (numbered after the decoder's: a drafter's, not the target pass's)."""
    return (name.endswith(("rotary_emb.inv_freq", ".attn.bias", ".attn.masked_bias"))
            or (name == "lm_head.weight" and config.tie_word_embeddings)
            or (config.model_type == "gemma3_text" and raw_name.startswith(MULTIMODAL_OTHER))
            or _mtp_layer(name, config))


def _mtp_layer(name: str, config: ModelConfig) -> bool:
    """Whether `name` belongs to one of the config's multi-token-prediction layers (layers.N.* for N from
    num_layers to num_layers + mtp_layers - 1)."""
    if not config.mtp_layers or not name.startswith("layers."):
        return False
    index = name.split(".")[1]
    return index.isdigit() and config.num_layers <= int(index) < config.num_layers + config.mtp_layers


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


def build_model(config: ModelConfig, device: str = "cpu", dtype: torch.dtype | None = None, seed: int = 0) -> CausalLM:
    """A model of `config`'s shape with seeded random weights (small), as for shape presets. The weights are
    made in `dtype` on `device` directly: an 8B model in bfloat16 needs 16 GB, not the 32 of float32 first."""
    dtype = dtype or default_dtype(device)
    torch.manual_seed(seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are born in `dtype`: no float32 copy of the whole model first
    try:
        with torch.device(device):
            model = CausalLM(config)
    finally:
        torch.set_default_dtype(default)
    for param in model.parameters():
        torch.nn.init.normal_(param, std=0.02) if param.dim() > 1 else torch.nn.init.ones_(param)
    return _finish(model, config, device, dtype)


def empty_model(config: ModelConfig, device: str, dtype: torch.dtype) -> CausalLM:
    """A model whose parameters are allocated on `device` in `dtype` and not initialized (to be loaded)."""
    with torch.device("meta"):
        model = CausalLM(config).to(dtype)
    model = model.to_empty(device=device)
    if config.tie_word_embeddings:  # to_empty gives every parameter its own storage: tie them again
        model.lm_head.weight = model.embed.weight
    return model


def _finish(model: CausalLM, config: ModelConfig, device: str, dtype: torch.dtype) -> CausalLM:
    model = model.to(dtype=dtype).eval()
    if config.family == "llama":  # RoPE frequencies stay float32 whatever the weights' dtype
        model.set_rope_frequencies(device)
    model.lay_out_for_matmul()
    return model


def load_checkpoint(path: str | Path, device: str = "cpu", dtype: torch.dtype | None = None,
                    role: str | None = None) -> LoadedModel:
    """Load a Hugging Face model directory onto `device` (float32 on CPU unless told otherwise); `role`
    (target, draft) names the model in errors."""
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
    dtype = dtype or default_dtype(device)
    model = empty_model(config, device, dtype)
    load_weights(model, config, directory, role)
    model = _finish(model, config, device, dtype)
    return LoadedModel(path=directory, config=config, model=model, tokenizer=load_tokenizer(directory))

