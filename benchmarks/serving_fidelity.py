"""Serving that checks its own model, measured: a mis-calibrated profile with and without --refit, --refit's cost,
and the drift warning, on the demo pair, one torch thread.

    OMP_NUM_THREADS=1 python benchmarks/serving_fidelity.py [--out DIR] [--profile P] [--rounds 12] [--write-docs]

1. Profiles. A quick calibration of the demo pair on one thread (`specbatch calibrate --quick --threads 1
   --no-stage2`, or --profile), and the same profile with every target pass time scaled by --factor and by its
   inverse (isolated and in-situ pass rows; each in-situ step gains the difference of its own target pass): a
   profile "measured while the target ran 1.5x slower (faster)". All three fitted (`specbatch fit`).
2. Load test in lockstep (the machine is shared: seconds apart it is another machine): the adaptive policy on
   each model, with and without --refit, each an engine built as `serve` builds it and kept for the whole run.
   Per round and rate one Poisson trace of --requests requests served by all of them one step of each in turn,
   each in its own virtual time (its clock advances by its own steps' host time; a request joins when that
   clock passes its arrival), so each meets the load as if alone and all meet the same moments of the machine;
   the order of turns rotated each round. Per (rate, round) each policy's mean TPOT over the correct profile's
   without --refit, then the geometric mean over the rounds (after --warmup-rounds) and the range. Also each
   policy's steps measured over predicted (and over the re-fitted prediction).
3. --refit's own cost: the policy's decision time per step (choice and learning, which holds the re-fit's
   update and the re-evaluation after it) with and without --refit, in-process runs of the same Poisson trace
   alternating, --cost-s seconds each.
4. Drift: the correct model in-process under Poisson load; after --warmup-steps steps every step is slowed to
   1.5x (the engine's step followed by a host sleep of half its time); the steps until the warning. Then
   --quiet-minutes of the same load without a change: the warnings counted.
--write-docs puts the figures in docs/results.md's "serving-fidelity" section (benchmarks/docs_sections.py).
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from docs_sections import replace_section  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results.md"
SPECBATCH = [sys.executable, "-c", "from specbatch.cli import app; app()"]


def specbatch(*args) -> None:
    subprocess.run([*SPECBATCH, *map(str, args)], check=True, stdout=subprocess.DEVNULL)


def scaled_profile(profile: dict, factor: float) -> dict:
    """The profile with every target pass `factor` times as long; an in-situ step gains its own target pass's
    difference (its draft passes and overhead unchanged)."""
    out = json.loads(json.dumps(profile))
    target_ms = {(r["batch_size"], r["k"], r["sweep"]): r["median_ms"] for r in out.get("insitu_timings") or []
                 if r["model"] == "target"}
    for key in ("timings", "insitu_timings"):
        for row in out.get(key) or []:
            if row["model"] == "target":
                for stat in ("median_ms", "p10_ms", "p90_ms"):
                    row[stat] *= factor
    for row in out.get("insitu_steps") or []:
        extra_ms = (factor - 1.0) * target_ms[(row["batch_size"], row["k"], row["sweep"])]
        for stat in ("median_ms", "p10_ms", "p90_ms"):
            row[stat] += extra_ms
    return out


def make_models(out: Path, profile: Path | None, factor: float) -> dict[str, Path]:
    """{"correct", "slower", "faster"} -> model files (slower: the profile's target passes x factor)."""
    if profile is None:
        profile = out / "profile.json"
        if not profile.is_file():
            specbatch("calibrate", "--quick", "--threads", "1", "--no-stage2", "-o", profile)
    profiles = {"correct": profile}
    data = json.loads(profile.read_text())
    for name, scale in (("slower", factor), ("faster", 1.0 / factor)):
        profiles[name] = out / f"profile-target-x{scale:.3g}.json"
        if not profiles[name].is_file():
            profiles[name].write_text(json.dumps(scaled_profile(data, scale)))
    models = {}
    for name, path in profiles.items():
        models[name] = out / f"model-{name}.json"
        if not models[name].is_file():  # a rerun of some parts keeps the models the others were measured with
            specbatch("fit", path, "-o", models[name])
    return models


def policy_names(models: dict[str, Path]) -> dict[str, str]:
    names = {}
    for name, path in models.items():
        names[name] = f"adaptive={path}"
        names[f"{name} --refit"] = f"adaptive+refit={path}"
    return names


def lockstep(engines: dict, order: list[str], trace, prompts) -> dict:
    """Every engine serves the same arrival trace in its own virtual time, one step of each in turn: an engine's
    clock advances by the host time of its own steps (each ends with its read-back) and jumps to the next
    arrival when it is idle, and a request joins when the engine's clock passes its arrival. Each engine meets
    the load as if it were alone, and all of them meet the same moments of the machine (a shared machine is
    another machine minutes apart). Returns label -> the requests' records in that virtual time."""
    from specbatch.runtime.engine import Request
    from specbatch.serve.loadtest_report import RequestRecord

    serial = itertools.count()
    state = {label: {"now": 0.0, "next": 0, "pending": [],
                     "records": [RequestRecord(i, item.arrival_s) for i, item in enumerate(trace)]} for label in order}

    def listener(pending, index):
        return lambda event: pending.append((index, event))

    active = set(order)
    while active:
        for label in order:
            if label not in active:
                continue
            engine, st = engines[label], state[label]
            while st["next"] < len(trace) and trace[st["next"]].arrival_s <= st["now"]:
                item, index = trace[st["next"]], st["next"]
                engine.submit(Request(f"r{next(serial)}", prompts[item.prompt_index], item.max_tokens,
                                      on_event=listener(st["pending"], index)))
                st["next"] += 1
            if not engine.running and not engine.waiting:
                if st["next"] == len(trace):
                    active.discard(label)
                else:
                    st["now"] = trace[st["next"]].arrival_s  # idle until the next arrival
                continue
            started = time.perf_counter()
            engine.step()
            st["now"] += time.perf_counter() - started
            for index, event in st["pending"]:
                record = st["records"][index]
                if event.token_ids and record.first_token_s is None:
                    record.first_token_s = st["now"]
                record.completion_tokens = event.completion_tokens
                if event.finish_reason:
                    record.finished_s, record.finish_reason = st["now"], event.finish_reason
            st["pending"].clear()
    return {label: st["records"] for label, st in state.items()}


def load_test(models, out: Path, args) -> list[dict]:
    """Per round and rate one Poisson trace (its own seed) served by every policy in lockstep (`lockstep`), the
    order of their turns rotated each round; every policy's engine built as `serve` builds it and kept for the
    whole run, like a running server. The first --warmup-rounds are not counted. One record per (policy, rate,
    round): its mean TPOT and its steps measured over predicted."""
    from specbatch.console.options import read_prompts_file
    from specbatch.runtime.assembly import DEMO_PROMPTS
    from specbatch.serve.loadtest import make_trace
    from specbatch.serve.loadtest_report import Slo, step_model_counters, step_model_use, summarize
    from specbatch.serve.server import ServeOptions, build

    labels = list(policy_names(models))
    engines, encode = {}, None
    for label in labels:
        runner, served = build(ServeOptions(adaptive=models[label.split()[0]], refit=label.endswith("--refit"),
                                            threads=1, max_batch_size=args.max_batch_size))
        engines[label], encode = runner.engine, served.encode
    prompts = [tuple(encode(p)) for p in read_prompts_file(DEMO_PROMPTS)]
    runs = []
    for r in range(args.warmup_rounds + args.rounds):
        for rate in args.rates:
            trace = make_trace(args.requests, rate, 1.0, 1000 * r + int(10 * rate), len(prompts), args.max_tokens)
            order = labels[r % len(labels):] + labels[:r % len(labels)]
            before = {label: step_model_counters(engines[label].metrics.snapshot()["fidelity"]) for label in labels}
            served_records = lockstep(engines, order, trace, prompts)
            if r < args.warmup_rounds:
                continue
            for label in labels:
                summary = summarize(served_records[label], len(trace), Slo(), None)
                after = step_model_counters(engines[label].metrics.snapshot()["fidelity"])
                runs.append({"label": label, "rate": rate, "round": r, "tpot_ms": summary["tpot_ms"]["mean"],
                             "ok": summary["ok"], "requests": summary["requests"],
                             "step_model": step_model_use(before[label], after)})
    (out / "load-runs.json").write_text(json.dumps(runs, indent=1))
    return runs


def paired_tpot(runs: list[dict]) -> dict:
    """(label, rate) -> geometric mean over rounds of TPOT / the correct profile's TPOT (same round, same
    trace), with the rounds' range, and the steps' measured / predicted seconds over the rounds."""
    table = {}
    for (label, rate) in sorted({(run["label"], run["rate"]) for run in runs}):
        ratios, measured, predicted, refit_predicted = [], 0.0, 0.0, 0.0
        for run in (x for x in runs if (x["label"], x["rate"]) == (label, rate)):
            base = next(x for x in runs if (x["label"], x["rate"], x["round"]) == ("correct", rate, run["round"]))
            if run["tpot_ms"] and base["tpot_ms"]:
                ratios.append(run["tpot_ms"] / base["tpot_ms"])
            model = run["step_model"] or {}
            measured += model.get("measured_s") or 0.0
            predicted += model.get("predicted_s") or 0.0
            if model.get("measured_over_refit"):
                refit_predicted += model["measured_s"] / model["measured_over_refit"]
        table[(label, rate)] = {
            "ratio": math.exp(np.mean(np.log(ratios))) if ratios else None,
            "low": min(ratios, default=None), "high": max(ratios, default=None), "rounds": len(ratios),
            "measured_over_predicted": measured / predicted if predicted else None,
            "measured_over_refit": measured / refit_predicted if refit_predicted else None}
    return table


# ---------------------------------------------------------------------- in-process runs (no HTTP)
def in_process(model: Path, refit: bool, max_batch_size: int):
    from specbatch.serve.server import ServeOptions, build

    runner, served = build(ServeOptions(adaptive=model, refit=refit, threads=1, max_batch_size=max_batch_size))
    runner.start()
    return runner, served


async def poisson_load(runner, served, rate_per_s: float, max_tokens: tuple[int, int], seed: int, done) -> int:
    """Requests at Poisson times (held-out prompts in turn) until `done()`; then the rest are cancelled.
    Returns the requests sent."""
    from specbatch.console.options import read_prompts_file
    from specbatch.runtime.assembly import DEMO_PROMPTS
    from specbatch.runtime.engine import Request

    prompts = [tuple(served.encode(p)) for p in read_prompts_file(DEMO_PROMPTS)]
    rng, loop = np.random.default_rng(seed), asyncio.get_running_loop()
    tasks, sent = [], 0

    async def one(index: int) -> None:
        stream = runner.submit(Request(f"q{index}", prompts[index % len(prompts)],
                                       int(rng.integers(max_tokens[0], max_tokens[1] + 1))), loop)
        while not (await stream.next()).finish_reason:
            pass

    while not done():
        tasks.append(asyncio.create_task(one(sent)))
        sent += 1
        deadline = time.perf_counter() + float(rng.exponential(1.0 / rate_per_s))
        while time.perf_counter() < deadline and not done():
            await asyncio.sleep(0.01)
    runner.engine.cancel_all_soon()
    await asyncio.gather(*tasks, return_exceptions=True)
    return sent


def refit_cost(model: Path, args) -> dict:
    """The policy's own time per step (its choice and its learning, the re-fit's update and re-evaluation
    included), with and without --refit: the steps of --cost-s seconds of served load recorded (request ids,
    context, accepted tokens, step time), then replayed through fresh policies in this thread alone (no engine,
    no client holding the interpreter), alternating, three times each; beside the served steps' mean time."""
    import logging

    from specbatch.runtime.adaptive import adaptive_policy

    runner, served = in_process(model, False, args.max_batch_size)
    policy, steps = runner.engine.policy, []
    choose, observe = policy.choose, policy.observe

    def recording_choose(ids, context):
        steps.append([list(ids), context, None, time.perf_counter()])
        return choose(ids, context)

    def recording_observe(ids, proposed, accepted):
        steps[-1][2], steps[-1][3] = list(accepted), time.perf_counter() - steps[-1][3]
        observe(ids, proposed, accepted)

    policy.choose, policy.observe = recording_choose, recording_observe
    end = time.perf_counter() + args.cost_s
    asyncio.run(poisson_load(runner, served, args.rates[0], args.max_tokens, 7, lambda: time.perf_counter() > end))
    snapshot = runner.engine.metrics.snapshot()
    runner.stop()
    steps = [s for s in steps if s[2] is not None]

    def replay(refit: bool) -> float:
        fresh, now = adaptive_policy(model, refit=refit), [0.0]
        fresh._clock = lambda: now[0]
        started = time.perf_counter()
        for ids, context, accepted, step_s in steps:
            answer = fresh.choose(ids, context)
            k = answer if isinstance(answer, int) else answer.k
            now[0] += step_s
            fresh.observe(ids, k, [min(a, k) for a in accepted])
        return (time.perf_counter() - started) / len(steps)

    logging.getLogger("specbatch.fidelity").disabled = True  # the replays' own warnings say nothing new
    times = {False: [], True: []}
    for refit in (False, True) * 3:
        times[refit].append(replay(refit))
    logging.getLogger("specbatch.fidelity").disabled = False
    return {"steps": len(steps), "served_step_ms": 1e3 * snapshot["step_seconds_sum"] / snapshot["steps_total"],
            "plain_us": 1e6 * min(times[False]), "refit_us": 1e6 * min(times[True])}


class _Tee:
    """The policy's step records made by several LiveFidelity at once: the same steps judged at several bands."""

    def __init__(self, records):
        self.records = records

    def observe(self, *args) -> None:
        for record in self.records:
            record.observe(*args)


def recorders(runner, bands) -> dict:
    """"profile" (the policy's own record, its band the profile's noise figure) and one per extra band."""
    from specbatch.runtime.fidelity import LiveFidelity

    policy = runner.engine.policy
    own = policy.fidelity
    records = {"profile": own, **{f"{b:g}": LiveFidelity(band=b, model_error=own.model_error,
                                                       band_source="a fixed band") for b in bands}}
    policy.fidelity = _Tee(list(records.values()))
    return records


def drift(model: Path, args) -> dict:
    """Steps from a 1.5x slowdown of every step to the warning; then warnings over --quiet-minutes unchanged;
    at the profile's band and at each of --bands, on the same steps."""
    runner, served = in_process(model, False, args.max_batch_size)
    records, engine = recorders(runner, args.bands), runner.engine
    count = records["profile"]
    step = engine.generator.step
    slowed = {"from": None}

    def slow_step(*a, **kw):
        started = time.perf_counter()
        result = step(*a, **kw)
        if slowed["from"] is not None:
            time.sleep(0.5 * (time.perf_counter() - started))
        return result

    engine.generator.step = slow_step

    at_change, warned = {}, {}  # per band: (warnings, drifting) when the slowdown began; its first warning after

    def done() -> bool:
        if slowed["from"] is None and count.steps >= args.warmup_steps:
            slowed["from"] = count.steps
            at_change.update({label: (r.drift_warnings, r.drifting) for label, r in records.items()})
        if slowed["from"] is None:
            return False
        for label, record in records.items():
            if label not in warned and record.drift_warnings > at_change[label][0]:
                warned[label] = record.snapshot()["drift"]
        return len(warned) == len(records) or count.steps - slowed["from"] > 1000

    asyncio.run(poisson_load(runner, served, args.rates[0], args.max_tokens, 11, done))
    runner.stop()
    out = {"slowed_from_step": slowed["from"], "bands": {}}
    for label, record in records.items():
        found = warned.get(label)
        out["bands"][label] = {"band": record.band, "drifting_at_the_change": at_change[label][1],
                               "warnings_before_the_change": at_change[label][0],
                               "steps_to_warning": None if found is None else found["since_step"] - slowed["from"],
                               "change": None if found is None else found["change"]}
    runner, served = in_process(model, False, args.max_batch_size)
    records = recorders(runner, args.bands)
    end = time.perf_counter() + 60 * args.quiet_minutes
    asyncio.run(poisson_load(runner, served, args.rates[0], args.max_tokens, 13, lambda: time.perf_counter() > end))
    runner.stop()
    health = records["profile"].health()
    out.update(quiet_steps=health["steps"], quiet_ratio=health["measured_over_predicted"])
    for label, record in records.items():
        out["bands"][label].update(quiet_warnings=record.drift_warnings,
                                   quiet_mismatch_warnings=record.mismatch_warnings)
    return out


# ---------------------------------------------------------------------- the page
def render(figures: dict, args) -> str:
    import torch

    table, cost, found = figures["load_test"], figures["refit_cost"], figures["drift"]
    rates = ", ".join(f"{r:g}" for r in args.rates)
    lines = [
        "## Serving fidelity",
        "",
        f"Demo pair, greedy, {platform.processor() or platform.machine()}, torch {torch.__version__}, one torch "
        f"thread; Poisson arrivals at {rates} requests/s, {args.requests} requests of "
        f"{args.max_tokens[0]}-{args.max_tokens[1]} tokens per trace, batch size up to {args.max_batch_size}; "
        f"{args.rounds} rounds after {args.warmup_rounds} warm-up; mis-calibrated: the profile's target pass times "
        f"x{args.factor:g} (slower) or /{args.factor:g} (faster), refitted.",
        "",
        "```bash",
        f"OMP_NUM_THREADS=1 python benchmarks/serving_fidelity.py --rounds {args.rounds} "
        f"--rates {rates.replace(' ', '')} "
        f"--requests {args.requests} --quiet-minutes {args.quiet_minutes:g} --write-docs",
        "```",
        "",
        "Each round serves a new trace per rate to every policy in lockstep, one step of each in turn, each in its "
        "own virtual time (in-process, no HTTP; each policy's engine kept across rounds); "
        "[serving.md](serving.md#the-model-beside-the-served-steps) and [adaptive.md](adaptive.md) say what is "
        "measured.",
        "",
        "| adaptive on the profile | rate /s | TPOT / correct profile's [range] | measured / predicted step "
        "seconds | with --refit: TPOT / correct [range] | measured / re-fitted |",
        "|---|---:|---|---:|---|---:|"]

    def cell(entry) -> str:
        if entry["ratio"] is None:
            return "-"
        return f"{entry['ratio']:.3f} [{entry['low']:.3f}, {entry['high']:.3f}]"

    def number(value, fmt="{:.2f}") -> str:
        return "-" if value is None else fmt.format(value)

    for name in ("correct", "slower", "faster"):
        for rate in args.rates:
            plain, refit = table[(name, rate)], table[(f"{name} --refit", rate)]
            lines.append(f"| {name} | {rate:g} | {cell(plain)} | {number(plain['measured_over_predicted'])} | "
                         f"{cell(refit)} | {number(refit['measured_over_refit'])} |")
    extra_us = cost["refit_us"] - cost["plain_us"]
    lines += [
        "",
        f"--refit's own cost: the policy's time per step (its choice and learning), {cost['plain_us']:.0f} µs "
        f"without it and {cost['refit_us']:.0f} µs with it, on {cost['steps']} served steps replayed through it "
        f"alone (fastest of three, alternating): {extra_us:+.0f} µs, "
        f"{100 * extra_us / 1e3 / cost['served_step_ms']:+.2f} % of the served steps' mean "
        f"{cost['served_step_ms']:.1f} ms.",
        "",
        f"Drift (in-process, the correct profile, Poisson load at {args.rates[0]:g} requests/s): every step slowed "
        f"to 1.5x from step {found['slowed_from_step']} (a host sleep of half its time after it); then "
        f"{args.quiet_minutes:g} minutes of the same load without a change ({found['quiet_steps']} steps, "
        f"measured / predicted {number(found['quiet_ratio'])}). The same steps judged at the profile's band and "
        "at fixed ones:",
        "",
        "| band | warned after the 1.5x change | its change | drift warnings without a change | mismatch "
        "warnings without a change |",
        "|---|---:|---:|---:|---:|"]
    for label, band in found["bands"].items():
        name = f"±{100 * band['band']:.0f} % (the profile's noise figure)" if label == "profile" else \
            f"±{100 * band['band']:.0f} %"
        warned = f"{band['steps_to_warning']} steps" if band["steps_to_warning"] is not None else \
            "none: drifting already (the machine)" if band["drifting_at_the_change"] else "none in 1000 steps"
        lines.append(f"| {name} | {warned} | "
                     f"{number(band['change'], 'x{:.2f}')} | {band['quiet_warnings']} | "
                     f"{band['quiet_mismatch_warnings']} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--out", type=Path, default=Path("specbatch-fidelity"))
    parser.add_argument("--profile", type=Path, help="a demo-pair profile to use (default: calibrate one)")
    parser.add_argument("--factor", type=float, default=1.5, help="the mis-calibration of the target's passes")
    parser.add_argument("--rates", type=lambda s: tuple(float(x) for x in s.split(",")), default=(3.0, 8.0))
    parser.add_argument("--requests", type=int, default=32, help="per trace (one per round and rate)")
    parser.add_argument("--max-tokens", type=lambda s: tuple(int(x) for x in s.split("-")), default=(32, 64))
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup-rounds", type=int, default=1)
    parser.add_argument("--cost-s", type=float, default=60.0)
    parser.add_argument("--warmup-steps", type=int, default=400)
    parser.add_argument("--quiet-minutes", type=float, default=10.0)
    parser.add_argument("--bands", type=lambda s: tuple(float(x) for x in s.split(",")), default=(0.1, 0.25),
                        help="fixed drift bands to judge the same steps at, beside the profile's")
    parser.add_argument("--parts", default="cost,drift,load", help="which measurements to (re)run; the others "
                        "are read from OUT/figures.json")
    parser.add_argument("--write-docs", action="store_true")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    models = make_models(args.out, args.profile, args.factor)
    saved = args.out / "figures.json"
    figures = json.loads(saved.read_text()) if saved.is_file() else {}
    parts = set(args.parts.split(","))
    if "cost" in parts:
        figures["refit_cost"] = refit_cost(models["correct"], args)
    if "drift" in parts:
        figures["drift"] = drift(models["correct"], args)
    if "load" in parts:
        figures["load_test"] = [{"policy": label, "rate": rate, **entry} for (label, rate), entry in
                                paired_tpot(load_test(models, args.out, args)).items()]
    saved.write_text(json.dumps(figures, indent=1))
    figures["load_test"] = {(entry["policy"], entry["rate"]): entry for entry in figures["load_test"]}
    text = render(figures, args)
    print(text)
    if args.write_docs:
        RESULTS.write_text(replace_section(RESULTS.read_text(), "serving-fidelity", text))


if __name__ == "__main__":
    main()
