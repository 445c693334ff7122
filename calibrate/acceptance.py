"""Acceptance of a draft by a target, per draft position, measured on prompts (real weights only).

The estimator. Let the target continue each prompt (greedy: its argmax path, produced by the
runtime's generator with k = 0; sampling: a path sampled from the target). Then run the target and
the draft teacher-forced over prompt + continuation (one no-cache forward each) and, at every
continuation position j, with p_j and q_j the two models' next-token distributions:

    greedy:    m_j = 1 if argmax q_j == argmax p_j else 0       (the runtime's acceptance test)
    sampling:  m_j = sum_x min(p_j(x), q_j(x))                   (the exact probability that
                                                                 rejection sampling accepts the
                                                                 draft's token, not a coin flip)

A speculative step may start at any position t; its draft token i is accepted when positions
t..t+i-1 all are, so the conditional acceptance of position i (counted only when 1..i-1 were
accepted) is

    alpha_i = sum_t prod_{j=t..t+i-1} m_j  /  sum_t prod_{j=t..t+i-2} m_j

over every start t whose window t..t+i-1 lies inside the continuation; the denominator is the number
of times position i was reached (`trials`; an expectation, rounded, for sampling).

Why teacher forcing is exact for greedy: once draft tokens 1..i-1 are accepted they ARE the target's
argmax tokens, so the draft's i-th proposal is made on the target's own path, the path scored here.
For sampling it is an approximation beyond position 1: tokens accepted by rejection sampling follow
min(p, q)/beta rather than p, so the scored path is the target's, not the accepted tokens'.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from perfmodel.acceptance import extend_alphas, parse_acceptance_option
from perfmodel.errors import PerfModelError
from perfmodel.profile import AcceptanceEntry
from runtime.generator import SpeculativeGenerator
from runtime.model import CausalLM
from runtime.policy import FixedK
from runtime.sampling import Sampling, probabilities

from . import bench
from .errors import CalibrationError

TEACHER_FORCING_ROWS = 16  # rows per no-cache forward: bounds the (rows, length, vocab) logits
GENERATION_ROWS = 32  # prompts per generate() call; prompts are sorted by length so padding stays small


# ---------------------------------------------------------------- options
def parse_sampling(text: str) -> Sampling:
    """'greedy' or 'T=0.8[,top_k=50][,top_p=0.95]': the grammar `specbatch bench --sampling` reads."""
    try:
        return bench.parse_sampling(text)
    except bench.BenchError as error:
        raise CalibrationError(str(error)) from None


def parse_acceptance(text: str, max_k: int) -> tuple[float, ...]:
    """'0.8' or '0.9,0.85,0.8' -> max_k probabilities; a short list repeats its last value, as
    perfmodel does for positions beyond the measured ones."""
    try:
        values = parse_acceptance_option(text, "--acceptance")
    except PerfModelError as error:
        raise CalibrationError(str(error)) from None
    if len(values) > max_k:
        raise CalibrationError(f"--acceptance: {len(values)} values given, more than --max-k ({max_k}) positions")
    return extend_alphas(values, max_k)


def entry_fields(sampling: Sampling) -> dict:
    """The mode and settings of an acceptance entry; filters that are off are recorded as null."""
    if sampling.greedy:
        return dict(mode="greedy", temperature=None, top_k=None, top_p=None)
    return dict(mode="sampling", temperature=sampling.temperature, top_k=sampling.top_k or None,
                top_p=sampling.top_p if sampling.top_p < 1.0 else None)


def sampling_key(sampling: Sampling) -> tuple:
    """What identifies an acceptance entry in a profile: its mode and settings."""
    fields = entry_fields(sampling)
    return (fields["mode"], fields["temperature"], fields["top_k"], fields["top_p"])


def entry_key(entry: AcceptanceEntry) -> tuple:
    return (entry.mode, entry.temperature, entry.top_k, entry.top_p)


def user_entry(sampling: Sampling, per_position: tuple[float, ...]) -> AcceptanceEntry:
    return AcceptanceEntry(**entry_fields(sampling), source="user", per_position=per_position, trials=None,
                           prompts=None, prompt_count=None)


# ---------------------------------------------------------------- prompts
def read_prompts(path: Path, option: str = "--prompts") -> list[str]:
    """One prompt per line: a JSON string, or the plain line itself; every command reads prompts here.
    Errors name `option` and the file."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise CalibrationError(f"{option} {path}: not readable ({error})") from None
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            prompt = json.loads(line)
        except json.JSONDecodeError:
            prompt = line
        if not isinstance(prompt, str):
            raise CalibrationError(f"{option} {path}:{number}: a JSON line must be a string")
        prompts.append(prompt)
    if not prompts:
        raise CalibrationError(f"{option} {path}: the file holds no prompts")
    return prompts


