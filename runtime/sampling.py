"""Sampling settings and the distribution they define, applied identically to draft and target.

Speculative sampling is exact only if the draft's q and the target's p are the distributions each
model would really sample from, so temperature, top-k and top-p go through this one function.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from perfmodel.errors import UsageError


class SamplingError(UsageError):
    """A --sampling option that does not parse; the message is one line naming the option."""


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 means greedy (argmax)
    top_k: int = 0  # 0 means no top-k filter
    top_p: float = 1.0  # 1.0 means no nucleus filter

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise UsageError(f"--temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise UsageError(f"--top-k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:  # also refuses NaN
            raise UsageError(f"--top-p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def describe(self) -> str:
        if self.greedy:
            return "greedy"
        return f"T={self.temperature:g}" + (f",top_k={self.top_k}" if self.top_k else "") + (
            f",top_p={self.top_p:g}" if self.top_p < 1.0 else "")


def parse_sampling(text: str) -> Sampling:
    """'greedy' | 'T=0.8' | 'T=0.8,top_k=50,top_p=0.9' (the form Sampling.describe() prints).

    >>> parse_sampling("T=0.8,top_p=0.9")
    Sampling(temperature=0.8, top_k=0, top_p=0.9)
    """
    if text.strip() == "greedy":
        return Sampling()
    fields: dict[str, float] = {}
    names = {"T": "temperature", "top_k": "top_k", "top_p": "top_p"}
    for part in text.split(","):
        key, _, value = part.strip().partition("=")
        if key not in names or not value:
            raise SamplingError(f"--sampling {text!r}: expected greedy or T=<temperature>[,top_k=<int>][,top_p=<p>]")
        try:
            fields[names[key]] = int(value) if key == "top_k" else float(value)
        except ValueError:
            raise SamplingError(f"--sampling {text!r}: {key}={value!r} is not a number") from None
    if not 0.0 < fields.get("temperature", 0.0) < math.inf:
        raise SamplingError(f"--sampling {text!r}: give T > 0 (or 'greedy')")
    try:
        return Sampling(**fields)
    except ValueError as error:
        raise SamplingError(f"--sampling {text!r}: {error}") from None


def probabilities(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """Softmax of `logits` (..., vocab) after temperature, top-k and top-p; float32."""
    logits = logits.float() / sampling.temperature
    if sampling.top_k and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # drop a token when the tokens ranked above it already hold top_p of the mass
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= sampling.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One token per distribution: probs (..., vocab) -> ids (...)."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])
