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


class RowSampling:
    """Settings per row of a batch whose rows come from different requests (the serving engine): row r
    of every logits tensor (batch first) follows `rows[r]`, as tensors of one value per row (one pass over
    the batch, whatever the mix). A greedy row (T = 0) gets the one-hot distribution at its argmax: through
    speculative sampling, one-hot p and q accept exactly the draft tokens that equal the target's argmax
    and resample the argmax otherwise, so a greedy row in a sampling batch produces its greedy tokens."""

    greedy = False  # a batch in which every row is greedy runs with a plain Sampling() instead

    def __init__(self, rows: tuple[Sampling, ...]):
        self.rows = tuple(rows)
        self.top_ks = tuple(row.top_k for row in self.rows)
        self.any_top_p = any(row.top_p < 1.0 for row in self.rows)
        self._tensors: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(temperature, top_k, top_p, greedy) per row on `device`, uploaded once: a greedy row's
        temperature is 1 (its distribution is replaced), no top-k is the whole vocabulary (0 here), and
        no top-p is 2 (a bound no cumulative mass reaches, not even rounded)."""
        if device not in self._tensors:
            from .kv_cache import upload

            settings = upload([[row.temperature if not row.greedy else 1.0 for row in self.rows],
                               [float(row.top_k) for row in self.rows],
                               [row.top_p if row.top_p < 1.0 else 2.0 for row in self.rows],
                               [float(row.greedy) for row in self.rows]], device, torch.float32)
            self._tensors[device] = (settings[0].clamp_min(_TINY), settings[1].long(), settings[2].clamp_min(_TINY),
                                     settings[3].bool())
        return self._tensors[device]

    def describe(self) -> str:
        return "per request"


# splitmix64's constants as signed 64-bit integers (torch has no unsigned int64 arithmetic)
_GOLDEN, _MIX1, _MIX2 = -0x61C8864680B583EB, -0x40A7B892E31B1A47, -0x6B2FB644ECCEEE15


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function: a bijection of 64-bit integers whose output bits each depend on every
    input bit (products wrap modulo 2^64, as two's complement int64 does)."""
    x = x + _GOLDEN
    x = (x ^ _shift_right(x, 30)) * _MIX1
    x = (x ^ _shift_right(x, 27)) * _MIX2
    return x ^ _shift_right(x, 31)


class RowGenerators:
    """Random numbers per row, counter-based: row r's i-th uniform is a hash of (its request's seed, its
    offset + i), computed for the whole batch at once. So a seeded request draws the same numbers whoever
    shares its batch, as long as it draws the same amount per step (true of chain steps, see
    runtime.engine), and a batch of any size costs a few kernels per draw, not one per row. `drawn` is how
    many uniforms each row has drawn from this object (the engine adds it to the request's offset)."""

    def __init__(self, seeds: list[int], offsets: list[int], device):
        from .kv_cache import upload

        state = upload([seeds, offsets], device)
        self.keys, self.offsets = _mix64(state[0]), state[1]
        self.drawn = 0

    def __len__(self) -> int:
        return self.keys.shape[0]

    def bits(self, per_row: int) -> torch.Tensor:
        """(rows, per_row) int64 hashes, the next `per_row` of each row's stream."""
        counters = self.offsets[:, None] + self.drawn + torch.arange(per_row, device=self.keys.device)
        self.drawn += per_row
        return _mix64(self.keys[:, None] ^ _mix64(counters))


def probabilities(logits: torch.Tensor, sampling) -> torch.Tensor:
    """Softmax of `logits` (..., vocab) after temperature, top-k and top-p; float32. With a RowSampling,
    row r of `logits` (batch first) follows the row's own settings."""
    if isinstance(sampling, RowSampling):
        return _row_probabilities(logits, sampling)
    logits = _relative(logits) / max(sampling.temperature, _TINY)
    if sampling.top_k and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        # drop a token when the tokens ranked above it already hold top_p of the mass
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= max(sampling.top_p, _TINY), 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


# Settings below float32's smallest normal number act as it (they would round to 0 in float32): the
# distribution is then its limit, the argmax (temperature) or the top token (top-p), as it is just above.
_TINY = torch.finfo(torch.float32).tiny


def _relative(logits: torch.Tensor) -> torch.Tensor:
    """Logits less their maximum, in float32: the same softmax, and a temperature however small divides
    numbers <= 0 (the largest gives 0, the others -inf at worst), so the distribution tends to its limit,
    the argmax, instead of overflowing to inf - inf = NaN."""
    logits = logits.float()
    return logits - logits.max(dim=-1, keepdim=True).values


def _row_probabilities(logits: torch.Tensor, sampling: RowSampling) -> torch.Tensor:
    """`probabilities` with one setting per row, every row in the same operations (the rules above)."""
    temperature, top_k, top_p, greedy = sampling.tensors(logits.device)
    per_row = (-1,) + (1,) * (logits.dim() - 1)
    scaled = _relative(logits) / temperature.view(per_row)
    vocab = logits.shape[-1]
    filtering = [k for k in sampling.top_ks if 0 < k < vocab]
    if filtering:
        largest = scaled.topk(max(filtering), dim=-1).values  # as many as the largest top-k any row asks
        index = (top_k.clamp(1, largest.shape[-1]) - 1).view(per_row).expand(*scaled.shape[:-1], 1)
        filters = ((top_k > 0) & (top_k < vocab)).view(per_row)
        kth = torch.where(filters, largest.gather(-1, index), float("-inf"))
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if sampling.any_top_p:
        sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        sorted_probs = sorted_probs.masked_fill(mass_before >= top_p.view(per_row), 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return torch.where(greedy.view(per_row), one_hot, probs)


def sample(probs: torch.Tensor, generator) -> torch.Tensor:
    """One token per distribution: probs (..., vocab) -> ids (...), the inverse of each cumulative
    distribution at a 53-bit uniform, all on the device: nothing is read back (torch.multinomial waits for
    the device twice a draw on CUDA). `generator`: a torch.Generator (or None) for the whole batch, or
    RowGenerators (row r of `probs`, batch first, draws from its own stream). A token of probability 0 is
    never drawn."""
    cumulative = probs.double().cumsum(-1)
    u = uniform(probs.shape[:-1], generator, probs.device, torch.float64)
    drawn = torch.searchsorted(cumulative, (u * cumulative[..., -1])[..., None], right=True).squeeze(-1)
    return drawn.clamp_(max=probs.shape[-1] - 1)


def uniform(shape: tuple[int, ...], generator, device, dtype=torch.float32) -> torch.Tensor:
    """Uniform [0, 1) numbers of `shape` (batch first) from one generator or from RowGenerators."""
    if isinstance(generator, RowGenerators):
        per_row = math.prod(shape[1:])
        bits = generator.bits(per_row).view(shape)
        if dtype == torch.float64:
            return _shift_right(bits, 11).double() * 2.0 ** -53
        return _shift_right(bits, 40).float() * 2.0 ** -24
    return torch.rand(tuple(shape), generator=generator, device=device, dtype=dtype)
