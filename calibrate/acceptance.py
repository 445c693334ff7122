"""Acceptance of a draft by a target, per draft position (chains) and per depth and rank (trees), measured
on prompts with real weights.

The target continues each prompt (greedy: its argmax path; sampling: a sampled path); both models then
score prompt + continuation teacher-forced, and each position j gives m_j: argmax agreement (greedy) or
sum_x min(p_j(x), q_j(x)) (sampling: the exact probability that rejection sampling accepts). alpha_i is the
share of the steps that reach draft position i whose i-th token is accepted, over every step start.
Assumptions: teacher forcing is exact for greedy (accepted tokens are the target's own) and approximate
beyond position 1 for sampling; the per-rank table of trees treats depths as independent.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from specbatch.perfmodel.acceptance import extend_alphas, parse_acceptance_option
from specbatch.perfmodel.errors import PerfModelError
from specbatch.perfmodel.profile import AcceptanceEntry
from specbatch.perfmodel.uncertainty import ratio_standard_error
from specbatch.runtime.generator import SpeculativeGenerator
from specbatch.runtime.model import CausalLM
from specbatch.runtime.policy import FixedK
from specbatch.runtime.sampling import Sampling, SamplingError, probabilities
from specbatch.runtime.sampling import parse_sampling as parse_sampling_option

from .errors import CalibrationError

TEACHER_FORCING_ROWS = 16  # rows per no-cache forward: bounds the (rows, length, vocab) logits
GENERATION_ROWS = 32  # prompts per generate() call; prompts are sorted by length so padding stays small
RANKS = 4  # R: ranks per depth in rank_acceptance (children per tree node) and n-gram guesses scored
SAMPLING_DRAWS = 4  # Monte Carlo draws of R children per position for the sampling ranks >= 1
MC_CHUNK_VALUES = 1 << 22  # positions x draws x vocab per Monte Carlo chunk: bounds its memory


# ---------------------------------------------------------------- options
def parse_sampling(text: str) -> Sampling:
    """'greedy' or 'T=0.8[,top_k=50][,top_p=0.95]': `runtime.sampling.parse_sampling`, the grammar
    `specbatch bench --sampling` reads, with its error raised as a CalibrationError."""
    try:
        return parse_sampling_option(text)
    except SamplingError as error:
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
        counts = [step_counts(row, k) for row in agreement_rows]
        tokens, steps = sum(c[0] for c in counts), sum(c[1] for c in counts)
        result.append(float(tokens / steps) if steps > 0 else float("nan"))
    return result


def step_counts(row: Sequence[float], k: int) -> tuple[float, float]:
    """(tokens, steps) of one continuation under step-aligned k-token steps (`tokens_per_step`): the
    per-prompt figures whose spread gives E(k)'s standard error (perfmodel.uncertainty)."""
    m = np.asarray(row, dtype=np.float64)
    tokens = steps = 0.0
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
    return tokens, steps


def rank_acceptance(rank_rows: Sequence[np.ndarray], depth: int) -> tuple[list[list[float]], list[float]]:
    """The step-aligned D x R table (D = `depth`) and the (expected) times each depth was reached.

    `rank_rows` holds one (T, R) array per continuation: P_j[r] (0/1 for greedy). Steps follow the full
    R-ary tree of depth D (see the module docstring): depth d+1 is reached when the target's token at
    depth d was one of the R children; only steps whose D positions lie inside the continuation count,
    as in `tokens_per_step`. A depth never reached gets a row of zeros.

    >>> rank_acceptance([np.array([[1, 0], [0, 1], [0, 0], [1, 0]])], 2)  # ranks 0, 1, >=2, 0: one step (at 0)
    ([[1.0, 0.0], [0.0, 1.0]], [1.0, 1.0])
    """
    ranks = np.asarray(rank_rows[0]).shape[1] if len(rank_rows) else RANKS
    hits, reached = np.zeros((depth, ranks)), np.zeros(depth)
    for row in rank_rows:
        p = np.asarray(row, dtype=np.float64)
        among = p.sum(1)  # P(the target's token is one of the R children)
        start_mass = np.zeros(len(p) + depth + 2)  # probability that a step starts at position t
        start_mass[0] = 1.0
        for t in range(len(p) - depth + 1):
            reach = start_mass[t]
            if reach == 0.0:
                continue
            for d in range(depth):
                reached[d] += reach
                hits[d] += reach * p[t + d]
                start_mass[t + d + 1] += reach * (1.0 - among[t + d])  # no child matched: the target's token
                reach *= among[t + d]
            start_mass[t + depth + 1] += reach  # all accepted, plus the bonus token
    table = np.divide(hits, reached[:, None], out=np.zeros_like(hits), where=reached[:, None] > 0)
    return [[float(x) for x in row] for row in table], [float(r) for r in reached]


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


