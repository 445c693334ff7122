"""One config-driven decoder for the Llama family (Llama, Mistral, Qwen2/3, Gemma 3, Phi-3, and the mixtures of
experts Qwen3-MoE, Mixtral and GLM-4.5), GPT-2 and OPT.

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

import logging
import math
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .attention import RaggedPass, TreeAttention, UniformPass, choose_backend
from .fused import kernels_for, rotate_half_split as _rotate
from .devices import device_kind
from .experts import RoutedExperts
from .config import ModelConfig
from .kv_cache import KVCache

log = logging.getLogger("specbatch.runtime")
_said: set[str] = set()


def say_once(message: str) -> None:
    """Log a note about how passes run once per process, not once per pass."""
    if message not in _said:
        _said.add(message)
        log.info(message)


def _llama3_frequencies(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    """Llama 3: stretch low frequencies by `factor`, keep high ones, blend in between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def _yarn_frequencies(theta: float, dim: int, scaling: dict) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate the low frequencies by `factor`, keep the high ones, ramp linearly between the
    dimensions that turn beta_fast and beta_slow times over the original context; cos/sin scaled up."""
    factor, original = scaling["factor"], scaling["original_max_position_embeddings"]

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = scaling.get("attention_factor")
    if attention is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    keep = 1 - ramp  # 1: extrapolate (the frequency as it is), 0: interpolate (divided by factor)
    return (1.0 / (factor * base)) * (1 - keep) + (1.0 / base) * keep, float(attention)


def rope_inverse_frequencies(config: ModelConfig, local: bool = False) -> tuple[torch.Tensor, float]:
    """(inverse frequencies (rotary_dim / 2,), float32; the factor cos and sin are scaled by) of the global
    layers, or with `local` of Gemma 3's sliding-window layers (their own base and scaling)."""
    theta = config.local_rope_theta if local else config.rope_theta
    scaling = config.local_rope_scaling if local else config.rope_scaling
    dim = config.rotary_dim or config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.float64) / dim
    inv_freq = 1.0 / (theta ** exponents)
    kind = scaling["rope_type"] if scaling else "default"
    attention = 1.0
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        inv_freq = _llama3_frequencies(inv_freq, scaling)
    elif kind == "yarn":
        return _yarn_frequencies(theta, dim, scaling)
    elif kind == "longrope":  # within the original context (config.py caps the runtime's there): short factors
        inv_freq = 1.0 / (torch.tensor(scaling["short_factor"], dtype=torch.float64) * theta ** exponents)
        attention = float(scaling["attention_factor"])
    return inv_freq.float(), attention


def _gelu_tanh_formula(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3.0))))


ACTIVATIONS = {
    "silu": F.silu, "swish": F.silu, "gelu": F.gelu, "gelu_python": F.gelu,
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    # transformers computes these by their formulas, not torch's tanh kernel: the same here
    "gelu_new": _gelu_tanh_formula, "gelu_python_tanh": _gelu_tanh_formula,
    "gelu_accurate": lambda x: 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x.pow(3)))),
    "gelu_fast": lambda x: 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x))),
    "gelu_10": lambda x: F.gelu(x).clamp(-10, 10), "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
    "relu": F.relu, "relu2": lambda x: F.relu(x).square(), "relu6": F.relu6, "leaky_relu": F.leaky_relu,
    "tanh": torch.tanh, "sigmoid": torch.sigmoid, "mish": F.mish, "linear": lambda x: x,
}


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: normalised in float32 and scaled by (1 + weight), then cast back."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


