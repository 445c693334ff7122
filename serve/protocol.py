"""The OpenAI completions protocol: request validation, error objects, response bodies.

Pure functions on JSON values (no FastAPI, no torch), so every rule is testable on its own. Rules follow
the OpenAI API reference for /v1/completions: `model` and `prompt` are required; `max_tokens` defaults
to 16 and `temperature` to 1; one prompt and one choice per request (n = 1); fields this server cannot
honour (logprobs, echo, suffix, best_of > 1, penalties, logit_bias; vLLM's min_p and repetition_penalty) are
refused, not silently ignored, and so is a field this server does not know (as OpenAI's API answers 400).
Extensions: `top_k` (vLLM's, sent through the OpenAI client's extra_body: -1 or 0 for none; applied to the
draft's and the target's distributions alike, so speculative sampling stays exact), and `return_token_ids:
true`, which adds each choice's (or chunk's) token ids, for clients that check outputs token by token (the
load test does).
"""
from __future__ import annotations

import json
import re
import time
import uuid
from dataclasses import dataclass

from specbatch.perfmodel.errors import SpecbatchError


class RequestError(SpecbatchError):
    """A request the server refuses, with what the OpenAI error object needs."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = message, param, code, status, kind

    def body(self) -> dict:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass(frozen=True)
class CompletionParams:
    model: str
    prompt_text: str | None  # exactly one of prompt_text and prompt_ids is set
    prompt_ids: tuple[int, ...] | None
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    return_token_ids: bool
    add_special_tokens: bool = True  # False for a chat template's text, which holds its own (transformers' rule)
    top_k: int = 0  # 0: no top-k filter


MAX_STOP_STRINGS = 4  # as OpenAI
TOP_K_LIMIT = 2**31 - 1  # any top_k at or past the vocabulary keeps every token; larger numbers are no settings


MAX_BODY_BYTES = 4 << 20  # a request body larger than this gets 413: far above any prompt a context holds


def _not_a_number(constant: str):
    raise RequestError(f"the request body is not valid JSON ({constant} is not a JSON number)", code="invalid_json")


def check_content_type(content_type: str | None) -> None:
    """A body sent as something else than JSON (a form, plain text) is refused; no header is taken as JSON."""
    if content_type is None:
        return
    media = content_type.split(";", 1)[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise RequestError(f"content-type must be application/json, got {content_type!r}", code="invalid_content_type",
                           status=415)


def parse_json_object(body: bytes) -> dict:
    """The body as a JSON object; NaN and Infinity (which Python's reader accepts) and nesting deeper than
    the reader's recursion are 400s, not a value that breaks a step or a 500."""
    try:
        value = json.loads(body, parse_constant=_not_a_number)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RequestError(f"the request body is not valid JSON ({error})", code="invalid_json") from None
    except RecursionError:
        raise RequestError("the request body nests JSON too deeply", code="invalid_json") from None
    if not isinstance(value, dict):
        raise RequestError("the request body must be a JSON object", code="invalid_json")
    if _SURROGATE_ESCAPE.search(body):
        _refuse_lone_surrogates(value)
    return value


# JSON spells a UTF-16 surrogate only as an escape (raw surrogate bytes are not UTF-8, refused above); a body
# without one holds none, and needs no walk
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")


def _refuse_lone_surrogates(body: dict) -> None:
    """A string holding a lone UTF-16 surrogate ("\\ud800" without its pair) is no Unicode text: no tokenizer
    takes it, and no response can echo it as UTF-8. Refused, naming where it is (`prompt`, `messages[0].content`,
    or the object whose field name holds it)."""
    pending: list[tuple[str, str | None, object]] = [(name, name, item) for name, item in reversed(body.items())]
    pending += [("a field name", None, name) for name in body]
    while pending:  # depth first, without recursion: the body may nest as deep as the JSON reader allows
        where, param, item = pending.pop()
        if isinstance(item, str):
            if not _is_text(item):
                bad = next(i for i, c in enumerate(item) if 0xD800 <= ord(c) <= 0xDFFF)
                raise RequestError(f"{where} holds a lone UTF-16 surrogate (\\u{ord(item[bad]):04x} at character "
                                   f"{bad}): text must be valid Unicode", param=param, code="invalid_value")
        elif isinstance(item, dict):
            pending += [(f"{where}.{name}", f"{where}.{name}", child) for name, child in reversed(item.items())
                        if _is_text(name)]
            pending += [(f"a field name in {where}", where, name) for name in item]
        elif isinstance(item, list):
            pending += [(f"{where}[{i}]", f"{where}[{i}]", child) for i, child in reversed(list(enumerate(item)))]


def _is_text(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_model(value: dict, served: str) -> str:
    model = value.get("model")
    if model is None:
        raise RequestError("you must provide a model parameter", param="model", code="missing_required_parameter")
    if not isinstance(model, str):
        raise RequestError("model must be a string", param="model", code="invalid_type")
    if model != served:
        raise RequestError(f"the model `{model}` does not exist; this server serves `{served}`", param="model",
                           code="model_not_found", status=404)
    return model


def _number(value: dict, name: str, default, low: float, high: float, low_open: bool = False, integer=False):
    got = value.get(name, default)
    if got is None:
        return default
    kinds = (int,) if integer else (int, float)
    if isinstance(got, bool) or not isinstance(got, kinds):
        raise RequestError(f"{name} must be {'an integer' if integer else 'a number'}, got {json.dumps(got)}",
                           param=name, code="invalid_type")
    if got < low or got > high or (low_open and got == low):
        interval = f"{'(' if low_open else '['}{_text(low)}, {_text(high)}]"
        raise RequestError(f"{name} must be in {interval}, got {got}", param=name, code="invalid_value")
    return got


def _text(number) -> str:
    return str(number) if isinstance(number, int) else f"{number:g}"


def _prompt(value: dict):
    """(text, None) or (None, token ids): a string, a list of one string, token ids, or a list of one list."""
    prompt = value.get("prompt")
    if prompt is None:
        raise RequestError("you must provide a prompt parameter", param="prompt", code="missing_required_parameter")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if prompt == "":
        raise RequestError("the prompt is empty: give text for the model to continue", param="prompt",
                           code="invalid_value")
    if isinstance(prompt, str):
        return prompt, None
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return None, tuple(prompt)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
        raise RequestError("one prompt per request: send several requests (they are batched together)",
                           param="prompt", code="invalid_value")
    raise RequestError("prompt must be a string, a list of token ids, or a list holding one of them",
                       param="prompt", code="invalid_type")


# Fields this server cannot honour, with the values that ask for nothing (accepted): anything else is a 400
# naming the field, never a silent ignore. vLLM's min_p and repetition_penalty (clients send them through
# extra_body) are among them: the runtime's sampling has neither, and a penalty that follows the tokens so far
# would have to shape the draft's and the target's distributions alike for speculative sampling to stay exact.
VLLM_NEUTRAL = {"min_p": (None, 0, 0.0), "repetition_penalty": (None, 1, 1.0)}
COMPLETION_NEUTRAL = {"n": (None, 1), "best_of": (None, 1), "echo": (None, False), "logprobs": (None,),
                      "suffix": (None, ""), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
                      "logit_bias": (None, {}), **VLLM_NEUTRAL}
# The fields both endpoints take (`user`, an end-user id for OpenAI's abuse monitoring, changes no output)
GENERATION_FIELDS = frozenset({"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
                               "stream_options", "return_token_ids", "user"})
COMPLETION_FIELDS = GENERATION_FIELDS | {"prompt"} | set(COMPLETION_NEUTRAL)


def refuse_unsupported(value: dict, neutral: dict) -> None:
    for name, accepted in neutral.items():
        if name in value and not any(value[name] == a and type(value[name]) is type(a) for a in accepted):
            raise RequestError(f"{name}={json.dumps(value[name])} is not supported by this server",
                               param=name, code="unsupported_parameter")


def refuse_unknown(value: dict, known: frozenset[str] | set[str]) -> None:
    """A field this server does not know is a 400 naming it, as OpenAI's API answers: ignoring it would
    answer 200 to a request that asked for something else (a misspelt field, another server's extension)."""
    unknown = [name for name in value if name not in known]
    if unknown:
        raise RequestError(f"unrecognized request field{'s' if len(unknown) > 1 else ''} "
                           f"{', '.join(json.dumps(name) for name in unknown)}: this server refuses fields it does "
                           "not know instead of ignoring them (its docs list those it takes)", param=unknown[0],
                           code="unknown_parameter")


def parse_completion(value: dict, served_model: str, max_tokens_limit: int) -> CompletionParams:
    """Validate a /v1/completions body (already a JSON object); raises RequestError naming the field."""
    model = check_model(value, served_model)
    text, ids = _prompt(value)
    refuse_unsupported(value, COMPLETION_NEUTRAL)
    refuse_unknown(value, COMPLETION_FIELDS)
    return generation_params(value, model, text, ids, max_tokens_limit)


def generation_params(value: dict, model: str, text: str | None, ids: tuple[int, ...] | None, max_tokens_limit: int,
                      max_tokens_field: str = "max_tokens", add_special_tokens: bool = True) -> CompletionParams:
    """The fields completions and chat share: length, sampling, seed, stop strings, streaming."""
    max_tokens = _number(value, max_tokens_field, 16, 1, max_tokens_limit, integer=True)
    temperature = _number(value, "temperature", 1.0, 0.0, 2.0)
    top_p = _number(value, "top_p", 1.0, 0.0, 1.0, low_open=True)
    top_k = max(0, _number(value, "top_k", 0, -1, TOP_K_LIMIT, integer=True))  # vLLM's -1: no filter, as 0
    if not isinstance(value.get("user"), (str, type(None))):
        raise RequestError("user must be a string", param="user", code="invalid_type")
    seed = _number(value, "seed", None, -(2**63), 2**63 - 1, integer=True)
    stop = value.get("stop")
    if stop is None:
        stop = ()
    elif isinstance(stop, str):
        stop = (stop,)
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = tuple(stop)
    else:
        raise RequestError("stop must be a string or a list of strings", param="stop", code="invalid_type")
    if len(stop) > MAX_STOP_STRINGS or any(s == "" for s in stop):
        raise RequestError(f"stop takes up to {MAX_STOP_STRINGS} non-empty strings", param="stop",
                           code="invalid_value")
    flags = {}
    for name in ("stream", "return_token_ids"):
        flags[name] = value.get(name, False)
        if flags[name] is None:
            flags[name] = False
        if not isinstance(flags[name], bool):
            raise RequestError(f"{name} must be a boolean", param=name, code="invalid_type")
    options = value.get("stream_options")
    if options is not None and (not isinstance(options, dict)
                                or not isinstance(options.get("include_usage", False), bool)):
        raise RequestError("stream_options must be an object like {\"include_usage\": true}", param="stream_options",
                           code="invalid_type")
    if options is not None and not flags["stream"]:
        raise RequestError("stream_options is only allowed with stream: true", param="stream_options",
                           code="invalid_value")
    return CompletionParams(model, text, ids, max_tokens, float(temperature), float(top_p),
                            None if seed is None else int(seed), stop, flags["stream"],
                            bool(options and options.get("include_usage")), flags["return_token_ids"],
                            add_special_tokens, int(top_k))


def new_completion_id(prefix: str = "cmpl") -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def completion_body(completion_id: str, created: int, model: str, text: str, finish_reason: str | None,
                    token_ids: list[int] | None, usage: dict | None) -> dict:
    """A completion object, or (usage None, text a delta) one streamed chunk of one."""
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    return response_object(completion_id, "text_completion", created, model, choice, token_ids, usage)


def response_object(completion_id: str, object_name: str, created: int, model: str, choice: dict,
                    token_ids: list[int] | None, usage: dict | None) -> dict:
    """An OpenAI response object (or chunk) with its one choice; the extension's token ids go in the choice."""
    if token_ids is not None:
        choice = {**choice, "token_ids": token_ids}
    body = {"id": completion_id, "object": object_name, "created": created, "model": model, "choices": [choice]}
    if usage is not None:
        body["usage"] = usage
    return body


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def models_body(model: str, created: int, draft: dict | None = None) -> dict:
    """The model list: the one served model and, beside OpenAI's fields, what drafts for it (`draft`: {"id",
    "kind": draft_model | eagle3 | mtp}; None without speculation)."""
    return {"object": "list", "data": [{"id": model, "object": "model", "created": created, "owned_by": "specbatch",
                                        "draft": draft}]}


def now_s() -> int:
    return int(time.time())
