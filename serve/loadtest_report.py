"""Load-test records -> per-run figures (TTFT, TPOT, end-to-end latency, throughput, goodput), and
their JSON, CSV and PNG. No HTTP, no torch: the numbers of a run can be recomputed from its records.

Definitions (per request): TTFT = first token's arrival - send time; TPOT = (last - first token's
arrival) / (completion tokens - 1), for requests of 2+ tokens; end-to-end = last arrival - send time.
Per run: throughput = completion tokens / (last finish - first send); goodput = requests that met every
SLO given (and their tokens) per second of the same span (DistServe's definition). With a step model
(--adaptive): its predicted seconds beside the measured ones over the run's steps (`step_model_use`).
"""
from __future__ import annotations

import csv
import io
import re
from dataclasses import dataclass

import numpy as np


@dataclass
class RequestRecord:
    index: int  # position in the trace
    sent_s: float  # times relative to the run's start
    first_token_s: float | None = None
    finished_s: float | None = None
    completion_tokens: int = 0
    token_ids: list[int] | None = None
    finish_reason: str | None = None
    error: str | None = None  # an HTTP status or exception; None when the request succeeded
    adversarial: str | None = None  # the hostile kind it was (serve.adversarial), None: well-formed
    as_expected: bool | None = None  # a hostile request: the server gave the answer it must

    @property
    def ok(self) -> bool:
        return self.error is None and self.finished_s is not None

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_token_s is None else 1000 * (self.first_token_s - self.sent_s)

    @property
    def e2e_ms(self) -> float | None:
        return None if self.finished_s is None else 1000 * (self.finished_s - self.sent_s)

    @property
    def tpot_ms(self) -> float | None:
        if self.finished_s is None or self.first_token_s is None or self.completion_tokens < 2:
            return None
        return 1000 * (self.finished_s - self.first_token_s) / (self.completion_tokens - 1)


@dataclass(frozen=True)
class Slo:
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def met(self, record: RequestRecord) -> bool:
        limits = ((self.ttft_ms, record.ttft_ms), (self.tpot_ms, record.tpot_ms), (self.e2e_ms, record.e2e_ms))
        return record.ok and all(limit is None or (value is not None and value <= limit) for limit, value in limits)

    def describe(self) -> str:
        parts = [f"{name}<={value:g}ms" for name, value in
                 (("TTFT", self.ttft_ms), ("TPOT", self.tpot_ms), ("E2E", self.e2e_ms)) if value is not None]
        return ", ".join(parts) or "none"