def encode_prompts(tokenizer, prompts: list[str], max_prompt_tokens: int) -> list[list[int]]:
    """Token ids of each prompt, keeping the last `max_prompt_tokens` (the end is what the model continues)."""
    encoded = [tokenizer.encode(prompt)[-max_prompt_tokens:] for prompt in prompts]
    return [ids for ids in encoded if ids]


# ---------------------------------------------------------------- the estimator
def conditional_acceptance(agreement_rows: Sequence[Sequence[float]], max_k: int) -> tuple[list[float], list[float]]:
    """alpha_i for i = 1..max_k and the (expected) number of times each position was reached.

    `agreement_rows` holds one sequence m_j per continuation (0/1 for greedy, probabilities for
    sampling). A position never reached gets alpha 0: it cannot contribute to E(k) anyway.

    >>> conditional_acceptance([[1, 1, 0, 1]], 3)  # alpha_1 = 3/4, alpha_2 = 1/2, alpha_3 = 0/1
    ([0.75, 0.5, 0.0], [4.0, 2.0, 1.0])
    """
    accepted, reached = np.zeros(max_k), np.zeros(max_k)
    for row in agreement_rows:
        m = np.asarray(row, dtype=np.float64)
        run = np.ones(len(m))  # run[t] = prod_{j=t..t+i-2} m_j: position i is reached from start t
        for i in range(1, max_k + 1):
            starts = len(m) - i + 1  # windows t..t+i-1 inside the continuation
            if starts <= 0:
                break
            reached[i - 1] += run[:starts].sum()
            run = run[:starts] * m[i - 1:i - 1 + starts]
            accepted[i - 1] += run.sum()
    alphas = np.divide(accepted, reached, out=np.zeros(max_k), where=reached > 0)
    return [float(a) for a in alphas], [float(r) for r in reached]


def tokens_per_step(agreement_rows: Sequence[Sequence[float]], max_k: int) -> list[float]:
    """E(k) for k = 0..max_k as the runtime meets it: each step starts right where the previous one
    ended (after the target's own token), not at an arbitrary position.

    That matters: a step starts right after a disagreement, where the next token tends to be hard
    too, so alphas averaged over every start position over-count. For each k this follows the
    probability of a step starting at each position t (greedy: 0/1; sampling: m_j are acceptance
    probabilities), counting only steps whose k draft positions lie inside the continuation.

    >>> tokens_per_step([[1, 1, 0, 1]], 2)  # k=1: steps at 0 (2 tokens), 2 (1), 3 (2); k=2: at 0 (3)
    [1.0, 1.6666666666666667, 3.0]
    """
    result = [1.0]
    for k in range(1, max_k + 1):
        tokens = steps = 0.0
        for row in agreement_rows:
            m = np.asarray(row, dtype=np.float64)
            start_mass = np.zeros(len(m) + k + 2)  # probability that a step starts at position t
            start_mass[0] = 1.0
            for t in range(len(m) - k + 1):
                reach = start_mass[t]
                if reach == 0.0:
                    continue
                steps += reach
                for i in range(k):  # draft token i+1 rejected: i accepted, one from the target
                    rejected = reach * (1.0 - m[t + i])
                    start_mass[t + i + 1] += rejected
                    tokens += rejected * (i + 1)
                    reach *= m[t + i]
                start_mass[t + k + 1] += reach  # all k accepted, plus the bonus token
                tokens += reach * (k + 1)
        result.append(float(tokens / steps) if steps > 0 else float("nan"))
    return result


