"""/v1/chat/completions: the messages rendered through the model's own chat template (tokenizer_config.json's
`chat_template`, a Jinja template run in a sandbox as transformers' `apply_chat_template` runs it, with
`add_generation_prompt`), then generated like a completion. Validation follows the OpenAI API reference
for chat: `model` and `messages` are required, `max_completion_tokens` (or the older `max_tokens`) bounds
the answer, one choice per request; tools, log probabilities and structured output are refused with a 400
naming the field, and so is a field this server does not know (serve.protocol).
"""
from __future__ import annotations

import json
from functools import lru_cache

from .protocol import (GENERATION_FIELDS, VLLM_NEUTRAL, CompletionParams, RequestError, check_model,
                       generation_params, refuse_unknown, refuse_unsupported, response_object)

CHAT_NEUTRAL = {"n": (None, 1), "logprobs": (None, False), "top_logprobs": (None, 0), "tools": (None, []),
                "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
                "response_format": (None, {"type": "text"}), "presence_penalty": (None, 0, 0.0),
                "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}), "audio": (None,),
                "modalities": (None, ["text"]), "prediction": (None,), "store": (None, False),
                "metadata": (None, {}), "service_tier": (None, "auto", "default"),
                "parallel_tool_calls": (None, True, False), "reasoning_effort": (None,),
                "web_search_options": (None,), **VLLM_NEUTRAL}
CHAT_FIELDS = GENERATION_FIELDS | {"messages", "max_completion_tokens"} | set(CHAT_NEUTRAL)


def parse_chat(value: dict, served_model: str, max_tokens_limit: int) -> tuple[list[dict], CompletionParams]:
    """(messages as {role, content: text}, the generation fields); raises RequestError naming the field."""
    model = check_model(value, served_model)
    messages = _messages(value.get("messages"))
    refuse_unsupported(value, CHAT_NEUTRAL)
    refuse_unknown(value, CHAT_FIELDS)
    if value.get("max_completion_tokens") is not None and value.get("max_tokens") is not None:
        raise RequestError("give max_completion_tokens or max_tokens, not both", param="max_tokens",
                           code="invalid_value")
    field = "max_tokens" if value.get("max_completion_tokens") is None else "max_completion_tokens"
    return messages, generation_params(value, model, None, None, max_tokens_limit, field, add_special_tokens=False)


def _messages(messages) -> list[dict]:
    if messages is None:
        raise RequestError("you must provide a messages parameter", param="messages",
                           code="missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list of {role, content} objects", param="messages",
                           code="invalid_type")
    parsed = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(f"{where} must be an object with a string role", param=where, code="invalid_type")
        parsed.append({"role": message["role"], "content": _content(message.get("content"), f"{where}.content")})
    return parsed


def _content(content, where: str) -> str:
    """A string, or a list of {"type": "text", "text": ...} parts (joined): the only modality served."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(part["text"] for part in content)
    raise RequestError(f"{where} must be a string or a list of text parts (this server serves text only)",
                       param=where, code="invalid_type")


@lru_cache(maxsize=4)
def _compiled(template: str):
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(value, indent=None):
        return json.dumps(value, ensure_ascii=False, indent=indent)

    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
    environment.filters["tojson"] = tojson
    environment.globals["raise_exception"] = raise_exception
    return environment.from_string(template)


def render_chat(template: str, messages: list[dict], special_tokens: dict[str, str]) -> str:
    """The prompt text the template makes of `messages`, ending where the assistant's answer begins.
    A template that refuses the messages (raise_exception: e.g. roles out of order) is a 400."""
    from jinja2 import TemplateError

    try:
        return _compiled(template).render(messages=messages, add_generation_prompt=True, **special_tokens)
    except TemplateError as error:
        raise RequestError(f"the model's chat template refused the messages: {error}", param="messages",
                           code="invalid_value") from None


def chat_body(completion_id: str, created: int, model: str, text: str, finish_reason: str | None,
              token_ids: list[int] | None, usage: dict | None) -> dict:
    choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
              "finish_reason": finish_reason}
    return response_object(completion_id, "chat.completion", created, model, choice, token_ids, usage)


def chat_chunk(completion_id: str, created: int, model: str, text: str, finish_reason: str | None,
               token_ids: list[int] | None, first: bool) -> dict:
    """One streamed chunk: the first delta names the role, later ones carry content only."""
    delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    return response_object(completion_id, "chat.completion.chunk", created, model, choice, token_ids, None)
