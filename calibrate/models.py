"""The two models being calibrated: what `--target`/`--draft` name, whether they fit, and loading them.

`--target` and `--draft` each accept a Hugging Face model directory (real weights), a preset name or
the path of a `config.json` (both: random weights of that shape). Timing needs only the shape;
acceptance needs real weights.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from specbatch.perfmodel.jsonio import directory_fingerprint, model_fingerprint
from specbatch.perfmodel.profile import Grid, ModelInfo
from specbatch.runtime.checkpoint import build_model, load_checkpoint
from specbatch.runtime.config import ConfigError, ModelConfig, load_config
from specbatch.runtime.model import CausalLM

from .errors import CalibrationError
from .grid import new_tokens_at
from .presets import PRESET_NAMES, PRESETS, preset_config

WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
GIB = 1024 ** 3


@dataclass(frozen=True)
class ModelSpec:
    role: str  # target | draft
    source: str  # as recorded in the profile: a preset name, or an absolute path
    config: ModelConfig
    directory: Path | None  # the weights' directory; None means random weights
    fingerprint: str | None = None  # perfmodel.jsonio.model_fingerprint: the model's content, not its path

    @property
    def random_weights(self) -> bool:
        return self.directory is None


@dataclass(frozen=True)
class LoadedPair:
    target: CausalLM
    draft: CausalLM
    tokenizer: object | None  # the target's runtime.checkpoint.Tokenizer; None for random weights
    eos_token_ids: tuple[int, ...]


def display_path(path: Path) -> str:
    """A path as recorded in a profile: absolute, so the files made from it work from any directory."""
    return str(path.resolve())


def resolve_model(text: str, role: str) -> ModelSpec:
    """Turn the text of `--target`/`--draft` into a spec; every failure names the option."""
    option = f"--{role}"
    if text in PRESETS:
        canonical = json.dumps(PRESETS[text], sort_keys=True).encode()
        return ModelSpec(role, text, preset_config(text), None, model_fingerprint(canonical))
    path = Path(text)
    if not path.exists():
        raise CalibrationError(f"{option} {text!r}: no such model directory or config file, and not a preset "
                               f"(presets: {', '.join(PRESET_NAMES)})")
    try:
        config = load_config(path)
    except ConfigError as error:
        raise CalibrationError(f"{option}: {error}") from None
    if path.is_file():
        return ModelSpec(role, display_path(path), config, None, model_fingerprint(path.read_bytes()))
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        raise CalibrationError(f"{option} {text}: no weights ({', '.join(WEIGHT_FILES)}); to time the shape alone "
                               f"pass {path / 'config.json'} with --acceptance")
    return ModelSpec(role, display_path(path), config, path, directory_fingerprint(path))


def model_info(spec: ModelSpec, dtype: torch.dtype) -> ModelInfo:
    element_bytes = torch.finfo(dtype).bits // 8
    config = spec.config
    return ModelInfo(
        source=spec.source, model_type=config.model_type, random_weights=spec.random_weights,
        parameters=config.parameter_count(), layers=config.num_layers, hidden_size=config.hidden_size,
        heads=config.num_heads, kv_heads=config.num_kv_heads, head_dim=config.head_dim,
        intermediate_size=config.intermediate_size, vocab_size=config.vocab_size,
        weight_bytes=config.parameter_count() * element_bytes,
        kv_bytes_per_token=config.kv_bytes_per_token(element_bytes),
        max_position_embeddings=config.max_position_embeddings, fingerprint=spec.fingerprint,
    )


@dataclass(frozen=True)
class MemoryNeed:
    """Peak memory of the largest grid point, by part (bytes)."""

    weight_bytes: int  # both models
    kv_cache_bytes: int  # both models' caches at the largest batch and context
    logits_bytes: int  # the target's verify logits, float32 after `probabilities`
    batch_size: int
    context_len: int

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_cache_bytes + self.logits_bytes


def memory_need(target: ModelInfo, draft: ModelInfo, grid: Grid, tree_nodes: int = 0) -> MemoryNeed:
    """Both models and both KV caches are resident at once while step overheads are measured (the
    generator holds both), so the check adds them; activations of one layer are small next to these.
    The largest verify pass is a chain's of max_k + 1 tokens at the largest batch, a wide pass at a
    small batch, or a tree step's of `tree_nodes` + 1 tokens (measured at every batch size)."""
    batch_size, context_len = max(grid.batch_sizes), max(grid.context_lens)
    cache_tokens = max(b * (context_len + max(new_tokens_at(grid, "target", b))) for b in grid.batch_sizes)
    kv_bytes = (target.kv_bytes_per_token + draft.kv_bytes_per_token) * cache_tokens
    verify_tokens = max([b * n for b in grid.batch_sizes for n in new_tokens_at(grid, "target", b)]
                        + [batch_size * (tree_nodes + 1)])
    logits_bytes = verify_tokens * target.vocab_size * 4
    return MemoryNeed(target.weight_bytes + draft.weight_bytes, kv_bytes, logits_bytes, batch_size, context_len)


def check_memory(need: MemoryNeed, available_bytes: int, device: str) -> None:
    if need.total_bytes > available_bytes:
        raise CalibrationError(
            f"the largest grid point does not fit on {device}: weights {need.weight_bytes / GIB:.2f} GiB + KV cache "
            f"{need.kv_cache_bytes / GIB:.2f} GiB (batch {need.batch_size}, context {need.context_len}) + logits "
            f"{need.logits_bytes / GIB:.2f} GiB = {need.total_bytes / GIB:.2f} GiB > {available_bytes / GIB:.2f} GiB "
            f"available; lower --batch-sizes or --context-lens, or use a smaller --dtype")


def load_pair(target: ModelSpec, draft: ModelSpec, device: str, dtype: torch.dtype) -> LoadedPair:
    """Load real weights where there are some, build seeded random ones where there are not."""
    models, tokenizer, eos = [], None, target.config.eos_token_ids
    for seed, spec in enumerate((target, draft)):
        if spec.random_weights:
            models.append(build_model(spec.config, device, dtype, seed=seed))
            continue
        loaded = load_checkpoint(spec.directory, device, dtype)
        models.append(loaded.model)
        if spec.role == "target":
            tokenizer, eos = loaded.tokenizer, loaded.eos_token_ids
    return LoadedPair(target=models[0], draft=models[1], tokenizer=tokenizer, eos_token_ids=tuple(eos))


def check_pair(target: ModelSpec, draft: ModelSpec) -> None:
    """The runtime verifies draft tokens by id, so both models must share one vocabulary."""
    if target.config.vocab_size != draft.config.vocab_size:
        raise CalibrationError(f"--draft: its vocabulary ({draft.config.vocab_size} tokens) differs from the target's "
                               f"({target.config.vocab_size} tokens); the pair must share a tokenizer")
