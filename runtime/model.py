"""One config-driven decoder for the Llama family (Llama, Mistral, Qwen2), GPT-2 and OPT.

Why one module: the families differ in a handful of switches (norm kind, position encoding, MLP
kind, where the norm sits), not in structure. Internal weight names are the same for every family
(q, k and v fused into `qkv`; gate and up fused into `gate_up`: fewer, larger matmuls, which is what
matters for small models on a CPU); `checkpoint.py` maps each family's Hugging Face names onto them.

A pass feeds tokens on top of a `KVCache` (runtime.kv_cache): uniformly, n tokens per row (b, n), or
ragged, row r's own n_r tokens packed one row after another (a prefill); `runtime.attention` decides how
each row attends over its own keys. Rolling back a rejected suffix is resetting a row's length: the stale
entries beyond it are never attended to and are overwritten later.
"""
from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .attention import RaggedPass, TreeAttention, UniformPass, choose_backend
from .devices import device_kind
from .config import ModelConfig
from .kv_cache import KVCache


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    scaling = config.rope_scaling
    if scaling:  # Llama 3: stretch low frequencies by `factor`, keep high ones, blend in between
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = torch.where(medium, blended, scaled)
    return inv_freq.float()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Block(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        d, hd = config.hidden_size, config.head_dim
        self.q_size, self.kv_size = config.num_heads * hd, config.num_kv_heads * hd
        llama = config.family == "llama"
        bias = config.qkv_bias if llama else config.enable_bias
        self.qkv = nn.Linear(d, self.q_size + 2 * self.kv_size, bias=bias)
        self.o = nn.Linear(self.q_size, d, bias=config.o_bias if llama else config.enable_bias)
        if llama:
            self.attn_norm = nn.RMSNorm(d, eps=config.norm_eps)
            self.mlp_norm = nn.RMSNorm(d, eps=config.norm_eps)
            self.gate_up = nn.Linear(d, 2 * config.intermediate_size, bias=config.mlp_bias)
            self.down = nn.Linear(config.intermediate_size, d, bias=config.mlp_bias)
        else:
            self.attn_norm = nn.LayerNorm(d, eps=config.norm_eps)
            self.mlp_norm = nn.LayerNorm(d, eps=config.norm_eps)
            self.up = nn.Linear(d, config.intermediate_size, bias=config.enable_bias)
            self.down = nn.Linear(config.intermediate_size, d, bias=config.enable_bias)

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        act = self.config.activation
        if self.config.family == "llama":
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            if torch.is_grad_enabled():
                return self.down(F.silu(gate) * up)
            # no autograd to feed: in place, in the projection's own output while it is still in cache
            return self.down(F.silu(gate, inplace=True).mul_(up))
        h = self.up(x)
        if act == "gelu_new":
            h = F.gelu(h, approximate="tanh")
        elif act == "gelu":
            h = F.gelu(h)
        else:
            h = F.relu(h)
        return self.down(h)

    def attention(self, x, rope, cache: KVCache | None, layer: int, attention) -> torch.Tensor:
        """x (..., tokens, d): (b, n, d) for a uniform pass or a scoring pass, (T, d) for a ragged one."""
        cfg = self.config
        qk, v = self.qkv(x).split((self.q_size + self.kv_size, self.kv_size), dim=-1)
        qk = qk.unflatten(-1, (cfg.num_heads + cfg.num_kv_heads, cfg.head_dim))  # (..., tokens, heads, hd)
        v = v.unflatten(-1, (cfg.num_kv_heads, cfg.head_dim))
        if rope is not None:  # queries and keys rotated together: one set of kernels, not two
            cos, sin = rope  # (..., tokens, 1, hd)
            qk = qk * cos + _rotate_half(qk) * sin
        q, k = qk.split((cfg.num_heads, cfg.num_kv_heads), dim=-2)
        gqa = cfg.num_kv_heads != cfg.num_heads
        windowed = bool(cfg.sliding_window) and (not cfg.sliding_layers or cfg.sliding_layers[layer])
        if cache is None:  # training / no-cache scoring: causal attention over the tokens given
            mask = attention if windowed else None
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 attn_mask=mask, is_causal=mask is None, enable_gqa=gqa)
            out = out.transpose(1, 2)
        else:
            attention.write(cache, layer, k, v)
            if isinstance(attention, RaggedPass):
                out = attention.attend(q, k, v, cache, layer, windowed, gqa)
            else:
                out = attention.attend(q, cache, layer, windowed, gqa)
        return self.o(out.flatten(-2))

    def forward(self, x, rope, cache, layer, attention):
        if self.config.family == "opt" and not self.config.do_layer_norm_before:  # post-LN (opt-350m)
            x = self.attn_norm(x + self.attention(x, rope, cache, layer, attention))
            return self.mlp_norm(x + self.mlp(x))
        if torch.is_grad_enabled():
            x = x + self.attention(self.attn_norm(x), rope, cache, layer, attention)
            return x + self.mlp(self.mlp_norm(x))
        # inference: the residual stream is summed in place (no new tensor per add: on a CPU whose caches
        # the weights and the KV cache sweep every step, each fresh tensor is memory touched cold); the
        # stream entering a block is the embedding's output or the previous block's, read by no one else
        x = x.add_(self.attention(self.attn_norm(x), rope, cache, layer, attention))
        return x.add_(self.mlp(self.mlp_norm(x)))