def distribution(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    array = np.asarray(values, dtype=float)
    return {"mean": float(array.mean()), "p50": float(np.percentile(array, 50)),
            "p90": float(np.percentile(array, 90)), "p99": float(np.percentile(array, 99))}


def summarize(records: list[RequestRecord], trace_len: int, slo: Slo, mismatched: int | None) -> dict:
    """The run's figures over its well-formed requests; hostile ones (serve.adversarial) counted apart."""
    hostile = [r for r in records if r.adversarial is not None]
    records = [r for r in records if r.adversarial is None]
    trace_len -= len(hostile)
    ok = [r for r in records if r.ok]
    sent = [r for r in records if r.sent_s is not None]
    span_s = (max(r.finished_s for r in ok) - min(r.sent_s for r in sent)) if ok else None
    tokens = sum(r.completion_tokens for r in ok)
    good = [r for r in ok if slo.met(r)]
    return {
        "requests": trace_len, "sent": len(sent), "ok": len(ok),
        "errors": sum(1 for r in records if r.error is not None and r.error != "unfinished"),
        "unfinished": sum(1 for r in records if r.error == "unfinished") + trace_len - len(records),
        "mismatched": mismatched,
        "ttft_ms": distribution([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        "tpot_ms": distribution([r.tpot_ms for r in ok if r.tpot_ms is not None]),
        "e2e_ms": distribution([r.e2e_ms for r in ok]),
        "completion_tokens": tokens, "span_s": span_s,
        "throughput_tokens_per_s": tokens / span_s if span_s else None,
        "goodput_requests_per_s": len(good) / span_s if span_s else None,
        "goodput_tokens_per_s": sum(r.completion_tokens for r in good) / span_s if span_s else None,
        "slo": slo.describe(),
        "error_examples": sorted({r.error for r in records if r.error is not None})[:3],
        "adversarial": {"sent": len(hostile), "as_expected": sum(1 for r in hostile if r.as_expected),
                        "unexpected": sorted({f"{r.adversarial}: {r.error}" for r in hostile if not r.as_expected})},
    }


def failed_runs(runs: list[dict]) -> list[str]:
    """One line per run in which no well-formed request succeeded, with the errors it saw: such a run has no
    figures, and a load test made only of them has failed."""
    return [f"policy {run['policy']} ({run['mode']}) at {run['rate_per_s']:g}/s: none of {run['requests']} requests "
            f"succeeded ({'; '.join(run.get('error_examples') or ['no answer'])})"
            for run in runs if run["requests"] > 0 and run["ok"] == 0]


CSV_COLUMNS = ["policy", "mode", "rate_per_s", "cv", "requests", "ok", "errors", "unfinished", "mismatched",
               "ttft_ms_mean", "ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99", "tpot_ms_mean", "tpot_ms_p50",
               "tpot_ms_p90", "tpot_ms_p99", "e2e_ms_mean", "e2e_ms_p50", "e2e_ms_p90", "e2e_ms_p99",
               "throughput_tokens_per_s", "goodput_requests_per_s", "goodput_tokens_per_s", "rss_before_mb",
               "rss_after_mb", "engine_steps", "engine_step_ms_mean", "engine_busy_fraction", "server_cpu_s",
               "client_cpu_s", "strategy_mix", "measured_over_predicted", "measured_over_refit", "drift_warnings"]


def describe_mix(mix: dict | None, top: int = 3) -> str:
    """The strategies a run's steps ran, most used first: 'chain k=4 62% (9.1 ms, 4.0 tok), none 30% (...)'."""
    if not mix:
        return "-"
    parts = [f"{label} {100 * m['share']:.0f}% ({m['step_ms']:.1f} ms, {m['tokens_per_step']:.1f} tok)"
             for label, m in list(mix.items())[:top]]
    return ", ".join(parts) + (f", +{len(mix) - top} more" if len(mix) > top else "")


def to_csv(runs: list[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, CSV_COLUMNS, extrasaction="ignore")
    writer.writeheader()
    for run in runs:
        row = dict(run, strategy_mix=describe_mix(run.get("strategy_mix"), top=len(run.get("strategy_mix") or ())))
        row.update({key: (run.get("step_model") or {}).get(key)
                    for key in ("measured_over_predicted", "measured_over_refit", "drift_warnings")})
        for name in ("ttft_ms", "tpot_ms", "e2e_ms"):
            for stat, value in run[name].items():
                row[f"{name}_{stat}"] = value
        writer.writerow(row)
    return out.getvalue()


def plot_latency(runs: list[dict], path) -> None:
    """Mean end-to-end latency vs arrival rate, one line per policy, one panel per CV (the paper's figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from specbatch.perfmodel.jsonio import atomic_output

    http = [r for r in runs if r["mode"] == "http"]
    cvs = sorted({r["cv"] for r in http})
    figure, axes = plt.subplots(1, len(cvs), figsize=(5 * len(cvs), 4), squeeze=False)
    for axis, cv in zip(axes[0], cvs):
        for policy in sorted({r["policy"] for r in http if r["cv"] == cv}):
            points = sorted((r["rate_per_s"], r["e2e_ms"]["mean"]) for r in http
                            if r["cv"] == cv and r["policy"] == policy and r["e2e_ms"]["mean"] is not None)
            if points:
                axis.plot(*zip(*points), marker="o", label=policy)
        axis.set_title(f"Gamma arrivals, CV {cv:g}")
        axis.set_xlabel("arrival rate (requests/s)")
        axis.set_ylabel("mean end-to-end latency (ms)")
        axis.set_yscale("log")
        axis.grid(True, alpha=0.3)
        axis.legend()
    figure.tight_layout()
    with atomic_output(path, "--out") as temporary:
        figure.savefig(temporary, format="png", dpi=120)
    plt.close(figure)


def _hostile(adversarial: dict | None) -> str:
    """'4/5': hostile requests answered as they must be, of those sent; '-' without any."""
    if not adversarial or not adversarial["sent"]:
        return "-"
    return f"{adversarial['as_expected']}/{adversarial['sent']}"


def render_runs(runs: list[dict]) -> None:
    """One row per run on the terminal (the CLI's view; the files hold every figure)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="load test: latencies in ms (means; E2E p99), throughput in tokens/s")
    for column in ("policy", "mode", "rate/s", "CV", "ok", "failed", "mismatch", "hostile ok", "TTFT", "TPOT",
                   "E2E", "E2E p99", "tok/s", "goodput/s"):
        table.add_column(column, justify="right", no_wrap=True)
    table.add_column("meas/pred", justify="right", no_wrap=True)
    table.add_column("steps ran (share, step time, tokens a step)", justify="left")

    def number(value, fmt="{:.0f}") -> str:
        return "-" if value is None else fmt.format(value)

    for run in runs:
        table.add_row(run["policy"], run["mode"], f"{run['rate_per_s']:g}", f"{run['cv']:g}", str(run["ok"]),
                      str(run["errors"] + run["unfinished"]), number(run["mismatched"], "{}"),
                      _hostile(run.get("adversarial")), number(run["ttft_ms"]["mean"]),
                      number(run["tpot_ms"]["mean"], "{:.1f}"),
                      number(run["e2e_ms"]["mean"]), number(run["e2e_ms"]["p99"]),
                      number(run["throughput_tokens_per_s"]), number(run["goodput_requests_per_s"], "{:.2f}"),
                      describe_fidelity(run.get("step_model")), describe_mix(run.get("strategy_mix")))
    Console(width=200).print(table)


# ---------------------------------------------------------------------- the step model beside the measured steps
_STEP_MODEL_SERIES = {"specbatch_step_model_steps_total": "steps",
                      "specbatch_step_model_predicted_seconds_total": "predicted_s",
                      "specbatch_step_model_measured_seconds_total": "measured_s",
                      "specbatch_step_model_refit_predicted_seconds_total": "refit_predicted_s"}
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def step_model_counters(fidelity: dict | None) -> dict | None:
    """The counters a run's step-model figures are the difference of, from an engine's fidelity snapshot
    (runtime.fidelity; None: the policy has no step model)."""
    if fidelity is None:
        return None
    return {"cells": {(c["strategy"], c["batch_sizes"]): {"steps": c["steps"], "predicted_s": c["predicted_s"],
                                                          "measured_s": c["measured_s"],
                                                          "refit_predicted_s": c["refit_predicted_s"] or 0.0}
                      for c in fidelity["cells"]},
            "drift_warnings": fidelity["drift_warnings"], "refit": fidelity["refit"] is not None}


def parse_step_model(samples: dict[str, str]) -> dict | None:
    """The same counters from a /metrics page's samples (series -> value; serve.metrics)."""
    if "specbatch_step_model_drift_warnings_total" not in samples:
        return None
    cells: dict[tuple[str, str], dict[str, float]] = {}
    for series, value in samples.items():
        name, _, labels = series.partition("{")
        if name in _STEP_MODEL_SERIES:
            found = {key: re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), text)
                     for key, text in _LABEL.findall(labels)}
            cell = cells.setdefault((found["strategy"], found["batch_sizes"]), dict.fromkeys(
                ("steps", "predicted_s", "measured_s", "refit_predicted_s"), 0.0))
            cell[_STEP_MODEL_SERIES[name]] = float(value)
    return {"cells": cells, "drift_warnings": float(samples["specbatch_step_model_drift_warnings_total"]),
            "refit": any(series.startswith("specbatch_step_refit_factor{") for series in samples)}


def step_model_use(before: dict | None, after: dict | None) -> dict | None:
    """A run's steps as the step model predicted them: predicted and measured seconds, their ratio (and the
    re-fitted prediction's with --refit), drift warnings, per (strategy, batch sizes) cell, most steps first."""
    if before is None or after is None:
        return None
    cells = []
    for (strategy, batch_sizes), counts in after["cells"].items():
        prior = before["cells"].get((strategy, batch_sizes), {})
        delta = {key: value - prior.get(key, 0.0) for key, value in counts.items()}
        if delta["steps"] > 0:
            cells.append({"strategy": strategy, "batch_sizes": batch_sizes, **delta})
    predicted, measured = sum(c["predicted_s"] for c in cells), sum(c["measured_s"] for c in cells)
    refit_predicted = sum(c["refit_predicted_s"] for c in cells)
    return {"steps": sum(c["steps"] for c in cells), "predicted_s": predicted, "measured_s": measured,
            "measured_over_predicted": measured / predicted if predicted else None,
            "measured_over_refit": measured / refit_predicted if after["refit"] and refit_predicted else None,
            "drift_warnings": after["drift_warnings"] - before["drift_warnings"],
            "cells": sorted(cells, key=lambda c: -c["steps"])}


def describe_fidelity(step_model: dict | None) -> str:
    """'1.52 (refit 1.01)': measured over predicted seconds of a run's steps; '-' without a step model."""
    if not step_model or step_model["measured_over_predicted"] is None:
        return "-"
    text = f"{step_model['measured_over_predicted']:.2f}"
    if step_model["measured_over_refit"] is not None:
        text += f" (refit {step_model['measured_over_refit']:.2f})"
    return text + (f", {step_model['drift_warnings']:.0f} drift" if step_model["drift_warnings"] else "")
