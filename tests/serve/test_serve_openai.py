"""The official `openai` client against the server on a free loopback port: completions (plain and
streaming), the model list and errors. Oracle: the prompt's solo greedy output."""
from __future__ import annotations

import openai
import pytest

from serve_helpers import demo_server, solo_greedy_ids

PROMPT = "def add(a, b):\n"


@pytest.fixture(scope="module")
def client_and_server():
    with demo_server(k=2) as server:
        yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0), server


def test_completion_and_streaming_equal_solo_greedy(client_and_server):
    client, server = client_and_server
    ids = solo_greedy_ids(server.runner, server.served.encode(PROMPT), 20)
    expected = server.served.decode(ids)
    completion = client.completions.create(model=server.served.name, prompt=PROMPT, max_tokens=20, temperature=0)
    assert completion.choices[0].text == expected
    assert completion.usage.completion_tokens == len(ids)
    assert completion.usage.prompt_tokens == len(server.served.encode(PROMPT))
    assert completion.choices[0].finish_reason in ("stop", "length")
    stream = client.completions.create(model=server.served.name, prompt=PROMPT, max_tokens=20, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert chunks[-1].usage.completion_tokens == completion.usage.completion_tokens


def test_models_and_errors(client_and_server):
    client, server = client_and_server
    assert [m.id for m in client.models.list()] == [server.served.name]
    assert client.models.retrieve(server.served.name).id == server.served.name
    with pytest.raises(openai.NotFoundError) as unknown:
        client.models.retrieve("gpt-4")
    assert unknown.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError) as missing:
        client.completions.create(model="gpt-4", prompt=PROMPT, max_tokens=4)
    assert missing.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as too_long:
        client.completions.create(model=server.served.name, prompt=PROMPT, max_tokens=100000)
    assert too_long.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as chat:
        client.chat.completions.create(model=server.served.name, messages=[{"role": "user", "content": "hi"}])
    assert chat.value.body["code"] == "no_chat_template"


def test_seeded_sampling_is_reproducible_through_the_client(client_and_server):
    client, server = client_and_server
    draws = [client.completions.create(model=server.served.name, prompt=PROMPT, max_tokens=16, temperature=1.0,
                                       top_p=0.9, seed=seed).choices[0].text for seed in (3, 3, 4)]
    assert draws[0] == draws[1]


def test_vllm_extensions_through_extra_body_are_honoured_or_refused(client_and_server):
    """What vLLM's clients send through extra_body: top_k is honoured (1: the greedy token whatever the
    temperature); min_p and repetition_penalty, which the runtime cannot apply exactly, and any field the server
    does not know, are 400s naming the field."""
    client, server = client_and_server
    expected = server.served.decode(solo_greedy_ids(server.runner, server.served.encode(PROMPT), 12))
    top_1 = client.completions.create(model=server.served.name, prompt=PROMPT, max_tokens=12, temperature=1.0,
                                      extra_body={"top_k": 1})
    assert top_1.choices[0].text == expected
    for extra, code in (({"repetition_penalty": 5.0}, "unsupported_parameter"),
                        ({"min_p": 0.2}, "unsupported_parameter"), ({"foo_bar": 1}, "unknown_parameter")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model=server.served.name, prompt=PROMPT, max_tokens=4, extra_body=extra)
        assert refused.value.body["code"] == code and refused.value.body["param"] == next(iter(extra))
