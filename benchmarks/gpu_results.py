"""The GPU section of docs/results.md: `fit`'s held-out errors and table on vidur's published A100 timings
of Llama-2-7B, and the same on a CPU calibration of the demo pair.

    python benchmarks/gpu_results.py [--vidur DIR] [--cpu-profile FILE] [--acceptance A] [--out FILE] [--work DIR]

Composes a profile with `specbatch calibrate --from-vidur` (draft: one layer of the target's block with its LM
head), fits it on b in {1, 2, 4, 8, 16, 32} and predicts every other batch size (1..128) and each context left
out, with the scoring `fit --holdout` uses (perfmodel.latency.held_out_report); then calibrate's refinement
(calibrate/refine.py) at a few budgets, the goodput the fitted table gives up against the data's best chain,
and k*(b) beside Su et al.'s table. Writes the section between its markers in --out and prints it.
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
from specbatch.perfmodel.fit import fit_role, overhead_model, with_token_curve
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
GOALS = {"mape": 3.0, "worst": 8.0, "loss": 1.0}  # percent
EVERY_OTHER_B = "every b not fitted"  # fit on TRAIN_BATCH_SIZES, predict every other b
STEP_SHARE = 0.03  # one more row adds at least this share of the pass: a step (kernel_notes' threshold)
REFINE_BUDGETS = (16, 32, DEFAULT_BUDGET)  # passes the refinement may add: a few, then calibrate's default


# ---------------------------------------------------------------- held out, scored as `fit --holdout` scores

@dataclass(frozen=True)
class HeldOut:
    label: str
    role: str
    report: lat.HoldoutReport  # perfmodel.latency.held_out_report on this split
    alone: tuple[float, float] | None = None  # the draft's staircase without the target's token curve

    @property
    def chosen(self) -> tuple[float, float]:
        """MAPE and worst |error| in percent of the kind `fit` chooses."""
        return self.report.mape_pct, self.report.max_error_pct

    @property
    def worst_at(self) -> tuple[int, int, int]:
        point = self.report.worst[0]
        return point.batch_size, point.new_tokens, point.context_len

    @property
    def test_points(self) -> int:
        return self.report.test_points


def role_points(profile: Profile, role: str) -> tuple[lat.RoleShape, lat.Points]:
    return lat.RoleShape.from_model_info(profile.model(role)), lat.Points.from_rows(profile.timings_of(role))


def sharing(profile: Profile, target: lat.LatencyModel) -> Callable[[lat.LatencyModel], lat.LatencyModel]:
    """What `fit` does to the draft's staircase with the target's fit `target` (perfmodel/token_curve.py)."""
    return lambda model: share_token_curve(model, profile.draft, target, profile.target)


def _alone(shape: lat.RoleShape, train: lat.Points, test: lat.Points) -> tuple[float, float]:
    model = lat.fit_latency_model(shape, train, lat.STAIRCASE)
    errors = np.abs(lat.percent_errors(model.latency_ms(test.batch_size, test.new_tokens, test.context_len),
                                       test.latency_ms))
    return float(errors.mean()), float(errors.max())


def both_roles(profile: Profile, train: dict, tests: dict) -> list[HeldOut]:
    """Each role fitted on its `train` points and scored on every (label -> role -> test points) of `tests`; the
    draft's models continued by the target's chosen fit, as `fit` does."""
    kinds = lat.kinds_for(profile.device.kind)
    shapes = {role: role_points(profile, role)[0] for role in ROLES}
    target_kind = lat.select_kind(lat.cross_validate(shapes["target"], train["target"], kinds=kinds))
    share = sharing(profile, lat.fit_latency_model(shapes["target"], train["target"], target_kind))
    found = []
    for label, test in tests.items():
        for role in ROLES:
            adapt = share if role == "draft" else None
            report = lat.held_out_report(shapes[role], train[role], test[role], kinds, adapt=adapt)
            shared = adapt is not None and lat.STAIRCASE in kinds and gemm_work_ratio(profile.target, profile.draft)
            alone = _alone(shapes[role], train[role], test[role]) if shared else None
            found.append(HeldOut(label, role, report, alone))
    return found


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


def cpu_held_out(profile: Profile) -> list[HeldOut]:
    """`fit --holdout` itself: every other interior batch size and context left out."""
    kinds = lat.kinds_for(profile.device.kind)
    return [HeldOut("every other interior b, L", role, lat.evaluate_holdout(*role_points(profile, role), role, kinds))
            for role in ROLES]


def fitted_models(profile: Profile) -> dict[str, lat.LatencyModel]:
    """Each role's model as `fit` makes it from the isolated passes, the draft's continued by the target's."""
    return {role: fit.model for role, fit in
            with_token_curve({role: fit_role(profile, role, False) for role in ROLES}, profile).items()}


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


# ---------------------------------------------------------------- markdown

def _pair(value: tuple[float, float], worst_digits: int = 0) -> str:
    return f"{value[0]:.1f} / {value[1]:.{worst_digits}f}"