def _rms_norm(config: ModelConfig, size: int) -> nn.Module:
    if config.norm_offset:
        return OffsetRMSNorm(size, config.norm_eps)
    return nn.RMSNorm(size, eps=config.norm_eps)


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, factor: float, dtype):
    """(cos, signed sin) of every position for `_rotate`, (..., tokens, 1, rotary dims) in `dtype`."""
    freqs = (positions[..., None].float() * inv_freq)[..., None, :]  # (..., tokens, 1, hd/2): over heads
    cos, sin = freqs.cos(), freqs.sin()
    cos, signed_sin = torch.cat((cos, cos), dim=-1), torch.cat((-sin, sin), dim=-1)
    if factor == 1.0:
        return cos.to(dtype), signed_sin.to(dtype)
    return (cos * factor).to(dtype), (signed_sin * factor).to(dtype)


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int = 0):
        super().__init__()
        self.config = config
        d, hd = config.hidden_size, config.head_dim
        self.q_size, self.kv_size = config.num_heads * hd, config.num_kv_heads * hd
        llama = config.family == "llama"
        bias = config.qkv_bias if llama else config.enable_bias
        self.qkv = nn.Linear(d, self.q_size + 2 * self.kv_size, bias=bias)
        self.o = nn.Linear(self.q_size, d, bias=config.o_bias if llama else config.enable_bias)
        self.q_norm = self.k_norm = self.attn_out_norm = self.mlp_out_norm = None
        self.experts = None  # a mixture of experts in place of the dense MLP (config.routes_experts)
        if llama:
            self.attn_norm = _rms_norm(config, d)
            self.mlp_norm = _rms_norm(config, d)
            if config.routes_experts(layer):
                self.experts = RoutedExperts(config, ACTIVATIONS[config.activation])
            else:
                self.gate_up = nn.Linear(d, 2 * config.intermediate_size, bias=config.mlp_bias)
                self.down = nn.Linear(config.intermediate_size, d, bias=config.mlp_bias)
            if config.qk_norm:
                self.q_norm, self.k_norm = _rms_norm(config, hd), _rms_norm(config, hd)
            if config.sandwich_norms:
                self.attn_out_norm, self.mlp_out_norm = _rms_norm(config, d), _rms_norm(config, d)
        else:
            self.attn_norm = nn.LayerNorm(d, eps=config.norm_eps)
            self.mlp_norm = nn.LayerNorm(d, eps=config.norm_eps)
            self.up = nn.Linear(d, config.intermediate_size, bias=config.enable_bias)
            self.down = nn.Linear(config.intermediate_size, d, bias=config.enable_bias)
        self.act = ACTIVATIONS[config.activation]
        # queries pre-multiplied so that the backends' 1 / sqrt(head_dim) gives the config's score scale
        scale = config.query_scale * math.sqrt(hd) if config.query_scale is not None else 1.0
        self.query_factor = None if scale == 1.0 else scale

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        if self.experts is not None:
            return self.experts(x)
        if self.config.family == "llama":
            gate, up = self.gate_up(x).chunk(2, dim=-1)
            if torch.is_grad_enabled():
                return self.down(self.act(gate) * up)
            if self.act is F.silu:  # no autograd to feed: in place, in the projection's output still in cache
                return self.down(F.silu(gate, inplace=True).mul_(up))
            return self.down(self.act(gate).mul_(up))
        return self.down(self.act(self.up(x)))

    def attention(self, x, rope, cache: KVCache | None, layer: int, attention) -> torch.Tensor:
        """x (..., tokens, d): (b, n, d) for a uniform pass or a scoring pass, (T, d) for a ragged one."""
        cfg = self.config
        qk, v = self.qkv(x).split((self.q_size + self.kv_size, self.kv_size), dim=-1)
        qk = qk.unflatten(-1, (cfg.num_heads + cfg.num_kv_heads, cfg.head_dim))  # (..., tokens, heads, hd)
        v = v.unflatten(-1, (cfg.num_kv_heads, cfg.head_dim))
        if self.q_norm is not None:  # per-head norms of queries and keys, before RoPE
            q, k = qk.split((cfg.num_heads, cfg.num_kv_heads), dim=-2)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=-2)
        if rope is not None:  # queries and keys rotated together: one set of kernels, not two
            cos, signed_sin = rope  # (..., tokens, 1, rotary dims)
            if cfg.rotary_dim:  # partial rotary: the rest of each head passes through
                turned = _rotate(qk[..., :cfg.rotary_dim], cos, signed_sin)
                qk = torch.cat((turned, qk[..., cfg.rotary_dim:]), dim=-1)
            else:
                qk = _rotate(qk, cos, signed_sin)
        q, k = qk.split((cfg.num_heads, cfg.num_kv_heads), dim=-2)
        if self.query_factor is not None:
            q = q * self.query_factor
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

    @property
    def fusable(self) -> bool:
        """Whether this layer's form is the one runtime.fused has kernels for: pre-norm with plain RMSNorms and
        a dense gated MLP (Llama, Mistral, Qwen2/3, Phi-3); Gemma's offset and sandwich norms, a mixture of
        experts, GPT-2 and OPT stay eager."""
        return (self.config.family == "llama" and isinstance(self.attn_norm, nn.RMSNorm)
                and self.attn_out_norm is None and self.experts is None)

    def fused_attention(self, kernels, x, rope, cache: KVCache, layer: int, attention) -> torch.Tensor:
        """`attention` over a cache pass with the fused kernels (runtime.fused): x is the normed input."""
        cfg = self.config
        qkv = self.qkv(x)
        cos, signed_sin = rope if rope is not None else (None, None)
        q_norm, k_norm = (self.q_norm.weight, self.k_norm.weight) if self.q_norm is not None else (None, None)
        q, k = kernels.queries_and_keys(qkv, cos, signed_sin, q_norm, k_norm, cfg.norm_eps, cfg.num_heads,
                                        cfg.num_kv_heads, cfg.head_dim, cfg.rotary_dim, self.query_factor)
        v = qkv[..., self.q_size + self.kv_size:].unflatten(-1, (cfg.num_kv_heads, cfg.head_dim))
        gqa = cfg.num_kv_heads != cfg.num_heads
        windowed = bool(cfg.sliding_window) and (not cfg.sliding_layers or cfg.sliding_layers[layer])
        attention.write(cache, layer, k, v)
        if isinstance(attention, RaggedPass):
            out = attention.attend(q, k, v, cache, layer, windowed, gqa)
        else:
            out = attention.attend(q, cache, layer, windowed, gqa, kernels.in_flight_merge)
        return self.o(out.flatten(-2))

    def forward(self, x, rope, cache, layer, attention):
        if self.config.family == "opt" and not self.config.do_layer_norm_before:  # post-LN (opt-350m)
            x = self.attn_norm(x + self.attention(x, rope, cache, layer, attention))
            return self.mlp_norm(x + self.mlp(x))
        if self.attn_out_norm is not None:  # Gemma 3: each sublayer's output normed before the residual add
            x = x + self.attn_out_norm(self.attention(self.attn_norm(x), rope, cache, layer, attention))
            return x + self.mlp_out_norm(self.mlp(self.mlp_norm(x)))
        if torch.is_grad_enabled():
            x = x + self.attention(self.attn_norm(x), rope, cache, layer, attention)
            return x + self.mlp(self.mlp_norm(x))
        # inference: the residual stream is summed in place (no new tensor per add: on a CPU whose caches
        # the weights and the KV cache sweep every step, each fresh tensor is memory touched cold); the
        # stream entering a block is the embedding's output or the previous block's, read by no one else
        x = x.add_(self.attention(self.attn_norm(x), rope, cache, layer, attention))
        return x.add_(self.mlp(self.mlp_norm(x)))


