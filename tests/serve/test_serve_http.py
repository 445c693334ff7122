"""The OpenAI-compatible server over raw HTTP (httpx) on a loopback port: every endpoint, streaming,
bad input, back-pressure and disconnects. Oracle: each completion equals the prompt's solo greedy output."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from serve_helpers import demo_server, solo_greedy_ids

PROMPTS = ["def eggs(b):\n    return", "import os\nimport sys\n\n\ndef main(", "class Stack:\n    def push(self, x):\n"]


@pytest.fixture(scope="module")
def server():
    with demo_server(max_waiting=16) as running:
        yield running


def complete(server, **body):
    return httpx.post(f"{server.url}/v1/completions", json={"model": server.served.name, **body}, timeout=60)


def expected_text(server, prompt: str, max_tokens: int) -> tuple[str, list[int]]:
    ids = solo_greedy_ids(server.runner, server.served.encode(prompt), max_tokens)
    return server.served.decode(ids), ids


def stream_chunks(server, **body) -> list:
    chunks = []
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      json={"model": server.served.name, "stream": True, **body}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[6:])
    return chunks


def wait_for(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_health_models_and_metrics(server):
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] == "ok"
    models = httpx.get(f"{server.url}/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [server.served.name]
    complete(server, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    response = httpx.get(f"{server.url}/metrics")
    assert response.headers["content-type"].startswith("text/plain")
    samples = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
               for line in response.text.splitlines() if line and not line.startswith("#")}
    assert samples["specbatch_generated_tokens_total"] >= 8
    assert samples['specbatch_requests_running{model="demo-target"}'] == 0
    assert samples["specbatch_speculation_k"] == 3
    assert samples['specbatch_strategy_info{strategy="chain k=3"}'] == 1
    assert 'specbatch_acceptance_rate{position="3"}' in samples
    assert samples['specbatch_step_seconds_bucket{le="+Inf"}'] == samples["specbatch_step_seconds_count"] > 0
    strategy_steps = [v for name, v in samples.items() if name.startswith("specbatch_strategy_steps_total{")]
    assert sum(strategy_steps) == samples["specbatch_steps_total"]


def test_completion_equals_solo_greedy_with_usage(server):
    prompt = PROMPTS[1]
    text, ids = expected_text(server, prompt, 24)
    body = complete(server, prompt=prompt, max_tokens=24, temperature=0, return_token_ids=True).json()
    choice = body["choices"][0]
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert choice["text"] == text and choice["token_ids"] == ids
    assert choice["finish_reason"] == ("stop" if len(ids) < 24 else "length")
    prompt_tokens = len(server.served.encode(prompt))
    assert body["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": len(ids),
                             "total_tokens": prompt_tokens + len(ids)}


def test_streaming_gives_the_same_text_then_usage_and_done(server):
    prompt = PROMPTS[2]
    text, ids = expected_text(server, prompt, 30)
    chunks = stream_chunks(server, prompt=prompt, max_tokens=30, temperature=0,
                           stream_options={"include_usage": True})
    assert chunks[-1] == "[DONE]"
    bodies = [json.loads(c) for c in chunks[:-1]]
    usage_chunk = bodies.pop()
    assert usage_chunk["choices"] == [] and usage_chunk["usage"]["completion_tokens"] == len(ids)
    assert "".join(b["choices"][0]["text"] for b in bodies) == text
    assert [b["choices"][0]["finish_reason"] for b in bodies[:-1]] == [None] * (len(bodies) - 1)
    assert all("usage" in b and b["usage"] is None for b in bodies)  # as OpenAI: null until the usage chunk
    assert bodies[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert len({b["id"] for b in bodies}) == 1


def test_concurrent_requests_are_not_crossed(server):
    lengths = [12, 20, 7, 16, 25, 9]
    prompts = [PROMPTS[i % 3] + " " * (i // 3) for i in range(len(lengths))]

    async def run():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await asyncio.gather(*[
                client.post("/v1/completions", json={"model": server.served.name, "prompt": p, "max_tokens": n,
                                                     "temperature": 0, "return_token_ids": True})
                for p, n in zip(prompts, lengths)])

    responses = asyncio.run(run())
    for response, prompt, n in zip(responses, prompts, lengths):
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["token_ids"] == expected_text(server, prompt, n)[1]


@pytest.mark.parametrize("body, status, param, code", [
    (b"{not json", 400, None, "invalid_json"),
    (b"[1, 2]", 400, None, "invalid_json"),
    ({"prompt": "x"}, 400, "model", "missing_required_parameter"),
    ({"model": "demo-target"}, 400, "prompt", "missing_required_parameter"),
    ({"model": "gpt-4", "prompt": "x"}, 404, "model", "model_not_found"),
    ({"model": "demo-target", "prompt": "x", "max_tokens": "16"}, 400, "max_tokens", "invalid_type"),
    ({"model": "demo-target", "prompt": "x", "max_tokens": 0}, 400, "max_tokens", "invalid_value"),
    ({"model": "demo-target", "prompt": "x", "max_tokens": 100000}, 400, "max_tokens", "invalid_value"),
    ({"model": "demo-target", "prompt": "x", "temperature": "hot"}, 400, "temperature", "invalid_type"),
    ({"model": "demo-target", "prompt": "x", "top_p": 0}, 400, "top_p", "invalid_value"),
    ({"model": "demo-target", "prompt": 5}, 400, "prompt", "invalid_type"),
    ({"model": "demo-target", "prompt": ["a", "b"]}, 400, "prompt", "invalid_value"),
    ({"model": "demo-target", "prompt": "x", "stop": 3}, 400, "stop", "invalid_type"),
    ({"model": "demo-target", "prompt": "x", "n": 2}, 400, "n", "unsupported_parameter"),
    ({"model": "demo-target", "prompt": "x", "stream": "yes"}, 400, "stream", "invalid_type"),
    ({"model": "demo-target", "prompt": "x" * 5000}, 400, "prompt", "context_length_exceeded"),
    ({"model": "demo-target", "prompt": "x" * 600, "max_tokens": 600}, 400, "max_tokens", "context_length_exceeded"),
    ({"model": "demo-target", "prompt": [1, 2, 100000]}, 400, "prompt", "invalid_value"),
])
def test_bad_input_gets_an_openai_error_object(server, body, status, param, code):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{server.url}/v1/completions", content=content,
                          headers={"content-type": "application/json"})
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["code"] == code and error["message"]
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"  # the server never dies on a request


def test_chat_without_a_template_and_unknown_routes(server):
    response = httpx.post(f"{server.url}/v1/chat/completions",
                          json={"model": server.served.name, "messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 400 and response.json()["error"]["code"] == "no_chat_template"
    assert "chat template" in response.json()["error"]["message"]
    missing = httpx.get(f"{server.url}/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def _counters(server) -> dict:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in httpx.get(f"{server.url}/metrics").text.splitlines() if line and not line.startswith("#")}


def test_disconnect_mid_stream_cancels_and_frees_the_slot(server, monkeypatch):
    monkeypatch.setattr(server.runner.engine.generator, "eos_token_ids", ())  # no early end: it must be cut
    before = _counters(server).get('specbatch_requests_finished_total{reason="cancelled"}', 0)
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      json={"model": server.served.name, "prompt": PROMPTS[0], "max_tokens": 900,
                            "temperature": 0, "stream": True}) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
    # the client hung up after its first chunk: the request is cancelled and its slot freed
    wait_for(lambda: _counters(server).get('specbatch_requests_finished_total{reason="cancelled"}', 0) == before + 1)
    wait_for(lambda: server.runner.engine.running == 0 and server.runner.engine.reserved_tokens == 0)


def test_full_queue_gets_429_with_retry_after():
    with demo_server(max_batch_size=1, max_waiting=1) as server:
        engine = server.runner.engine
        engine.generator.eos_token_ids = ()  # the first request runs until the test hangs up
        body = {"model": server.served.name, "prompt": PROMPTS[0], "max_tokens": 900, "temperature": 0,
                "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as first:
            lines = first.iter_lines()  # kept: dropping the iterator closes the response (a disconnect)
            next(lines)
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as second:
                wait_for(lambda: engine.running == 1 and engine.waiting == 1)
                third = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False}, timeout=60)
                assert third.status_code == 429 and third.headers["retry-after"] == "1"
                assert third.json()["error"]["type"] == "rate_limit_error"
                assert second.status_code == 200
        wait_for(lambda: engine.running == 0 and engine.waiting == 0)
