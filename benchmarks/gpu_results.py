"""The GPU section of docs/results.md: our fits on vidur's published A100 timings, and on a CPU calibration.

    python benchmarks/gpu_results.py [--vidur DIR] [--cpu-profile FILE] [--acceptance A] [--out FILE] [--work DIR]

Composes a profile from vidur's Llama-2-7B per-operation A100 timings with the installed `specbatch calibrate
--from-vidur` (target Llama-2-7B; draft one layer of its own block with its LM head, an EAGLE-sized draft
vidur's folder also times; acceptance given), then measures, for each latency kind and for the kind `fit`
chooses (by cross-validation among the roofline and the monotone refinement as before, and now with the
staircase too):
- held-out pass MAPE over batch sizes: fit on b in {1, 2, 4, 8, 16, 32} (a default calibration's), predict
  every other batch size the data hold (1..128), and apart the b up to 32 (inside the grid) and above it
  (beyond);
- where the data step past b = 32 (increments of 3 % of the pass or more from one batch size to the next)
  and where the fit on b <= 32 puts its steps;
- held-out pass MAPE over contexts: each profiled context left out in turn;
- the draft's staircase continued past its token counts by the target's fit (perfmodel/token_curve.py, as `fit`
  does where the two have the same block), beside its own rows alone;
- the same held-out protocol after calibrate's refinement (calibrate/refine.py) has added the target passes it
  chooses, at a few budgets, each pass read from the data only once chosen;
- the goodput the fitted table gives up against the best chain read from the composed passes directly, at
  every batch size 1..128 and every profiled context;
- k*(b) at contexts 256 and 2048 beside Su et al.'s OPT-6.7B/125M table;
and the same held-out and goodput figures on a CPU calibration of the demo pair (--cpu-profile). Writes the
section between its markers in --out (default docs/results.md; benchmarks/results.py keeps it) and prints it.
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from specbatch.calibrate.refine import DEFAULT_BUDGET, refinement_rounds
from specbatch.perfmodel import latency as lat
from specbatch.perfmodel.acceptance import acceptance_from_profile
from specbatch.perfmodel.fit import overhead_model
from specbatch.perfmodel.jsonio import write_text_atomic
from specbatch.perfmodel.profile import ROLES, Profile, TimingRow, load_profile
from specbatch.perfmodel.strategy import StepModel
from specbatch.perfmodel.token_curve import gemm_work_ratio, share_token_curve
from specbatch.perfmodel.tree import Strategy
from specbatch.runtime.presets import PRESETS

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling scripts, however this is run
import results  # noqa: E402
from docs_sections import replace_section  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

SECTION = "gpu-data"  # this script's section of docs/results.md

VIDUR = ROOT.parent / "shared" / "gpu_data" / "vidur" / "a100" / "Llama-2-7b-hf"
CPU_PROFILE = ROOT / "data" / "profiles" / "demo-cpu.json"
TRAIN_BATCH_SIZES = (1, 2, 4, 8, 16, 32)
SU_ET_AL = {1: 7, 2: 6, 4: 4, 8: 4, 16: 3, 32: 1}  # OPT-6.7B with OPT-125M, arXiv:2310.18813
BEFORE = (lat.ROOFLINE, lat.MONOTONE)  # the kinds `fit` chose among before the staircase; now: lat.kinds_for
GOALS = {"mape": 3.0, "worst": 8.0, "loss": 1.0}  # percent
EVERY_OTHER_B = "every b not fitted"  # the protocol: fit on TRAIN_BATCH_SIZES, predict every other b
STEP_SHARE = 0.03  # one more row adds at least this share of the pass: a step (kernel_notes' threshold)
REFINE_BUDGETS = (16, 32, DEFAULT_BUDGET)  # passes the refinement may add: a few, then calibrate's default


# ---------------------------------------------------------------- fitting as `fit` does, with a choice of kinds

def fitted(shape: lat.RoleShape, points: lat.Points, kinds: Sequence[str], cv: dict | None = None) -> lat.LatencyModel:
    """The kind `fit` would choose among `kinds` (grouped cross-validation, the same rule), fitted on `points`."""
    cv = lat.cross_validate(shape, points) if cv is None else cv
    return lat.fit_latency_model(shape, points, lat.select_kind({k: v for k, v in cv.items() if k in kinds}))


def errors_pct(model: lat.LatencyModel, points: lat.Points) -> np.ndarray:
    return np.abs(lat.percent_errors(model.latency_ms(points.batch_size, points.new_tokens, points.context_len),
                                     points.latency_ms))


@dataclass(frozen=True)
class HeldOut:
    label: str
    role: str
    by_kind: dict  # kind, "before" / "now", or ALONE -> (MAPE, worst) in percent
    chosen: dict  # "before" / "now" -> the kind chosen
    worst_at: dict  # as by_kind -> (b, n, L) of the worst point
    test_points: int = 0


ALONE = "staircase, own rows alone"  # the draft's staircase without the target's token curve


@dataclass(frozen=True)
class Fits:
    """One role's fits on one training set: each kind's, and the kinds `fit` chooses among before and now."""

    by_kind: dict  # kind -> LatencyModel (the staircase with the token curve where it applies)
    chosen: dict  # "before" / "now" -> kind
    alone: lat.LatencyModel | None  # the staircase without the token curve, where it got one


def fits_on(shape: lat.RoleShape, train: lat.Points, now: Sequence[str],
            share: Callable[[lat.LatencyModel], lat.LatencyModel] | None = None) -> Fits:
    """`share` continues a staircase by another role's token curve (perfmodel/token_curve.py), as `fit` does."""
    cv = lat.cross_validate(shape, train)
    by_kind = {kind: lat.fit_latency_model(shape, train, kind) for kind in lat.KINDS}
    alone = None
    if share is not None:
        shared = share(by_kind[lat.STAIRCASE])
        if shared is not by_kind[lat.STAIRCASE]:
            alone, by_kind[lat.STAIRCASE] = by_kind[lat.STAIRCASE], shared
    chosen = {name: lat.select_kind({k: v for k, v in cv.items() if k in kinds})
              for name, kinds in (("before", BEFORE), ("now", now))}
    return Fits(by_kind, chosen, alone)


