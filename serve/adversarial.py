"""Requests a broken or hostile client sends, for load tests that mix them into a trace of well-formed ones:
each kind says what it sends and what the server must answer. None of them may change another request's
output (the server validates at the door; a tiny temperature or nucleus mass is greedy, its limit).

    outcome = await send_adversarial(client, url, "nan_temperature", model, prompt)
    assert outcome.as_expected, outcome.detail
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

import httpx

# kind -> the HTTP status the server must answer (200: it completes, greedy; None: the client leaves first)
EXPECTED_STATUS: dict[str, int | None] = {
    "nan_temperature": 400, "infinite_top_p": 400, "deep_json": 400, "not_json": 400, "form_body": 415,
    "huge_body": 413, "huge_prompt": 400, "unknown_model": 404, "zero_max_tokens": 400,
    "tiny_temperature": 200, "tiny_top_p": 200, "drop_plain": None, "drop_stream": None,
}
KINDS = tuple(EXPECTED_STATUS)
HUGE_BYTES = 10 << 20  # past the server's body limit
HUGE_PROMPT_CHARS = 3 << 20  # under the body limit, past any context the demo pair holds
DROP_AFTER_S = 0.3  # how long a leaving client waits before it hangs up


@dataclass(frozen=True)
class AdversarialOutcome:
    kind: str
    status: int | None  # None: the client hung up before an answer
    text: str | None  # the completion's text, for kinds that complete (compare with the greedy reference)
    as_expected: bool
    detail: str


def _raw(model: str, prompt: str, max_tokens: int, extra: str = "") -> str:
    fields = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    return fields[:-1] + extra + "}"


async def send_adversarial(client: httpx.AsyncClient, url: str, kind: str, model: str, prompt: str,
                           max_tokens: int = 16) -> AdversarialOutcome:
    """Send one request of `kind` to `url` (the server's root) and judge the answer."""
    if kind not in EXPECTED_STATUS:
        raise ValueError(f"unknown adversarial kind {kind!r}; known: {', '.join(KINDS)}")
    endpoint, json_type = f"{url}/v1/completions", {"content-type": "application/json"}
    text = None
    if kind in ("drop_plain", "drop_stream"):
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                "stream": kind == "drop_stream"}

        async def read_to_the_end() -> int:
            async with client.stream("POST", endpoint, json=body) as response:
                async for _ in response.aiter_bytes():
                    pass
                return response.status_code

        try:  # on the timeout the read is cancelled and its connection closed: the client has left
            status = await asyncio.wait_for(read_to_the_end(), DROP_AFTER_S)
            return AdversarialOutcome(kind, status, None, status == 200, "finished before the client left")
        except asyncio.TimeoutError:
            return AdversarialOutcome(kind, None, None, True, f"hung up after {DROP_AFTER_S} s")
    contents = {
        "nan_temperature": _raw(model, prompt, max_tokens, ', "temperature": NaN'),
        "infinite_top_p": _raw(model, prompt, max_tokens, ', "top_p": Infinity'),
        "deep_json": _raw(model, prompt, max_tokens, ', "stop": ' + "[" * 100_000 + "]" * 100_000),
        "not_json": "{\"model\": ",
        "form_body": _raw(model, prompt, max_tokens),
        "huge_body": _raw(model, "x" * HUGE_BYTES, max_tokens),
        "huge_prompt": _raw(model, "x" * HUGE_PROMPT_CHARS, max_tokens),
        "unknown_model": _raw("no-such-model", prompt, max_tokens),
        "zero_max_tokens": _raw(model, prompt, 0),
        "tiny_temperature": _raw(model, prompt, max_tokens, ', "temperature": 1e-320'),
        "tiny_top_p": _raw(model, prompt, max_tokens, ', "temperature": 0.9, "top_p": 1e-300'),
    }
    headers = {"content-type": "application/x-www-form-urlencoded"} if kind == "form_body" else json_type
    response = await client.post(endpoint, content=contents[kind].encode(), headers=headers)
    expected = EXPECTED_STATUS[kind]
    if response.status_code == 200:
        text = response.json()["choices"][0]["text"]
    elif "error" not in _json_or_empty(response):
        return AdversarialOutcome(kind, response.status_code, None, False, f"no OpenAI error object: {response.text!r}")
    return AdversarialOutcome(kind, response.status_code, text, response.status_code == expected,
                              f"expected {expected}, got {response.status_code}: {response.text[:200]}")


def _json_or_empty(response: httpx.Response) -> dict:
    try:
        value = response.json()
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}

