"""The server under faults, against a live server on a loopback port, for /v1/completions and
/v1/chat/completions alike: requests that must be refused at the door (oversized, not JSON, NaN, nested
past the reader, unknown model, lengths past the limits, fields this server cannot honour), requests that
must not hurt others (a temperature or nucleus mass below the greedy floor, a huge prompt), clients that
leave (mid-stream, or while a plain request runs), and 64 concurrent requests. Oracle: every completion
equals its prompt's solo greedy output (the target alone)."""
from __future__ import annotations

import asyncio
import json
import shutil
import socket
import threading

import httpx
import pytest

from serve_helpers import demo_server, solo_greedy_ids

PROMPT = "def eggs(b):\n    return"
ENDPOINTS = ["completions", "chat"]
# a small chat template in the usual style (begin with BOS, a header per message, the assistant's header last)
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")


@pytest.fixture(scope="module")
def chat_target(tmp_path_factory):
    """The demo target with a chat template in its tokenizer_config.json."""
    from specbatch.runtime.assembly import DEMO_TARGET

    target = tmp_path_factory.mktemp("chat") / "demo-chat"
    shutil.copytree(DEMO_TARGET, target)
    config = json.loads((target / "tokenizer_config.json").read_text()) | {"chat_template": CHAT_TEMPLATE}
    (target / "tokenizer_config.json").write_text(json.dumps(config))
    return target


@pytest.fixture(scope="module")
def server(chat_target):
    from specbatch.runtime.assembly import DEMO_DRAFT

    with demo_server(target=str(chat_target), draft=str(DEMO_DRAFT), max_batch_size=16, max_waiting=128) as running:
        yield running


def url(server, endpoint: str) -> str:
    return f"{server.url}/v1/{'chat/completions' if endpoint == 'chat' else 'completions'}"


def body(server, endpoint: str, prompt: str = PROMPT, **fields) -> dict:
    if endpoint == "chat":
        return {"model": server.served.name, "messages": [{"role": "user", "content": prompt}], **fields}
    return {"model": server.served.name, "prompt": prompt, **fields}


def prompt_ids(server, endpoint: str, prompt: str) -> list[int]:
    """What the server feeds the model, computed by transformers where a chat template is involved."""
    if endpoint == "chat":
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(server.chat_target / "tokenizer.json"),
                                            bos_token="<bos>", eos_token="<eos>")
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], chat_template=CHAT_TEMPLATE,
                                                  add_generation_prompt=True, tokenize=True, return_dict=False))
    return server.served.encode(prompt)


def greedy_text(server, endpoint: str, prompt: str, max_tokens: int) -> str:
    return server.served.decode(solo_greedy_ids(server.runner, prompt_ids(server, endpoint, prompt), max_tokens))


def answer_text(endpoint: str, response: httpx.Response) -> str:
    choice = response.json()["choices"][0]
    return choice["message"]["content"] if endpoint == "chat" else choice["text"]


def assert_error(response: httpx.Response, status: int, code: str, param: str | None = None, *fragments: str):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error
    for fragment in fragments:
        assert fragment in error["message"], error["message"]


def metrics(server) -> dict:
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
            for line in httpx.get(f"{server.url}/metrics").text.splitlines() if line and not line.startswith("#")}


