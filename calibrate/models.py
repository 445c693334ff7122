"""What calibration needs to know about the two models before it loads them: their profile entries and
whether the largest grid point fits in memory. Resolving and loading them is `runtime.loading`'s.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specbatch.perfmodel.profile import Grid, ModelInfo
from specbatch.runtime.loading import ModelSpec

from .errors import CalibrationError
from .grid import new_tokens_at

GIB = 1024 ** 3


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
