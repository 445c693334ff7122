"""The step model beside the served steps over HTTP: /metrics and /health of a demo-pair server whose adaptive
policy re-fits its step costs, the load test's reading of them, and the --refit option.

Oracles: every completion equals its prompt's solo greedy output; the /metrics page read back (as the load test
reads it) equals the engine's own counters; a constructed 1.5x drift fed to the server's record shows in the
/health body (still 200) and in /metrics; step_model_use's differences by hand.
"""
from __future__ import annotations

import httpx
import pytest
import torch

from serve_helpers import solo_greedy_ids
from specbatch.perfmodel.acceptance import acceptance_from_user
from specbatch.perfmodel.overhead import OverheadModel
from specbatch.perfmodel.strategy import StepModel
from specbatch.runtime.adaptive import AdaptivePolicy
from specbatch.runtime.engine import Engine, EngineConfig
from specbatch.runtime.fidelity import LiveFidelity
from specbatch.runtime.learning import LEARNING
from specbatch.runtime.refit import StepCostRefit
from specbatch.serve.loadtest import _serve_options, server_command_args
from specbatch.serve.loadtest_report import describe_fidelity, parse_step_model, step_model_counters, step_model_use
from specbatch.serve.server import ServeError, ServeOptions, choose_policy

PROMPTS = ["def eggs(b):\n    return", "import os\nimport sys\n\n\ndef main(", "class Stack:\n    def push(self, x):\n"]


def cheap_drafts(role, batch_size, new_tokens, context_len):
    return 0.3 if role == "draft" else 10.0 + 0.5 * (new_tokens - 1)


@pytest.fixture(scope="module")
def server():
    """The demo pair behind the real HTTP stack, its engine driven by an adaptive policy with --refit on a
    constructed step model (its predictions are far from this machine's: what the record is for)."""
    from specbatch.serve.app import create_app
    from specbatch.serve.runner import EngineRunner
    from specbatch.serve.server import BackgroundServer, build

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        plain, served = build(ServeOptions(k=3, max_batch_size=4))
        refit = StepCostRefit()
        policy = AdaptivePolicy(StepModel(cheap_drafts, OverheadModel(()), acceptance_from_user([0.7])), max_k=4,
                                refit=refit, fidelity=LiveFidelity(band=0.1, refit=refit))
        runner = EngineRunner(Engine(plain.engine.generator, policy, EngineConfig(max_batch_size=4),
                                     decode=served.decode))
        with BackgroundServer(create_app(runner, served)) as running:
            running.runner, running.served = runner, served
            yield running
    finally:
        torch.set_num_threads(threads)


def samples_of(text: str) -> dict[str, str]:
    return dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))


def test_served_steps_beside_the_model_in_metrics_and_health(server):
    for prompt in PROMPTS:
        body = httpx.post(f"{server.url}/v1/completions", timeout=60, json={
            "model": server.served.name, "prompt": prompt, "max_tokens": 12, "temperature": 0,
            "return_token_ids": True}).json()
        expected = solo_greedy_ids(server.runner, server.served.encode(prompt), 12)
        assert body["choices"][0]["token_ids"] == expected  # lossless with --refit
    engine = server.runner.engine
    snapshot = engine.metrics.snapshot()
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 200
    step_model = health.json()["step_model"]
    assert step_model["steps"] == snapshot["steps_total"] > 0 and step_model["refit"] is True
    fidelity = snapshot["fidelity"]
    measured = sum(c["measured_s"] for c in fidelity["cells"])
    assert step_model["measured_over_predicted"] == pytest.approx(
        measured / sum(c["predicted_s"] for c in fidelity["cells"]))
    page = httpx.get(f"{server.url}/metrics").text
    read = parse_step_model(samples_of(page))
    own = step_model_counters(fidelity)
    assert read["refit"] and own["refit"] and read["drift_warnings"] == own["drift_warnings"] == 0
    assert read["cells"].keys() == own["cells"].keys()
    for key, cell in own["cells"].items():
        assert read["cells"][key] == pytest.approx(cell, rel=1e-8)
    assert 'specbatch_step_refit_factor{role="target",width="2"}' in page
    assert sum(c["measured_s"] for c in own["cells"].values()) <= snapshot["step_seconds_sum"]  # decisions excluded