def wait_for(predicate, timeout_s: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


@pytest.fixture(autouse=True)
def _chat_target_on_server(server, chat_target):
    server.chat_target = chat_target


# -------------------------------------------------------------------------------------------- the door
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_a_body_past_the_limit_gets_413_declared_or_chunked(server, endpoint):
    from specbatch.serve.protocol import MAX_BODY_BYTES

    huge = json.dumps(body(server, endpoint, "x" * (10 << 20))).encode()
    assert_error(httpx.post(url(server, endpoint), content=huge, headers={"content-type": "application/json"}),
                 413, "request_too_large", None, str(MAX_BODY_BYTES))
    chunks = (huge[i:i + 65536] for i in range(0, len(huge), 65536))  # no content-length: read up to the limit
    assert_error(httpx.post(url(server, endpoint), content=chunks, headers={"content-type": "application/json"}),
                 413, "request_too_large")
    assert httpx.get(f"{server.url}/health").json()["status"] == "ok"


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_a_body_that_is_not_json_gets_4xx(server, endpoint):
    assert_error(httpx.post(url(server, endpoint), content=b"{not json", headers={"content-type": "application/json"}),
                 400, "invalid_json")
    valid = json.dumps(body(server, endpoint, max_tokens=2)).encode()
    for content_type in ("application/x-www-form-urlencoded", "text/plain"):
        assert_error(httpx.post(url(server, endpoint), content=valid, headers={"content-type": content_type}),
                     415, "invalid_content_type", None, content_type)
    ok = httpx.post(url(server, endpoint), content=valid, headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_nan_and_infinity_get_400_and_the_connection_serves_the_next_request(server, endpoint):
    with httpx.Client(timeout=60) as client:  # one keep-alive connection
        for field, constant in (("temperature", "NaN"), ("top_p", "NaN"), ("temperature", "Infinity"),
                                ("top_p", "-Infinity")):
            raw = json.dumps(body(server, endpoint, max_tokens=2))[:-1] + f', "{field}": {constant}}}'
            response = client.post(url(server, endpoint), content=raw, headers={"content-type": "application/json"})
            assert_error(response, 400, "invalid_json", None, f"{constant} is not a JSON number")
        after = client.post(url(server, endpoint), json=body(server, endpoint, max_tokens=4, temperature=0))
        assert after.status_code == 200
        assert answer_text(endpoint, after) == greedy_text(server, endpoint, PROMPT, 4)


LONE = "\ud800"  # a UTF-16 surrogate without its pair: JSON may spell it (as an escape), Unicode text holds none


@pytest.mark.parametrize("endpoint, fields, param", [
    ("completions", {"prompt": LONE + "abc"}, "prompt"),
    ("completions", {"prompt": [LONE + "abc"]}, "prompt[0]"),
    ("completions", {"prompt": [LONE + "a", "b" + LONE]}, "prompt[0]"),
    ("completions", {"stop": ["x", LONE]}, "stop[1]"),
    ("completions", {"model": LONE}, "model"),
    ("completions", {LONE: 1}, None),
    ("chat", {"messages": [{"role": "user", "content": "abc" + LONE}]}, "messages[0].content"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
     "messages[0].content[0].text"),
    ("chat", {"messages": [{"role": "user" + LONE, "content": "hi"}]}, "messages[0].role"),
    ("chat", {"messages": [{"role": "user", "content": "hi", "\udfff": "x"}]}, "messages[0]"),
])
def test_a_lone_surrogate_gets_400_naming_the_field_and_the_connection_serves_the_next_request(
        server, endpoint, fields, param, caplog):
    raw = json.dumps(body(server, endpoint, max_tokens=2) | fields)  # json.dumps escapes the surrogate: \ud800
    assert "\\ud800" in raw or "\\udfff" in raw
    with httpx.Client(timeout=60) as client:  # one keep-alive connection
        response = client.post(url(server, endpoint), content=raw, headers={"content-type": "application/json"})
        assert_error(response, 400, "invalid_value", param, "lone UTF-16 surrogate", "valid Unicode")
        assert (param or "a field name") in response.json()["error"]["message"]
        after = client.post(url(server, endpoint), json=body(server, endpoint, max_tokens=4, temperature=0))
        assert after.status_code == 200 and answer_text(endpoint, after) == greedy_text(server, endpoint, PROMPT, 4)
    assert not [r for r in caplog.records if r.levelname == "ERROR"]  # no traceback in the server's log


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_a_surrogate_pair_is_text_and_is_served(server, endpoint):
    raw = json.dumps(body(server, endpoint, PROMPT + " \U0001F600", max_tokens=3, temperature=0))
    assert "\\ud83d\\ude00" in raw  # the pair, escaped as JSON spells it
    response = httpx.post(url(server, endpoint), content=raw, headers={"content-type": "application/json"})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_json_nested_past_the_reader_gets_400(server, endpoint):
    deep = "[" * 100_000 + "]" * 100_000
    for raw in (deep, json.dumps(body(server, endpoint))[:-1] + f', "stop": {deep}}}'):
        response = httpx.post(url(server, endpoint), content=raw, headers={"content-type": "application/json"})
        assert_error(response, 400, "invalid_json")


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_an_unknown_model_gets_404_in_openais_shape(server, endpoint):
    response = httpx.post(url(server, endpoint), json=body(server, endpoint) | {"model": "gpt-4"})
    assert_error(response, 404, "model_not_found", "model", "gpt-4", server.served.name)
    assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("endpoint, field", [("completions", "max_tokens"), ("chat", "max_tokens"),
                                             ("chat", "max_completion_tokens")])
def test_max_tokens_zero_or_past_the_limits_names_the_limit(server, endpoint, field):
    limit, context = server.served.max_tokens_limit, server.runner.engine.max_context_tokens
    for value in (0, limit + 1):
        response = httpx.post(url(server, endpoint), json=body(server, endpoint, **{field: value}))
        assert_error(response, 400, "invalid_value", field, f"[1, {limit}]", str(value))
    long_prompt = "x = 1\n" * (context // 4)  # fits alone, not with max_tokens = limit
    response = httpx.post(url(server, endpoint), json=body(server, endpoint, long_prompt, **{field: limit}))
    assert_error(response, 400, "context_length_exceeded", None, f"maximum context length is {context} tokens")


@pytest.mark.parametrize("endpoint, fields, param", [
    ("completions", {"n": 2}, "n"), ("completions", {"logprobs": 1}, "logprobs"),
    ("completions", {"echo": True}, "echo"), ("completions", {"best_of": 3}, "best_of"),
    ("chat", {"n": 2}, "n"), ("chat", {"logprobs": True}, "logprobs"), ("chat", {"top_logprobs": 2}, "top_logprobs"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("chat", {"response_format": {"type": "json_object"}}, "response_format"),
])
def test_fields_this_server_cannot_honour_get_400_naming_the_field(server, endpoint, fields, param):
    response = httpx.post(url(server, endpoint), json=body(server, endpoint, **fields))
    assert_error(response, 400, "unsupported_parameter", param, param)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("fields, param", [({"min_p": 0.1}, "min_p"), ({"repetition_penalty": 5.0},
                                                                     "repetition_penalty")])
def test_vllm_sampling_extensions_the_runtime_cannot_honour_exactly_get_400(server, endpoint, fields, param):
    response = httpx.post(url(server, endpoint), json=body(server, endpoint, **fields))
    assert_error(response, 400, "unsupported_parameter", param, param)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_an_unknown_field_gets_400_naming_it(server, endpoint):
    response = httpx.post(url(server, endpoint), json=body(server, endpoint, foo_bar=1, max_tokens=2))
    assert_error(response, 400, "unknown_parameter", "foo_bar", '"foo_bar"', "refuses fields it does not know")
    response = httpx.post(url(server, endpoint), json=body(server, endpoint, ignore_eos=True, min_tokens=3))
    assert_error(response, 400, "unknown_parameter", "ignore_eos", '"ignore_eos", "min_tokens"')
    response = httpx.post(url(server, endpoint), json=body(server, endpoint, user=5))
    assert_error(response, 400, "invalid_type", "user")


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_neutral_values_of_those_fields_are_accepted(server, endpoint):
    neutral = {"n": 1, "logprobs": None if endpoint == "completions" else False, "min_p": 0.0,
               "repetition_penalty": 1.0, "top_k": -1, "user": "someone"}
    response = httpx.post(url(server, endpoint), json=body(server, endpoint, max_tokens=3, temperature=0, **neutral))
    assert response.status_code == 200


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_a_stop_string_ends_the_text_before_it(server, endpoint):
    reference = greedy_text(server, endpoint, PROMPT, 40)
    stop = reference[12:15]
    assert stop and reference.index(stop) > 0
    response = httpx.post(url(server, endpoint), json=body(server, endpoint, max_tokens=40, temperature=0,
                                                           stop=[stop, "never appears §"],
                                                           return_token_ids=True), timeout=60)
    text = reference[:reference.index(stop)]
    assert answer_text(endpoint, response) == text
    assert response.json()["choices"][0]["finish_reason"] == "stop"
    # the tokens sent and counted are those of the text: none accepted past the stop in the same step
    ids = response.json()["choices"][0]["token_ids"]
    assert response.json()["usage"]["completion_tokens"] == len(ids)
    assert server.served.decode(ids).startswith(text) and len(server.served.decode(ids[:-1])) < len(text)


def test_an_empty_prompt_is_refused(server):
    for prompt in ("", [""]):
        response = httpx.post(url(server, "completions"), json={"model": server.served.name, "prompt": prompt})
        assert_error(response, 400, "invalid_value", "prompt", "empty")


# --------------------------------------------------------------------------- one client, others unharmed
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_tiny_temperatures_and_nucleus_masses_are_greedy_and_hurt_nobody(server, endpoint):
    prompts = [PROMPT, "import os\nimport sys\n\n\ndef main(", "class Stack:\n    def push(self, x):\n"]
    settings = [{"temperature": 0}, {"temperature": 1e-320}, {"temperature": 0.9, "top_p": 1e-300},
                {"temperature": 0}, {"temperature": 5e-6, "seed": 3}, {"temperature": 0}]

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*[
                client.post(url(server, endpoint), json=body(server, endpoint, prompts[i % 3], max_tokens=12, **s))
                for i, s in enumerate(settings)])

    for i, response in enumerate(asyncio.run(run())):
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["finish_reason"] in ("stop", "length")
        assert answer_text(endpoint, response) == greedy_text(server, endpoint, prompts[i % 3], 12)


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_top_k_one_is_the_greedy_token_whatever_the_temperature(server, endpoint):
    response = httpx.post(url(server, endpoint), json=body(server, endpoint, max_tokens=12, temperature=1.0, top_k=1,
                                                           seed=5))
    assert response.status_code == 200, response.text
    assert answer_text(endpoint, response) == greedy_text(server, endpoint, PROMPT, 12)


def _target_top_k(server, ids: list[int], prompt_len: int, k: int) -> list[set[int]]:
    """For each token after the prompt, the target's k most likely tokens where it was drawn."""
    import torch

    with torch.inference_mode():
        logits = server.runner.engine.generator.target(torch.tensor([ids]))[0]
    return [set(logits[position - 1].topk(k).indices.tolist()) for position in range(prompt_len, len(ids))]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_top_k_is_honoured_every_token_among_the_targets_top_k(server, endpoint):
    """A hot temperature spreads the mass over the vocabulary: without the filter, 4 x 24 tokens would leave the
    top 3 many times; speculative sampling of the filtered distributions never draws a token the target's
    filtered distribution gives probability 0."""
    prompt = prompt_ids(server, endpoint, PROMPT)
    for seed in range(4):
        response = httpx.post(url(server, endpoint), json=body(server, endpoint, max_tokens=24, temperature=2.0,
                                                               top_k=3, seed=seed, return_token_ids=True))
        assert response.status_code == 200, response.text
        drawn = response.json()["choices"][0]["token_ids"]
        allowed = _target_top_k(server, prompt + drawn, len(prompt), 3)
        assert all(token in top for token, top in zip(drawn, allowed)), (seed, drawn)


def test_top_k_reaches_the_engine_as_the_requests_sampling(server, monkeypatch):
    """What the runtime's exact-sampling tests cover (tests/runtime/test_runtime_sampling.py: top-k through
    speculative sampling is the target's filtered distribution) is what the request asked for; no filter is
    -1, 0, or a k at least the vocabulary."""
    from specbatch.runtime.sampling import Sampling

    seen = []
    submit = server.runner.submit
    monkeypatch.setattr(server.runner, "submit", lambda request, loop: seen.append(request.sampling) or
                        submit(request, loop))
    texts = []
    vocab = server.runner.engine.generator.target.config.vocab_size
    for top_k in (7, -1, 0, vocab, None):
        fields = {} if top_k is None else {"top_k": top_k}
        response = httpx.post(url(server, "completions"), json=body(server, "completions", max_tokens=10,
                                                                    temperature=0.8, top_p=0.9, seed=11, **fields))
        assert response.status_code == 200, response.text
        texts.append(answer_text("completions", response))
    assert seen[0] == Sampling(temperature=0.8, top_k=7, top_p=0.9)
    assert seen[1:3] == [Sampling(temperature=0.8, top_p=0.9)] * 2 and seen[3].top_k == vocab
    assert texts[1] == texts[2] == texts[3] == texts[4]  # one seed, one distribution: one text


@pytest.mark.parametrize("value, code", [(-2, "invalid_value"), (1.5, "invalid_type"), ("3", "invalid_type"),
                                         (True, "invalid_type"), (2**40, "invalid_value")])
def test_a_top_k_that_is_no_setting_gets_400(server, value, code):
    assert_error(httpx.post(url(server, "completions"), json=body(server, "completions", top_k=value)), 400, code,
                 "top_k")


def test_a_prompt_too_long_for_the_context_is_refused_untokenized(server, monkeypatch):
    calls = []
    encode = server.served.encode
    object.__setattr__(server.served, "encode", lambda *args: calls.append(threading.current_thread()) or encode(*args))
    try:
        huge = "x" * (3 << 20)  # under the body limit, far past what 1024 tokens can hold
        response = httpx.post(url(server, "completions"), json=body(server, "completions", huge), timeout=60)
        assert_error(response, 400, "context_length_exceeded", "prompt", str(len(huge)),
                     str(server.served.max_prompt_chars))
        assert calls == []  # refused by its length in characters: never tokenized
        assert httpx.post(url(server, "completions"), json=body(server, "completions", max_tokens=2)).status_code == 200
        assert calls and all(thread is not threading.main_thread() for thread in calls)
        assert all(thread.name != "specbatch-engine" for thread in calls)
    finally:
        object.__setattr__(server.served, "encode", encode)


def test_a_chat_prompt_is_transformers_apply_chat_template_token_for_token(server):
    from specbatch.serve.chat import render_chat

    for content in (PROMPT, "héllo ✓\n"):
        text = render_chat(CHAT_TEMPLATE, [{"role": "user", "content": content}], server.served.special_tokens)
        expected = prompt_ids(server, "chat", content)
        assert server.served.encode(text, False) == expected and expected.count(256) == 1  # the template's BOS only
    parts = [{"type": "text", "text": "two "}, {"type": "text", "text": "parts"}]  # text parts are joined
    response = httpx.post(url(server, "chat"), json=body(server, "chat", max_tokens=6, temperature=0)
                          | {"messages": [{"role": "user", "content": parts}]})
    assert answer_text("chat", response) == greedy_text(server, "chat", "two parts", 6)
    assert response.json()["object"] == "chat.completion" and response.json()["id"].startswith("chatcmpl-")


def test_the_servers_tokenizer_gives_the_tokenizers_ids(server):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(server.chat_target / "tokenizer.json"))
    for text in (PROMPT, "héllo wörld ✓\n\ttabs", "x" * 5000):
        assert server.served.encode(text) == tokenizer.encode(text).ids
        assert server.served.encode(text, False) == tokenizer.encode(text, add_special_tokens=False).ids
    assert server.served.max_prompt_chars >= server.runner.engine.max_context_tokens * 2


# ------------------------------------------------------------------------------------- clients that leave
@pytest.fixture
def endless(server, monkeypatch):
    """No EOS: a request runs until max_tokens or until it is cancelled."""
    monkeypatch.setattr(server.runner.engine.generator, "eos_token_ids", ())


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_a_plain_request_whose_client_leaves_is_cancelled_and_frees_its_slot(server, endpoint, endless):
    before = metrics(server)
    payload = json.dumps(body(server, endpoint, max_tokens=900, temperature=0)).encode()
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    with socket.create_connection((server.host, server.port)) as raw:
        raw.sendall(f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                    f"content-length: {len(payload)}\r\n\r\n".encode() + payload)
        wait_for(lambda: server.runner.engine.running == 1)
    # the client hung up without reading: the request is cancelled, not run to its 900 tokens
    cancelled = 'specbatch_requests_finished_total{reason="cancelled"}'
    wait_for(lambda: metrics(server).get(cancelled, 0) == before.get(cancelled, 0) + 1)
    wait_for(lambda: server.runner.engine.running == 0 and server.runner.engine.reserved_tokens == 0)
    after = metrics(server)
    length = 'specbatch_requests_finished_total{reason="length"}'
    assert after.get(length, 0) == before.get(length, 0)
    assert after['specbatch_requests_running{model="demo-chat"}'] == 0


def test_a_chat_stream_dropped_mid_way_frees_its_slot(server, endless):
    cancelled = 'specbatch_requests_finished_total{reason="cancelled"}'
    before = metrics(server).get(cancelled, 0)
    with httpx.stream("POST", url(server, "chat"), timeout=60,
                      json=body(server, "chat", max_tokens=900, temperature=0, stream=True)) as response:
        first = json.loads(next(line for line in response.iter_lines() if line.startswith("data: "))[6:])
        assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"]["role"] == "assistant"
    wait_for(lambda: metrics(server).get(cancelled, 0) == before + 1)
    wait_for(lambda: metrics(server)['specbatch_requests_running{model="demo-chat"}'] == 0)


# ----------------------------------------------------------------------------------- many clients at once
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_64_concurrent_requests_all_complete_and_none_is_crossed(server, endpoint):
    bases = [PROMPT, "import os\nimport sys\n\n\ndef main(", "class Stack:\n    def push(self, x):\n", "# list\nxs = ["]
    prompts = [f"{bases[i % 4]}{' ' * (i // 4)}" for i in range(64)]
    lengths = [4 + i % 9 for i in range(64)]
    streamed = {i for i in range(64) if i % 3 == 0}

    async def one(client, i):
        fields = dict(max_tokens=lengths[i], temperature=0, stream=i in streamed)
        if i not in streamed:
            return answer_text(endpoint, await client.post(url(server, endpoint), json=body(server, endpoint,
                                                                                            prompts[i], **fields)))
        text = []
        async with client.stream("POST", url(server, endpoint), json=body(server, endpoint, prompts[i], **fields)) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = json.loads(line[6:])["choices"][0]
                    text.append(choice["delta"].get("content", "") if endpoint == "chat" else choice["text"])
        return "".join(text)

    async def run():
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64)) as client:
            return await asyncio.gather(*[one(client, i) for i in range(64)])

    texts = asyncio.run(run())
    for i, text in enumerate(texts):
        assert text == greedy_text(server, endpoint, prompts[i], lengths[i]), i
    wait_for(lambda: server.runner.engine.running == 0 and server.runner.engine.waiting == 0)


