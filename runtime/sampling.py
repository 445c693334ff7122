"""Sampling settings and the distribution they define, applied identically to draft and target.

Speculative sampling is exact only if the draft's q and the target's p are the distributions each
model would really sample from, so temperature, top-k and top-p go through this one function.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specbatch.perfmodel.errors import UsageError


class SamplingError(UsageError):
    """A --sampling option that does not parse; the message is one line naming the option."""


# Below these, sampling is greedy: the limit T -> 0 (or top_p -> 0) samples the argmax, and computing it
# would divide float32 logits by a temperature that rounds to 0 (or keep a nucleus of mass that rounds to
# 0): inf and NaN probabilities. vLLM treats temperatures below 1e-5 as greedy too.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy; 0 < temperature < GREEDY_BELOW or top_p < GREEDY_BELOW is greedy too (the
    settings become temperature 0, top_k 0, top_p 1: their limit)."""

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
        if 0.0 < self.temperature < GREEDY_BELOW or self.top_p < GREEDY_BELOW:
            for name, limit in (("temperature", 0.0), ("top_k", 0), ("top_p", 1.0)):
                object.__setattr__(self, name, limit)

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
        sampling = Sampling(**fields)
    except ValueError as error:
        raise SamplingError(f"--sampling {text!r}: {error}") from None
    if sampling.greedy:  # a measurement labelled T=1e-9 would be a greedy one
        raise SamplingError(f"--sampling {text!r}: T and top_p below {GREEDY_BELOW:g} sample the argmax; write "
                            f"'greedy', or give T and top_p in [{GREEDY_BELOW:g}, ...]")
    return sampling


@dataclass(frozen=True)
class RowSampling:
    """Settings per row of a batch whose rows come from different requests (the serving engine): row r
    of every logits tensor (batch first) follows `rows[r]`. A greedy row (T = 0) gets the one-hot
    distribution at its argmax: through speculative sampling, one-hot p and q accept exactly the draft
    tokens that equal the target's argmax and resample the argmax otherwise, so a greedy row in a
    sampling batch produces its greedy tokens."""

    rows: tuple[Sampling, ...]
    greedy = False  # a batch in which every row is greedy runs with a plain Sampling() instead

    def select(self, rows: list[int]) -> RowSampling:
        return RowSampling(tuple(self.rows[r] for r in rows))

    def describe(self) -> str:
        return "per request"


class RowGenerators:
    """One torch.Generator per row: a seeded request draws its own random numbers whoever shares the
    batch (as long as it draws the same amount per step: true of chain steps, see runtime.engine)."""

    def __init__(self, generators: list[torch.Generator]):
        self.generators = list(generators)

    def select(self, rows: list[int]) -> RowGenerators:
        return RowGenerators([self.generators[r] for r in rows])


def probabilities(logits: torch.Tensor, sampling) -> torch.Tensor:
    """Softmax of `logits` (..., vocab) after temperature, top-k and top-p; float32. With a RowSampling,
    row r of `logits` (batch first) follows the row's own settings."""
    if isinstance(sampling, RowSampling):
        return torch.stack([_one_hot_argmax(row) if setting.greedy else probabilities(row, setting)
                            for row, setting in zip(logits, sampling.rows)])
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


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()


def sample(probs: torch.Tensor, generator) -> torch.Tensor:
    """One token per distribution: probs (..., vocab) -> ids (...). `generator`: a torch.Generator (or
    None) for the whole batch, or RowGenerators (row r of `probs`, batch first, draws from its own)."""
    if isinstance(generator, RowGenerators):
        return torch.stack([sample(row, g) for row, g in zip(probs, generator.generators)])
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


def uniform(shape: tuple[int, ...], generator, device) -> torch.Tensor:
    """Uniform [0, 1) numbers of `shape` (batch first) from one generator or from RowGenerators."""
    if isinstance(generator, RowGenerators):
        return torch.stack([torch.rand(tuple(shape[1:]), generator=g, device=device) for g in generator.generators])
    return torch.rand(tuple(shape), generator=generator, device=device)
