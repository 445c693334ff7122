"""Loading what a user names: the device, the model pair, an n-gram file.

A model is a Hugging Face model directory (real weights), a shape preset or the path of a `config.json`
(both: seeded random weights of that shape; timing needs only the shape). Every check of what a user
names happens here, before or while loading, with a one-line error naming the option: the device, the
pair's shared vocabulary, the n-gram's vocabulary and tokenizer. Each model carries a fingerprint of its
content, so a table or model file can tell which pair it was made for.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from specbatch.perfmodel.errors import NoteWarning, UsageError
from specbatch.perfmodel.jsonio import directory_fingerprint, model_fingerprint

from .checkpoint import Tokenizer, build_model, load_checkpoint
from .devices import resolve_device  # noqa: F401 - commands import it from here, with the loaders
from .config import ConfigError, ModelConfig, check_vocabulary, load_config
from .model import CausalLM
from .heads import DraftHead, HeadConfig, HeadError, is_head_dir, load_head, random_head, read_head_config
from .heads.config import target_mtp_config
from .presets import HEAD_PRESETS, PRESET_NAMES, PRESETS, head_preset_config, preset_config

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
TARGET_MTP_DRAFT = "mtp"  # --draft mtp: the target checkpoint's own MTP layer (vLLM's speculative method "mtp")


@dataclass(frozen=True)
class ModelSpec:
    role: str  # target | draft
    source: str  # as recorded in a profile: a preset name, or an absolute path
    config: ModelConfig
    directory: Path | None  # the weights' directory; None means random weights
    fingerprint: str | None = None  # perfmodel.jsonio.model_fingerprint: the model's content, not its path
    head: HeadConfig | None = None  # a draft that is a head (EAGLE-3, MTP); `config` is then its layer's

    @property
    def random_weights(self) -> bool:
        return self.directory is None

    @property
    def drafter(self) -> str:
        """What drafts: "draft_model", or the head's kind ("eagle3", "mtp")."""
        return self.head.kind if self.head is not None else "draft_model"


def display_path(path: Path) -> str:
    """A path as recorded in a profile: absolute, so the files made from it work from any directory."""
    return str(Path(path).resolve())


def resolve_model(text: str, role: str) -> ModelSpec:
    """The text of `--target`/`--draft` as a spec (nothing is loaded); every failure names the option."""
    option = f"--{role}"
    if text in PRESETS:
        canonical = json.dumps(PRESETS[text], sort_keys=True).encode()
        return ModelSpec(role, text, preset_config(text), None, model_fingerprint(canonical))
    path = Path(text)
    if not path.exists():
        raise UsageError(f"{option} {text!r}: no such model directory or config file, and not a preset "
                         f"(presets: {', '.join(PRESET_NAMES)})")
    try:
        config = load_config(path)
    except ConfigError as error:
        raise UsageError(f"{option}: {error}") from None
    if path.is_file():
        return ModelSpec(role, display_path(path), config, None, model_fingerprint(path.read_bytes()))
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        raise UsageError(f"{option} {text}: no weights ({', '.join(WEIGHT_FILES)}); for random weights of its "
                         f"shape name {path / 'config.json'} itself")
    return ModelSpec(role, display_path(path), config, path, directory_fingerprint(path))


def resolve_head(text: str, target: ModelSpec) -> ModelSpec | None:
    """`--draft` as a head (a head preset, a head's directory or its config.json) checked against the target, or
    None when it names no head; every failure names the option."""
    path = Path(text)
    if text in HEAD_PRESETS:
        config = head_preset_config(text, target.config)
        canonical = json.dumps(HEAD_PRESETS[text], sort_keys=True).encode()
        return ModelSpec("draft", text, config.layer, None, model_fingerprint(canonical), config)
    if not is_head_dir(path):
        return None
    try:
        config = read_head_config(path, target.config)
    except HeadError as error:
        raise UsageError(f"--draft: {error}") from None
    if path.is_file():
        return ModelSpec("draft", display_path(path), config.layer, None, model_fingerprint(path.read_bytes()), config)
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        raise UsageError(f"--draft {text}: a head without weights ({', '.join(WEIGHT_FILES)}); for random weights of "
                         f"its shape name {path / 'config.json'} itself")
    return ModelSpec("draft", display_path(path), config.layer, path, directory_fingerprint(path), config)


