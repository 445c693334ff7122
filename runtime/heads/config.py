"""A draft head's configuration, read from its `config.json` and checked against its target before any work.

Three layouts are read:
  * the `speculators` format (what vLLM loads): `speculators_model_type` "eagle3" or "mtp", the decoder layer's
    own config in `transformer_layer_config` (a Llama or Qwen3 config), `draft_vocab_size` (EAGLE-3), the target
    layers EAGLE-3 reads in `eagle_aux_hidden_state_layer_ids`, `norm_before_residual` and the other norm
    switches, and the verifier it was trained for in `speculators_config.verifier`;
  * EAGLE-3's original layout: a Llama config with `draft_vocab_size` and architecture `LlamaForCausalLMEagle3`
    (its weights name the layer `midlayer`); the target layers are then vLLM's default, (2, L // 2, L - 3);
  * a target's own MTP layer (`--draft mtp`, vLLM's method "mtp"): a glm4_moe checkpoint (GLM-4.5, GLM-4.5-Air,
    GLM-4.6) with `num_nextn_predict_layers` 1 stores it as decoder layer `num_hidden_layers`, read from the
    target's own config (`target_mtp_config`).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

from specbatch.perfmodel.errors import SpecbatchError

from ..config import ConfigError, ModelConfig, config_from_dict
from ..model import NORMED_OUTPUT

HEAD_KINDS = ("eagle3", "mtp")
HEAD_LAYER_TYPES = ("llama", "qwen3")  # the decoder layers the head format defines
HEAD_TARGET_TYPES = ("llama", "qwen3")
TARGET_MTP = "target-mtp"  # HeadConfig.layout of a target checkpoint's own MTP layer
TARGET_MTP_TYPES = ("glm4_moe",)  # the targets whose own MTP layer the runtime reads
ORIGINAL_EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
# transformers' defaults for the fields our reader needs, where a config written by `to_diff_dict` leaves them out
LAYER_DEFAULTS = {
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32,
              "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "hidden_act": "silu"},
    "qwen3": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_attention_heads": 32,
              "num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
              "hidden_act": "silu"},
}


class HeadError(SpecbatchError):
    """A head that cannot draft for this target; the message names the file and what does not fit."""


@dataclass(frozen=True)
class HeadConfig:
    kind: str  # eagle3 | mtp
    layer: ModelConfig  # the head's one decoder layer (num_layers 1); vocab_size is the target's
    draft_vocab_size: int  # the head's output vocabulary: the target's, or a subset mapped by d2t (EAGLE-3)
    feature_layers: tuple[int, ...]  # the target's hidden states it reads (model.NORMED_OUTPUT: the normed output)
    source: str  # the config file, for messages
    layout: str = "speculators"  # speculators | eagle3-original | target-mtp (TARGET_MTP)
    norm_before_residual: bool = False  # EAGLE-3: the residual is the normed hidden state
    norm_before_fc: bool = False  # EAGLE-3 (gpt-oss style): one norm over the concatenated features
    fc_norm: bool = False  # EAGLE-3: one norm per target layer's features before the projection
    norm_output: bool = False  # EAGLE-3.1: the normed output feeds the next pass
    verifier: str | None = None  # the target it was trained for, as the config names it
    trained_tokens: int | None = None  # the speculative tokens it was trained to draft

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size

    @property
    def feature_size(self) -> int:
        """Width of the target features a first pass reads."""
        return len(self.feature_layers) * self.hidden_size

    def parameter_count(self) -> int:
        """Parameters a head pass reads: its layer (EAGLE-3: q, k and v read 2 x hidden), EAGLE-3's projection,
        norms and LM head over the draft vocabulary. Embedding rows are looked up, not streamed: not counted;
        an MTP head's LM head is the target's, read by every drafting pass: counted. A target's own MTP layer
        counts every routed expert of its mixture of experts, as the target's own count does (a pass reads the
        dense part and the experts its tokens route to)."""
        layer, d = self.layer, self.hidden_size
        if self.layout == TARGET_MTP:  # the layer as the config counts it, less its embeddings, final norm, LM head
            v = layer.vocab_size
            block = layer.parameter_count() - v * d - d - (0 if layer.tie_word_embeddings else v * d)
            return block + 2 * d * d + 3 * d + v * d  # eh_proj; enorm, hnorm, shared_head.norm; shared_head.head
        q_out, kv_out = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim
        qkv_in = 2 * d if self.kind == "eagle3" else d
        attention = qkv_in * (q_out + 2 * kv_out) + q_out * d + 2 * layer.head_dim * layer.qk_norm
        mlp = 3 * d * layer.intermediate_size
        norms = 3 * d  # the layer's two, and the hidden state's (EAGLE-3) or the output's (MTP)
        if self.kind == "eagle3":
            extra = self.feature_size * d + d + self.draft_vocab_size * d  # fc, the final norm, the LM head
        else:
            extra = 2 * d * d + 2 * d + layer.vocab_size * d  # input_proj, the token norm and the output norm
        return attention + mlp + norms + extra

    def describe(self) -> str:
        if self.layout == TARGET_MTP:
            layer = self.layer
            experts = (f", {layer.num_experts} experts top-{layer.experts_per_token}" if layer.routes_experts(0)
                       else "")
            return f"the target's MTP layer (width {self.hidden_size}{experts})"
        vocab = (f", draft vocabulary {self.draft_vocab_size}" if self.draft_vocab_size != self.layer.vocab_size
                 else "")
        return f"{self.kind} head (1 layer, width {self.hidden_size}{vocab})"


def is_head_dir(path: str | Path) -> bool:
    """Whether `path` holds a head's config (a speculators head, or EAGLE-3's original layout)."""
    config = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    if not config.is_file():
        return False
    try:
        raw = json.loads(config.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and (raw.get("speculators_model_type") is not None or _is_original_eagle3(raw))


def _is_original_eagle3(raw: dict) -> bool:
    return "draft_vocab_size" in raw and any(a in ORIGINAL_EAGLE3_ARCHITECTURES for a in raw.get("architectures") or [])


def read_head_config(path: str | Path, target: ModelConfig) -> HeadConfig:
    """The head's config at `path` (a directory or its config.json), checked against `target` in one line."""
    path = Path(path)
    file = path / "config.json" if path.is_dir() else path
    try:
        raw = json.loads(file.read_text())
    except FileNotFoundError:
        raise HeadError(f"{file}: no such file") from None
    except (OSError, ValueError) as error:
        raise HeadError(f"{file}: not a readable JSON config ({error})") from None
    if not isinstance(raw, dict):
        raise HeadError(f"{file}: expected a JSON object")
    return head_config_from_dict(raw, target, str(file))