# ------------------------------------------------------------------------ every hostile kind, mixed in
def test_every_adversarial_kind_mixed_with_well_formed_requests_changes_none_of_them(server, endless):
    from specbatch.serve.adversarial import KINDS, send_adversarial

    prompts = [PROMPT, "import os\nimport sys\n\n\ndef main(", "class Stack:\n    def push(self, x):\n"]
    errors = 'specbatch_requests_finished_total{reason="error"}'
    before = metrics(server).get(errors, 0)

    async def run():
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64)) as client:
            normal = [client.post(url(server, "completions"), json=body(server, "completions", prompts[i % 3],
                                                                         max_tokens=10 + i, temperature=0))
                      for i in range(9)]
            hostile = [send_adversarial(client, server.url, kind, server.served.name, prompts[i % 3], max_tokens=10)
                       for i, kind in enumerate(KINDS)]
            results = await asyncio.gather(*normal, *hostile)
            return results[:len(normal)], results[len(normal):]

    normal, hostile = asyncio.run(run())
    for i, response in enumerate(normal):
        assert response.status_code == 200 and response.json()["choices"][0]["finish_reason"] == "length"
        assert answer_text("completions", response) == greedy_text(server, "completions", prompts[i % 3], 10 + i)
    for i, outcome in enumerate(hostile):
        assert outcome.as_expected, (outcome.kind, outcome.detail)
        if outcome.text is not None:
            assert outcome.text == greedy_text(server, "completions", prompts[i % 3], 10), outcome.kind
    wait_for(lambda: server.runner.engine.running == 0 and server.runner.engine.waiting == 0)
    assert metrics(server).get(errors, 0) == before  # no step failed