def scored(label: str, role: str, fits: Fits, test: lat.Points) -> HeldOut:
    by_kind, worst_at = {}, {}
    models = dict(fits.by_kind, **({} if fits.alone is None else {ALONE: fits.alone}))
    for kind, model in models.items():
        e = errors_pct(model, test)
        by_kind[kind] = (float(e.mean()), float(e.max()))
        i = int(np.argmax(e))
        worst_at[kind] = (int(test.batch_size[i]), int(test.new_tokens[i]), int(test.context_len[i]))
    for name, kind in fits.chosen.items():
        by_kind[name], worst_at[name] = by_kind[kind], worst_at[kind]
    return HeldOut(label, role, by_kind, dict(fits.chosen), worst_at, len(test))


def held_out(label: str, role: str, shape: lat.RoleShape, train: lat.Points, test: lat.Points,
             now: Sequence[str]) -> HeldOut:
    return scored(label, role, fits_on(shape, train, now), test)


def role_points(profile: Profile, role: str) -> tuple[lat.RoleShape, lat.Points]:
    return lat.RoleShape.from_model_info(profile.model(role)), lat.Points.from_rows(profile.timings_of(role))


def sharing(profile: Profile, target: lat.LatencyModel) -> Callable[[lat.LatencyModel], lat.LatencyModel]:
    """What `fit` does to the draft's staircase with the target's fit `target` (perfmodel/token_curve.py)."""
    return lambda model: share_token_curve(model, profile.draft, target, profile.target)


def both_roles(profile: Profile, train: dict, tests: dict) -> list[HeldOut]:
    """Fit each role on its `train` points (the draft's staircase continued by the target's fit chosen now) and
    score every (label -> role -> test points) of `tests`."""
    now = lat.kinds_for(profile.device.kind)
    target = fits_on(role_points(profile, "target")[0], train["target"], now)
    fits = {"target": target, "draft": fits_on(role_points(profile, "draft")[0], train["draft"], now,
                                               sharing(profile, target.by_kind[target.chosen["now"]]))}
    return [scored(label, role, fits[role], test[role]) for label, test in tests.items() for role in ROLES]


def gpu_held_out(profile: Profile) -> list[HeldOut]:
    points = {role: role_points(profile, role)[1] for role in ROLES}
    train = {role: np.isin(p.batch_size, TRAIN_BATCH_SIZES) for role, p in points.items()}
    top = max(TRAIN_BATCH_SIZES)
    tests = {EVERY_OTHER_B: {role: p.subset(~train[role]) for role, p in points.items()},
             "b inside the grid": {role: p.subset(~train[role] & (p.batch_size <= top)) for role, p in points.items()},
             "b beyond the grid": {role: p.subset(p.batch_size > top) for role, p in points.items()}}
    found = both_roles(profile, {role: p.subset(train[role]) for role, p in points.items()}, tests)
    for L in profile.grid.context_lens:
        left = {role: p.context_len == L for role, p in points.items()}
        found += both_roles(profile, {role: p.subset(~left[role]) for role, p in points.items()},
                            {f"L = {L} left out": {role: p.subset(left[role]) for role, p in points.items()}})
    return sorted(found, key=lambda row: ROLES.index(row.role))  # stable: each role's rows in the order above


# ---------------------------------------------------------------- the base grid and calibrate's refinement

@dataclass(frozen=True)
class Refined:
    budget: int
    added: tuple[tuple[int, int, int], ...]  # (b, n, L) of each target pass the refinement chose and was given
    unavailable: int  # chosen passes the data do not hold (none composed there)
    rows: tuple[HeldOut, ...]  # per role: every b not fitted nor refined