def resolve_target_mtp(target: ModelSpec) -> ModelSpec:
    """`--draft mtp`: the target's own MTP layer as a head (runtime.heads.config.target_mtp_config), checked before
    anything is loaded. Its source is the target's (the checkpoint an engine loads for vLLM's method "mtp"), its
    weights the target's directory (random with the target's, for a preset or a config.json)."""
    if target.directory is not None:
        file = target.directory / "config.json"
    elif target.source in PRESETS:
        file = None
    else:
        file = Path(target.source)
    try:
        raw = PRESETS[target.source] if file is None else json.loads(file.read_text())
        config = target_mtp_config(raw, target.config, f"preset {target.source}" if file is None else str(file))
    except HeadError as error:
        raise UsageError(f"--draft {TARGET_MTP_DRAFT}: {error}") from None
    fingerprint = (None if target.fingerprint is None
                   else model_fingerprint(f"{TARGET_MTP_DRAFT} layer of {target.fingerprint}".encode()))
    return ModelSpec("draft", target.source, config.layer, target.directory, fingerprint, config)


def named_head(text: str) -> str | None:
    """The kind of head ("eagle3", "mtp") `--draft TEXT` names (a head preset, a head's directory or its config,
    `mtp`: the target's own MTP layer), None when it names no head."""
    if text == TARGET_MTP_DRAFT:
        return "mtp"
    if text in HEAD_PRESETS:
        return HEAD_PRESETS[text]["speculators_model_type"]
    path = Path(text)
    if not is_head_dir(path):
        return None
    raw = json.loads((path / "config.json" if path.is_dir() else path).read_text())
    return raw.get("speculators_model_type") or "eagle3"  # else EAGLE-3's original layout


def resolve_pair(target: str, draft: str | None) -> tuple[ModelSpec, ModelSpec | None]:
    """Both specs, checked to share one vocabulary (the runtime verifies draft tokens by id). `draft` may be a
    draft model or a head (runtime.heads), which is checked against the target instead; `mtp` names the target's own
    MTP layer (`resolve_target_mtp`)."""
    target_spec = resolve_model(target, "target")
    if draft == TARGET_MTP_DRAFT:
        return target_spec, resolve_target_mtp(target_spec)
    if draft is not None and target_spec.config.family == "llama":
        head = resolve_head(draft, target_spec)
        if head is not None:
            return target_spec, head
    if draft is not None and (draft in HEAD_PRESETS or is_head_dir(Path(draft))):
        raise UsageError(f"--draft {draft}: a head drafts for a llama/qwen3 target, and --target "
                         f"{target_spec.source} is a {target_spec.config.model_type} model")
    draft_spec = None if draft is None else resolve_model(draft, "draft")
    if draft_spec is not None:
        same = check_same_tokenizer(target_spec, draft_spec)
        if not draft_pads_to_target(target_spec, draft_spec, same):
            check_vocabulary(f"--draft {draft_spec.source}", draft_spec.config.vocab_size,
                             target_spec.config.vocab_size)
    return target_spec, draft_spec


def draft_pads_to_target(target: ModelSpec, draft: ModelSpec, same_tokenizer: bool | None) -> bool:
    """A draft whose vocabulary is the first ids of the target's: one tokenizer, the target's embedding table
    padded past it (Gemma 3 1B, 262,144 ids, for Gemma 3 12B's 262,208). It proposes from its own ids and its
    logits are padded with -inf (`CausalLM.pad_vocabulary_to`): lossless, as the target verifies every token.
    Allowed when the tokenizer files are the same, or for random weights (timing) of one model type."""
    if draft.config.vocab_size >= target.config.vocab_size:
        return False
    shapes_only = draft.random_weights and target.random_weights and draft.config.model_type == target.config.model_type
    return bool(same_tokenizer) or shapes_only


