"""What calibration needs to know about the two models before it loads them: their profile entries (what
fits in memory is calibrate.memory's). Resolving and loading them is `runtime.loading`'s.
"""
from __future__ import annotations

import torch

from specbatch.perfmodel.profile import ModelInfo
from specbatch.perfmodel.profile.routing import ExpertShape
from specbatch.runtime.config import ModelConfig
from specbatch.runtime.loading import ModelSpec


def expert_shape(config: ModelConfig, element_bytes: int) -> ExpertShape | None:
    """A mixture of experts' routed experts (runtime.experts.RoutedExperts: gate, up and down projections, no
    biases); None for a dense model. GLM-4.5's shared expert runs for every token: it is part of the dense weights."""
    moe_layers = sum(config.routes_experts(layer) for layer in range(config.num_layers))
    if not moe_layers:
        return None
    parameters = 3 * config.hidden_size * config.expert_intermediate_size
    return ExpertShape(num_experts=config.num_experts, experts_per_token=config.experts_per_token,
                       moe_layers=moe_layers, expert_parameters=parameters, expert_bytes=parameters * element_bytes)


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
        experts=expert_shape(config, element_bytes),
    ) if spec.head is None else head_info(spec, element_bytes)


def head_info(spec: ModelSpec, element_bytes: int) -> ModelInfo:
    """A head as the draft role: one layer, the parameters a head pass reads, its draft vocabulary."""
    head, config = spec.head, spec.config
    return ModelInfo(
        source=spec.source, model_type=config.model_type, random_weights=spec.random_weights,
        parameters=head.parameter_count(), layers=1, hidden_size=config.hidden_size, heads=config.num_heads,
        kv_heads=config.num_kv_heads, head_dim=config.head_dim, intermediate_size=config.intermediate_size,
        vocab_size=config.vocab_size, weight_bytes=head.parameter_count() * element_bytes,
        kv_bytes_per_token=config.kv_bytes_per_token(element_bytes),
        max_position_embeddings=config.max_position_embeddings, fingerprint=spec.fingerprint,
        drafter=head.kind, draft_vocab_size=head.draft_vocab_size,
        experts=expert_shape(head.layer, element_bytes),  # GLM-4.5's MTP layer routes to experts as the target does
    )


def named_pair(target: str | None, draft: str | None, command: str) -> tuple[str, str]:
    """What --target/--draft name for a command that needs a draft (runtime.assembly.required_draft), the target
    checked first: a target that is no model (no such path, a JSON that is no config, an unknown preset) is
    named as such, not taken for a model that merely has no default draft."""
    from specbatch.runtime.assembly import DEMO_TARGET, default_draft, required_draft
    from specbatch.runtime.loading import resolve_model

    if default_draft(target, draft) is None:  # only then is a target given and the draft missing
        resolve_model(target, "target")  # a one-line error naming --target when it is no model
    return target or str(DEMO_TARGET), required_draft(target, draft, command)