def refined(profile: Profile, budget: int) -> Refined:
    """The issue's protocol with calibrate's refinement (calibrate/refine.py): the base grid (b in
    TRAIN_BATCH_SIZES), then the target passes `refinement_rounds` chooses from fits of what is measured so
    far, up to `budget`, each read from the data only when chosen (a pass the data lack is recorded as not
    measurable, as calibrate records one that does not fit in memory); fit on all that, predict every other
    row of the data."""
    data = {(r.model, r.batch_size, r.new_tokens, r.context_len): r for r in profile.timings}
    state = {"profile": replace(profile, timings=tuple(r for r in profile.timings
                                                       if r.batch_size in TRAIN_BATCH_SIZES),
                                grid=replace(profile.grid, batch_sizes=TRAIN_BATCH_SIZES))}
    added, unavailable = [], 0
    for point in refinement_rounds(lambda: state["profile"], budget):
        key = (point.model, point.batch_size, point.new_tokens, point.context_len)
        row = data.get(key, TimingRow(*key, None, None, None, 0, False))
        if row.feasible:
            added.append(key[1:])
        unavailable += not row.feasible
        state["profile"] = replace(state["profile"], timings=state["profile"].timings + (row,))
    measured = {(r.model, r.batch_size, r.new_tokens, r.context_len) for r in state["profile"].timings}
    train = {role: lat.Points.from_rows(state["profile"].timings_of(role)) for role in ROLES}
    tests = {}
    for role in ROLES:
        points = role_points(profile, role)[1]
        keep = np.array([(role, int(b), int(n), int(L)) not in measured for b, n, L in
                         zip(points.batch_size, points.new_tokens, points.context_len)], dtype=bool)
        tests[role] = points.subset(keep)
    rows = both_roles(profile, train, {"every b not fitted nor refined": tests})
    return Refined(budget, tuple(added), unavailable, tuple(rows))


def where_refined(added: Sequence[tuple[int, int, int]]) -> str:
    """The passes a refinement added, by what they resolve: token counts (n > 1) and batch sizes (n = 1)."""
    tokens = sorted({(b * n, b, n, L) for b, n, L in added if n > 1})
    rows = sorted({b for b, n, _ in added if n == 1})
    parts = []
    if tokens:
        parts.append("b n = " + ", ".join(f"{t} ({b} x {n}, L = {L})" for t, b, n, L in tokens))
    if rows:
        parts.append(f"b = {', '.join(map(str, rows))} at n = 1")
    return "; ".join(parts) or "none"


def cpu_held_out(profile: Profile) -> list[HeldOut]:
    """`fit --holdout`'s split: every other interior batch size and context left out."""
    found = []
    for role in ("target", "draft"):
        shape, points = role_points(profile, role)
        test = (np.isin(points.batch_size, lat.every_other_interior(points.batch_size))
                | np.isin(points.context_len, lat.every_other_interior(points.context_len)))
        found.append(held_out("every other interior b, L", role, shape, points.subset(~test), points.subset(test),
                              lat.kinds_for(profile.device.kind)))
    return found


# ---------------------------------------------------------------- goodput against the data's own best k

def chain_choices(latency_ms: Callable, profile: Profile, b: int, L: int) -> dict[int, float]:
    """k -> goodput of the chain of k (0: none) at (b, L), with the profile's overheads and acceptance."""
    acceptance = acceptance_from_profile(next(e for e in profile.acceptance if e.mode == "greedy"))
    model = StepModel(latency_ms, overhead_model(profile), acceptance)
    return {k: model.evaluate(Strategy.from_k(k), b, L).tokens_per_s for k in range(profile.grid.max_k + 1)}


@dataclass(frozen=True)
class Loss:
    context_len: int
    batch_sizes: int
    worst_pct: float
    mean_pct: float
    where: tuple[int, int, int]  # b, the fit's k, the data's k at the worst point
    best_k: dict  # b -> (the data's k, the fit's k)


def goodput_losses(profile: Profile, models: dict[str, lat.LatencyModel], batch_sizes: Sequence[int]) -> list[Loss]:
    """At every (b, L) where the profile has every pass a chain needs: 1 - G(k chosen by the fit) / G(best k),
    both goodputs from the measured (composed) passes."""
    data = {(r.model, r.batch_size, r.new_tokens, r.context_len): r.median_ms for r in profile.timings if r.feasible}
    widths = {"target": range(1, profile.grid.max_k + 2), "draft": (1, 2)}
    losses = []
    for L in profile.grid.context_lens:
        worst, total, count, where, best_k = 0.0, 0.0, 0, (0, 0, 0), {}
        for b in batch_sizes:
            if any((role, b, n, L) not in data for role, ns in widths.items() for n in ns):
                continue
            measured = chain_choices(lambda role, bb, n, LL: data[(role, bb, n, LL)], profile, b, L)
            predicted = chain_choices(lambda role, bb, n, LL: float(models[role].latency_ms(bb, n, LL)), profile, b, L)
            k_fit = max(predicted, key=lambda k: (predicted[k], -k))
            k_data = max(measured, key=lambda k: (measured[k], -k))
            loss = 100 * (1 - measured[k_fit] / measured[k_data])
            best_k[b] = (k_data, k_fit)
            total, count = total + loss, count + 1
            if loss > worst:
                worst, where = loss, (b, k_fit, k_data)
        losses.append(Loss(L, count, worst, total / max(count, 1), where, best_k))
    return losses


@dataclass(frozen=True)
class StepsPast:
    role: str
    context_len: int
    new_tokens: int
    measured: tuple[tuple[int, float], ...]  # (b, percent): the pass at b + 1 is that much above the pass at b
    predicted: tuple[tuple[int, float], ...]  # the same read from the fit on TRAIN_BATCH_SIZES


