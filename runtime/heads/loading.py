"""A head's weights: from its safetensors (the `speculators` names, or EAGLE-3's original `midlayer`), from a
target checkpoint's own MTP layer (GLM-4.5's `model.layers.<num_hidden_layers>.*`), or random with a preset's
shapes (a head timed before its weights exist)."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..checkpoint import CheckpointError, Placement, _file_tensors, _llama_layer, _place, _strip_prefix, _weight_files
from .config import TARGET_MTP, HeadConfig, HeadError, read_head_config
from .model import DraftHead

VOCABULARY_MAPS = ("d2t", "t2d")  # integer and boolean buffers, not weights


def head_placements(config: HeadConfig, own_embed: bool) -> dict[str, Placement]:
    """Every tensor the head's checkpoint must hold -> where it goes in `DraftHead`."""
    layer = _llama_layer(config.layer, 0)  # 'layers.0.self_attn.q_proj.weight' -> 'layers.0.qkv.weight', ...
    if config.kind == "mtp":
        plan = {"mtp_" + name: placement for name, placement in layer.items()}
        for theirs, ours in (("hidden_layernorm", "hidden_norm"), ("token_layernorm", "token_norm"),
                             ("input_proj", "input_proj"), ("final_layernorm", "final_norm")):
            plan[f"mtp_layers.0.{theirs}.weight"] = Placement(f"{ours}.weight")
        return plan
    if config.layout == "eagle3-original":
        layer = {name.replace("layers.0.", "midlayer.", 1): placement for name, placement in layer.items()}
    prefix = "midlayer." if config.layout == "eagle3-original" else "layers.0."
    plan = dict(layer)
    plan[prefix + "hidden_norm.weight"] = Placement("hidden_norm.weight")
    for name in ("fc.weight", "norm.weight", "lm_head.weight"):
        plan[name] = Placement(name)
    if config.norm_before_fc:
        plan["input_norm.weight"] = Placement("input_norm.weight")
    if config.fc_norm:
        for i in range(len(config.feature_layers)):
            plan[f"fc_norm.{i}.weight"] = Placement(f"fc_norms.{i}.weight")
    if own_embed:
        plan["embed_tokens.weight"] = Placement("own_embed.weight")
    return plan


def load_head(path: str | Path, target, device=None, dtype: torch.dtype | None = None,
              config: HeadConfig | None = None) -> DraftHead:
    """The head at `path` for `target` (a CausalLM), on the target's device and in its dtype. `config`: the head's
    config when it is read already (a target's own MTP layer: `path` is the target's directory)."""
    directory = Path(path)
    if config is not None and config.layout == TARGET_MTP:
        return load_target_mtp(directory, target, config, device, dtype)
    config = read_head_config(directory, target.config)
    weight = target.lm_head.weight
    device, dtype = device or weight.device, dtype or weight.dtype
    files = _weight_files(directory)
    names = {name for file in files for name in _names(file)}
    own_embed = config.kind == "eagle3" and "embed_tokens.weight" in names
    head = DraftHead(config, target)
    if own_embed:  # a checkpoint that carries its embeddings (speculators saves them) drafts with its own
        head.own_embed = torch.nn.Embedding(target.config.vocab_size, config.hidden_size)
    head = _finish(head, device, dtype)
    placements = head_placements(config, own_embed)
    params = dict(head.named_parameters())
    filled, maps, unused = set(), {}, []
    with torch.no_grad():
        for file in files:
            for name, tensor in _file_tensors(file, torch.device("cpu")):
                if name in VOCABULARY_MAPS:
                    maps[name] = tensor
                elif name in placements:
                    _place(params[placements[name].name], placements[name], tensor.to(device), file, name)
                    filled.add(name)
                elif not name.endswith("rotary_emb.inv_freq") and name not in ("verifier_norm.weight",
                                                                                "verifier_lm_head.weight",
                                                                                "embed_tokens.weight",
                                                                                "lm_head.weight"):
                    unused.append(name)
    _check_filled(f"{directory}: head weights", placements, filled, unused)
    if config.draft_vocab_size != target.config.vocab_size:
        head.draft_to_target = draft_to_target_ids(maps, config, target.config.vocab_size, directory).to(device)
    return head.eval()


