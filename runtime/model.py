"""One config-driven decoder for the Llama family (Llama, Mistral, Qwen2), GPT-2 and OPT, with a
preallocated KV cache that keeps a length per row.

Why one module: the families differ in a handful of switches (norm kind, position encoding, MLP
kind, where the norm sits), not in structure. Internal weight names are the same for every family
(q, k and v fused into `qkv`; gate and up fused into `gate_up`: fewer, larger matmuls, which is what
matters for small models on a CPU); `checkpoint.py` maps each family's Hugging Face names onto them.

The cache is `[layers, batch, kv_heads, max_len, head_dim]` for keys and for values, plus
`lengths[batch]`. A forward pass over `n` new tokens per row writes them at positions
`lengths[r] .. lengths[r] + n - 1` of row r and advances `lengths` by n. Rolling back a rejected
suffix is `cache.lengths[r] = kept`: the stale entries beyond are masked out and later overwritten.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


class KVCache:
    """Preallocated keys and values with one length per row."""

    def __init__(self, config: ModelConfig, batch_size: int, max_len: int, device, dtype):
        shape = (config.num_layers, batch_size, config.num_kv_heads, max_len, config.head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.max_len = max_len

    @property
    def batch_size(self) -> int:
        return self.keys.shape[1]

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Drop finished rows: the batch shrinks to `rows` (increasing indices), compacted in place.

        Row i of the result is row rows[i]; with increasing indices every source lies at or after its
        destination, so copying in order never overwrites a row still to be moved. Only each row's live
        entries (its first `lengths` slots) move, and nothing is allocated: the buffer is kept and viewed
        at its first len(rows) rows, so leaving rows neither copies whole caches nor doubles peak memory."""
        order = rows.tolist()
        if any(later <= earlier for earlier, later in zip(order, order[1:])):
            raise ValueError(f"keep_rows: row indices must be increasing, found {order}")
        lengths = self.lengths.tolist()
        for destination, source in enumerate(order):
            if source != destination:
                live = lengths[source]
                self.keys[:, destination, :, :live] = self.keys[:, source, :, :live]
                self.values[:, destination, :, :live] = self.values[:, source, :, :live]
        self.keys, self.values = self.keys.narrow(1, 0, len(order)), self.values.narrow(1, 0, len(order))
        self.lengths = self.lengths.index_select(0, rows)

    def rows(self, start: int, count: int) -> KVCache:
        """Rows start..start+count-1 as a cache of their own whose keys and values are views of this
        one's (a forward pass through it writes here; no copy). Its `lengths` are its own copy: the
        serving engine's slots (runtime.engine) store them back after the pass."""
        view = KVCache.__new__(KVCache)
        view.keys, view.values = self.keys.narrow(1, start, count), self.values.narrow(1, start, count)
        view.lengths = self.lengths[start:start + count].clone()
        view.max_len = self.max_len
        return view

    def move_row(self, source: int, destination: int) -> None:
        """Copy row `source` (its first lengths[source] entries, all that is live) onto `destination`."""
        live = int(self.lengths[source])
        self.keys[:, destination, :, :live] = self.keys[:, source, :, :live]
        self.values[:, destination, :, :live] = self.values[:, source, :, :live]
        self.lengths[destination] = self.lengths[source]


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
            return self.down(F.silu(gate) * up)
        h = self.up(x)
        if act == "gelu_new":
            h = F.gelu(h, approximate="tanh")
        elif act == "gelu":
            h = F.gelu(h)
        else:
            h = F.relu(h)
        return self.down(h)

    def attention(self, x, rope, cache: KVCache | None, layer: int, mask, slots) -> torch.Tensor:
        b, n, _ = x.shape
        cfg = self.config
        q, k, v = self.qkv(x).split((self.q_size, self.kv_size, self.kv_size), dim=-1)
        q = q.view(b, n, cfg.num_heads, cfg.head_dim).transpose(1, 2)  # (b, heads, n, hd)
        k = k.view(b, n, cfg.num_kv_heads, cfg.head_dim)  # (b, n, kv_heads, hd)
        v = v.view(b, n, cfg.num_kv_heads, cfg.head_dim)
        if rope is not None:
            cos, sin = rope  # (b, 1, n, hd) and (b, n, 1, hd) views of the same values
            q = q * cos[0] + _rotate_half(q) * sin[0]
            k = k * cos[1] + _rotate_half(k) * sin[1]
        if cache is None:  # training / no-cache scoring: causal attention over the tokens given
            out = F.scaled_dot_product_attention(
                q, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, is_causal=mask is None,
                enable_gqa=cfg.num_kv_heads != cfg.num_heads,
            )
        else:
            rows = torch.arange(b, device=x.device)[:, None]
            cache.keys[layer][rows, :, slots] = k.to(cache.keys.dtype)
            cache.values[layer][rows, :, slots] = v.to(cache.values.dtype)
            key_len = mask.shape[-1]
            out = F.scaled_dot_product_attention(
                q, cache.keys[layer, :, :, :key_len], cache.values[layer, :, :, :key_len], attn_mask=mask,
                enable_gqa=cfg.num_kv_heads != cfg.num_heads,
            )
        return self.o(out.transpose(1, 2).reshape(b, n, self.q_size))

    def forward(self, x, rope, cache, layer, mask, slots):
        if self.config.family == "opt" and not self.config.do_layer_norm_before:  # post-LN (opt-350m)
            x = self.attn_norm(x + self.attention(x, rope, cache, layer, mask, slots))
            return self.mlp_norm(x + self.mlp(x))
        x = x + self.attention(self.attn_norm(x), rope, cache, layer, mask, slots)
        return x + self.mlp(self.mlp_norm(x))