def plan_pass(tokens: torch.Tensor, cache: KVCache | None, tree: TreeAttention | None, last: int | None,
              new_tokens: list[int] | None, window: int | None, backend: str | None):
    """(how the pass attends, each fed token's position) for a pass of `tokens` (CausalLM.forward's arguments;
    a head's passes too). `backend`: the model's requested attention backend (None: by device)."""
    if new_tokens is not None:
        if cache is None or last not in (0, 1):
            raise ValueError("a ragged pass needs a cache and last=0 or 1")
        needed = int((cache.host_lengths + np.asarray(new_tokens)).max())
        if needed > cache.max_len:
            raise ValueError(f"KV cache overflow: {needed} positions needed, {cache.max_len} allocated")
        attention = RaggedPass(cache, new_tokens, window, choose_backend(cache, backend, None, window))
        return attention, attention.positions
    b, n = tokens.shape
    if cache is None:
        positions = torch.arange(n, device=tokens.device).expand(b, n)
        if window and n > window:
            steps = torch.arange(n, device=tokens.device)
            return (steps <= steps[:, None]) & (steps > steps[:, None] - window), positions  # the windowed mask
        return None, positions
    needed = cache.longest() + n
    if needed > cache.max_len:
        raise ValueError(f"KV cache overflow: {needed} positions needed, {cache.max_len} allocated")
    chosen = choose_backend(cache, backend, tree, window)
    if tree is not None and chosen == "sdpa" and choose_backend(cache, backend, None, window) == "varlen":
        say_once("tree passes of a sliding-window model attend through sdpa, not varlen: the window counts "
                 "positions, which inside a tree are not the cache slots' order")
    attention = UniformPass(cache, n, tree, window, chosen)
    return attention, attention.positions


