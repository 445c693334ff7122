"""The acceptance rule of a chain step, and the per-position tallies of what was accepted.

Greedy: a draft token is kept while it equals the target's argmax. Sampling: rejection sampling (accept x
with probability min(1, p(x)/q(x)), resample from the residual at the first rejection), which leaves the
output distributed exactly as the target's. Benchmarks may replace the comparison by a synthetic
acceptance probability per draft position (every pass still runs).
"""
from __future__ import annotations

from functools import lru_cache

import torch

from .kv_cache import upload
from .sampling import Sampling, probabilities, sample, uniform


def accept(draft_tokens, draft_probs, target_logits, sampling: Sampling, rng, synthetic: float | None = None):
    """How many draft tokens each row accepts (b,) and the target's token after them (b,).

    Greedy: accept while the draft token equals the target's argmax; the next token is the argmax at the
    first disagreement (or after the last draft token). Sampling: accept x with probability
    min(1, p(x)/q(x)); at the first rejection sample from norm(max(0, p - q)); if all are accepted,
    sample the bonus token from p. With `synthetic`, each draft token is accepted with that probability.
    """
    b = target_logits.shape[0]
    k = 0 if draft_tokens is None else draft_tokens.shape[1]
    rows = torch.arange(b, device=target_logits.device)
    if sampling.greedy:
        target_choice = target_logits.argmax(-1)  # (b, k+1)
        if k == 0:
            return torch.zeros(b, dtype=torch.long, device=rows.device), target_choice[:, 0]
        if synthetic is None:
            agree = draft_tokens == target_choice[:, :k]
        else:
            agree = uniform((b, k), rng, rows.device) < synthetic_threshold(synthetic, k, rows.device)
        accepted = agree.long().cumprod(1).sum(1)
        return accepted, target_choice[rows, accepted]
    p = probabilities(target_logits, sampling)  # (b, k+1, vocab)
    if k == 0:
        return torch.zeros(b, dtype=torch.long, device=rows.device), sample(p[:, 0], rng)
    u = uniform((b, k), rng, rows.device)
    if synthetic is None:
        p_draft = p[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)
        q_draft = draft_probs.gather(-1, draft_tokens[..., None]).squeeze(-1)
        agree = u * q_draft < p_draft  # u < p/q without dividing by q
    else:
        agree = u < synthetic_threshold(synthetic, k, rows.device)
    accepted = agree.long().cumprod(1).sum(1)
    p_next = p[rows, accepted]  # (b, vocab)
    if synthetic is not None:
        return accepted, sample(p_next, rng)
    q_next = torch.cat([draft_probs, torch.zeros_like(draft_probs[:, :1])], dim=1)[rows, accepted]
    residual = torch.clamp(p_next - q_next, min=0.0)  # q_next is 0 when every draft token was accepted
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_next)  # p == q up to rounding
    return accepted, sample(residual, rng)


def synthetic_threshold(synthetic: float | tuple[float, ...], k: int, device):
    """The acceptance probability of draft positions 1..k: one for all, or one per position (the last
    value for positions beyond the given ones), as a tensor that broadcasts over the rows."""
    if isinstance(synthetic, (int, float)):
        return float(synthetic)
    return _thresholds(tuple(synthetic), k, torch.device(device))


@lru_cache(maxsize=64)
def _thresholds(synthetic: tuple[float, ...], k: int, device: torch.device) -> torch.Tensor:
    return upload([synthetic[min(i, len(synthetic) - 1)] for i in range(k)], device, torch.float32)


def count_acceptance(accepted_per_position: list[int], trials_per_position: list[int], counts: list[int],
                     depth: int) -> None:
    """Add one step of draft depth `depth` to the per-position tallies, in place: a row keeping c tokens
    accepted c - 1 draft tokens, and draft token i was tried when the i - 1 before it were accepted.

    >>> accepted, trials = [], []
    >>> count_acceptance(accepted, trials, [1, 3, 2], 2)  # rows that accepted 0, 2 and 1 tokens
    >>> accepted, trials
    ([2, 1], [3, 2])
    """
    while len(trials_per_position) < depth:
        trials_per_position.append(0)
        accepted_per_position.append(0)
    stopped_at = [0] * (depth + 1)  # rows by how many draft tokens they accepted
    for c in counts:
        stopped_at[c - 1] += 1
    reached = len(counts)  # rows that accepted every draft token before position i + 1
    for i in range(depth):
        trials_per_position[i] += reached
        reached -= stopped_at[i]
        accepted_per_position[i] += reached
