"""A mixture-of-experts MLP layer (Qwen3-MoE, Mixtral, GLM-4.5) that multiplies only the experts its tokens route
to; runtime.model's Block runs it in place of the dense MLP."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .devices import capturing_graph, device_kind


def _grouped_products_fit(x: torch.Tensor, *weights: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM takes these operands on this device: CUDA (its kernel streams only the groups
    that have rows, and needs no host read-back, so a CUDA graph captures it), bfloat16 (what the kernel takes),
    every row 16-byte aligned."""
    return (device_kind(x.device).grouped_expert_products and hasattr(torch, "_grouped_mm")
            and x.dtype == torch.bfloat16
            and all(w.dtype == torch.bfloat16 and w.shape[-1] % 8 == 0 and w.shape[-2] % 8 == 0 for w in weights))


class RoutedExperts(nn.Module):
    """A mixture-of-experts MLP: a router picks `experts_per_token` of `num_experts` gated MLPs for every token and
    sums their outputs, weighted (GLM-4.5 adds a shared expert every token runs). The experts are stacked,
    `gate_up` (experts, 2 x width, hidden) and `down` (experts, hidden, width), so a pass can multiply each expert
    by only the tokens routed to it.

    A pass reads only the experts its tokens route to: the (token, expert) pairs are sorted by expert, and each
    touched expert multiplies its own rows (on a CPU one product per touched expert, after one read-back of the
    counts; on CUDA in bfloat16 one grouped GEMM over all experts' row groups, which skips the empty ones and reads
    nothing back, so a graph captures it). Every pair's output lands in its own row and a token's k outputs are
    summed in a fixed order: the result does not depend on which experts share a pass, nor on the path."""

    def __init__(self, config: ModelConfig, act):
        """`act`: the gated MLPs' activation (runtime.model.ACTIVATIONS[config.activation])."""
        super().__init__()
        self.config = config
        d, width, count = config.hidden_size, config.expert_intermediate_size, config.num_experts
        self.router = nn.Linear(d, count, bias=False)
        # GLM-4.5's score-correction bias: shifts which experts are chosen, not their weights
        self.score_bias = nn.Parameter(torch.zeros(count), requires_grad=False) if config.router == "sigmoid" else None
        self.gate_up = nn.Parameter(torch.empty(count, 2 * width, d))
        self.down = nn.Parameter(torch.empty(count, d, width))
        self.shared_gate_up = self.shared_down = None
        if config.shared_expert_intermediate_size:
            self.shared_gate_up = nn.Linear(d, 2 * config.shared_expert_intermediate_size, bias=False)
            self.shared_down = nn.Linear(config.shared_expert_intermediate_size, d, bias=False)
        self.act = act
        self.grouped_products: bool | None = None  # None: by device (_grouped_products_fit); tests force either

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(each token's experts (tokens, k), their weights (tokens, k)) for x (tokens, hidden). The weights are
        float32 where transformers keeps them so (Mixtral, GLM-4.5), in x's dtype for Qwen3-MoE."""
        cfg = self.config
        if cfg.router == "softmax":
            probabilities = torch.softmax(self.router(x).float(), dim=-1)
            weights, experts = probabilities.topk(cfg.experts_per_token, dim=-1)
            if cfg.normalize_expert_weights:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return experts, (weights.to(x.dtype) if cfg.model_type == "qwen3_moe" else weights)
        scores = F.linear(x.float(), self.router.weight.float()).sigmoid()  # GLM-4.5 routes in float32
        biased = scores + self.score_bias.float()
        if cfg.expert_groups > 1:  # keep the best groups' experts only, a group scored by its two best
            grouped = biased.unflatten(-1, (cfg.expert_groups, -1))
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            best = group_scores.topk(cfg.expert_groups_per_token, dim=-1).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(-1, best, True)
            biased = grouped.masked_fill(~keep[..., None], float("-inf")).flatten(-2)
        experts = biased.topk(cfg.experts_per_token, dim=-1).indices
        weights = scores.gather(-1, experts)
        if cfg.normalize_expert_weights:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return experts, weights * cfg.routed_scaling_factor

    def _gated(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = h.chunk(2, dim=-1)
        return self.act(gate) * up

    def _per_expert(self, x: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Each touched expert's product over its rows of x[rows] (rows sorted by expert, counts per expert)."""
        out = x.new_empty(rows.shape[0], x.shape[-1])
        start = 0
        for expert, count in enumerate(counts.tolist()):  # the one read-back: which experts this pass touches
            if count:
                end = start + count
                h = self._gated(F.linear(x[rows[start:end]], self.gate_up[expert]))
                out[start:end] = F.linear(h, self.down[expert])
                start = end
        return out

    def _grouped(self, x: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The same products as `_per_expert` in two grouped GEMMs (torch._grouped_mm: row group e is expert e's,
        ending at the cumulative count; empty groups cost nothing)."""
        ends = counts.cumsum(0).to(torch.int32)
        h = self._gated(torch._grouped_mm(x[rows], self.gate_up.transpose(1, 2), offs=ends))
        return torch._grouped_mm(h, self.down.transpose(1, 2), offs=ends)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        experts, weights = self.route(x)
        pairs = experts.flatten()  # (tokens x k): token t's choices at t*k .. t*k+k-1
        order = pairs.argsort(stable=True)  # the pairs grouped by expert
        counts = torch.zeros(self.config.num_experts, dtype=torch.int64, device=x.device).scatter_add_(
            0, pairs, torch.ones_like(pairs))
        grouped = self.grouped_products
        if grouped is None:
            grouped = _grouped_products_fit(x, self.gate_up, self.down)
        if not grouped and capturing_graph(x.device):
            raise RuntimeError(f"a mixture-of-experts pass in {str(x.dtype).removeprefix('torch.')} multiplies expert "
                               "by expert after reading the routing back, which a CUDA graph cannot capture: run it "
                               "in bfloat16 (torch's grouped GEMM) or eagerly (--eager)")
        rows = order // experts.shape[-1]
        products = (self._grouped if grouped else self._per_expert)(x, rows, counts)
        by_pair = torch.empty_like(products)
        by_pair[order] = products  # back to token order: each token's k outputs side by side
        out = (by_pair.unflatten(0, experts.shape) * weights[..., None]).sum(dim=1).to(x.dtype)
        if self.shared_gate_up is not None:
            out = out + self.shared_down(self._gated(self.shared_gate_up(x)))
        return out.reshape(shape)
