"""The OpenAI-compatible HTTP face (FastAPI): /v1/completions, /v1/chat/completions (serve.chat),
/v1/models, /health (503 while shutting down), /metrics. Handlers validate (serve.protocol), submit to the
engine's thread (serve.runner) and stream its events; they never touch torch.

Errors are OpenAI error objects {"error": {"message", "type", "param", "code"}}: bad input 400, unknown
model 404, a body that is not JSON 415, a body over `protocol.MAX_BODY_BYTES` 413, a full queue 429 with
Retry-After, shutting down 503. Every request is checked at the door, before it reaches the engine: no
value one client sends can fail a step that other clients' requests share. A client that disconnects
cancels its request: a stream at its next chunk, a plain request as soon as the server sees the connection
close. Prompts are tokenized in a worker thread (after a length check in characters), so a huge prompt
does not stall the event loop.
"""
from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specbatch.runtime.engine import EngineClosed, EngineError, QueueFull, Request as EngineRequest
from specbatch.runtime.sampling import Sampling

from . import protocol
from .chat import chat_body, chat_chunk, parse_chat, render_chat
from .metrics import CONTENT_TYPE, render_metrics
from .protocol import RequestError
from .runner import EngineRunner

log = logging.getLogger("specbatch.serve")

RETRY_AFTER_S = 1  # what a 429 tells the client: a step takes milliseconds, a queue drains in seconds


@dataclass(frozen=True)
class ServedModel:
    name: str  # what clients put in "model"
    encode: Callable[..., list[int]]  # (text, add_special_tokens=True); called in a worker thread: it must
    decode: Callable[[list[int]], str]  # release the GIL on long texts
    max_tokens_limit: int  # the largest max_tokens a request may ask for
    chat_template: str | None  # the tokenizer's, when it ships one
    max_prompt_chars: int  # a longer prompt cannot fit the context, whatever its tokens: refused untokenized
    special_tokens: dict = field(default_factory=dict)  # bos_token, eos_token, ... for the chat template
    draft: dict | None = None  # what drafts, as /v1/models describes it ({"id", "kind"}); None: nothing


@dataclass(frozen=True)
class Shape:
    """What differs between completions and chat completions: ids and objects; the flow is shared."""

    id_prefix: str
    body: Callable[..., dict]  # (id, created, model, text, finish_reason, token_ids, usage)
    chunk: Callable[..., dict]  # (id, created, model, text, finish_reason, token_ids, first)
    object_name: str  # of the usage chunk
    prompt_field: str  # the field the prompt's text comes from, named by errors about that text


COMPLETION = Shape("cmpl", protocol.completion_body,
                   lambda *fields, first: protocol.completion_body(*fields, None), "text_completion", "prompt")
CHAT = Shape("chatcmpl", chat_body, chat_chunk, "chat.completion.chunk", "messages")


async def read_json_body(request: Request) -> dict:
    """The body as a JSON object, read no further than MAX_BODY_BYTES (413 beyond), sent as JSON (415)."""
    protocol.check_content_type(request.headers.get("content-type"))
    too_large = RequestError(f"the request body is larger than {protocol.MAX_BODY_BYTES} bytes",
                             code="request_too_large", status=413)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > protocol.MAX_BODY_BYTES:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > protocol.MAX_BODY_BYTES:
            raise too_large
    return protocol.parse_json_object(bytes(body))


async def prompt_ids_of(params: protocol.CompletionParams, served: ServedModel) -> tuple[int, ...]:
    if params.prompt_ids is not None:
        return params.prompt_ids
    if len(params.prompt_text) > served.max_prompt_chars:
        raise RequestError(f"the prompt has {len(params.prompt_text)} characters: more than this model's context can "
                           f"hold ({served.max_prompt_chars} at most); shorten the prompt", param="prompt",
                           code="context_length_exceeded")
    return tuple(await asyncio.to_thread(served.encode, params.prompt_text, params.add_special_tokens))


