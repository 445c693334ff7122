"""A draft head: one decoder layer that drafts from the target's hidden states, with its own KV cache.

EAGLE-3: the target's hidden states at a few layers (`feature_layers`) are concatenated and projected to the
hidden size (`fc`); the layer's attention reads [norm(embedding of the next token), norm(hidden)] (2 x hidden
wide) and its residual is the hidden state; the output feeds the next pass, and `lm_head(norm(output))` gives
logits over the draft vocabulary, mapped to target ids by `d2t` (target id = draft id + d2t[draft id]).
MTP: the target's normed output and the next token's embedding, each normed, are projected together
(`input_proj`); a standard decoder layer and a final norm follow, and the target's own LM head gives logits.
A target's own MTP layer (GLM-4.5's, `TARGET_MTP`) is the same pass with the target's decoder layer (a mixture of
experts), as vLLM runs it: the embedding of the token at position 0 is zeroed, the layer's output before the
final norm (`shared_head.norm`) feeds the next pass, and its own LM head (`shared_head.head`, else the target's)
gives logits from the normed output.

A head entry pairs token x_p with the hidden state at position p - 1. Its cache slot s holds the entry of
token position s + 1, so the head's cache spans what the target's does (its length is the committed tokens
less one). RoPE positions are those `speculators` trains with: slot + 1 for EAGLE-3, the slot for MTP (only
differences of positions reach the scores; the offsets keep the rounding the same as theirs).
"""
from __future__ import annotations

import torch
from torch import nn

from ..kv_cache import KVCache
from ..model import Block, _rms_norm, finish_pass, plan_pass, rope_inverse_frequencies, rope_tables
from .config import TARGET_MTP, HeadConfig


class HeadCache(KVCache):
    """The head's one-layer KV cache, and each row's last output (`hidden`, (b, hidden)): the head's state at
    the row's last committed token, from which its next draft token comes. Views and row moves carry both."""

    def __init__(self, config, batch_size: int, max_len: int, device, dtype):
        super().__init__(config, batch_size, max_len, device, dtype)
        self.hidden = torch.zeros(batch_size, config.hidden_size, device=device, dtype=dtype)

    def rows(self, start: int, count: int) -> HeadCache:
        view = super().rows(start, count)
        view.__class__ = HeadCache
        view.hidden = self.hidden.narrow(0, start, count)
        return view

    def move_row(self, source: int, destination: int) -> None:
        super().move_row(source, destination)
        self.hidden[destination] = self.hidden[source]


