"""The OpenAI-compatible HTTP face (FastAPI): /v1/completions, /v1/chat/completions, /v1/models,
/health, /metrics. Handlers validate (serve.protocol), submit to the engine's thread (serve.runner) and
stream its events; they never touch torch.

Errors are OpenAI error objects {"error": {"message", "type", "param", "code"}}: bad input 400, unknown
model 404, a full queue 429 with Retry-After, shutting down 503. A client that disconnects cancels its
request: a stream notices at its next chunk, a plain request within `DISCONNECT_POLL_S`.
"""
from __future__ import annotations

import asyncio
import json
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specbatch.runtime.engine import EngineClosed, EngineError, QueueFull, Request as EngineRequest
from specbatch.runtime.sampling import Sampling

from . import protocol
from .metrics import CONTENT_TYPE, render_metrics
from .protocol import RequestError
from .runner import EngineRunner

log = logging.getLogger("specbatch.serve")

DISCONNECT_POLL_S = 0.5  # how often a non-streaming request checks that its client is still there
RETRY_AFTER_S = 1  # what a 429 tells the client: a step takes milliseconds, a queue drains in seconds


@dataclass(frozen=True)
class ServedModel:
    name: str  # what clients put in "model"
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    max_tokens_limit: int  # the largest max_tokens a request may ask for
    chat_template: str | None  # the tokenizer's, when it ships one


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
        return {"status": "ok", "running": engine.running, "waiting": engine.waiting,
                "step_model": None if fidelity is None else fidelity.health()}

    @app.get("/v1/models")
    async def models():
        return protocol.models_body(served.name, created)

    @app.get("/metrics")
    async def metrics():
        engine = runner.engine
        text = render_metrics(engine.metrics.snapshot(), engine.running, engine.waiting, engine.reserved_tokens,
                              engine.kv_budget_tokens, served.name)
        return PlainTextResponse(text, media_type=CONTENT_TYPE)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        value = protocol.parse_json_object(await request.body())
        protocol.check_model(value, served.name)
        if served.chat_template is None:
            raise RequestError(f"model `{served.name}` has no chat template (its tokenizer_config.json has no "
                               "chat_template): use /v1/completions with a plain prompt", param="messages",
                               code="no_chat_template")
        raise RequestError("chat templates are not implemented by this server yet: use /v1/completions",
                           param="messages", code="unsupported_endpoint")

    @app.post("/v1/completions")
    async def completions(request: Request):
        params = protocol.parse_completion(protocol.parse_json_object(await request.body()), served.name,
                                           served.max_tokens_limit)
        prompt_ids = params.prompt_ids or tuple(served.encode(params.prompt_text))
        _check_lengths(len(prompt_ids), params.max_tokens, runner.engine.max_context_tokens)
        vocab = runner.engine.generator.target.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise RequestError(f"token ids must be in [0, {vocab})", param="prompt", code="invalid_value")
        completion_id = protocol.new_completion_id()
        sampling = Sampling(temperature=params.temperature, top_p=params.top_p)
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
        created_s = protocol.now_s()
        if params.stream:
            return StreamingResponse(_sse(runner, stream, params, completion_id, created_s, served.name),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return await _collect(runner, request, stream, params, completion_id, created_s, served.name)

    return app


def _check_lengths(prompt_tokens: int, max_tokens: int, context_tokens: int) -> None:
    if prompt_tokens == 0:
        raise RequestError("the prompt is empty (zero tokens)", param="prompt", code="invalid_value")
    if prompt_tokens + max_tokens > context_tokens:
        param = "prompt" if prompt_tokens >= context_tokens else "max_tokens"
        raise RequestError(f"this model's maximum context length is {context_tokens} tokens; the request asks for "
                           f"{prompt_tokens + max_tokens} ({prompt_tokens} in the prompt, {max_tokens} for the "
                           f"completion): shorten the prompt or lower max_tokens", param=param,
                           code="context_length_exceeded")


async def _collect(runner, request: Request, stream, params, completion_id: str, created_s: int, model: str):
    """A non-streaming completion: wait for the last event, cancelling if the client goes away."""
    text, tokens = [], []
    while True:
        try:
            event = await asyncio.wait_for(stream.next(), DISCONNECT_POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                runner.engine.cancel(completion_id)
                return PlainTextResponse("", status_code=499)  # nobody reads it; nginx's "client closed"
            continue
        text.append(event.text)
        tokens.extend(event.token_ids)
        if event.finish_reason in ("cancelled", "error"):
            status, kind = (503, "server_error") if event.finish_reason == "cancelled" else (500, "server_error")
            return JSONResponse(protocol.error_body(f"the completion ended early ({event.finish_reason})", kind,
                                                    code=event.finish_reason), status_code=status)
        if event.finish_reason:
            usage = protocol.usage_body(event.prompt_tokens, event.completion_tokens)
            return protocol.completion_body(completion_id, created_s, model, "".join(text), event.finish_reason,
                                            tokens if params.return_token_ids else None, usage)


async def _sse(runner, stream, params, completion_id: str, created_s: int, model: str):
    """Server-sent events: one chunk per engine event, a usage chunk when asked, then [DONE]. A client
    that goes away closes this generator: the `finally` cancels the request and frees its slot."""
    finished = False
    try:
        while True:
            event = await stream.next()
            chunk = protocol.completion_body(completion_id, created_s, model, event.text, event.finish_reason,
                                             event.token_ids if params.return_token_ids else None, None)
            yield f"data: {json.dumps(chunk)}\n\n"
            if event.finish_reason:
                finished = True
                break
        if params.include_usage:
            usage = protocol.usage_body(event.prompt_tokens, event.completion_tokens)
            body = {"id": completion_id, "object": "text_completion", "created": created_s, "model": model,
                    "choices": [], "usage": usage}
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        if not finished:
            runner.engine.cancel(completion_id)