def steps_past_grid(profile: Profile, contexts: Sequence[int]) -> list[StepsPast]:
    """Where one more row makes the pass STEP_SHARE or more dearer past b = 32, in the composed passes and in
    the staircase fitted on TRAIN_BATCH_SIZES (the draft's continued by the target's, as `fit` does), at the
    narrowest and widest pass of each role."""
    found, models = [], {}
    for role in ROLES:
        shape, points = role_points(profile, role)
        model = lat.fit_latency_model(shape, points.subset(np.isin(points.batch_size, TRAIN_BATCH_SIZES)),
                                      lat.STAIRCASE)
        model = models[role] = model if role == "target" else sharing(profile, models["target"])(model)
        data = {(int(b), int(n), int(L)): ms for b, n, L, ms in
                zip(points.batch_size, points.new_tokens, points.context_len, points.latency_ms)}
        widths = profile.grid.target_new_tokens if role == "target" else profile.grid.draft_new_tokens
        for L in contexts:
            for n in (min(widths), max(widths)):
                sizes = np.array([b for b in range(max(TRAIN_BATCH_SIZES), max(profile.grid.batch_sizes))
                                  if (b, n, L) in data and (b + 1, n, L) in data], dtype=float)
                at = np.array([data[(int(b), n, L)] for b in sizes])
                measured = np.array([data[(int(b) + 1, n, L)] for b in sizes]) - at
                predicted = model.latency_ms(sizes + 1, n, L) - model.latency_ms(sizes, n, L)
                found.append(StepsPast(role, L, n, *(tuple((int(b), 100 * float(d / ms)) for b, d, ms
                                                           in zip(sizes, rise, at) if d >= STEP_SHARE * ms)
                                                     for rise in (measured, predicted))))
    return found


def full_fits(profile: Profile, kinds: Sequence[str], cv: dict) -> dict[str, lat.LatencyModel]:
    """Each role's fit on every point, the draft's continued by the target's token curve as `fit` does."""
    models = {role: fitted(*role_points(profile, role), kinds, cv[role]) for role in ROLES}
    return dict(models, draft=sharing(profile, models["target"])(models["draft"]))


# ---------------------------------------------------------------- markdown

def _pair(value: tuple[float, float], worst_digits: int = 0) -> str:
    return f"{value[0]:.1f} / {value[1]:.{worst_digits}f}"