def finish_pass(cache: KVCache | None, attention, tokens: torch.Tensor) -> None:
    """Every layer wrote the pass's keys and values: advance the cache's lengths over them."""
    if cache is None:
        return
    if isinstance(attention, RaggedPass):
        cache.written(attention.ends)
        cache.set_lengths(None, attention.ends)
    else:
        cache.advance(tokens.shape[1])


BY_DEVICE = "by device"  # CausalLM.layer_kernels before its first cache pass: the device's record decides
NORMED_OUTPUT = -1  # a feature id: the final norm's output (what an MTP head reads), not a layer's input


def _take_features(taken: torch.Tensor, ids: tuple[int, ...], layer_id: int, x: torch.Tensor) -> None:
    """Copy the hidden states `x` into their slice of `taken` where `layer_id` is one of the ids asked for."""
    width = x.shape[-1]
    for slot, wanted in enumerate(ids):
        if wanted == layer_id:
            taken[..., slot * width:(slot + 1) * width].copy_(x)


class CausalLM(nn.Module):
    """A decoder-only language model; `forward(tokens, cache)` returns logits `(b, n, vocab)`."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.attention_backend: str | None = None  # None: by device (runtime.attention.choose_backend)
        # the fused layer kernels cache passes run (runtime.fused.LayerKernels), None for the eager layer, or
        # BY_DEVICE: the device's record decides at the first cache pass (runtime.fused.kernels_for)
        self.layer_kernels = BY_DEVICE
        self._kernels_by_device = None  # (device, its kernels) as the record decided
        # a draft whose vocabulary is the start of its target's (one tokenizer, the target's table padded, as
        # Gemma 3 1B for 12B): logits padded with -inf to the target's size (`pad_vocabulary_to`)
        self.logits_size = config.vocab_size
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
        self.layers = nn.ModuleList(Block(config, index) for index in range(config.num_layers))
        self.final_norm = None
        if config.family == "llama":
            self.final_norm = _rms_norm(config, d)
        elif config.final_layer_norm:
            self.final_norm = nn.LayerNorm(d, eps=config.norm_eps)
        self.lm_head = nn.Linear(embed_dim, config.vocab_size, bias=False)
        self.register_buffer("local_inv_freq", None, persistent=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        if config.family == "llama":
            self.set_rope_frequencies(None)

    def set_rope_frequencies(self, device) -> None:
        """RoPE's inverse frequencies, float32 whatever the weights' dtype (and Gemma 3's local layers' own)."""
        inv_freq, self.rope_attention_factor = rope_inverse_frequencies(self.config)
        self.register_buffer("inv_freq", inv_freq.to(device) if device else inv_freq, persistent=False)
        if self.config.local_rope_theta is not None:
            local, self.local_rope_attention_factor = rope_inverse_frequencies(self.config, local=True)
            self.register_buffer("local_inv_freq", local.to(device) if device else local, persistent=False)

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

    def _rope(self, positions: torch.Tensor, dtype, local: bool = False):
        """(cos, signed sin) of every position, (..., tokens, 1, rotary dims) in `dtype`, for `_rotate`: the
        sine's first half negated (exactly: a sign flip commutes with the scaling and the rounding)."""
        inv_freq = self.local_inv_freq if local else self.inv_freq
        factor = self.local_rope_attention_factor if local else self.rope_attention_factor
        return rope_tables(positions, inv_freq, factor, dtype)

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None, tree: TreeAttention | None = None,
                last: int | None = None, new_tokens: list[int] | None = None,
                features: tuple[int, ...] | None = None):
        """Logits of a pass, (b, n, vocab) for every fed position, or only each row's `last` positions
        (b, last, vocab); `last=0` computes none and returns None (the pass only fills the cache).
        No pass reads the device back: what the attention spans comes from the cache's host lengths.

        `tokens` (b, n): n tokens per row, on top of `cache` when given (under `tree`: a tree of in-flight
        slots). With `new_tokens` (one count per row), `tokens` (T,) packs row 0's tokens, then row 1's...
        (a prefill: no padding, each row over its own keys) and `last` is 1 (each row's last token: (b, 1,
        vocab)) or 0.

        `features` (a head's inputs, runtime.heads): also return the hidden states of every fed position at
        those layer ids, concatenated, (b, n, len(ids) * hidden) or packed (T, ...): id i is the residual
        stream entering layer i (i = num_layers: leaving the last one), `NORMED_OUTPUT` the final norm's
        output. The pass then returns (logits or None, features)."""
        window = self.config.sliding_window
        attention, positions = plan_pass(tokens, cache, tree, last, new_tokens, window, self.attention_backend)
        if self.logits_size > self.config.vocab_size:
            tokens = tokens.clamp(max=self.config.vocab_size - 1)
        x = self.embed(tokens)
        if self.config.embed_scale is not None:  # Gemma: the scale rounded to the weights' dtype, as transformers
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        if self.project_in is not None:
            x = self.project_in(x)
        if self.config.family == "gpt2":
            x = x + self.pos_embed(positions)
        elif self.config.family == "opt":
            x = x + self.pos_embed(positions + 2)
        rope = self._rope(positions, x.dtype) if self.config.family == "llama" else None
        local_rope = self._rope(positions, x.dtype, local=True) if self.local_inv_freq is not None else None
        sliding = self.config.sliding_layers
        taken = None if features is None else x.new_empty(*x.shape[:-1], len(features) * x.shape[-1])
        kernels = self.fused_kernels() if cache is not None else None
        if kernels is not None:
            x = self._fused_layers(kernels, x, rope, local_rope, cache, attention, features, taken)
        for index, layer in enumerate(self.layers if kernels is None else ()):
            if features is not None:
                _take_features(taken, features, index, x)  # a copy: the block sums its residual in place
            layer_rope = local_rope if local_rope is not None and sliding and sliding[index] else rope
            x = layer(x, layer_rope, cache, index, attention)
        if features is not None:
            _take_features(taken, features, len(self.layers), x)
            if NORMED_OUTPUT in features:
                _take_features(taken, features, NORMED_OUTPUT, self.final_norm(x))
        finish_pass(cache, attention, tokens)
        if features is not None:
            return self._logits(x, attention, last, new_tokens), taken
        return self._logits(x, attention, last, new_tokens)

    def fused_kernels(self):
        """The fused layer kernels this model's cache passes run, or None (the eager layer)."""
        if self.layer_kernels is not BY_DEVICE:
            return self.layer_kernels
        device = self.lm_head.weight.device
        if self._kernels_by_device is None or self._kernels_by_device[0] != device:  # once per device it runs on
            fusable = all(layer.fusable for layer in self.layers)
            self._kernels_by_device = (device, kernels_for(device) if fusable else None)
        return self._kernels_by_device[1]

    def _fused_layers(self, kernels, x, rope, local_rope, cache, attention, features, taken):
        """Every layer with the fused kernels: each layer's last residual add is done with the next layer's
        input norm (and the last one's after the loop), so the stream is summed where it is next read."""
        eps, sliding = self.config.norm_eps, self.config.sliding_layers
        delta = None
        for index, layer in enumerate(self.layers):
            if delta is None:
                normed = kernels.norm(x, layer.attn_norm.weight, eps)
            else:
                normed, x = kernels.add_norm(x, delta, layer.attn_norm.weight, eps)
            if features is not None:
                _take_features(taken, features, index, x)
            layer_rope = local_rope if local_rope is not None and sliding and sliding[index] else rope
            attended = layer.fused_attention(kernels, normed, layer_rope, cache, index, attention)
            normed, x = kernels.add_norm(x, attended, layer.mlp_norm.weight, eps)
            delta = layer.down(kernels.gated(layer.gate_up(normed), layer.act))
        return x + delta

    def _logits(self, x, attention, last, new_tokens):
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
        logits = self.lm_head(x)
        cap = self.config.final_logit_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        if self.logits_size > self.config.vocab_size:  # ids past our table: probability 0, never an argmax
            logits = F.pad(logits, (0, self.logits_size - self.config.vocab_size), value=float("-inf"))
        return logits

    def pad_vocabulary_to(self, size: int) -> None:
        """Serve as a draft for a target whose vocabulary has `size` ids, ours being its first ones: logits
        are padded with -inf to `size`, and an id past ours (the target's, fed back) reads our last row."""
        if size < self.config.vocab_size:
            raise ValueError(f"a vocabulary of {size} ids cannot hold this model's {self.config.vocab_size}")
        self.logits_size = size