def held_out_table(rows: Sequence[HeldOut]) -> str:
    """Held-out MAPE of every kind `fit` offers on the device, and the one it chooses with its worst point."""
    lines = ["| role | held out | roofline | roofline+monotone | roofline+staircase | chosen: MAPE / worst |",
             "|---|---|---:|---:|---:|---|"]
    for row in rows:
        by_kind = row.report.mape_pct_by_kind
        cells = [f"{by_kind[kind]:.1f}" if kind in by_kind else "-" for kind in lat.KINDS]
        kind = row.report.kind.replace("roofline+", "+")
        lines.append(f"| {row.role} | {row.label} | " + " | ".join(cells) + f" | {_pair(row.chosen)} ({kind}) |")
    return "\n".join(lines)


def loss_table(losses: Sequence[Loss]) -> str:
    lines = ["| context | batch sizes | worst (b, k fitted, k best) | mean |", "|---:|---:|---:|---:|"]
    lines += [f"| {loss.context_len} | {loss.batch_sizes} | {loss.worst_pct:.2f} % {loss.where} | "
              f"{loss.mean_pct:.2f} % |" for loss in losses]
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
    return f"{value:.1f} % {'met' if value <= goal else 'not met'}"


def _at(where: tuple[int, int, int]) -> str:
    b, n, L = where
    return f"b = {b}, n = {n}, L = {L} ({b * n} tokens)"


def goal_table(gpu: Sequence[HeldOut], losses: Sequence[Loss], refinements: Sequence[Refined] = ()) -> str:
    """Each held-out figure against its goal, and the goodput the table gives up against its own."""
    rows = [(f"{row.role}, {label}", row.chosen, row.worst_at) for label in (EVERY_OTHER_B, "b inside the grid",
            "b beyond the grid") for row in gpu if row.label == label]
    for role in ROLES:
        mine = [r for r in gpu if r.label.startswith("L = ") and r.role == role]
        worst = max(mine, key=lambda r: r.chosen[1])
        rows.append((f"{role}, each context left out (the largest)", (max(r.chosen[0] for r in mine), worst.chosen[1]),
                     worst.worst_at))
    for run in refinements[-1:]:
        rows += [(f"{row.role}, refined (budget {run.budget}, {len(run.added)} target passes added), every b not "
                  "fitted nor refined", row.chosen, row.worst_at) for row in run.rows]
    lines = [f"| held out | MAPE (goal <= {GOALS['mape']:g} %) | worst (goal <= {GOALS['worst']:g} %) | worst point |",
             "|---|---:|---:|---|"]
    lines += [f"| {name} | {verdict(mape, GOALS['mape'])} | {verdict(worst, GOALS['worst'])} | {_at(at)} |"
              for name, (mape, worst), at in rows]
    worst = max(losses, key=lambda loss: loss.worst_pct)
    lines += ["", f"Goodput given up by the table, every b in 1..128 and every context: at most "
              f"{worst.worst_pct:.1f} % (goal <= {GOALS['loss']:g} %: "
              f"{'met' if worst.worst_pct <= GOALS['loss'] else 'not met'}; L = {worst.context_len}, "
              f"b = {worst.where[0]})."]
    return "\n".join(lines)