class DraftHead(nn.Module):
    """An EAGLE-3 or MTP head for one target (its embeddings, and for MTP its LM head, are the target's)."""

    def __init__(self, config: HeadConfig, target):
        super().__init__()
        self.head_config, self.kind = config, config.kind
        self.config = config.layer  # a one-layer model's config: what the KV cache and the step model read
        self.attention_backend = target.attention_backend
        self.logits_size = target.config.vocab_size
        d = config.hidden_size
        layer = Block(config.layer)
        self._target = (target,)  # not a submodule: its weights are the target's, not the head's
        self.own_embed: nn.Embedding | None = None
        if self.kind == "eagle3":
            q_out = layer.q_size + 2 * layer.kv_size
            layer.qkv = nn.Linear(2 * d, q_out, bias=layer.qkv.bias is not None)  # [embedding, hidden]
            self.fc = nn.Linear(config.feature_size, d, bias=False)
            self.input_norm = _rms_norm(config.layer, config.feature_size) if config.norm_before_fc else None
            self.fc_norms = (nn.ModuleList(_rms_norm(config.layer, d) for _ in config.feature_layers)
                             if config.fc_norm else None)
            self.hidden_norm = _rms_norm(config.layer, d)
            self.norm = _rms_norm(config.layer, d)
            self.lm_head = nn.Linear(d, config.draft_vocab_size, bias=False)
            self.position_offset = 1
        else:
            self.token_norm, self.hidden_norm = _rms_norm(config.layer, d), _rms_norm(config.layer, d)
            self.input_proj = nn.Linear(2 * d, d, bias=False)
            self.final_norm = _rms_norm(config.layer, d)
            self.position_offset = 0
        # a target's own MTP layer: its LM head where its checkpoint holds one unlike the target's (loading)
        self.target_mtp = config.layout == TARGET_MTP
        self.shared_head: nn.Linear | None = None
        self.layers = nn.ModuleList([layer])
        # draft id -> target id; None when the head drafts over the whole target vocabulary
        self.register_buffer("draft_to_target", None)
        inv_freq, self.rope_attention_factor = rope_inverse_frequencies(config.layer)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def set_rope_frequencies(self, device) -> None:
        """RoPE's inverse frequencies in float32 whatever the weights' dtype (as CausalLM's); after a move in dtype."""
        self.inv_freq = rope_inverse_frequencies(self.config)[0].to(device)

    @property
    def target(self):
        return self._target[0]

    @property
    def embed(self) -> nn.Embedding:
        return self.own_embed if self.own_embed is not None else self.target.embed

    @property
    def weight_device(self) -> torch.device:
        return self.layers[0].o.weight.device

    def new_cache(self, batch_size: int, max_len: int) -> HeadCache:
        weight = self.layers[0].o.weight
        return HeadCache(self.config, batch_size, max_len, weight.device, weight.dtype)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """EAGLE-3: the target's concatenated features (..., layers x hidden) -> (..., hidden)."""
        if self.input_norm is not None:
            features = self.input_norm(features)
        if self.fc_norms is not None:
            features = torch.cat([norm(part) for norm, part in zip(self.fc_norms, features.chunk(len(self.fc_norms),
                                                                                                  dim=-1))], dim=-1)
        return self.fc(features)

    def forward(self, tokens: torch.Tensor, inputs: torch.Tensor, cache: KVCache, last: int | None = None,
                new_tokens: list[int] | None = None, from_target: bool = True, tree=None):
        """One head pass: `tokens` (b, n), or packed (T,) with `new_tokens` per row as a ragged pass, on top of
        `cache`; `inputs` (..., F): the target's features at the positions before the tokens' (`from_target`),
        or the head's own outputs there (..., hidden). Returns (logits over the target's vocabulary of every
        position, or of each row's `last` ones, or None for last=0; the outputs (..., hidden) the next pass
        reads). `tree`: the tokens are a level of a drafted tree on top of in-flight slots
        (runtime.attention.TreeAttention)."""
        attention, positions = plan_pass(tokens, cache, tree, last, new_tokens, None, self.attention_backend)
        embeds = self.embed(tokens)  # (..., hidden)
        rope = rope_tables(positions + self.position_offset, self.inv_freq, self.rope_attention_factor, embeds.dtype)
        layer = self.layers[0]
        if self.kind == "eagle3":
            hidden = self.project(inputs) if from_target else inputs
            normed = self.hidden_norm(hidden)
            residual = normed if self.head_config.norm_before_residual else hidden
            x = residual + layer.attention(torch.cat([layer.attn_norm(embeds), normed], dim=-1), rope, cache, 0,
                                           attention)
            x = x + layer.mlp(layer.mlp_norm(x))
            outputs = self.norm(x) if self.head_config.norm_output else x
        else:
            if self.target_mtp:  # vLLM and SGLang zero the token's embedding at position 0
                embeds = torch.where((positions == 0)[..., None], 0.0, embeds)
            x = self.input_proj(torch.cat([self.token_norm(embeds), self.hidden_norm(inputs)], dim=-1))
            x = x + layer.attention(layer.attn_norm(x), rope, cache, 0, attention)
            x = x + layer.mlp(layer.mlp_norm(x))
            outputs = x if self.target_mtp else self.final_norm(x)
        finish_pass(cache, attention, tokens)
        if last == 0:
            return None, outputs
        if new_tokens is not None:
            chosen = outputs[attention.last_token][:, None]  # (b, 1, hidden)
        else:
            chosen = outputs if last is None else outputs[:, -last:]
        return self.logits(chosen), outputs

    def logits(self, outputs: torch.Tensor) -> torch.Tensor:
        """Logits over the target's vocabulary (-inf outside the draft vocabulary) from the head's outputs."""
        if self.kind == "mtp":
            return self.draft_logits(outputs)
        scores = self.lm_head(outputs if self.head_config.norm_output else self.norm(outputs))
        if self.draft_to_target is None:
            return scores
        full = scores.new_full((*scores.shape[:-1], self.logits_size), float("-inf"))
        return full.index_copy_(-1, self.draft_to_target, scores)

    def draft_logits(self, outputs: torch.Tensor) -> torch.Tensor:
        """The head's logits over its own draft vocabulary (tests compare them with `speculators`)."""
        if self.target_mtp:
            return (self.shared_head if self.shared_head is not None else self.target.lm_head)(self.final_norm(outputs))
        if self.kind == "mtp":
            return self.target.lm_head(outputs)
        return self.lm_head(outputs if self.head_config.norm_output else self.norm(outputs))



class HeadPasses:
    """A head's passes with a draft model's call (`passes(tokens, cache, tree, last)`), for timing them as the
    runtime runs them: one token is a drafting pass (the head's own previous output in, logits of its draft
    vocabulary out); n >= 2 tokens is the pass over a verify's k + 1 positions (the target's features in, projected
    for EAGLE-3; no logits). The inputs are random (a pass's time does not depend on their values), made once per
    shape. `head`: a DraftHead, or its CUDA graphs (runtime.cuda_graphs.GraphedHead) where the runtime graphs it."""

    def __init__(self, head):
        self.head, self.config = head, head.config
        self._inputs: dict[tuple, torch.Tensor] = {}

    def new_cache(self, batch_size: int, max_len: int) -> HeadCache:
        return self.head.new_cache(batch_size, max_len)

    def _random(self, shape: tuple) -> torch.Tensor:
        if shape not in self._inputs:
            weight = self.head.layers[0].o.weight
            generator = torch.Generator().manual_seed(len(self._inputs))
            self._inputs[shape] = torch.randn(shape, generator=generator).to(weight.device, weight.dtype)
        return self._inputs[shape]

    def __call__(self, tokens: torch.Tensor, cache: KVCache, tree=None, last: int | None = None):
        b, n = tokens.shape
        if tree is not None:  # a level of a drafted tree: the head's own outputs in, every node's logits out
            return self.head(tokens, self._random((b, n, self.head.config.hidden_size)), cache, last=None,
                             from_target=False, tree=tree)[0]
        if n == 1:
            return self.head(tokens, self._random((b, 1, self.head.config.hidden_size)), cache, last=1,
                             from_target=False)[0]
        return self.head(tokens, self._random((b, n, self.head.head_config.feature_size)), cache, last=0)[0]