def check_same_tokenizer(target: ModelSpec, draft: ModelSpec) -> bool | None:
    """The draft's tokenizer.json must map the same tokens to the same ids as the target's
    (`ngram.tokenizer_fingerprint`, as for an n-gram draft), or every draft token is rejected: True when it
    does; a one-line error when it does not; None where it cannot be checked (random weights have no tokens;
    where one checkpoint has no tokenizer.json, a note says so)."""
    from .ngram import NGramError, tokenizer_fingerprint

    if target.directory is None or draft.directory is None:
        return None
    files = [target.directory / "tokenizer.json", draft.directory / "tokenizer.json"]
    present = [f for f in files if f.is_file()]
    if len(present) == 1:
        missing = target if present[0] == files[1] else draft
        warnings.warn(f"--{missing.role} {missing.source} has no tokenizer.json: whether the draft shares the "
                      "target's tokens is unchecked (acceptance near 0 means it does not)", NoteWarning, stacklevel=3)
    if len(present) < 2:
        return None
    try:
        same = tokenizer_fingerprint(files[0]) == tokenizer_fingerprint(files[1])
    except NGramError as error:
        raise UsageError(str(error)) from None
    if not same:
        raise UsageError(f"--draft {draft.source}: its tokenizer ({files[1]}) maps tokens to ids unlike the "
                         f"target's ({files[0]}), so every draft token would be rejected; give a draft trained with "
                         "the target's tokenizer")
    return True


@dataclass(frozen=True)
class LoadedPair:
    target: CausalLM
    draft: CausalLM | DraftHead | None
    tokenizer: Tokenizer | None  # the target's; None for random weights or a directory without tokenizer.json
    eos_token_ids: tuple[int, ...]
    target_spec: ModelSpec
    draft_spec: ModelSpec | None

    def running(self) -> dict:
        """role -> (source, fingerprint), and "drafter" -> what drafts (with a draft): what
        `assembly.check_made_for` compares a table or model with."""
        return running_pair(self.target_spec, self.draft_spec)


def running_pair(target: ModelSpec, draft: ModelSpec | None) -> dict:
    """`LoadedPair.running` of two specs, before anything is loaded."""
    running = {spec.role: (spec.source, spec.fingerprint) for spec in (target, draft) if spec is not None}
    return running if draft is None else {**running, "drafter": draft.drafter}


def model_made_for(fitted) -> dict:
    """`running_pair`'s counterpart for a perfmodel.model.FittedModel: the pair and drafter it was fitted for."""
    return {"target": (fitted.target_info.source, fitted.target_info.fingerprint),
            "draft": (fitted.draft_info.source, fitted.draft_info.fingerprint), "drafter": fitted.draft_info.drafter}


def load_pair(target: ModelSpec, draft: ModelSpec | None, device: str, dtype: torch.dtype) -> LoadedPair:
    """Load real weights where there are some, build seeded random ones where there are not."""
    models, tokenizer, eos = [], None, target.config.eos_token_ids
    for seed, spec in enumerate((target, draft)):
        if spec is None:
            models.append(None)
        elif spec.head is not None:
            models.append(random_head(spec.head, models[0], seed=seed) if spec.random_weights
                          else load_head(spec.directory, models[0], config=spec.head))
        elif spec.random_weights:
            models.append(build_model(spec.config, device, dtype, seed=seed))
        else:
            loaded = load_checkpoint(spec.directory, device, dtype, role=spec.role)
            models.append(loaded.model)
            if spec.role == "target":
                tokenizer, eos = loaded.tokenizer, loaded.eos_token_ids
    if models[1] is not None and draft.head is None and draft.config.vocab_size < target.config.vocab_size:
        models[1].pad_vocabulary_to(target.config.vocab_size)
    return LoadedPair(models[0], models[1], tokenizer, tuple(eos), target, draft)


def is_ngram_file(path: str | Path | None) -> bool:
    return path is not None and str(path).endswith(".safetensors") and Path(path).is_file()


def load_ngram(path: Path | str, option: str, target: ModelSpec):
    """An n-gram file checked against the target's vocabulary and, when the target has a tokenizer.json,
    its fingerprint; every failure is one line naming the option and the file."""
    from .ngram import NGramError, NGramModel, tokenizer_fingerprint

    try:
        ngram = NGramModel.load(path)
        tokenizer_file = target.directory / "tokenizer.json" if target.directory is not None else None
        fingerprint = tokenizer_fingerprint(tokenizer_file) if tokenizer_file and tokenizer_file.is_file() else None
    except NGramError as error:
        message = str(error).replace("\n", " ")  # safetensors' own messages may span lines
        raise UsageError(f"{option}: {message}") from None
    ngram.check_compatible(target.config.vocab_size, fingerprint, f"{option} {path}")
    return ngram
