"""What `table` and `query` say about kernel steps near a choice.

The verify pass of a chain of k feeds b * (k + 1) tokens; a GEMM tile step in the target's token count
(`perfmodel.staircase`) makes the last token of a chain expensive exactly when it crosses the step. A choice
whose verify pass is past a step that k - 1's is not sits on the step's edge: its lead over k - 1 is what
the step leaves, and a step measured slightly off moves the choice. A verify pass inside a gap where the
fit found a step it cannot place is interpolated. Both are said, with the goodput k - 1 gives up.
"""
from __future__ import annotations

from dataclasses import dataclass

from .staircase import ROWS, ROWS_CONTEXT, TOKENS, KernelStep
from .tree import Strategy, chain

MIN_STEP_SHARE = 0.03  # a step up by less than 3 % of the pass is within a calibration's noise
CLOSE_CALL = 0.02  # k - 1 within 2 % of the choice: a step measured that much off would swap them
MAX_NOTES = 8  # per table: the rest are counted (query shows any one batch size's)


@dataclass(frozen=True)
class StepEdge:
    """A chain's verify pass at (b, L) past a token step, or inside an unresolved gap (`interpolating`)."""

    batch_size: int
    context_len: int
    k: int
    step: KernelStep
    share: float  # the step's height over k - 1's verify pass time (0 for a gap)
    behind: float  # 1 - G(k - 1) / G(k): what k - 1 gives up (negative: k - 1 is ahead)
    interpolating: bool


def _previous(strategy: Strategy) -> Strategy:
    return Strategy(None) if strategy.k == 1 else Strategy(chain(strategy.k - 1), strategy.stage2)


def _target_staircase(fitted):
    """The target's learnt kernel steps; None without them, and for an engine's model (whole steps, no
    pass latencies: perfmodel/engine_steps.py)."""
    target = fitted.roles.get("target")
    return None if target is None else target.model.staircase


def step_edge(fitted, model, strategy: Strategy, batch_size: int, context_len: int) -> StepEdge | None:
    """The edge a chain (with or without the second stage) at (b, L) sits on, if any; `model` is the
    strategy.StepModel the choice was made with. Trees, no speculation and fits without steps: None."""
    staircase = _target_staircase(fitted)
    if staircase is None or strategy.kind != "chain" or strategy.k < 1:
        return None
    b, k = batch_size, strategy.k
    tokens = b * (k + 1)
    box = fitted.roles["target"].model.box
    if box is not None and not box.batch_size[0] <= b <= box.batch_size[1]:
        return None  # beyond the measured batch sizes no step is known
    gap = staircase.interpolating_gap(tokens, b, axes=(TOKENS,))
    found = None
    if gap is not None:
        found = (gap, 0.0, True)
    else:
        before = float(fitted.latency_ms("target", b, k, context_len))
        for step in staircase.steps:
            if (step.axis == TOKENS and step.sharp and step.coefficient >= MIN_STEP_SHARE * before
                    and b * k <= step.after < tokens):
                found = (step, step.coefficient / before, False)
                break
    if found is None:
        return None
    chosen = model.evaluate(strategy, b, context_len).tokens_per_s
    previous = model.evaluate(_previous(strategy), b, context_len).tokens_per_s
    return StepEdge(b, context_len, k, found[0], found[1], 1.0 - previous / chosen, found[2])


def _span(first: float, last: float, fmt: str) -> str:
    return fmt.format(first) if fmt.format(first) == fmt.format(last) else f"{fmt.format(first)}-{fmt.format(last)}"


def describe(first: StepEdge, last: StepEdge | None = None, behind: tuple[float, float] | None = None) -> str:
    """'k = 4 at b = 32 (context 512): its verify pass of 160 tokens is past the step after 128 tokens
    (+45 %); k = 3 (128 tokens) is 0.4 % behind'; over a run of batch sizes from `first` to `last`, whose
    k - 1 gives up between behind[0] and behind[1]."""
    last = last or first
    k, b0, b1 = first.k, first.batch_size, last.batch_size
    span = "b = " + _span(b0, b1, "{}")
    behind = behind or (first.behind, first.behind)
    if behind[0] >= 0:
        lead = f"is {_span(100 * behind[0], 100 * behind[1], '{:.1f}')} % behind"
    elif behind[1] <= 0:
        lead = f"is {_span(-100 * behind[1], -100 * behind[0], '{:.1f}')} % ahead"
    else:
        lead = f"is within {100 * max(-behind[0], behind[1]):.1f} %"
    lead = f"k = {k - 1} ({_span(b0 * k, b1 * k, '{}')} tokens) {lead}"
    verify = _span(b0 * (k + 1), b1 * (k + 1), "{}")
    where = f"k = {k} at {span} (context {first.context_len}): its verify pass of {verify} tokens"
    if first.interpolating:
        return (f"{where} lies between the measured {first.step.after:g} and {first.step.until:g} tokens, where "
                f"the fit found a step it cannot place: interpolating ({lead}; calibrate --refine measures there)")
    return f"{where} is past the step after {first.step.after:g} tokens (+{100 * first.share:.0f} %); {lead}"


def table_step_notes(fitted, table, model) -> list[str]:
    """One note per run of consecutive batch sizes (per bucket) whose choice sits at the same step's edge
    with k - 1 a close call, with the range of what k - 1 gives up over the run; at most MAX_NOTES."""
    notes = []
    for bucket in table.buckets:
        runs: list[list] = []  # [first edge, last edge, least behind, most behind] of each run
        for entry in bucket.entries:
            edge = step_edge(fitted, model, entry.chosen(), entry.batch_size, bucket.context_len)
            if edge is None or (not edge.interpolating and abs(edge.behind) > CLOSE_CALL):
                continue
            run = runs[-1] if runs else None
            if run and run[1].batch_size == edge.batch_size - 1 and (run[1].k, run[1].step) == (edge.k, edge.step):
                run[1:] = [edge, min(run[2], edge.behind), max(run[3], edge.behind)]
            else:
                runs.append([edge, edge, edge.behind, edge.behind])
        notes += [describe(first, last, (low, high)) for first, last, low, high in runs]
    if len(notes) > MAX_NOTES:
        notes = notes[:MAX_NOTES] + [f"... and {len(notes) - MAX_NOTES} more choices at a kernel step's edge "
                                     "(query --batch-size B --context-len L says which)"]
    return notes


def row_gap_notes(fitted, batch_size: int | None = None) -> list[str]:
    """The target's steps in the batch size (attention waves) that the fit could only ramp across a gap: every
    such gap (a table), or the one holding `batch_size` (a query)."""
    staircase = _target_staircase(fitted)
    if staircase is None:
        return []
    gaps = sorted({(s.after, s.until) for s in staircase.steps if s.axis in (ROWS, ROWS_CONTEXT) and not s.sharp})
    if batch_size is not None:
        gaps = [(a, z) for a, z in gaps if a < batch_size < z]
    if not gaps:
        return []
    spans = ", ".join(f"{a:g} and {z:g}" for a, z in gaps)
    return [f"the target's fit found a step in the batch size it cannot place between the measured {spans}: batch "
            "sizes inside are interpolated (calibrate --refine measures there)"]