class TreeAttention:
    """Tokens that form a tree (or a chain followed by a tree) on top of each row's cached prefix.

    The cache of every row holds `base[r]` committed tokens and then `m` in-flight slots of the same
    tree for every row (fed by earlier passes of this step); this pass appends `n` more. `offsets`
    (m + n,) are the in-flight slots' positions relative to `base` (a node's depth, for a tree), and
    `mask` (n, m + n) says which in-flight slots each new token may attend to (its ancestors and
    itself). Every new token also sees the whole committed prefix. Positions feed RoPE or learned
    position embeddings; slots are where keys and values are stored: they differ inside a tree.
    """

    def __init__(self, offsets: torch.Tensor, mask: torch.Tensor):
        if mask.dim() != 2 or offsets.shape != (mask.shape[1],):
            raise ValueError(f"tree attention: mask {tuple(mask.shape)} does not match offsets {tuple(offsets.shape)}")
        self.offsets, self.mask = offsets, mask

    def masks(self, cache: KVCache, n: int, key_len: int, window: int | None):
        in_flight = self.mask.shape[1]
        base = cache.lengths - (in_flight - n)  # (b,)
        positions = base[:, None] + self.offsets[in_flight - n:]  # (b, n)
        keys = torch.arange(key_len, device=base.device)
        relative = keys - base[:, None]  # (b, key_len): slot index inside the in-flight region
        inside = (relative >= 0) & (relative < in_flight)
        tree_part = self.mask[:, relative.clamp(0, in_flight - 1)].permute(1, 0, 2)  # (b, n, key_len)
        allowed = (relative < 0)[:, None, :] | (inside[:, None, :] & tree_part)
        window_mask = None
        if window:
            key_positions = torch.where(inside, base[:, None] + self.offsets[relative.clamp(0, in_flight - 1)], keys)
            window_mask = (allowed & (key_positions[:, None, :] > positions[..., None] - window))[:, None]
        mask = allowed[:, None].contiguous()  # attention reads it once per layer: lay it out once
        return mask, (window_mask.contiguous() if window else mask), positions


class CausalLM(nn.Module):
    """A decoder-only language model; `forward(tokens, cache)` returns logits `(b, n, vocab)`."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
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

    def new_cache(self, batch_size: int, max_len: int) -> KVCache:
        weight = self.lm_head.weight
        return KVCache(self.config, batch_size, max_len, weight.device, weight.dtype)

    def _rope(self, positions: torch.Tensor, dtype):
        freqs = positions[..., None].float() * self.inv_freq  # (b, n, hd/2)
        angles = torch.cat((freqs, freqs), dim=-1)  # (b, n, hd)
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        return (cos[:, None], cos[:, :, None]), (sin[:, None], sin[:, :, None])

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None,
                tree: TreeAttention | None = None, logits_at: torch.Tensor | None = None,
                logits: bool = True) -> torch.Tensor | None:
        """Logits (b, n, vocab) of every fed position; with `logits_at` (b,) only that position of each row,
        (b, vocab); with `logits=False` none (the pass only fills the cache). A prefill needs one position
        per row, so the LM head need not run over every prompt token (b x n x vocab floats)."""
        b, n = tokens.shape  # tokens: (b, n)
        steps = torch.arange(n, device=tokens.device)
        window = self.config.sliding_window
        if cache is None:
            slots = positions = steps.expand(b, n)
            key_len = n
        else:
            start = cache.lengths  # (b,)
            slots = positions = start[:, None] + steps  # (b, n)
            key_len = int(start.max()) + n
            if key_len > cache.max_len:
                raise ValueError(f"KV cache overflow: {key_len} positions needed, {cache.max_len} allocated")
        mask = window_mask = None
        if tree is not None:
            mask, window_mask, positions = tree.masks(cache, n, key_len, window)
        elif cache is not None or (window and n > window):
            keys = torch.arange(key_len, device=tokens.device)
            allowed = keys <= positions[..., None]  # (b, n, key_len)
            mask = window_mask = allowed[:, None]  # (b, 1, n, key_len)
            if window:
                window_mask = (allowed & (keys > positions[..., None] - window))[:, None]
        x = self.embed(tokens)
        if self.project_in is not None:
            x = self.project_in(x)
        if self.config.family == "gpt2":
            x = x + self.pos_embed(positions)
        elif self.config.family == "opt":
            x = x + self.pos_embed(positions + 2)
        rope = None
        if self.config.family == "llama":
            cos, sin = self._rope(positions, x.dtype)
            rope = (cos, sin)
        sliding = self.config.sliding_layers
        for index, layer in enumerate(self.layers):
            layer_mask = window_mask if sliding and sliding[index] else mask
            x = layer(x, rope, cache, index, layer_mask, slots)
        if cache is not None:
            cache.lengths = cache.lengths + n
        if not logits:
            return None
        if logits_at is not None:
            x = x[torch.arange(b, device=x.device), logits_at]  # (b, hidden): the norm and head are per position
        if self.final_norm is not None:
            x = self.final_norm(x)
        if self.project_out is not None:
            x = self.project_out(x)
        return self.lm_head(x)