@dataclass(frozen=True)
class ScoredRow:
    """What the teacher-forced pass says about one continuation, position by position (T positions)."""

    agreement: np.ndarray  # (T,) m_j
    ranks: np.ndarray  # (T, R) P_j[r]: the target's token is the draft's rank-r child
    draft_top: np.ndarray | None  # (T, R) the draft's top-R tokens (greedy only): what the n-gram guesses
    contexts: np.ndarray  # (T, 2) the two tokens before each predicted one (-1 before the sequence)


def _greedy_ranks(target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:
    """(n, R) one-hot rank of the target's argmax among the draft's logits (argmax's tie rule: among
    equal logits the smaller id ranks first); all zeros when the rank is R or more."""
    choice = target_logits.argmax(-1, keepdim=True)  # (n, 1)
    chosen = draft_logits.gather(-1, choice)
    ids = torch.arange(draft_logits.shape[-1], device=draft_logits.device)
    rank = ((draft_logits > chosen) | ((draft_logits == chosen) & (ids < choice))).sum(-1)  # (n,)
    return torch.nn.functional.one_hot(rank.clamp(max=RANKS), RANKS + 1)[:, :RANKS].double()


def _sampled_ranks(p: torch.Tensor, q: torch.Tensor, rng: torch.Generator, draws: int = SAMPLING_DRAWS) -> torch.Tensor:
    """(n, R) P(recursive rejection sampling over R children drawn without replacement from q accepts
    child r), for distributions p, q (n, vocab): rank 0 exact, ranks >= 1 by Monte Carlo given rank 0
    rejected (module docstring)."""
    n = p.shape[0]
    exact = torch.minimum(p, q).sum(-1).clamp(max=1.0).double()  # (n,) = m_j
    target, draft = p.repeat_interleave(draws, 0), q.repeat_interleave(draws, 0)  # (n * draws, vocab)
    rejected = (draft - target).clamp(min=0.0)  # the first child's law given its rejection, unnormalised
    alive = (rejected.sum(-1) > 0).float()  # P(every earlier child rejected), for the draws' children
    child = torch.multinomial(torch.where(alive[:, None] > 0, rejected, draft), 1, generator=rng)  # (n * draws, 1)
    accepted = torch.zeros(n * draws, RANKS, device=p.device)
    for r in range(1, RANKS):
        residual = (target - draft).clamp(min=0.0)  # after the rejection of `child`, as the runtime updates
        mass = residual.sum(-1, keepdim=True)
        target = torch.where(mass > 0, residual / mass.clamp_min(1e-30), target)
        draft = draft.scatter(1, child, 0.0)
        left = draft.sum(-1, keepdim=True)
        alive = alive * (left.squeeze(1) > 0)  # support exhausted: no further child is usable
        draft = torch.where(left > 0, draft / left.clamp_min(1e-30), torch.full_like(draft, 1.0 / draft.shape[1]))
        child = torch.multinomial(draft, 1, generator=rng)
        px, qx = target.gather(1, child).squeeze(1), draft.gather(1, child).squeeze(1)
        a = (px / qx.clamp_min(1e-30)).clamp(max=1.0)  # P(child r accepted | reached)
        accepted[:, r] = alive * a
        alive = alive * (1.0 - a)
    later = accepted[:, 1:].double().view(n, draws, RANKS - 1).mean(1)  # (n, R-1) given rank 0 rejected
    return torch.cat([exact[:, None], (1.0 - exact)[:, None] * later], dim=1)


def _scored(target_logits: torch.Tensor, draft_logits: torch.Tensor, sequence: list[int], first: int,
            sampling: Sampling, rng: torch.Generator) -> ScoredRow:
    """One continuation's row from the logits (n, vocab) at its n positions; position i predicts
    sequence[first + i + 1]."""
    n = target_logits.shape[0]
    padded = torch.tensor([-1] + sequence, dtype=torch.long)
    contexts = torch.stack([padded[first:first + n], padded[first + 1:first + 1 + n]], dim=1)  # (n, 2)
    if sampling.greedy:
        agreement = (target_logits.argmax(-1) == draft_logits.argmax(-1)).double()
        ranks = _greedy_ranks(target_logits, draft_logits)
        top = draft_logits.topk(RANKS, dim=-1).indices.cpu().numpy() if draft_logits.shape[-1] >= RANKS else None
        return ScoredRow(agreement.cpu().numpy(), ranks.cpu().numpy(), top, contexts.numpy())
    p, q = probabilities(target_logits, sampling), probabilities(draft_logits, sampling)
    agreement = torch.minimum(p, q).sum(-1).double().clamp(max=1.0)  # float rounding can exceed 1 by ~1e-7
    chunk = max(1, MC_CHUNK_VALUES // (SAMPLING_DRAWS * p.shape[-1]))
    ranks = torch.cat([_sampled_ranks(p[i:i + chunk], q[i:i + chunk], rng) for i in range(0, n, chunk)])
    return ScoredRow(agreement.cpu().numpy(), ranks.cpu().numpy(), None, contexts.numpy())


@torch.inference_mode()
def score_continuations(target: CausalLM, draft: CausalLM, prompts: list[list[int]], continuations: list[list[int]],
                        sampling: Sampling, seed: int = 0) -> list[ScoredRow]:
    """Teacher-forced rows over each non-empty continuation. Rows are right-padded (a causal model's
    positions never see the padding after them) and grouped by length so that padding stays small."""
    device = target.lm_head.weight.device
    rng = torch.Generator(device=device).manual_seed(seed)  # the sampling ranks' Monte Carlo
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
            rows.append(_scored(target_logits[r, scored], draft_logits[r, scored], p + c, len(p) - 1, sampling, rng))
    return rows


def agreement_rows(target: CausalLM, draft: CausalLM, prompts: list[list[int]], continuations: list[list[int]],
                   sampling: Sampling) -> list[np.ndarray]:
    """Teacher-forced m_j over each non-empty continuation."""
    return [row.agreement for row in score_continuations(target, draft, prompts, continuations, sampling)]


def rank_sequences(rows: list[ScoredRow]) -> tuple[tuple[int, ...], ...] | None:
    """Greedy: the rank of the target's token among the draft's at every scored position, R standing for
    "R or worse" (one-hot rows of `ranks`, all zero past R). perfmodel replays tree steps on them."""
    sequences = tuple(tuple(int(r) for r in np.where(row.ranks.any(1), row.ranks.argmax(1), row.ranks.shape[1]))
                      for row in rows if len(row.ranks))
    return sequences or None


def measure_acceptance(target: CausalLM, draft: CausalLM, prompts: list[list[int]], sampling: Sampling, max_k: int,
                       new_tokens: int, eos_token_ids: tuple[int, ...] = (), prompts_source: str | None = None,
                       seed: int = 0) -> AcceptanceEntry:
    """The measured acceptance entry of one decoding mode (see the module docstring)."""
    return entry_from_rows(score(target, draft, prompts, sampling, new_tokens, eos_token_ids, seed), sampling, max_k,
                           len(prompts), prompts_source)


def score(target: CausalLM, draft: CausalLM, prompts: list[list[int]], sampling: Sampling, new_tokens: int,
          eos_token_ids: tuple[int, ...] = (), seed: int = 0) -> list[ScoredRow]:
    """The target's continuations of `prompts`, scored teacher-forced: every per-position figure."""
    continuations = target_continuations(target, prompts, new_tokens, sampling, eos_token_ids, seed)
    return score_continuations(target, draft, prompts, continuations, sampling, seed)


def entry_from_rows(rows: list[ScoredRow], sampling: Sampling, max_k: int, prompt_count: int,
                    prompts_source: str | None = None) -> AcceptanceEntry:
    agreement = [row.agreement for row in rows]
    per_position, reached = conditional_acceptance(agreement, max_k)
    per_step = tokens_per_step(agreement, max_k)
    per_step_se = counts = None
    if any(np.isnan(per_step)):  # continuations shorter than max_k: no step-aligned figure for long k
        per_step = None
    elif len(agreement) > 1:  # the prompts are the independent units: E(k)'s standard error across them
        counts = tuple(tuple(step_counts(row, k) for row in agreement) for k in range(1, max_k + 1))
        per_step_se = tuple([0.0] + [ratio_standard_error(*zip(*per_k)) for per_k in counts])
    table, depth_reached = rank_acceptance([row.ranks for row in rows], max_k)
    return AcceptanceEntry(**entry_fields(sampling), source="measured", per_position=tuple(per_position),
                           tokens_per_step=None if per_step is None else tuple(per_step),
                           tokens_per_step_se=per_step_se, step_counts_by_prompt=counts,
                           rank_acceptance=tuple(tuple(r) for r in table) if depth_reached[0] > 0 else None,
                           rank_sequences=rank_sequences(rows) if sampling.greedy else None,
                           trials=tuple(int(round(r)) for r in reached), prompts=prompts_source,
                           prompt_count=prompt_count)


def step_rank_table(ranks_by_start: Sequence[np.ndarray], depth: int, ranks: int = RANKS) -> list[list[float]]:
    """The D x R table of `rank_acceptance` from ranks that depend on where a step starts (a head's): array i holds
    (T_i, D) ints, row t the rank of the target's token at depth d of a step starting at position t (R: R or worse,
    -1: past the continuation). Greedy: a step reaches depth d + 1 when depth d's rank is below R; steps follow
    the full R-ary tree as in `rank_acceptance`.

    >>> step_rank_table([np.array([[0, 1], [2, 2], [0, 4], [-1, -1]])], 2, ranks=4)  # steps at 0 (ranks 0, 1), 3
    [[1.0, 0.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]
    """
    hits, reached = np.zeros((depth, ranks)), np.zeros(depth)
    for table in ranks_by_start:
        t = 0
        while t + depth <= len(table) and (table[t] >= 0).all():
            d = 0
            while d < depth:
                reached[d] += 1
                rank = int(table[t, d])
                if rank >= ranks:  # no child is the target's token: the step ends with it
                    break
                hits[d, rank] += 1
                d += 1
            t += d + 1  # the d accepted tokens, then the target's own
    table = np.divide(hits, reached[:, None], out=np.zeros_like(hits), where=reached[:, None] > 0)
    return [[float(x) for x in row] for row in table]


@torch.inference_mode()
def head_step_ranks(target: CausalLM, head, sequence: list[int], first: int, depth: int) -> np.ndarray:
    """(T, depth) ranks of `sequence`'s tokens among a head's drafts along it, for every step start t (committed
    = sequence[:first + t], t = 0..T-1 with T = len(sequence) - first): the head caught up on the committed
    positions from the target's hidden states, then fed the target's own next tokens, so depth d's logits are
    the ones a drafted tree has at the node holding the target's token (a tree's accepted path is the target's).
    -1 past the sequence's end."""
    device = target.lm_head.weight.device
    tokens = torch.tensor([sequence], device=device)
    _, features = target(tokens, None, features=head.head_config.feature_layers)  # (1, S, F)
    starts = list(range(first, len(sequence)))  # committed lengths
    cache = head.new_cache(len(starts), len(sequence) + depth + 1)
    counts = [c - 1 for c in starts]  # the head's entries: positions 1..c-1, each with the feature before it
    packed = torch.cat([tokens[0, 1:c] for c in starts])
    inputs = torch.cat([features[0, :c - 1] for c in starts])
    _, outputs = head(packed, inputs, cache, last=0, new_tokens=counts)
    hidden = outputs[torch.as_tensor(np.cumsum(counts) - 1, device=device)][:, None]  # (T, 1, hidden)
    logits = head.logits(hidden)[:, -1]
    result = np.full((len(starts), depth), -1, dtype=np.int64)
    for d in range(depth):
        positions = [c + d for c in starts]
        inside = torch.tensor([p < len(sequence) for p in positions], device=device)
        truth = torch.tensor([sequence[min(p, len(sequence) - 1)] for p in positions], device=device)
        chosen = logits.gather(1, truth[:, None])
        ids = torch.arange(logits.shape[1], device=device)
        rank = ((logits > chosen) | ((logits == chosen) & (ids < truth[:, None]))).sum(-1).clamp(max=RANKS)
        result[:, d] = torch.where(inside, rank, -1).cpu().numpy()
        if d + 1 < depth:
            logits, hidden = head(truth[:, None], hidden, cache, last=1, from_target=False)
            logits = logits[:, -1]
    return result


def drafted_acceptance(target: CausalLM, draft, prompts: list[list[int]], sampling: Sampling, max_k: int,
                       new_tokens: int, eos_token_ids: tuple[int, ...] = (), prompts_source: str | None = None,
                       seed: int = 0) -> AcceptanceEntry:
    """Acceptance per draft position measured as the runtime drafts: generating the prompts' continuations with
    chains of max_k (greedy, or rejection sampling), counting at each position how often it was reached and
    accepted. How a head's acceptance is measured: teacher forcing does not apply to it (it drafts token i from
    its own output at i - 1, so alpha_i is a property of the chain, not of one position); any drafter can be
    measured so, for comparison. The drafting of token i does not depend on k, so a chain of max_k measures
    every shorter chain's alphas too."""
    generator = SpeculativeGenerator(target, draft, eos_token_ids)
    accepted, trials = [0] * max_k, [0] * max_k
    ordered = sorted(prompts, key=len)
    for start in range(0, len(ordered), GENERATION_ROWS):
        stats = generator.generate(ordered[start:start + GENERATION_ROWS], new_tokens, FixedK(max_k), sampling,
                                   seed=seed + start).stats
        for i, (a, t) in enumerate(zip(stats.accepted_per_position, stats.trials_per_position)):
            accepted[i] += a
            trials[i] += t
    if not trials[0]:
        raise CalibrationError("acceptance: the prompts gave no drafting step (every continuation ended at once)")
    reached = [t for t in trials if t]
    per_position = [a / t for a, t in zip(accepted, trials) if t]
    per_position += [per_position[-1]] * (max_k - len(per_position))  # positions never reached: the last value
    rank_table = None
    if sampling.greedy and getattr(draft, "head_config", None) is not None:  # a head's trees: ranks by drafting
        continuations = target_continuations(target, prompts, new_tokens, sampling, eos_token_ids, seed)
        rank_table = tuple(tuple(row) for row in step_rank_table(
            [head_step_ranks(target, draft, prompt + continuation, len(prompt), max_k)
             for prompt, continuation in zip(prompts, continuations) if continuation], max_k))
    return AcceptanceEntry(**entry_fields(sampling), source="measured", per_position=tuple(per_position),
                           trials=tuple(reached) + (0,) * (max_k - len(reached)), prompts=prompts_source,
                           prompt_count=len(prompts), rank_acceptance=rank_table)