# ---------------------------------------------------------------- running the models
def target_continuations(target: CausalLM, prompts: list[list[int]], new_tokens: int, sampling: Sampling,
                         eos_token_ids: tuple[int, ...], seed: int) -> list[list[int]]:
    """The target's own continuation of each prompt, from the runtime's generator with k = 0."""
    generator = SpeculativeGenerator(target, None, eos_token_ids)
    order = sorted(range(len(prompts)), key=lambda r: len(prompts[r]))
    continuations: list[list[int]] = [[] for _ in prompts]
    for start in range(0, len(order), GENERATION_ROWS):
        rows = order[start:start + GENERATION_ROWS]
        result = generator.generate([prompts[r] for r in rows], new_tokens, FixedK(0), sampling, seed=seed + start)
        for r, ids in zip(rows, result.token_ids):
            continuations[r] = ids
    return continuations


def _agreement(target_logits: torch.Tensor, draft_logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """m_j for logits (n, vocab) of the two models at the same positions -> (n,)."""
    if sampling.greedy:
        return (target_logits.argmax(-1) == draft_logits.argmax(-1)).double()
    p, q = probabilities(target_logits, sampling), probabilities(draft_logits, sampling)
    return torch.minimum(p, q).sum(-1).double().clamp(max=1.0)  # float rounding can exceed 1 by ~1e-7


@torch.inference_mode()
def agreement_rows(target: CausalLM, draft: CausalLM, prompts: list[list[int]], continuations: list[list[int]],
                   sampling: Sampling) -> list[np.ndarray]:
    """Teacher-forced m_j over each non-empty continuation. Rows are right-padded (a causal model's
    positions never see the padding after them) and grouped by length so that padding stays small."""
    device = target.lm_head.weight.device
    pairs = sorted(((p, c) for p, c in zip(prompts, continuations) if c), key=lambda pc: len(pc[0]) + len(pc[1]))
    rows = []
    for start in range(0, len(pairs), TEACHER_FORCING_ROWS):
        chunk = pairs[start:start + TEACHER_FORCING_ROWS]
        width = max(len(p) + len(c) - 1 for p, c in chunk)  # the last token predicts nothing we score
        tokens = torch.zeros(len(chunk), width, dtype=torch.long, device=device)  # (rows, width)
        for r, (p, c) in enumerate(chunk):
            sequence = (p + c)[:-1]
            tokens[r, :len(sequence)] = torch.tensor(sequence, dtype=torch.long)
        target_logits, draft_logits = target(tokens), draft(tokens)  # (rows, width, vocab)
        for r, (p, c) in enumerate(chunk):
            scored = slice(len(p) - 1, len(p) - 1 + len(c))  # logits at index i predict token i + 1
            rows.append(_agreement(target_logits[r, scored], draft_logits[r, scored], sampling).cpu().numpy())
    return rows


def measure_acceptance(target: CausalLM, draft: CausalLM, prompts: list[list[int]], sampling: Sampling, max_k: int,
                       new_tokens: int, eos_token_ids: tuple[int, ...] = (), prompts_source: str | None = None,
                       seed: int = 0) -> AcceptanceEntry:
    """The measured acceptance entry of one decoding mode (see the module docstring)."""
    continuations = target_continuations(target, prompts, new_tokens, sampling, eos_token_ids, seed)
    rows = agreement_rows(target, draft, prompts, continuations, sampling)
    per_position, reached = conditional_acceptance(rows, max_k)
    per_step = tokens_per_step(rows, max_k)
    if any(np.isnan(per_step)):  # continuations shorter than max_k: no step-aligned figure for long k
        per_step = None
    return AcceptanceEntry(**entry_fields(sampling), source="measured", per_position=tuple(per_position),
                           tokens_per_step=None if per_step is None else tuple(per_step),
                           trials=tuple(int(round(r)) for r in reached), prompts=prompts_source,
                           prompt_count=len(prompts))