class CausalLM(nn.Module):
    """A decoder-only language model; `forward(tokens, cache)` returns logits `(b, n, vocab)`."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.attention_backend: str | None = None  # None: by device (runtime.attention.choose_backend)
        d = config.hidden_size
        embed_dim = config.word_embed_proj_dim or d
        self.embed = nn.Embedding(config.vocab_size, embed_dim)
        self.pos_embed = None
        self.project_in = self.project_out = None
        if config.family == "gpt2":
            self.pos_embed = nn.Embedding(config.max_position_embeddings, d)
        elif config.family == "opt":
            # OPT's learned positions are stored with an offset of 2 (rows 0 and 1 are unused)
            self.pos_embed = nn.Embedding(config.max_position_embeddings + 2, d)
            if embed_dim != d:
                self.project_in = nn.Linear(embed_dim, d, bias=False)
                self.project_out = nn.Linear(d, embed_dim, bias=False)
        self.layers = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.final_norm = None
        if config.family == "llama":
            self.final_norm = nn.RMSNorm(d, eps=config.norm_eps)
        elif config.final_layer_norm:
            self.final_norm = nn.LayerNorm(d, eps=config.norm_eps)
        self.lm_head = nn.Linear(embed_dim, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        if config.family == "llama":
            self.register_buffer("inv_freq", rope_inverse_frequencies(config), persistent=False)

    def lay_out_for_matmul(self) -> None:
        """Where the device's record asks for it (the CPU's MKL: runtime.devices), store every projection's
        weight transposed (a contiguous (in, out) tensor seen as the usual (out, in) parameter): `F.linear` then
        hands MKL a row-major right operand, which it multiplies 20-40 % faster at decode shapes (tokens <= 512;
        benchmarks/linear_layout.py measures it). Values, shapes and state-dict keys are unchanged. A tied LM
        head keeps the embedding's layout (the lookup reads rows)."""
        if not device_kind(self.lm_head.weight.device).transposed_projections:
            return
        for module in self.modules():
            if isinstance(module, nn.Linear) and module.weight is not self.embed.weight:
                module.weight = nn.Parameter(module.weight.detach().t().contiguous().t(),
                                             requires_grad=module.weight.requires_grad)

    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        weight = self.lm_head.weight
        return KVCache(self.config, batch_size, max_len, weight.device, weight.dtype)

    def _rope(self, positions: torch.Tensor, dtype):
        freqs = positions[..., None].float() * self.inv_freq  # (..., tokens, hd/2)
        angles = torch.cat((freqs, freqs), dim=-1)[..., None, :]  # (..., tokens, 1, hd): broadcast over heads
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, tree: TreeAttention | None = None,
                last: int | None = None, new_tokens: list[int] | None = None) -> torch.Tensor | None:
        """Logits of a pass, (b, n, vocab) for every fed position, or only each row's `last` positions
        (b, last, vocab); `last=0` computes none and returns None (the pass only fills the cache).
        No pass reads the device back: what the attention spans comes from the cache's host lengths.

        `tokens` (b, n): n tokens per row, on top of `cache` when given (under `tree`: a tree of in-flight
        slots). With `new_tokens` (one count per row), `tokens` (T,) packs row 0's tokens, then row 1's...
        (a prefill: no padding, each row over its own keys) and `last` is 1 (each row's last token: (b, 1,
        vocab)) or 0."""
        window = self.config.sliding_window
        attention = None
        if new_tokens is not None:
            if cache is None or last not in (0, 1):
                raise ValueError("a ragged pass needs a cache and last=0 or 1")
            needed = int((cache.host_lengths + np.asarray(new_tokens)).max())
            if needed > cache.max_len:
                raise ValueError(f"KV cache overflow: {needed} positions needed, {cache.max_len} allocated")
            backend = choose_backend(cache, self.attention_backend, None, window)
            attention = RaggedPass(cache, new_tokens, window, backend)
            positions = attention.positions
        elif cache is None:
            b, n = tokens.shape
            positions = torch.arange(n, device=tokens.device).expand(b, n)
            if window and n > window:
                steps = torch.arange(n, device=tokens.device)
                attention = (steps <= steps[:, None]) & (steps > steps[:, None] - window)  # the windowed layers' mask
        else:
            b, n = tokens.shape
            needed = cache.longest() + n
            if needed > cache.max_len:
                raise ValueError(f"KV cache overflow: {needed} positions needed, {cache.max_len} allocated")
            backend = choose_backend(cache, self.attention_backend, tree, window)
            attention = UniformPass(cache, n, tree, window, backend)
            positions = attention.positions
        x = self.embed(tokens)
        if self.project_in is not None:
            x = self.project_in(x)
        if self.config.family == "gpt2":
            x = x + self.pos_embed(positions)
        elif self.config.family == "opt":
            x = x + self.pos_embed(positions + 2)
        rope = self._rope(positions, x.dtype) if self.config.family == "llama" else None
        for index, layer in enumerate(self.layers):
            x = layer(x, rope, cache, index, attention)
        if cache is not None:
            if new_tokens is not None:
                cache.written(attention.ends)  # every layer wrote each row's tokens
                cache.set_lengths(None, attention.ends)
            else:
                cache.advance(n)
        if last == 0:
            return None
        if new_tokens is not None:
            x = x[attention.last_token][:, None]  # (b, 1, hidden): the norm and head are per position
        elif last is not None:
            x = x[:, -last:]
        if self.final_norm is not None:
            x = self.final_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return self.lm_head(x)