def head_config_from_dict(raw: dict, target: ModelConfig, source: str) -> HeadConfig:
    if target.model_type not in HEAD_TARGET_TYPES:
        raise HeadError(f"{source}: a head drafts for a {'/'.join(HEAD_TARGET_TYPES)} target (the families the head "
                        f"format defines); this target is {target.model_type!r}")
    if raw.get("speculators_model_type") is None:
        if not _is_original_eagle3(raw):
            raise HeadError(f"{source}: not a draft head (no speculators_model_type, and not EAGLE-3's original "
                            "layout: a config with draft_vocab_size and architecture LlamaForCausalLMEagle3)")
        return _checked(_original_eagle3(raw, target, source), target)
    kind = raw["speculators_model_type"]
    if kind not in HEAD_KINDS:
        raise HeadError(f"{source}: speculators_model_type {kind!r} is not supported (supported: "
                        f"{', '.join(HEAD_KINDS)})")
    layer_raw = raw.get("transformer_layer_config")
    if not isinstance(layer_raw, dict):
        raise HeadError(f"{source}: transformer_layer_config must be the head layer's config (an object)")
    layer = _layer_config(layer_raw, source)
    spec = raw.get("speculators_config") if isinstance(raw.get("speculators_config"), dict) else {}
    verifier = (spec.get("verifier") or {}).get("name_or_path") if isinstance(spec.get("verifier"), dict) else None
    methods = spec.get("proposal_methods") or [{}]
    trained = methods[0].get("speculative_tokens") if isinstance(methods[0], dict) else None
    if kind == "mtp":
        layers = (NORMED_OUTPUT,)
        draft_vocab = layer.vocab_size
        switches = {}
    else:
        ids = raw.get("eagle_aux_hidden_state_layer_ids")
        layers = _layer_ids(ids, target, source) if ids is not None else default_eagle3_layers(target)
        draft_vocab = raw.get("draft_vocab_size", layer.vocab_size)
        switches = {name: _flag(raw, name, source) for name in ("norm_before_residual", "norm_before_fc", "fc_norm",
                                                                "norm_output")}
        if switches["norm_before_fc"] and switches["fc_norm"]:
            raise HeadError(f"{source}: norm_before_fc and fc_norm exclude each other")
        hidden = raw.get("target_hidden_size")
        if hidden is not None and hidden != target.hidden_size:
            raise HeadError(f"{source}: target_hidden_size {hidden}, the target's hidden size is {target.hidden_size}")
    config = HeadConfig(kind=kind, layer=layer, draft_vocab_size=_draft_vocab(draft_vocab, source),
                        feature_layers=layers, source=source, verifier=verifier,
                        trained_tokens=trained if isinstance(trained, int) else None, **switches)
    return _checked(config, target)