# a target's own MTP layer: its tensors (after `layers.<L>.`) beside the decoder layer's -> where they go
TARGET_MTP_TENSORS = {"enorm.weight": "token_norm.weight", "hnorm.weight": "hidden_norm.weight",
                      "eh_proj.weight": "input_proj.weight", "shared_head.norm.weight": "final_norm.weight"}
# ... and the two a checkpoint may leave out (GLM-4.6 does): the target's embeddings and LM head are then used
TARGET_MTP_OPTIONAL = {"embed_tokens.weight": "own_embed", "shared_head.head.weight": "shared_head"}


def target_mtp_placements(config: HeadConfig, index: int) -> dict[str, Placement]:
    """Every tensor a target's own MTP layer must hold (names without `model.`, the layer numbered `index`) ->
    where it goes in `DraftHead`."""
    prefix = f"layers.{index}."
    plan = {prefix + name.removeprefix("layers.0."): placement
            for name, placement in _llama_layer(config.layer, 0).items()}
    plan.update({prefix + theirs: Placement(ours) for theirs, ours in TARGET_MTP_TENSORS.items()})
    return plan


def load_target_mtp(directory: str | Path, target, config: HeadConfig, device=None,
                    dtype: torch.dtype | None = None) -> DraftHead:
    """The MTP layer of the target checkpoint at `directory` (config: runtime.heads.config.target_mtp_config) for
    `target`, the CausalLM loaded from it (which skips these tensors): only the shards holding layer
    `num_hidden_layers` are opened, and only its tensors read. Its embeddings and LM head, where the checkpoint
    holds them, are the target's own when equal to them (GLM-4.5 stores copies), the head's otherwise."""
    directory = Path(directory)
    weight = target.lm_head.weight
    device, dtype = device or weight.device, dtype or weight.dtype
    index = target.config.num_layers
    prefix = f"layers.{index}."
    placements = target_mtp_placements(config, index)
    where = f"{directory}: the MTP layer's weights (layer {index})"
    found = _layer_tensor_names(directory, prefix)
    with torch.device("meta"):  # allocated once, on the device in the dtype: a layer of 128 experts is large
        head = DraftHead(config, target)
        if prefix + "embed_tokens.weight" in found:
            head.own_embed = torch.nn.Embedding(target.config.vocab_size, config.hidden_size)
        if prefix + "shared_head.head.weight" in found:
            head.shared_head = torch.nn.Linear(config.hidden_size, target.config.vocab_size, bias=False)
    head = head.to(dtype).to_empty(device=device)
    head.set_rope_frequencies(device)
    optional = {prefix + theirs: ours + ".weight" for theirs, ours in TARGET_MTP_OPTIONAL.items()}
    params = dict(head.named_parameters())
    filled, unused = set(), []
    with torch.no_grad():
        for file, names in _by_file(found).items():
            for name, raw, tensor in _tensors(file, names):
                if name in placements:
                    _place(params[placements[name].name], placements[name], tensor.to(device), file, raw)
                    filled.add(name)
                elif name in optional:
                    _place(params[optional[name]], Placement(optional[name]), tensor.to(device), file, raw)
                elif not name.endswith("rotary_emb.inv_freq"):
                    unused.append(raw)
    _check_filled(where, placements, filled, unused, prefix="model.")
    with torch.no_grad():  # a copy of the target's own: share the target's
        if head.own_embed is not None and torch.equal(head.own_embed.weight, target.embed.weight):
            head.own_embed = None
        if head.shared_head is not None and torch.equal(head.shared_head.weight, target.lm_head.weight):
            head.shared_head = None
    return head.eval()


def _layer_tensor_names(directory: Path, prefix: str) -> dict[str, tuple[Path, str]]:
    """name (without `model.`) -> (its file, its name there) of every tensor under `prefix` (a layer), from the
    shard index where there is one (no other shard is opened), else from the weight files' headers."""
    index = directory / "model.safetensors.index.json"
    out: dict[str, tuple[Path, str]] = {}
    if index.is_file() and not (directory / "model.safetensors").is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise HeadError(f"{index}: not a readable shard index ({error})") from None
        for raw, shard in weight_map.items():
            if _strip_prefix(raw).startswith(prefix):
                out[_strip_prefix(raw)] = (directory / shard, raw)
        return out
    try:
        files = _weight_files(directory)
    except CheckpointError as error:
        raise HeadError(str(error)) from None
    for file in files:
        out.update({_strip_prefix(raw): (file, raw) for raw in _names(file) if _strip_prefix(raw).startswith(prefix)})
    return out


