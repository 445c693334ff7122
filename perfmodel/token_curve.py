"""A role's passes past its own token counts, read from another role's fit on the same device (`TokenCurve`).

A GEMM's time over t token rows is set by the kernel the library picks for its widths (N, K) and t: the
tiles and waves it runs. Two models whose GEMMs have the same widths run the same kernels at the same t,
so their passes step at the same token counts, by amounts in proportion to how much GEMM work each feeds
a token. A draft's passes feed few tokens (1 or 2 per row): at the batch sizes a calibration measures
they never reach the token counts where the GEMMs step, and no fit of its rows alone can place those
steps. The target's verify passes (k + 1 tokens per row) reach them on the same grid. So, past the
draft's measured token counts, its staircase grows the way the target's fit does, scaled:

    G_draft(t) = scale * T_target(b_s, t / b_s, L_s),     scale = W_draft / W_target

b_s is the target's largest measured batch size (its rows reach the most tokens), L_s its smallest
measured context (the least attention in the curve), and G takes the place of the draft's own padded
roofline in `Staircase.continued_ms`, where only its differences count. W is the GEMM work per token:
W = layers * B + vocab * hidden (each layer's linear weights B, and the LM head over every fed token;
the embedding is a lookup, not a GEMM), with B = (P_target - P_draft) / (layers_target - layers_draft)
from the parameter counts: both models count their embeddings and head alike.

Assumes: the same block in both models (model type, hidden, intermediate, heads, KV heads, head size,
vocabulary), so the same kernels: a draft made of target layers (self-speculative, layer-skip) or one
layer of the target's width with its head (EAGLE). The per-token operations of a layer (norms,
activations) scale with its GEMMs. Breaks for a draft of other widths (a separate small model: other
tiles, other steps, and none of this is applied), and where the head's steps weigh differently from
the blocks' (a one-layer draft's head is 40 % of its GEMM work, a 32-layer target's 2 %). Only the staircase
is continued so: a draft whose rows show no step keeps the kind cross-validation chose (the monotone kind
scales its edge by the roofline, whose growth in rows would be lost beside the curve's in tokens).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np

from .jsonio import rounded
from .profile import ModelInfo

SAME_BLOCK = ("model_type", "hidden_size", "intermediate_size", "heads", "kv_heads", "head_dim", "vocab_size")


class _Latency(Protocol):
    def latency_ms(self, b, n, L): ...


@dataclass(frozen=True)
class TokenCurve:
    """G(t) of the module docstring: `source`'s fitted pass along t at `batch_size` rows and `context_len`."""

    source: _Latency = field(repr=False)  # the source role's LatencyModel
    source_role: str
    scale: float  # GEMM work per token, this role over the source
    batch_size: float  # b_s
    context_len: float  # L_s

    def tokens_ms(self, tokens) -> np.ndarray:
        tokens = np.asarray(tokens, dtype=float)
        return self.scale * np.asarray(self.source.latency_ms(self.batch_size, tokens / self.batch_size,
                                                              self.context_len), dtype=float)

    def to_json(self) -> dict:
        return {"from_role": self.source_role, "scale": rounded(self.scale, 12), "batch_size": rounded(self.batch_size),
                "context_len": rounded(self.context_len)}


def gemm_work_ratio(source: ModelInfo, info: ModelInfo) -> float | None:
    """W_info / W_source (module docstring), or None where the blocks differ or the counts are inconsistent."""
    if any(getattr(source, name) != getattr(info, name) for name in SAME_BLOCK):
        return None
    if source.layers == info.layers:
        return 1.0 if source.parameters == info.parameters else None
    per_layer = (source.parameters - info.parameters) / (source.layers - info.layers)
    rest = info.parameters - info.layers * per_layer  # embeddings, head, final norm: the same in both
    if per_layer <= 0 or rest < 0:
        return None
    head = info.vocab_size * info.hidden_size
    return (info.layers * per_layer + head) / (source.layers * per_layer + head)


def share_token_curve(model, info: ModelInfo, source, source_info: ModelInfo, source_role: str = "target"):
    """`model` (a LatencyModel) continued past its token counts by `source`'s fit where the module docstring's
    conditions hold: the same block, a staircase to continue, and source rows that reach more tokens. Else
    `model` unchanged."""
    ratio = gemm_work_ratio(source_info, info)
    if ratio is None or model.staircase is None or model.box is None or source.box is None:
        return model
    reach = source.box.batch_size[1] * source.box.new_tokens[1]
    if reach <= model.box.batch_size[1] * model.box.new_tokens[1]:
        return model
    return replace(model, token_curve=TokenCurve(source, source_role, ratio, source.box.batch_size[1],
                                                 source.box.context_len[0]))