def refined_table(gpu: Sequence[HeldOut], refinements: Sequence[Refined]) -> str:
    """Held-out figures (the kind `fit` chooses) on the base grid alone, then with each budget's refinement."""
    plain = {row.role: row for row in gpu if row.label == EVERY_OTHER_B}
    lines = ["| budget | target passes added | where (tokens: b x n at L; batch sizes: n = 1 at every context) | "
             "target: MAPE / worst | draft: MAPE / worst | rows predicted |", "|---|---:|---|---:|---:|---:|"]
    predicted = plain["target"].test_points + plain["draft"].test_points
    lines.append(f"| none (the base grid) | 0 | - | {_pair(plain['target'].chosen, 1)} | "
                 f"{_pair(plain['draft'].chosen, 1)} | {predicted} |")
    for run in refinements:
        rows = {row.role: row for row in run.rows}
        missing = f" ({run.unavailable} more not in the data)" if run.unavailable else ""
        default = " (calibrate's)" if run.budget == DEFAULT_BUDGET else ""
        lines.append(f"| {run.budget}{default} | {len(run.added)}{missing} | {where_refined(run.added)} | "
                     f"{_pair(rows['target'].chosen, 1)} | {_pair(rows['draft'].chosen, 1)} | "
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


def notes(profile: Profile, gpu: Sequence[HeldOut], losses: Sequence[Loss]) -> str:
    """Short facts behind the tables: the learnt tile, the draft's token curve, the draft's cost and the
    attention's share at long contexts."""
    shape, points = role_points(profile, "target")
    train = points.subset(np.isin(points.batch_size, TRAIN_BATCH_SIZES))
    tile = lat.fit_latency_model(shape, train, lat.STAIRCASE).staircase.tile_tokens()
    reach = int(np.max(train.batch_size * train.new_tokens))
    lines = [f"- Fitted on b <= {max(TRAIN_BATCH_SIZES)}, the target's rows reach {reach} tokens; its staircase "
             + (f"learns a tile of {tile} tokens." if tile else "learns no tile.")]
    beyond = next(r for r in gpu if r.role == "draft" and r.label == "b beyond the grid")
    ratio = gemm_work_ratio(profile.target, profile.draft)
    if ratio is not None and beyond.alone is not None:
        lines.append(f"- Draft past the grid: {_pair(beyond.alone)} % on its own rows, {_pair(beyond.chosen)} % "
                     f"continued along the target's fit (GEMM work per token {ratio:.4f}, perfmodel/token_curve.py).")
    rows = {(r.model, r.batch_size, r.new_tokens, r.context_len): r.median_ms for r in profile.timings}
    short, long = min(profile.grid.context_lens), max(profile.grid.context_lens)
    share = 100 * rows[("draft", 1, 1, short)] / rows[("target", 1, 1, short)]
    lines.append(f"- The draft's composed pass costs {share:.0f} % of the target's at b = 1 (launch gaps left out); "
                 "Su et al.'s separate small draft costs more.")
    best = {loss.context_len: loss.best_k for loss in losses}
    if 32 in best.get(long, {}):
        k = best[long][32][0]
        one, verify = rows[("target", 32, 1, long)], rows[("target", 32, k + 1, long)]
        lines.append(f"- At b = 32 a pass costs {rows[('target', 32, 1, short)]:.1f} ms at {short} cached tokens and "
                     f"{one:.1f} ms at {long}; there a verify pass of k* = {k} adds {100 * (verify / one - 1):.0f} %.")
    return "\n".join(lines)


def render(conditions: str, command: str, gpu: Sequence[HeldOut], losses: Sequence[Loss], cpu_conditions: str,
           cpu: Sequence[HeldOut], cpu_losses: Sequence[Loss], steps: Sequence[StepsPast], facts: str,
           refinements: Sequence[Refined] = ()) -> str:
    grid = ", ".join(map(str, TRAIN_BATCH_SIZES))
    return f"""## The GPU regime, from published timings

{conditions}

```bash
{command}
```

**Held-out pass MAPE, percent** (fitted on b = {grid}; every other b predicted, or each context left out):

{held_out_table(gpu)}

**Steps past b = {max(TRAIN_BATCH_SIZES)}**: where one more row makes the pass {100 * STEP_SHARE:.0f} % dearer or \
more, in the data and in the staircase fitted on b = {grid}:

{steps_table(steps)}

**Calibrate's refinement** (calibrate/refine.py): the base grid, then the target passes it chooses up to a budget;
every row not fitted predicted:

{refined_table(gpu, refinements)}

**Goodput the fitted table gives up** against the best chain read from the composed passes, every b in 1..128:

{loss_table(losses)}

**The best k per batch size**, from the composed passes (data) and from the fit:

{best_k_table(losses)}

**Against the goals**:

{goal_table(gpu, losses, refinements)}

{facts}

**A CPU calibration** ({cpu_conditions}), `fit --holdout`'s split, and the goodput given up at its batch sizes:

{held_out_table(cpu)}

{loss_table(cpu_losses)}
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
    steps = steps_past_grid(profile, sorted({min(profile.grid.context_lens), max(profile.grid.context_lens)}))
    losses = goodput_losses(profile, fitted_models(profile), range(1, args.max_batch + 1))
    cpu_profile = load_profile(args.cpu_profile)
    cpu = cpu_held_out(cpu_profile)
    cpu_losses = goodput_losses(cpu_profile, fitted_models(cpu_profile), cpu_profile.grid.batch_sizes)
    refinements = [refined(profile, budget) for budget in REFINE_BUDGETS]
    grid, noise, threads = profile.grid, cpu_profile.noise, cpu_profile.device.cpu_threads
    seconds = time.monotonic() - started
    conditions = (f"vidur's A100 timings of Llama-2-7B (fp16) composed into {len(profile.timings)} passes (b = "
                  f"{grid.batch_sizes[0]}-{grid.batch_sizes[-1]}, L = {', '.join(map(str, grid.context_lens))}, "
                  f"1-{grid.max_k + 1} tokens per row, {profile.composition.padded_rows} of them at a token count read "
                  f"from the next profiled one; left out: {'; '.join(profile.composition.left_out)}); draft "
                  f"one Llama-2-7B layer with its LM head; acceptance {args.acceptance} per position; k = "
                  f"0..{grid.max_k}; {seconds:.0f} s on the CPU.")
    cpu_conditions = (f"the demo pair on {cpu_profile.device.name}, {threads} thread{'s' if threads > 1 else ''}, "
                      f"b = {', '.join(map(str, cpu_profile.grid.batch_sizes))}, L = "
                      f"{', '.join(map(str, cpu_profile.grid.context_lens))}"
                      + (f", noise floor {100 * noise.floor_mape:.0f} %" if noise is not None else ""))
    section = render(conditions, "python benchmarks/gpu_results.py    # runs: " + command, gpu, losses,
                     cpu_conditions, cpu, cpu_losses, steps, notes(profile, gpu, losses), refinements)
    write_section(args.out, section)
    print(section)
    print(f"wrote the GPU section of {args.out}; the composed profile is {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