def test_a_drift_shows_in_the_health_body_and_metrics(server):
    """A cell of constructed steps: its baseline at the prediction, then 1.5x, until the record drifts."""
    fidelity = server.runner.engine.metrics.fidelity
    for _ in range(LEARNING.fidelity.warmup_steps + LEARNING.fidelity.settle_steps):
        fidelity.observe("constructed", 2, 0.01, 0.01)
    for _ in range(200):
        fidelity.observe("constructed", 2, 0.01, 0.015)
        if fidelity.drifting:
            break
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    drift = health.json()["step_model"]["drift"]
    assert drift["change"] == pytest.approx(1.5, rel=0.01)
    assert drift["cells"][0]["strategy"] == "constructed" and drift["cells"][0]["batch_sizes"] == "2"
    samples = samples_of(httpx.get(f"{server.url}/metrics").text)
    assert float(samples["specbatch_step_model_drift"]) == 1
    assert float(samples["specbatch_step_model_drift_warnings_total"]) == 1


def test_refit_needs_the_adaptive_policy():
    with pytest.raises(ServeError, match="--refit .* needs --adaptive"):
        choose_policy(ServeOptions(refit=True, k=2), None, None, "cpu", 1)


def test_the_load_test_starts_refit_servers_and_reads_a_run():
    assert server_command_args(("--threads", "1"), "adaptive+refit=m.json") == ["--threads", "1", "--adaptive",
                                                                                "m.json", "--refit"]
    options = _serve_options(("--threads", "1"), "adaptive+refit=m.json")
    assert options.refit and str(options.adaptive) == "m.json" and options.threads == 1
    cell = {"steps": 10, "predicted_s": 0.1, "measured_s": 0.15, "refit_predicted_s": 0.14}
    before = {"cells": {("chain k=2", "1"): cell}, "drift_warnings": 0, "refit": True}
    after = {"cells": {("chain k=2", "1"): {"steps": 30, "predicted_s": 0.3, "measured_s": 0.45,
                                            "refit_predicted_s": 0.44},
                       ("none", "3-4"): {"steps": 5, "predicted_s": 0.05, "measured_s": 0.05,
                                         "refit_predicted_s": 0.05}},
             "drift_warnings": 1, "refit": True}
    run = step_model_use(before, after)
    # the run's own steps: 20 of chain k=2 (0.2 s predicted, 0.3 measured, 0.3 re-fitted) and 5 of none
    assert run["steps"] == 25 and run["predicted_s"] == pytest.approx(0.25) and run["measured_s"] == pytest.approx(0.35)
    assert run["measured_over_predicted"] == pytest.approx(0.35 / 0.25)
    assert run["measured_over_refit"] == pytest.approx(0.35 / 0.35) and run["drift_warnings"] == 1
    assert [c["strategy"] for c in run["cells"]] == ["chain k=2", "none"]
    assert describe_fidelity(run) == "1.40 (refit 1.00), 1 drift"
    assert step_model_use(None, after) is None and describe_fidelity(None) == "-"


def test_the_mismatched_cells_are_a_counter_in_metrics():
    """Steps at 2x their prediction from the start: every cell settles beyond the band, and /metrics counts it."""
    import math

    from specbatch.runtime.fidelity import LiveFidelity
    from specbatch.serve.metrics import _fidelity

    fidelity = LiveFidelity(band=0.10, model_error=0.05)
    cells = [("chain k=3", 3), ("none", 12)]
    for step in range(400):
        strategy, batch_size = cells[step % 2]
        fidelity.observe(strategy, batch_size, 0.01, 0.02 * math.exp(0.01 * (step % 5 - 2)))
    series = {}
    _fidelity(lambda name, kind, help_text, samples: series.update({name: (kind, samples)}), fidelity.snapshot())
    assert series["step_model_mismatched_cells_total"] == ("counter", [("", 2)])
