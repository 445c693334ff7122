"""Greedy losslessness per dtype, said precisely: in float32 speculative decoding equals plain decoding token
for token; in bfloat16 and float16 the verify pass (k + 1 tokens a row) and plain decoding's pass (one token)
run differently shaped kernels whose rounding differs, so where the target's two best logits lie within
that rounding the two may pick different tokens and part there. A first divergence is lossless only at
such a near tie: the plain run's logits, at the position where the rows part, give the speculative run's
token within ROUNDING_ULPS units in the last place of the dtype at the logits' scale."""
from __future__ import annotations

import torch

ROUNDING_ULPS = 8  # units in the last place of the logits' magnitude: a near tie in that dtype


def first_divergence(expected: list[int], found: list[int]) -> int | None:
    """The first position where two token lists differ (None when one is a prefix of the other)."""
    return next((i for i, (a, b) in enumerate(zip(expected, found)) if a != b), None)


@torch.inference_mode()
def tie_gap(target, prompt: list[int], plain: list[int], position: int, other_token: int) -> tuple[float, float]:
    """(logit of the plain token - logit of `other_token`, near 0 either way at a tie; the dtype's rounding at the
    logits' scale) at `position` of the plain continuation, from one uncached pass over prompt + plain[:position]."""
    tokens = torch.tensor([prompt + plain[:position]], device=target.lm_head.weight.device)
    logits = target(tokens)[0, -1].float()
    gap = float(logits[plain[position]] - logits[other_token])
    scale = float(logits.abs().max())
    return gap, ROUNDING_ULPS * torch.finfo(target.lm_head.weight.dtype).eps * max(scale, 1.0)


def divergences_at_near_ties(target, prompts: list[list[int]], plain: list[list[int]],
                             speculative: list[list[int]]) -> tuple[int, list[str]]:
    """How many rows part from plain decoding, and a line for each that parts away from a near tie."""
    parted, bad = 0, []
    for row, (prompt, expected, found) in enumerate(zip(prompts, plain, speculative)):
        position = first_divergence(expected, found)
        if position is None:
            assert len(expected) == len(found), (row, expected, found)
            continue
        parted += 1
        gap, rounding = tie_gap(target, prompt, expected, position, found[position])
        if abs(gap) > rounding:  # the uncached pass rounds differently again: a tie either way
            bad.append(f"row {row} parts at token {position}: logit gap {gap:.4g} beyond rounding {rounding:.4g}")
    return parted, bad


@torch.no_grad()
def naive_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Argmax decoding with a full forward pass over the whole sequence at every token (no cache)."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]