def _by_file(found: dict[str, tuple[Path, str]]) -> dict[Path, dict[str, str]]:
    """`_layer_tensor_names`' entries grouped by file: file -> {its name there: name without `model.`}."""
    out: dict[Path, dict[str, str]] = {}
    for name, (file, raw) in sorted(found.items()):
        out.setdefault(file, {})[raw] = name
    return out


def _tensors(file: Path, names: dict[str, str]):
    """(name without `model.`, name in the file, tensor) of the tensors `names` of one weight file, only those read."""
    if file.suffix == ".bin":
        for raw, tensor in _file_tensors(file, torch.device("cpu")):
            if raw in names:
                yield names[raw], raw, tensor
        return
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt", device="cpu") as opened:
            present = set(opened.keys())
            for raw, name in names.items():
                if raw in present:  # an index naming a tensor its shard lacks: the tensor is reported missing
                    yield name, raw, opened.get_tensor(raw)
    except (OSError, SafetensorError) as error:
        raise HeadError(f"{file}: the MTP layer's weights are not readable ({error})") from None


def _check_filled(where: str, placements: dict, filled: set, unused: list, prefix: str = "") -> None:
    """One line for the first tensor the plan needs that the files lack (named with `prefix`, as the files name
    it), else for tensors the files hold that the config does not describe."""
    missing = sorted(set(placements) - filled)
    if missing:
        raise HeadError(f"{where}: tensor {prefix + missing[0]!r} is missing"
                        + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if unused:
        raise HeadError(f"{where}: {len(unused)} tensor(s) its config does not describe, e.g. {sorted(unused)[:3]}")


def _names(file: Path) -> list[str]:
    """The tensor names of one weight file, without reading the tensors."""
    if file.suffix == ".bin":
        return [name for name, _ in _file_tensors(file, torch.device("cpu"))]
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(file), framework="pt", device="cpu") as opened:
            return list(opened.keys())
    except (OSError, SafetensorError) as error:
        raise HeadError(f"{file}: head weights are not readable ({error})") from None


def _finish(head: DraftHead, device, dtype: torch.dtype) -> DraftHead:
    """The head on its device in its dtype, RoPE's frequencies kept in float32 (as the target's)."""
    head = head.to(device=device, dtype=dtype)
    head.set_rope_frequencies(device)
    return head


def draft_to_target_ids(maps: dict, config: HeadConfig, vocab_size: int, where) -> torch.Tensor:
    """Target ids of the draft vocabulary from `d2t` (target id = draft id + d2t[draft id]): distinct, rising and
    inside the target's vocabulary, and where `t2d` is given, the same set it marks."""
    if "d2t" not in maps:
        raise HeadError(f"{where}: draft_vocab_size {config.draft_vocab_size} is below the target's {vocab_size} "
                        "but the weights hold no d2t map")
    d2t = maps["d2t"]
    if d2t.dtype.is_floating_point or d2t.shape != (config.draft_vocab_size,):
        raise HeadError(f"{where}: d2t must hold {config.draft_vocab_size} integer offsets, found "
                        f"{str(d2t.dtype).removeprefix('torch.')} {tuple(d2t.shape)}")
    ids = torch.arange(config.draft_vocab_size, dtype=torch.long) + d2t.long()
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size or not bool((ids[1:] > ids[:-1]).all()):
        raise HeadError(f"{where}: d2t maps draft ids outside the target's vocabulary of {vocab_size} or not to "
                        "distinct rising ids")
    t2d = maps.get("t2d")
    if t2d is not None:
        marked = torch.nonzero(t2d.bool().reshape(-1)).reshape(-1)
        if t2d.numel() != vocab_size or not torch.equal(marked, ids):
            raise HeadError(f"{where}: t2d and d2t disagree on which target ids the draft vocabulary holds")
    return ids


