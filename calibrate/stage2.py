"""The n-gram second stage (`--stage2 FILE`): does it fit the pair, how often does it guess the draft's
tokens, and what does one query cost; filled into the profile's `stage2` (perfmodel.profile.Stage2Info).

Guess accuracy per rank r: how often the n-gram's rank-r token after (x_{j-1}, x_j) is the draft's rank-r
token at j, teacher-forced at every position of the greedy continuations acceptance is scored on. Query
cost: timed where runtime.tree_decoding queries, at QUERY_CONTEXTS contexts: host look-ups one context at a
time where tree bookkeeping stays on the host (the CPU), one batched device query over all of them elsewhere
(CUDA: device work, timed by the device clock's marks); fitted as
query_overhead_ms + n * query_ms_per_context (both clipped at 0; a term under a nanosecond, which no clock
resolves and a profile may not record, is 0).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from specbatch.perfmodel.fields import MIN_MEASURED_MS
from specbatch.perfmodel.profile import Stage2Info
from specbatch.runtime.assembly import DEMO_DRAFT, DEMO_NGRAM
from specbatch.runtime.loading import ModelSpec, load_ngram
from specbatch.runtime.ngram import NGramModel

from .acceptance import RANKS, ScoredRow
from .errors import CalibrationError
from .timing import Clock, RepetitionRule, device_timed_ms, repeat, timed_ms

QUERY_CONTEXTS = (1, 4, 16, 64, 256)  # b x (nodes of one level): 1 at b = 1 up to hundreds at large b
QUERY_CALLS_PER_SAMPLE = 10


def default_stage2(draft: str, acceptance: str | None = None) -> Path | None:
    """The bundled n-gram when `draft` (as --draft gives it) is the bundled demo draft and acceptance
    is measured (guess accuracy needs the real models and prompts); else None."""
    if acceptance is not None or not DEMO_NGRAM.is_file():
        return None
    try:
        same = Path(draft).resolve() == DEMO_DRAFT.resolve()
    except OSError:
        return None
    return DEMO_NGRAM if same else None


def stage2_for_calibration(stage2: Path | None, no_stage2: bool, draft: str | None,
                           acceptance: str | None) -> Path | None:
    """--stage2, or the bundled n-gram for the bundled draft. The profile records its absolute path and
    sha256, so the tables made from it find it from any directory (and by sha256 when it has moved)."""
    if no_stage2:
        if stage2 is not None:
            raise CalibrationError("--stage2 and --no-stage2 are mutually exclusive")
        return None
    if stage2 is not None:
        return stage2
    return default_stage2(draft or str(DEMO_DRAFT), acceptance)


def load_stage2(path: Path, target: ModelSpec) -> NGramModel:
    """Load the n-gram and check it against the target's vocabulary and tokenizer.json (when it has
    one) by `runtime.loading.load_ngram`, and that it has enough ranks to guess."""
    ngram = load_ngram(path, "--stage2", target)
    if ngram.vocab_size < RANKS:
        raise CalibrationError(f"--stage2 {path}: a vocabulary of {ngram.vocab_size} tokens has fewer than "
                               f"{RANKS} ranks to guess")
    return ngram


def _positions(rows: Sequence[ScoredRow]) -> tuple[np.ndarray, np.ndarray]:
    """Every greedy-scored position: contexts (n, 2) and the draft's top-R tokens (n, R)."""
    usable = [row for row in rows if row.draft_top is not None and len(row.agreement)]
    if not usable:
        raise CalibrationError("--stage2: no greedy continuation to measure the n-gram's guesses on "
                               "(every prompt ended at once)")
    return (np.concatenate([row.contexts for row in usable]), np.concatenate([row.draft_top for row in usable]))


def guess_accuracy(ngram: NGramModel, rows: Sequence[ScoredRow]) -> tuple[float, ...]:
    """P(the n-gram's rank-r guess == the draft's rank-r token), r = 0..R-1, over every position."""
    contexts, draft_top = _positions(rows)
    guesses = ngram.top_tokens(torch.from_numpy(contexts), RANKS).numpy()  # (n, R)
    return tuple(float(x) for x in (guesses == draft_top).mean(0))


def query_sampler(ngram: NGramModel, contexts: list[tuple[int, int]], clock: Clock = time.perf_counter,
                  device: torch.device | None = None) -> Callable[[], float]:
    """A function returning the mean time of one query over `contexts`, in ms: the runtime's host look-ups,
    or with `device` one batched `top_tokens` call there (its contexts uploaded here, once; `clock` then a
    runtime.clock.DeviceClock, or anything with its mark and elapsed_s)."""
    if device is not None:
        table = torch.tensor(contexts, dtype=torch.long, device=device)
        ngram.top_tokens(table, RANKS)  # the first query moves the n-gram's tables to the device

        def device_queries():
            for _ in range(QUERY_CALLS_PER_SAMPLE):
                ngram.top_tokens(table, RANKS)

        return lambda: device_timed_ms(device_queries, clock) / QUERY_CALLS_PER_SAMPLE
    lookup = ngram.top_tokens_host
    lookup(*contexts[0])  # the first look-up builds the host tables

    def queries():
        for _ in range(QUERY_CALLS_PER_SAMPLE):
            for u, v in contexts:
                lookup(u, v)

    return lambda: timed_ms(queries, clock) / QUERY_CALLS_PER_SAMPLE


def fit_line(contexts: Sequence[int], times_ms: Sequence[float]) -> tuple[float, float]:
    """(overhead_ms, ms_per_context) by least squares, both >= 0 (see the module docstring).

    >>> fit_line([1, 4, 16], [1.1, 1.4, 2.6])
    (1.0, 0.1)
    >>> fit_line([1, 4, 16], [0.0010003, 0.0040003, 0.0160003])  # an intercept of 0.3 ns is no overhead
    (0.0, 0.001)
    """
    x, y = np.asarray(contexts, dtype=float), np.asarray(times_ms, dtype=float)
    slope, intercept = np.polyfit(x, y, 1) if len(x) > 1 else (0.0, float(y[0]))
    if slope < 0:
        slope, intercept = 0.0, float(np.median(y))
    elif intercept < 0:
        slope, intercept = float((x * y).sum() / (x * x).sum()), 0.0
    return _recordable_ms(intercept), _recordable_ms(slope)


def _recordable_ms(value: float) -> float:
    """`value` as a profile records it: 0 below the least time a profile accepts (perfmodel.fields)."""
    return 0.0 if value < MIN_MEASURED_MS else round(float(value), 9)


def measure_stage2(ngram: NGramModel, file: str, sha256: str, rows: Sequence[ScoredRow], rule: RepetitionRule,
                   clock: Clock = time.perf_counter, device: torch.device | None = None) -> Stage2Info:
    """The profile's stage2 object: guess accuracy over `rows` (greedy), query cost (host look-ups, or with
    `device` batched queries there: see the module docstring)."""
    accuracy = guess_accuracy(ngram, rows)
    pool, _ = _positions(rows)
    medians = []
    for n in QUERY_CONTEXTS:
        contexts = [(int(u), int(v)) for u, v in np.resize(pool, (n, 2))]  # the first n positions, cycled
        medians.append(repeat(query_sampler(ngram, contexts, clock, device), rule, clock).median_ms)
    overhead_ms, per_context_ms = fit_line(QUERY_CONTEXTS, medians)
    return Stage2Info(file=file, sha256=sha256, guess_accuracy=accuracy, query_overhead_ms=overhead_ms,
                      query_ms_per_context=per_context_ms)