def target_mtp_config(raw: dict, target: ModelConfig, source: str) -> HeadConfig:
    """A target's own MTP layer as a head (`raw`: the target's config.json, read into `target`; `source` names it).
    GLM-4.5 stores it as decoder layer `num_hidden_layers` (L): a decoder layer of the target's shapes whose MLP is
    a mixture of experts where a decoder layer of index L would be one (from `first_k_dense_replace` on), with
    `enorm`, `hnorm`, `eh_proj` and `shared_head` beside it. It reads the target's normed output (vLLM feeds it
    the target model's output, after its final norm)."""
    if target.model_type not in TARGET_MTP_TYPES:
        raise HeadError(f"{source}: the target's own MTP layer is read for {'/'.join(TARGET_MTP_TYPES)} targets "
                        f"(GLM-4.5, GLM-4.5-Air, GLM-4.6); this target is {target.model_type!r}")
    if target.mtp_layers != 1:
        found = "0 or absent" if not target.mtp_layers else str(target.mtp_layers)
        raise HeadError(f"{source}: num_nextn_predict_layers is {found}; drafting with the target's own MTP layer "
                        "needs a checkpoint that carries exactly one (GLM-4.5's)")
    index = target.num_layers
    try:  # the config read as if it had one more decoder layer: that layer's shape is the MTP layer's
        extended = config_from_dict({**raw, "num_hidden_layers": index + 1, "num_nextn_predict_layers": 0}, source)
    except ConfigError as error:
        raise HeadError(str(error)) from None
    layer = replace(extended, num_layers=1, expert_layers=extended.expert_layers[index:], mtp_layers=0)
    config = HeadConfig(kind="mtp", layer=layer, draft_vocab_size=target.vocab_size, feature_layers=(NORMED_OUTPUT,),
                        source=source, layout=TARGET_MTP)
    return _checked(config, target)


def default_eagle3_layers(target: ModelConfig) -> tuple[int, ...]:
    """The target layers an EAGLE-3 head reads when its config names none (vLLM's and speculators' default)."""
    count = target.num_layers
    return (2, count // 2, count - 3) if count >= 4 else (0, count // 2, count)


def _original_eagle3(raw: dict, target: ModelConfig, source: str) -> HeadConfig:
    layer = _layer_config({**raw, "model_type": raw.get("model_type", "llama")}, source)
    ids = raw.get("eagle_aux_hidden_state_layer_ids")
    return HeadConfig(kind="eagle3", layer=layer, draft_vocab_size=_draft_vocab(raw["draft_vocab_size"], source),
                      feature_layers=_layer_ids(ids, target, source) if ids is not None
                      else default_eagle3_layers(target),
                      source=source, layout="eagle3-original",
                      norm_before_residual=_flag(raw, "norm_before_residual", source))


def _layer_config(layer_raw: dict, source: str) -> ModelConfig:
    model_type = layer_raw.get("model_type", "llama")
    if model_type not in HEAD_LAYER_TYPES:
        raise HeadError(f"{source}: the head's layer is a {model_type!r} layer; supported: "
                        f"{', '.join(HEAD_LAYER_TYPES)}")
    merged = {**LAYER_DEFAULTS[model_type], **{k: v for k, v in layer_raw.items() if v is not None}}
    merged["num_hidden_layers"] = 1  # a head is one decoder layer, whatever the copied config says
    try:
        return config_from_dict(merged, f"{source} (transformer_layer_config)")
    except ConfigError as error:
        raise HeadError(str(error)) from None


def _flag(raw: dict, name: str, source: str) -> bool:
    value = raw.get(name, False)
    if not isinstance(value, bool):
        raise HeadError(f"{source}: {name} must be true or false, found {value!r}")
    return value


def _draft_vocab(value, source: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise HeadError(f"{source}: draft_vocab_size must be a positive integer, found {value!r}")
    return value


def _layer_ids(ids, target: ModelConfig, source: str) -> tuple[int, ...]:
    count = target.num_layers
    if (not isinstance(ids, list) or not ids or any(isinstance(i, bool) or not isinstance(i, int) for i in ids)
            or len(set(ids)) != len(ids)):
        raise HeadError(f"{source}: eagle_aux_hidden_state_layer_ids must be distinct layer ids, found {ids!r}")
    outside = [i for i in ids if not 0 <= i <= count]
    if outside:
        raise HeadError(f"{source}: eagle_aux_hidden_state_layer_ids {outside} are outside the target's layers "
                        f"0..{count} (the target has {count} layers)")
    return tuple(ids)


def _checked(config: HeadConfig, target: ModelConfig) -> HeadConfig:
    """The head's shapes against its target's: one line naming what does not fit."""
    source, layer = config.source, config.layer
    if layer.hidden_size != target.hidden_size:
        raise HeadError(f"{source}: hidden size {layer.hidden_size}, the target's is {target.hidden_size} (the head "
                        "reads the target's hidden states and embeddings)")
    if layer.vocab_size != target.vocab_size:
        raise HeadError(f"{source}: vocabulary of {layer.vocab_size} tokens, the target's has {target.vocab_size}")
    if config.draft_vocab_size > target.vocab_size:
        raise HeadError(f"{source}: draft_vocab_size {config.draft_vocab_size} exceeds the target's vocabulary of "
                        f"{target.vocab_size}")
    if config.kind == "mtp" and config.draft_vocab_size != target.vocab_size:
        raise HeadError(f"{source}: an MTP head drafts over the target's whole vocabulary")
    # the head addresses the target's positions (its own config may say fewer: EAGLE-3's original says 2048)
    return replace(config, layer=replace(layer, max_position_embeddings=target.max_position_embeddings))