def held_out_table(rows: Sequence[HeldOut]) -> str:
    lines = ["| role | held out | roofline | roofline+monotone | roofline+staircase | chosen before | chosen now |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        cells = [_pair(row.by_kind[k]) for k in lat.KINDS]
        cells += [f"{_pair(row.by_kind[name])} ({row.chosen[name].replace('roofline+', '+')})"
                  for name in ("before", "now")]
        lines.append(f"| {row.role} | {row.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def loss_table(before: Sequence[Loss], now: Sequence[Loss]) -> str:
    lines = ["| context | batch sizes | before: worst (b, k fitted, k best) | before: mean | now: worst (b, k fitted, "
             "k best) | now: mean |", "|---:|---:|---:|---:|---:|---:|"]
    for old, new in zip(before, now):
        lines.append(f"| {old.context_len} | {old.batch_sizes} | {old.worst_pct:.2f} % {old.where} | "
                     f"{old.mean_pct:.2f} % | {new.worst_pct:.2f} % {new.where} | {new.mean_pct:.2f} % |")
    return "\n".join(lines)


def best_k_table(now: Sequence[Loss], contexts=(256, 2048)) -> str:
    by_context = {loss.context_len: loss.best_k for loss in now}
    shown = [L for L in contexts if L in by_context]
    columns = " | ".join(f"data, L = {L} | fitted, L = {L}" for L in shown)
    lines = [f"| b | Su et al. (OPT-6.7B/125M) | {columns} |", "|---:|---:|" + "---:|---:|" * len(shown)]
    for b in (1, 2, 4, 8, 16, 32, 64, 128):
        cells = [f"{by_context[L][b][0]} | {by_context[L][b][1]}" if b in by_context[L] else "- | -" for L in shown]
        lines.append(f"| {b} | {SU_ET_AL.get(b, '-')} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def verdict(value: float, goal: float) -> str:
    return f"{value:.1f} % (goal <= {goal:g} %: {'met' if value <= goal else 'not met'})"


def _at(where: tuple[int, int, int]) -> str:
    b, n, L = where
    return f"b = {b}, n = {n}, L = {L}: {b * n} tokens"


def goal_lines(gpu: Sequence[HeldOut], losses: Sequence[Loss], refinements: Sequence[Refined] = ()) -> str:
    lines = []
    for label in (EVERY_OTHER_B, "b inside the grid", "b beyond the grid"):
        for row in (r for r in gpu if r.label == label):
            mape, worst = row.by_kind["now"]
            lines.append(f"- {row.role}, {label}: MAPE {verdict(mape, GOALS['mape'])}, worst "
                         f"{verdict(worst, GOALS['worst'])} ({_at(row.worst_at['now'])}).")
    contexts = [r for r in gpu if r.label.startswith("L = ")]
    for role in ("target", "draft"):
        mine = [r for r in contexts if r.role == role]
        worst = max(mine, key=lambda r: r.by_kind["now"][1])
        lines.append(f"- {role}, each context left out: MAPE at most "
                     f"{verdict(max(r.by_kind['now'][0] for r in mine), GOALS['mape'])}, worst "
                     f"{verdict(worst.by_kind['now'][1], GOALS['worst'])} ({_at(worst.worst_at['now'])}).")
    for run in refinements[-1:]:
        for row in run.rows:
            mape, worst = row.by_kind["now"]
            lines.append(f"- {row.role}, {row.label}, the base grid and {len(run.added)} target passes chosen by "
                         f"the refinement (budget {run.budget}): MAPE {verdict(mape, GOALS['mape'])}, worst "
                         f"{verdict(worst, GOALS['worst'])} ({_at(row.worst_at['now'])}).")
    worst = max(losses, key=lambda loss: loss.worst_pct)
    lines.append(f"- Goodput given up by the table, every b in 1..128 and every context: at most "
                 f"{verdict(worst.worst_pct, GOALS['loss'])} (L = {worst.context_len}, b = {worst.where[0]}).")
    return "\n".join(lines)


def refined_worst(refinements: Sequence[Refined]) -> str:
    """Where the target's worst point lies at each budget, against the grid the refinement measures in."""
    places = [next(r for r in run.rows if r.role == "target").worst_at["now"] for run in refinements]
    top = max(TRAIN_BATCH_SIZES)
    if not places or any(b <= top for b, _, _ in places):
        return ""
    return (f" At every budget the target's worst point lies past b = {top}, where the refinement measures nothing "
            f"({'; '.join(f'budget {run.budget}: {_at(place)}' for run, place in zip(refinements, places))}): a "
            "budget moves it only by what the passes it added "
            "change in the fit.")


def refined_table(gpu: Sequence[HeldOut], refinements: Sequence[Refined]) -> str:
    """Held-out figures (the kinds chosen now) on the base grid alone, then with each budget's refinement."""
    plain = {row.role: row for row in gpu if row.label == EVERY_OTHER_B}
    lines = ["| budget | target passes added | where (tokens: b x n at L; batch sizes: n = 1 at every context) | "
             "target: MAPE / worst | draft: MAPE / worst | rows predicted |", "|---|---:|---|---:|---:|---:|"]
    predicted = plain["target"].test_points + plain["draft"].test_points
    lines.append(f"| none (the base grid) | 0 | - | {_pair(plain['target'].by_kind['now'], 1)} | "
                 f"{_pair(plain['draft'].by_kind['now'], 1)} | {predicted} |")
    for run in refinements:
        rows = {row.role: row for row in run.rows}
        missing = f" ({run.unavailable} more not in the data)" if run.unavailable else ""
        default = " (calibrate's)" if run.budget == DEFAULT_BUDGET else ""
        lines.append(f"| {run.budget}{default} | {len(run.added)}{missing} | {where_refined(run.added)} | "
                     f"{_pair(rows['target'].by_kind['now'], 1)} | {_pair(rows['draft'].by_kind['now'], 1)} | "
                     f"{rows['target'].test_points + rows['draft'].test_points} |")
    return "\n".join(lines)


def _steps(found: Sequence[tuple[int, float]], n: int, unit: str = "") -> str:
    return ", ".join(f"{b} ({b * n}): +{pct:.0f}{unit}" for b, pct in found) or "none"


def steps_table(steps: Sequence[StepsPast]) -> str:
    lines = ["| role | context | tokens per row | the data: a step after b (tokens), + % of the pass "
             "| the fit on b <= 32 |", "|---|---:|---:|---|---|"]
    for row in steps:
        lines.append(f"| {row.role} | {row.context_len} | {row.new_tokens} | {_steps(row.measured, row.new_tokens)} | "
                     f"{_steps(row.predicted, row.new_tokens)} |")
    return "\n".join(lines)


def steps_explained(profile: Profile, steps: Sequence[StepsPast], gpu: Sequence[HeldOut]) -> str:
    """How the steps past the grid fall against the target's learnt tile, and why the draft's rows cannot show
    its steps, from the figures above."""
    shape, points = role_points(profile, "target")
    train = points.subset(np.isin(points.batch_size, TRAIN_BATCH_SIZES))
    tile = lat.fit_latency_model(shape, train, lat.STAIRCASE).staircase.tile_tokens() or 0
    widest = max(profile.grid.target_new_tokens)
    row = next(r for r in steps if r.role == "target" and r.new_tokens == widest)

    def crossed(b: int) -> int | None:  # the multiple of the tile between b and b + 1 rows of `widest` tokens
        multiple = (b * widest // tile + 1) * tile if tile else 0
        return multiple if tile and multiple <= (b + 1) * widest else None

    hits = [crossed(b) for b, _ in row.measured if crossed(b)]
    others = [(b + 1) * widest for b, _ in row.measured if not crossed(b)]
    missing = [crossed(b) for b, _ in row.predicted if crossed(b) and crossed(b) not in hits]
    d_shape, d_points = role_points(profile, "draft")
    d_train = d_points.subset(np.isin(d_points.batch_size, TRAIN_BATCH_SIZES))
    d_model = lat.fit_latency_model(d_shape, d_train, lat.STAIRCASE)
    d_b, d_n, d_L = d_train.batch_size, d_train.new_tokens, d_train.context_len
    compute_bound = int(np.sum(d_model.roofline.compute_ms(d_shape, d_b, d_n, d_L)
                               > d_model.roofline.memory_ms(d_shape, d_b, d_n, d_L)))
    d_widest = max(profile.grid.draft_new_tokens)
    d_row = next(r for r in steps if r.role == "draft" and r.new_tokens == d_widest)
    worst = next(r for r in gpu if r.role == "target" and r.label == "b beyond the grid").worst_at["now"]
    waves = next(r for r in steps if r.role == "target" and r.new_tokens == min(profile.grid.target_new_tokens)
                 and r.context_len == max(profile.grid.context_lens))
    unseen = [(b, pct) for b, pct in waves.measured if b not in {b for b, _ in waves.predicted}]
    beyond = next(r for r in gpu if r.role == "draft" and r.label == "b beyond the grid")
    ratio = gemm_work_ratio(profile.target, profile.draft)
    if ratio is None or ALONE not in beyond.by_kind:
        shared = ("no fit of those rows alone can place or size them, and the target's cannot be lent (their "
                  "blocks differ, perfmodel/token_curve.py): the draft's figures past the grid show it.")
    else:
        alone, now = beyond.by_kind[ALONE], beyond.by_kind["now"]
        shared = (f"no fit of those rows alone can place or size them (its staircase on its own rows: "
                  f"{_pair(alone)} % held out past the grid). Its GEMMs have the target's widths (one layer of "
                  f"the target's block, and its head), so `fit` continues it past its token counts along the "
                  f"target's fit at b = {max(TRAIN_BATCH_SIZES)} and {min(profile.grid.context_lens)} cached tokens, "
                  f"scaled by their GEMM work per token ({ratio:.4f}, from the models' shapes; "
                  f"perfmodel/token_curve.py): {_pair(now)} % past the grid, the steps in the last column. That "
                  "holds for drafts made of the target's layers or of its width (EAGLE); a draft of other widths "
                  "runs other kernels and gets no curve.")
    return (f"Where the steps fall. Fitted on b <= {max(TRAIN_BATCH_SIZES)}, the target's rows reach "
            f"{int(np.max(train.batch_size * train.new_tokens))} tokens; its staircase learns a tile of {tile} tokens "
            f"and puts a step at each multiple past them. At {widest} tokens per row and {row.context_len} cached "
            f"tokens the data step at {', '.join(map(str, hits)) or 'none'} of those multiples, and also where the "
            f"tile says nothing (the pass of {', '.join(map(str, others)) or 'no'} tokens: the library's own tile "
            f"choices past the measured counts){'' if not missing else ', and not at ' + ', '.join(map(str, missing))}"
            f": the target's worst point past the grid ({_at(worst)}) sits among them. No wave width is learnt "
            f"from b = {', '.join(map(str, TRAIN_BATCH_SIZES))} (no two neighbouring batch sizes past 2), so the "
            f"attention's waves past b = {max(TRAIN_BATCH_SIZES)} (at one token per row and {waves.context_len} cached "
            f"tokens, the data's steps after b = {', '.join(f'{b} (+{pct:.0f} %)' for b, pct in unseen) or 'none'}) "
            f"are averaged into the cost of a row. The draft's rows at "
            f"b <= {max(TRAIN_BATCH_SIZES)} feed at most {int(np.max(d_b * d_n))} tokens: {compute_bound} of its "
            f"{len(d_train)} rows are compute-bound in its own roofline (fitted FLOP rate "
            f"{d_model.roofline.flops_TFLOPs:.0f} TFLOPs: no row sets it), its staircase learns "
            f"{'no' if d_model.staircase.tile_tokens() is None else 'a'} tile, and past b = {max(TRAIN_BATCH_SIZES)} "
            "its passes cross the GEMM steps its rows never reach "
            f"(after b (tokens): {_steps(d_row.measured, d_widest, ' %')} at {d_widest} tokens per row, "
            f"{d_row.context_len} cached): " + shared)


def differences(profile: Profile, target: lat.LatencyModel, now: Sequence[Loss]) -> str:
    """What differs from Su et al.'s table, with the composed figures that explain it."""
    rows = {(r.model, r.batch_size, r.new_tokens, r.context_len): r.median_ms for r in profile.timings}
    short, long = min(profile.grid.context_lens), max(profile.grid.context_lens)
    best = {loss.context_len: {b: ks[0] for b, ks in loss.best_k.items()} for loss in now}
    draft_share = 100 * rows[("draft", 1, 1, short)] / rows[("target", 1, 1, short)]
    at_32 = (rows[("target", 32, 1, short)], rows[("target", 32, 1, long)])
    verify_32 = (rows[("target", 32, best[long][32] + 1, long)] / at_32[1] - 1) * 100
    big = sorted(s.after for s in (target.staircase.steps if target.staircase else ()) if s.axis == "tokens"
                 and s.sharp and s.coefficient >= 0.1 * float(target.latency_ms(max(1.0, s.after), 1, short)))
    first = f"the step after {big[0]:g} tokens" if big else "any step of 10 % or more"

    def verify(b: int, L: int) -> str:
        tokens = b * (best[L][b] + 1)
        side = "before" if not big or tokens <= big[0] else "past"
        return f"k* = {best[L][b]}, whose verify pass of {tokens} tokens is {side} {first}"

    return (f"What differs from Su et al. and why. At b = 16 ({short} cached tokens) {verify(16, short)} (theirs: "
            f"3): this draft is one Llama-2-7B layer whose composed pass costs {draft_share:.0f} % of the target's "
            f"at b = 1 (vidur's per-operation times leave out the launch gaps between operations, which weigh most "
            f"in a small model's pass: a separate small draft costs more than this). At b = 32, "
            f"{verify(32, short)} (theirs: 1). At {long} cached tokens, {verify(32, long)}: the decode attention "
            f"reads every row's cache whatever the tokens fed (a pass of 32 rows costs {at_32[1]:.1f} ms there "
            f"against {at_32[0]:.1f} ms at {short}), "
            f"so that verify pass adds only {verify_32:.0f} % to a pass of one token. The fitted target's steps of "
            f"10 % or more are past {', '.join(f'{a:g}' for a in big) or 'none'} tokens.")


def cpu_staircase(cpu: Sequence[HeldOut]) -> str:
    """The staircase's held-out MAPE on the CPU profile beside the chosen kind's."""
    return "held out, the staircase would give " + ", ".join(
        f"{r.by_kind[lat.STAIRCASE][0]:.1f} % for the {r.role} (chosen: {r.by_kind['now'][0]:.1f} %)" for r in cpu)


def render(conditions: str, command: str, seconds: float, gpu: Sequence[HeldOut], before: Sequence[Loss],
           now: Sequence[Loss], cpu_conditions: str, cpu: Sequence[HeldOut], cpu_before: Sequence[Loss],
           cpu_now: Sequence[Loss], differences: str, steps: Sequence[StepsPast], explained: str,
           refinements: Sequence[Refined] = ()) -> str:
    return f"""## The GPU regime, from published timings

Written by `python benchmarks/gpu_results.py` ({seconds:.0f} s here): {conditions}

```bash
{command}
```

**Held-out pass MAPE / worst point, percent** (the kind `fit` chooses by cross-validation in the last two
columns: among the roofline and the monotone refinement before, with the staircase now on a GPU profile; the
draft's staircase continued past its token counts by the target's fit, as `fit` now does, below).
Batch sizes: fitted on b = {', '.join(map(str, TRAIN_BATCH_SIZES))}, every other b the data hold predicted
(all of them, then apart those inside the grid and those past it); contexts: each left out in turn:

{held_out_table(gpu)}

**Where one more row makes the pass {100 * STEP_SHARE:.0f} % dearer or more past b = {max(TRAIN_BATCH_SIZES)}**,
in the composed passes and in the staircase fitted on b = {', '.join(map(str, TRAIN_BATCH_SIZES))}, at the
narrowest and widest pass of each role:

{steps_table(steps)}

{explained}

**Calibration that looks for steps** (calibrate/refine.py, what `calibrate` runs on a GPU): the base grid
(b = {', '.join(map(str, TRAIN_BATCH_SIZES))}), then, round after round, a target pass in the middle of every gap
where the staircase fitted to what is measured so far ramps a step of 3 % of the pass or more (a token count
at the smallest context; a batch size at one token per row and every context), up to a budget of passes, each
read from the data only once chosen. Fitted on all of it (the draft continued by the target's fit as above),
every other row the data hold predicted; the chosen passes are no longer held out. The refinement stays
within the grid's batch sizes: past them (b > {max(TRAIN_BATCH_SIZES)}) it measures nothing.{refined_worst(refinements)}

{refined_table(gpu, refinements)}

**Goodput the fitted table gives up** against the best chain read from the composed passes themselves
(both goodputs from the composed passes; same acceptance, no step overhead), every batch size 1..128:

{loss_table(before, now)}

**The best k per batch size** (now), read from the composed passes (data) and chosen by the fit:

{best_k_table(now)}

Against the goals:

{goal_lines(gpu, now, refinements)}

{differences}

**The same on a CPU calibration** ({cpu_conditions}): held-out pass MAPE / worst, and the goodput given
up at the measured batch sizes. On a CPU `fit` does not offer the staircase (a shared CPU's slow spells
last a grid cell's points and look like steps), so its choices are the ones it made before; {cpu_staircase(cpu)}:

{held_out_table(cpu)}

{loss_table(cpu_before, cpu_now)}
"""


# ---------------------------------------------------------------- running

def compose(vidur: Path, acceptance: str, max_batch: int, work: Path) -> tuple[Path, str]:
    """The imported profile, through the installed command as a user runs it; (its path, the command)."""
    draft = work / "draft-one-layer.json"
    draft.write_text(json.dumps(dict(PRESETS["llama-2-7b"], num_hidden_layers=1)))
    command = results.specbatch_command()
    args = ["calibrate", "--from-vidur", str(vidur), "--target", "llama-2-7b", "--draft", str(draft),
            "--acceptance", acceptance, "-o", str(work / "profile.json"), "--force"]
    shown = ["<vidur folder>" if a == str(vidur) else "draft.json" if a == str(draft) else
             "profile.json" if a == str(work / "profile.json") else a for a in args]
    if max_batch != 128:
        args += ["--batch-sizes", ",".join(str(b) for b in range(1, max_batch + 1))]
        shown += ["--batch-sizes", f"1,2,...,{max_batch}"]
    done = subprocess.run([str(command), *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise results.ResultsError(f"`specbatch {shlex.join(args)}` failed: {done.stderr.strip()}")
    return work / "profile.json", "specbatch " + shlex.join(shown)


def write_section(out: Path, section: str) -> None:
    """Replace the gpu-data section of `out`, or append it (benchmarks/docs_sections.py)."""
    text = out.read_text() if out.is_file() else ""
    write_text_atomic(out, replace_section(text, SECTION, section.rstrip()))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vidur", type=Path, default=VIDUR, help=f"vidur's model folder (default: {VIDUR})")
    parser.add_argument("--cpu-profile", type=Path, default=CPU_PROFILE, help="a CPU calibration of the demo pair "
                        f"(default: {CPU_PROFILE.relative_to(ROOT)})")
    parser.add_argument("--acceptance", default="0.8", help="the pair's acceptance per draft position (default 0.8)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results.md", help="the file whose GPU section "
                        "is written (default docs/results.md)")
    parser.add_argument("--max-batch", type=int, default=128, help="compose and tabulate batch sizes 1..this "
                        "(default 128)")
    parser.add_argument("--work", type=Path, help="folder for the composed profile (default: a temporary one)")
    args = parser.parse_args(argv)
    try:
        return _main(args)
    except results.ResultsError as error:
        print(f"benchmarks/gpu_results.py: {error}", file=sys.stderr)
        return 1


def _main(args: argparse.Namespace) -> int:
    if not (args.vidur / "mlp.csv").is_file():
        raise results.ResultsError(f"--vidur {args.vidur}: no mlp.csv there")
    if not args.cpu_profile.is_file():
        raise results.ResultsError(f"--cpu-profile {args.cpu_profile}: no such file")
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="specbatch-gpu-")) if args.work is None else args.work
    work.mkdir(parents=True, exist_ok=True)
    if not 33 <= args.max_batch <= 128:
        raise results.ResultsError(f"--max-batch {args.max_batch}: from 33 (past the b <= 32 fits) to 128 (vidur's)")
    path, command = compose(args.vidur, args.acceptance, args.max_batch, work)
    profile = load_profile(path)
    gpu = gpu_held_out(profile)
    contexts = sorted({min(profile.grid.context_lens), max(profile.grid.context_lens)})
    steps = steps_past_grid(profile, contexts)
    cv = {role: lat.cross_validate(*role_points(profile, role)) for role in ("target", "draft")}
    batch_sizes = range(1, args.max_batch + 1)
    before = goodput_losses(profile, full_fits(profile, BEFORE, cv), batch_sizes)
    fits_now = full_fits(profile, lat.kinds_for(profile.device.kind), cv)
    now = goodput_losses(profile, fits_now, batch_sizes)
    cpu_profile = load_profile(args.cpu_profile)
    cpu_cv = {role: lat.cross_validate(*role_points(cpu_profile, role)) for role in ("target", "draft")}
    cpu = cpu_held_out(cpu_profile)
    cpu_sizes = cpu_profile.grid.batch_sizes
    cpu_before = goodput_losses(cpu_profile, full_fits(cpu_profile, BEFORE, cpu_cv), cpu_sizes)
    cpu_now = goodput_losses(cpu_profile, full_fits(cpu_profile, lat.kinds_for(cpu_profile.device.kind), cpu_cv),
                             cpu_sizes)
    grid = profile.grid
    conditions = (f"vidur's per-operation A100 timings of Llama-2-7B (fp16, one GPU), composed by `calibrate "
                  f"--from-vidur` into {len(profile.timings)} passes (batch sizes {grid.batch_sizes[0]}-"
                  f"{grid.batch_sizes[-1]}, contexts {', '.join(map(str, grid.context_lens))}, verify passes of "
                  f"1-{grid.max_k + 1} tokens; {profile.composition.padded_rows} at a token count read from the next "
                  f"profiled one); left out: {'; '.join(profile.composition.left_out)}. Target Llama-2-7B, draft "
                  f"one Llama-2-7B layer with its LM head, acceptance {args.acceptance} per position (given), "
                  f"k = 0..{grid.max_k}.")
    noise = cpu_profile.noise
    threads = cpu_profile.device.cpu_threads
    cpu_conditions = (f"the demo pair on {cpu_profile.device.name}, {threads} thread{'s' if threads > 1 else ''}, "
                      f"batch sizes {', '.join(map(str, cpu_sizes))}, contexts "
                      f"{', '.join(map(str, cpu_profile.grid.context_lens))}"
                      + (f"; its reference pass lay {100 * noise.floor_mape:.0f} % from its own median on average"
                         if noise is not None else ""))
    refinements = [refined(profile, budget) for budget in REFINE_BUDGETS]
    section = render(conditions, "python benchmarks/gpu_results.py    # runs: " + command, time.monotonic() - started,
                     gpu, before, now, cpu_conditions, cpu, cpu_before, cpu_now,
                     differences(profile, fits_now["target"], now), steps, steps_explained(profile, steps, gpu),
                     refinements)
    write_section(args.out, section)
    print(section)
    print(f"wrote the GPU section of {args.out}; the composed profile is {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