def _error(error: RequestError) -> JSONResponse:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if error.status == 429 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def create_app(runner: EngineRunner, served: ServedModel) -> FastAPI:
    """The app; its lifespan starts the engine's thread and stops it (in-flight requests end first)."""
    created = protocol.now_s()

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        runner.start()
        yield
        await asyncio.to_thread(runner.stop)

    app = FastAPI(title="specbatch", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.runner = runner

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, error: StarletteHTTPException):
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        return JSONResponse(protocol.error_body(str(error.detail), kind), status_code=error.status_code)

    @app.exception_handler(RequestError)
    async def request_error(_request: Request, error: RequestError):
        return _error(error)

    @app.exception_handler(Exception)
    async def server_error(_request: Request, error: Exception):
        log.exception("request failed")
        return JSONResponse(protocol.error_body(f"internal error: {type(error).__name__}", "server_error"),
                            status_code=500)

    @app.get("/health")
    async def health():
        engine = runner.engine
        if not runner.alive:
            return JSONResponse({"status": "engine not running"}, status_code=503)
        fidelity = engine.metrics.fidelity  # the policy's step model beside the measured steps (runtime.fidelity)
        step_model = None if fidelity is None else fidelity.health()
        if runner.draining:
            return JSONResponse({"status": "shutting down", "running": engine.running, "waiting": engine.waiting,
                                 "step_model": step_model}, status_code=503)
        return {"status": "ok", "running": engine.running, "waiting": engine.waiting, "step_model": step_model}

    @app.get("/v1/models")
    async def models():
        return protocol.models_body(served.name, created, served.draft)

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != served.name:
            raise RequestError(f"the model `{model_id}` does not exist; this server serves `{served.name}`",
                               param="model", code="model_not_found", status=404, kind="not_found_error")
        return protocol.models_body(served.name, created, served.draft)["data"][0]

    @app.get("/metrics")
    async def metrics():
        engine = runner.engine
        text = render_metrics(engine.metrics.snapshot(), engine.running, engine.waiting, engine.reserved_tokens,
                              engine.kv_budget_tokens, served.name)
        return PlainTextResponse(text, media_type=CONTENT_TYPE)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        messages, params = parse_chat(await read_json_body(request), served.name, served.max_tokens_limit)
        if served.chat_template is None:
            raise RequestError(f"model `{served.name}` has no chat template (its tokenizer_config.json has no "
                               "chat_template): use /v1/completions with a plain prompt", param="messages",
                               code="no_chat_template")
        text = render_chat(served.chat_template, messages, served.special_tokens)
        return await _generate(request, replace(params, prompt_text=text), CHAT)

    @app.post("/v1/completions")
    async def completions(request: Request):
        params = protocol.parse_completion(await read_json_body(request), served.name, served.max_tokens_limit)
        return await _generate(request, params, COMPLETION)

    async def _generate(request: Request, params: protocol.CompletionParams, shape: Shape):
        prompt_ids = await prompt_ids_of(params, served)
        _check_lengths(len(prompt_ids), params.max_tokens, runner.engine.max_context_tokens)
        vocab = runner.engine.generator.target.config.vocab_size
        if outside := [t for t in prompt_ids if not 0 <= t < vocab]:
            if params.prompt_ids is not None:
                raise RequestError(f"token ids must be in [0, {vocab})", param="prompt", code="invalid_value")
            # the server's tokenizer has ids its model lacks (serve warned at start): say so, not "token ids"
            raise RequestError(f"the text of {shape.prompt_field} gives token id {outside[0]}, past the model's "
                               f"vocabulary of {vocab} tokens: this server's tokenizer has ids its model lacks (an "
                               "added token?); leave out the text that gives it", param=shape.prompt_field,
                               code="invalid_value")
        completion_id = protocol.new_completion_id(shape.id_prefix)
        sampling = request_sampling(params)
        engine_request = EngineRequest(completion_id, prompt_ids, params.max_tokens, sampling, params.seed,
                                       params.stop)
        try:
            stream = runner.submit(engine_request, asyncio.get_running_loop())
        except QueueFull as error:
            raise RequestError(f"the server is busy ({error}); retry after {RETRY_AFTER_S} s", code="queue_full",
                               status=429, kind="rate_limit_error") from None
        except EngineClosed as error:
            raise RequestError(str(error), code="shutting_down", status=503, kind="server_error") from None
        except EngineError as error:
            raise RequestError(str(error), param="prompt", code="invalid_value") from None
        reply = Reply(shape, completion_id, protocol.now_s(), served.name, params)
        if params.stream:
            return StreamingResponse(_sse(runner, stream, reply), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await _collect(runner, request, stream, reply)

    return app


def request_sampling(params: protocol.CompletionParams) -> Sampling:
    """The request's distribution, applied to the draft's and the target's alike (runtime.sampling). top_k = 1
    keeps the top token alone: its limit is greedy, and greedy it runs (the argmax even where logits tie)."""
    temperature = 0.0 if params.top_k == 1 else params.temperature
    return Sampling(temperature=temperature, top_k=params.top_k, top_p=params.top_p)


def _check_lengths(prompt_tokens: int, max_tokens: int, context_tokens: int) -> None:
    if prompt_tokens == 0:
        raise RequestError("the prompt is empty (zero tokens)", param="prompt", code="invalid_value")
    if prompt_tokens + max_tokens > context_tokens:
        param = "prompt" if prompt_tokens >= context_tokens else "max_tokens"
        raise RequestError(f"this model's maximum context length is {context_tokens} tokens; the request asks for "
                           f"{prompt_tokens + max_tokens} ({prompt_tokens} in the prompt, {max_tokens} for the "
                           f"completion): shorten the prompt or lower max_tokens", param=param,
                           code="context_length_exceeded")


@dataclass(frozen=True)
class Reply:
    """Everything a response object of one request repeats."""

    shape: Shape
    id: str
    created_s: int
    model: str
    params: protocol.CompletionParams

    def body(self, text: str, finish_reason: str, token_ids: list[int], usage: dict) -> dict:
        ids = token_ids if self.params.return_token_ids else None
        return self.shape.body(self.id, self.created_s, self.model, text, finish_reason, ids, usage)

    def chunk(self, text: str, finish_reason: str | None, token_ids: list[int], first: bool) -> dict:
        ids = token_ids if self.params.return_token_ids else None
        body = self.shape.chunk(self.id, self.created_s, self.model, text, finish_reason, ids, first=first)
        if self.params.include_usage:  # OpenAI's shape: every chunk but the usage chunk says "usage": null
            body["usage"] = None
        return body


async def _cancel_when_gone(request: Request, runner, completion_id: str) -> None:
    """Wait for the client to close its connection (the server's receive channel says http.disconnect once
    the body is read), then cancel its request: the slot is freed at the engine's next iteration."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    runner.engine.cancel(completion_id)


async def _collect(runner, request: Request, stream, reply: Reply):
    """A non-streaming completion: wait for the last event, cancelling as soon as the client goes away."""
    watcher = asyncio.create_task(_cancel_when_gone(request, runner, reply.id))
    try:
        text, tokens = [], []
        while True:
            event = await stream.next()
            if event.finish_reason == "cancelled" and watcher.done():
                return PlainTextResponse("", status_code=499)  # nobody reads it; nginx's "client closed"
            text.append(event.text)
            tokens.extend(event.token_ids)
            if event.finish_reason in ("cancelled", "error"):
                status = 503 if event.finish_reason == "cancelled" else 500
                return JSONResponse(protocol.error_body(f"the completion ended early ({event.finish_reason})",
                                                        "server_error", code=event.finish_reason), status_code=status)
            if event.finish_reason:
                usage = protocol.usage_body(event.prompt_tokens, event.completion_tokens)
                return reply.body("".join(text), event.finish_reason, tokens, usage)
    finally:
        watcher.cancel()


async def _sse(runner, stream, reply: Reply):
    """Server-sent events: one chunk per engine event, a usage chunk when asked, then [DONE]. A client
    that goes away closes this generator: the `finally` cancels the request and frees its slot."""
    finished, first = False, True
    try:
        while True:
            event = await stream.next()
            yield f"data: {json.dumps(reply.chunk(event.text, event.finish_reason, event.token_ids, first))}\n\n"
            first = False
            if event.finish_reason:
                finished = True
                break
        if reply.params.include_usage:
            usage = protocol.usage_body(event.prompt_tokens, event.completion_tokens)
            body = {"id": reply.id, "object": reply.shape.object_name, "created": reply.created_s,
                    "model": reply.model, "choices": [], "usage": usage}
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        if not finished:
            runner.engine.cancel(reply.id)
