"""GET /metrics: the engine's counters in the Prometheus text exposition format (version 0.0.4)."""
from __future__ import annotations

from specbatch.runtime.engine_metrics import STEP_BUCKETS_S

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\"", "\\\"").replace("\n", "\\n")


def render_metrics(snapshot: dict, running: int, waiting: int, reserved_tokens: int, budget_tokens: int,
                   model: str) -> str:
    """`snapshot` is EngineMetrics.snapshot(); the gauges are read from the engine at the same moment."""
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP specbatch_{name} {help_text}")
        lines.append(f"# TYPE specbatch_{name} {kind}")
        for labels, value in samples:
            lines.append(f"specbatch_{name}{labels} {value:.10g}")

    model_label = f'model="{_label(model)}"'
    metric("requests_running", "gauge", "Requests in the running batch.", [(f"{{{model_label}}}", running)])
    metric("requests_waiting", "gauge", "Requests queued for admission.", [(f"{{{model_label}}}", waiting)])
    metric("kv_reserved_tokens", "gauge", "KV-cache tokens reserved by running requests.", [("", reserved_tokens)])
    metric("kv_budget_tokens", "gauge", "KV-cache token budget for admission.", [("", budget_tokens)])
    metric("prompt_tokens_total", "counter", "Prompt tokens prefilled.", [("", snapshot["prompt_tokens_total"])])
    metric("generated_tokens_total", "counter", "Completion tokens delivered.",
           [("", snapshot["generated_tokens_total"])])
    metric("steps_total", "counter", "Speculative steps run.", [("", snapshot["steps_total"])])
    metric("requests_finished_total", "counter", "Requests ended, by finish reason.",
           [(f'{{reason="{_label(reason)}"}}', count) for reason, count in sorted(snapshot["finished_total"].items())])
    positions = range(1, len(snapshot["trials_per_position"]) + 1)
    metric("draft_accepted_total", "counter", "Draft tokens accepted at each position of a step.",
           [(f'{{position="{i}"}}', a) for i, a in zip(positions, snapshot["accepted_per_position"])])
    metric("draft_proposed_total", "counter", "Draft tokens verified at each position (all before it accepted).",
           [(f'{{position="{i}"}}', t) for i, t in zip(positions, snapshot["trials_per_position"])])
    metric("acceptance_rate", "gauge", "Accepted / proposed draft tokens at each position, since start.",
           [(f'{{position="{i}"}}', a / t if t else 0.0)
            for i, a, t in zip(positions, snapshot["accepted_per_position"], snapshot["trials_per_position"])])
    metric("speculation_k", "gauge", "Draft depth of the last step (a chain's k; 0: no speculation).",
           [("", snapshot["k"])])
    metric("draft_tokens_per_step", "gauge", "Draft tokens verified per row in the last step.",
           [("", snapshot["draft_tokens"])])
    metric("batch_size", "gauge", "Rows in the last step.", [("", snapshot["batch_size"])])
    metric("strategy_info", "gauge", "The strategy of the last step, as a label.",
           [(f'{{strategy="{_label(snapshot["strategy"])}"}}', 1)])
    mix = sorted(snapshot["by_strategy"].items())
    for name, key, help_text in (
            ("strategy_steps_total", "steps", "Speculative steps run, by strategy."),
            ("strategy_step_seconds_total", "seconds", "Wall time of those steps, by strategy."),
            ("strategy_tokens_total", "tokens", "Tokens those steps committed over all rows, by strategy."),
            ("strategy_rows_total", "rows", "Rows those steps ran on (their batch sizes summed), by strategy.")):
        metric(name, "counter", help_text, [(f'{{strategy="{_label(label)}"}}', counts[key]) for label, counts in mix])
    lines.append("# HELP specbatch_step_seconds Wall time of one speculative step (all rows).")
    lines.append("# TYPE specbatch_step_seconds histogram")
    cumulative = 0
    for bound, count in zip(list(STEP_BUCKETS_S) + [float("inf")], snapshot["step_bucket_counts"]):
        cumulative += count
        le = "+Inf" if bound == float("inf") else f"{bound:g}"
        lines.append(f'specbatch_step_seconds_bucket{{le="{le}"}} {cumulative}')
    lines.append(f"specbatch_step_seconds_sum {snapshot['step_seconds_sum']:.10g}")
    lines.append(f"specbatch_step_seconds_count {cumulative}")
    if snapshot.get("fidelity") is not None:
        _fidelity(metric, snapshot["fidelity"])
    return "\n".join(lines) + "\n"


def _fidelity(metric, fidelity: dict) -> None:
    """The step model beside the measured steps (runtime.fidelity), per strategy and batch-size bucket."""
    cells = [(f'{{strategy="{_label(c["strategy"])}",batch_sizes="{c["batch_sizes"]}"}}', c) for c in fidelity["cells"]]
    series = [("step_model_steps_total", "counter", "steps", "Steps the step model predicted."),
              ("step_model_predicted_seconds_total", "counter", "predicted_s", "The step model's predicted seconds."),
              ("step_model_measured_seconds_total", "counter", "measured_s", "Measured seconds of the same steps."),
              ("step_model_ratio", "gauge", "ratio", "Measured / predicted, geometric, over the last ~32 steps."),
              ("step_model_ratio_spread", "gauge", "spread", "Std. deviation of log(measured / predicted).")]
    if fidelity["refit"] is not None:
        series.append(("step_model_refit_predicted_seconds_total", "counter", "refit_predicted_s",
                       "The re-fitted step costs' predicted seconds (--refit)."))
    for name, kind, key, help_text in series:
        metric(name, kind, help_text, [(labels, cell[key]) for labels, cell in cells])
    metric("step_model_band", "gauge", "Relative band the ratio may move in (the profile's noise figure).",
           [("", fidelity["band"])])
    metric("step_model_drift", "gauge", "1 while the step times have drifted out of the band.",
           [("", 0 if fidelity["drift"] is None else 1)])
    metric("step_model_drift_warnings_total", "counter", "Drift warnings logged.", [("", fidelity["drift_warnings"])])
    metric("step_model_mismatched_cells_total", "counter", "Cells (strategy, batch sizes) whose served steps settled "
           "beyond the band and the model's error of the prediction (logged as a mismatch).",
           [("", len(fidelity["mismatched"]))])
    if fidelity["refit"] is not None:
        rows = fidelity["refit"]["factors"]
        for name, key, help_text in (("step_refit_factor", "factor", "Re-fitted step-cost factor per role and width."),
                                     ("step_refit_factor_low", "low", "Its 95 % interval, low end."),
                                     ("step_refit_factor_high", "high", "Its 95 % interval, high end.")):
            metric(name, "gauge", help_text, [(f'{{role="{r["role"]}",width="{r["width"]}"}}', r[key]) for r in rows])