def random_head(config: HeadConfig, target, seed: int = 0) -> DraftHead:
    """A head of `config`'s shapes with random weights (timing before weights exist: acceptance is synthetic);
    a draft vocabulary smaller than the target's takes every (V / draft)-th id."""
    weight = target.lm_head.weight
    generator = torch.Generator().manual_seed(seed)
    head = DraftHead(config, target)
    with torch.no_grad():
        for param in head.parameters():
            if param.dim() >= 2:
                param.copy_(torch.randn(param.shape, generator=generator) * param.shape[-1] ** -0.5)
    if config.draft_vocab_size != target.config.vocab_size:
        step = target.config.vocab_size / config.draft_vocab_size
        head.draft_to_target = (torch.arange(config.draft_vocab_size) * step).long()
    return _finish(head, weight.device, weight.dtype).eval()


def save_head(head: DraftHead, directory: str | Path, verifier: str | None = None, dtype: torch.dtype | None = None,
              speculative_tokens: int = 3) -> None:
    """Write `head` in the `speculators` format (config.json and model.safetensors, the names `speculators` and vLLM
    read): what `load_head` reads back. `verifier`: the target's path or name, recorded for the engines."""
    from safetensors.torch import save_file

    from specbatch.perfmodel.jsonio import atomic_output, write_text_atomic

    config = head.head_config
    if config.layout == TARGET_MTP:
        raise HeadError("a target's own MTP layer is saved with its target (as GLM-4.5's checkpoints hold it), not "
                        "as a speculators head")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {name: tensor.detach().cpu() for name, tensor in head.state_dict().items()}
    placements = head_placements(config, head.own_embed is not None)
    tensors = {}
    for theirs, placement in placements.items():
        tensor = state[placement.name]
        if placement.start is not None:
            tensor = tensor.narrow(0, placement.start, placement.rows)
        tensors[theirs] = tensor.to(dtype or tensor.dtype).contiguous()
    if head.draft_to_target is not None:
        ids = head.draft_to_target.cpu()
        tensors["d2t"] = (ids - torch.arange(len(ids))).contiguous()
        t2d = torch.zeros(head.logits_size, dtype=torch.bool)
        t2d[ids] = True
        tensors["t2d"] = t2d
    with atomic_output(directory / "model.safetensors") as temporary:
        save_file(tensors, str(temporary), metadata={"format": "pt"})
    write_text_atomic(directory / "config.json", json.dumps(speculators_config(config, verifier, speculative_tokens),
                                                            indent=2) + "\n")


def speculators_config(config: HeadConfig, verifier: str | None, speculative_tokens: int) -> dict:
    """The head's `config.json` in the `speculators` format."""
    layer = config.layer
    rope = {"rope_theta": layer.rope_theta, **(layer.rope_scaling or {"rope_type": "default"})}
    layer_config = {
        "model_type": layer.model_type, "vocab_size": layer.vocab_size, "hidden_size": layer.hidden_size,
        "intermediate_size": layer.intermediate_size, "num_hidden_layers": 1, "num_attention_heads": layer.num_heads,
        "num_key_value_heads": layer.num_kv_heads, "head_dim": layer.head_dim,
        "max_position_embeddings": layer.max_position_embeddings, "rms_norm_eps": layer.norm_eps,
        "hidden_act": layer.activation, "attention_bias": layer.o_bias, "mlp_bias": layer.mlp_bias,
        "rope_parameters": rope, "tie_word_embeddings": False,
    }
    raw = {"architectures": ["Eagle3DraftModel" if config.kind == "eagle3" else "MTPDraftModel"],
           "speculators_model_type": config.kind, "transformer_layer_config": layer_config,
           "speculators_config": {"algorithm": config.kind, "default_proposal_method": "greedy",
                                  "proposal_methods": [{"proposal_type": "greedy",
                                                        "speculative_tokens": speculative_tokens}],
                                  "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]}}}
    if config.kind == "eagle3":
        raw.update(draft_vocab_size=config.draft_vocab_size,
                   eagle_aux_hidden_state_layer_ids=list(config.feature_layers),
                   norm_before_residual=config.norm_before_residual, norm_before_fc=config.norm_before_fc,
                   fc_norm=config.fc_norm, norm_output=config.norm_output)
    else:
        raw["num_nextn_predict_layers"] = 1
    return raw
