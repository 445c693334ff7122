"""Shutdown: SIGTERM (or SIGINT) closes the server to new requests, which get 503 while the port stays open,
lets in-flight requests finish or cancels them after --drain-s (a stream still ends with a finish_reason and
[DONE]), then exits 0. In this process (the same drain, its signal handler called directly: a thread gets no
signals) and as a `specbatch serve` subprocess sent SIGTERM."""
from __future__ import annotations

import json
import signal

import httpx
import pytest

from serve_helpers import demo_server
from specbatch.serve.loadtest_servers import ServerProcess

NO_EOS_PROMPT = "def eggs(b):\n"  # the demo target's greedy continuation holds no EOS in 1000 tokens


def _completion(url: str, **fields) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=30,
                      json={"model": "demo-target", "prompt": "import os\n", "max_tokens": 4, **fields})


def test_a_draining_server_answers_503_then_cancels_what_is_left_and_stops(monkeypatch):
    with demo_server(drain_s=1.0) as server:
        monkeypatch.setattr(server.runner.engine.generator, "eos_token_ids", ())
        body = {"model": "demo-target", "prompt": NO_EOS_PROMPT, "max_tokens": 1000, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            server.server.handle_exit(signal.SIGTERM, None)
            refused = _completion(server.url)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
            health = httpx.get(f"{server.url}/health", timeout=30)
            assert health.status_code == 503 and health.json()["status"] == "shutting down"
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "cancelled"  # 1000 tokens take > 1 s
        server._thread.join(30)
        assert not server._thread.is_alive()  # uvicorn stopped once the engine was idle


@pytest.mark.slow
def test_sigterm_gives_503_while_draining_and_the_process_exits_0(tmp_path):
    server = ServerProcess(["--k", "2", "--threads", "1", "--drain-s", "2", "--max-tokens-limit", "1000"],
                           tmp_path / "server.log")
    server.start(timeout_s=120)
    try:
        body = {"model": "demo-target", "prompt": NO_EOS_PROMPT, "max_tokens": 1000, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            assert next(lines).startswith("data: ")
            server.process.send_signal(signal.SIGTERM)
            refused = _completion(server.url)  # a new connection: the port is still open while draining
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"  # nothing half-written: a final chunk, then [DONE]
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] in ("length", "cancelled")
        assert server.process.wait(60) == 0
    finally:
        server.stop()
    log = (tmp_path / "server.log").read_text()
    assert "shutting down" in log and "Finished server process" in log and "Traceback" not in log


@pytest.mark.slow
def test_sigterm_on_an_idle_server_exits_0(tmp_path):
    server = ServerProcess(["--k", "0", "--threads", "1"], tmp_path / "server.log")
    server.start(timeout_s=120)
    try:
        assert _completion(server.url).status_code == 200
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(60) == 0
    finally:
        server.stop()
