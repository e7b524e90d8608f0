"""The OpenAI-compatible HTTP server (FastAPI): completions, chat completions, models, health, metrics,
and Vertex AI's custom-container predict route.

Routes (trainer.serve.routes, trainer.serve.tokenizer_routes):
  POST /v1/completions, /v1/chat/completions   OpenAI's request and response shapes (trainer.serve.protocol);
                                               log-probabilities (and echo) as OpenAI's legacy API and vLLM
                                               give them; `stream: true` answers server-sent events ending
                                               `data: [DONE]`. Beyond OpenAI's fields: vLLM's `top_k` (0: all
                                               tokens) and `ignore_eos`; structured output, OpenAI's
                                               `response_format` and vLLM's `structured_outputs`
                                               (trainer.serve.structured). What is not offered is refused
                                               (400) naming the field.
  GET  /v1/models                              the one model served
  POST /tokenize, /detokenize, GET /tokenizer_info   vLLM's tokenizer routes
  GET  /health (and $AIP_HEALTH_ROUTE)         503 until the weights are loaded and the steps compiled, while
                                               the engine is stuck (no step done for --step-timeout s), and
                                               once a multi-host group has lost a process or stopped stepping
  GET  /livez                                  liveness: 503 while the engine is stuck or once the group failed
                                               (200 while loading or draining)
  GET  /metrics                                Prometheus text, vLLM's metric names
  POST $AIP_PREDICT_ROUTE (default /predict)   {"instances": [completion or chat request, ...]} ->
                                               {"predictions": [{"text", "finish_reason", "usage"}, ...]}

The models are base models, so chat messages are laid out by a template: each message as
`"{role}: {content}\\n"`, then `"assistant:"` for the model to continue. `--chat-template FILE` replaces it
with a JSON object {"message": "...{role}...{content}...", "generation": "..."}.

Errors are OpenAI's error objects {"error": {"message", "type", "param", "code"}}: 400 for a bad request
(naming the field or the limit), 404 for an unknown model or route, 429 with Retry-After when the waiting
queue is full, 503 while loading or shutting down (or when the grace period after SIGTERM ran out), 500 for a
request the engine failed.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from trainer.serve import routes
from trainer.serve.metrics import ServingMetrics
from trainer.serve.protocol import APIError, ChatRequest, CompletionRequest, invalid
from trainer.serve.streams import STREAM_INTERVAL

DEFAULT_CHAT_TEMPLATE = {"message": "{role}: {content}\n", "generation": "assistant:"}


@dataclasses.dataclass
class ServerState:
    """What the routes need; `loop` (trainer.serve.loop.EngineLoop) is None until loaded and compiled."""

    model_name: str
    encode: Callable[[str], list[int]] | None = None
    decode: Callable[[list[int]], str] | None = None
    loop: Any = None
    max_waiting: int = 64
    default_max_tokens: int = 16
    chat_template: dict = dataclasses.field(default_factory=lambda: dict(DEFAULT_CHAT_TEMPLATE))
    draining: bool = False
    expired: bool = False  # the grace period after SIGTERM ran out: requests still open end with an error
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    metrics: ServingMetrics = None  # set by create_app
    eos_token: str | None = None  # the tokenizer's end-of-document token (/tokenizer_info)
    tokenizer_class: str = "bytes"
    tokenizer: Any = None  # the codec's tokenizers.Tokenizer ("tokenizer" class): structured output's tokens
    open: set = dataclasses.field(default_factory=set)  # engine requests whose answer is being waited for
    failed: str | None = None  # why the server cannot serve any more (a multi-host group lost a process)
    stream_interval: float = STREAM_INTERVAL  # --stream-interval

    @property
    def ready(self) -> bool:
        return self.loop is not None and not self.draining

    @property
    def body_limit(self) -> int:
        """The largest request body taken, in bytes: room for --max-waiting prompts of the whole context at 64
        bytes a token (a token id in JSON takes at most 12; a text's token seldom spans 64 bytes), and at
        least 1 MiB. Larger bodies are refused unread, before any parsing or tokenizing."""
        return max(2**20, 64 * (self.max_len or 0) * max(self.max_waiting, 1))

    @functools.cached_property
    def grammars(self):
        """Structured output's grammars for the engine's tokens (built on first use, once loaded)."""
        from trainer.serve.structured import Grammars

        engine = self.loop.engine
        return Grammars(self.tokenizer_class, engine.model.cfg.model.vocab_size, engine.eos_id, self.tokenizer)

    @property
    def max_len(self) -> int | None:
        return self.loop.engine.max_len if self.loop is not None else None

    def expire(self) -> int:
        """Ends every open request with an error (the grace period ran out, or the group failed): streams get
        an error event, others a 503, and nothing is logged per request. Call on the event loop. Returns how many
        there were (the caller's one line)."""
        self.expired = True
        cut = [req for req in self.open if req.finish_reason is None]
        for req in cut:
            req.cancelled = True
            req.events.put_nowait(None)
        return len(cut)


class _Body:
    """Reads each request's body before the app does (a plain ASGI middleware): a body past the state's
    `body_limit` is refused with a 413 as soon as its announced length or its bytes pass it, unread; a client
    that goes away before its body is whole gets nothing, and the app never runs for it (no half-read body
    reaches a route, to fail there with a traceback)."""

    def __init__(self, app, state):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        limit = self.state.body_limit
        announced = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if announced.isdigit() and int(announced) > limit:
            return await _too_large(send, int(announced), limit)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                return await _too_large(send, size, limit)
            if not message.get("more_body"):
                break
        body, given = b"".join(chunks), False

        async def replay():
            nonlocal given
            if given:
                return await receive()  # what comes after the body: a disconnect
            given = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)


async def _too_large(send, size: int, limit: int) -> None:
    error = APIError(413, f"the body is {size:,} bytes or more; this server takes at most {limit:,} (64 bytes a "
                          "token of its context for each request it queues: --max-len x --max-waiting)",
                     code="request_too_large")
    response = error.response()
    await send({"type": "http.response.start", "status": 413, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})


class _Arrival:
    """Stamps each HTTP request with its arrival (`request.state.arrival`), from which TTFT and end-to-end
    latency count, where the HTTP protocol (`http_protocol`) has not already stamped it on the request's first
    bytes. A plain ASGI middleware, the first code a request meets: Starlette's `@app.middleware("http")`
    stamps later and passes every streamed chunk through a task and a queue of its own (measured with
    benchmarks/serve_load.py at concurrency 1, one run each: 213 -> 242 output tokens/s, ITL median 4.5 -> 3.9
    ms without it)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            scope.setdefault("state", {}).setdefault("arrival", time.perf_counter())
        await self.app(scope, receive, send)


def http_protocol():
    """uvicorn's HTTP protocol for this server (uvicorn.Config's `http`): its httptools protocol, stamping each
    request's arrival when the request's first bytes reach the process, else "auto".

    By the time the app is called, uvicorn has parsed the headers and a task has started: measured with
    benchmarks/serve_load.py, 0.1-0.3 ms after the bytes came, some 5% of a short prompt's TTFT that clients
    see and /metrics would not. uvicorn has no hook for the moment (its protocols are its API for this: the
    `http` setting takes a class), so the stamp is taken in the protocol's own callbacks."""
    return _stamped_protocol() or "auto"


@functools.cache
def _stamped_protocol():
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:  # no httptools: uvicorn's own choice, and the app stamps arrivals
        return None

    class ArrivalStampedProtocol(HttpToolsProtocol):
        _received = 0.0

        def data_received(self, data: bytes) -> None:
            self._received = time.perf_counter()  # the parser calls on_message_begin from in here
            super().data_received(data)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.scope.setdefault("state", {})["arrival"] = self._received

    return ArrivalStampedProtocol


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="moe-tpu serve", docs_url=None, redoc_url=None, openapi_url=None)
    state.metrics = ServingMetrics(state)
    app.state.serving = state

    app.add_middleware(_Body, state=state)
    app.add_middleware(_Arrival)  # added last: the outermost, the first code a request meets

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, e: RequestValidationError):
        first = e.errors()[0]
        if first.get("type") == "json_invalid":  # its loc holds the character where the JSON breaks
            at = first.get("loc", (None, None))[-1]
            reason = (first.get("ctx") or {}).get("error", "invalid")
            return APIError(400, f"the body is not JSON: {reason} at character {at}").response()
        fields = (ChatRequest if request.url.path.endswith("/chat/completions") else CompletionRequest).model_fields
        return invalid(first, fields=fields).response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        """Starlette's own refusals (no route, a method the route lacks, a body it cannot parse) as OpenAI
        error objects too."""
        if e.status_code == 404:
            return APIError(404, f"no route {request.method} {request.url.path}", kind="not_found_error").response()
        if e.status_code == 405:
            allowed = (e.headers or {}).get("allow") or (e.headers or {}).get("Allow") or "another method"
            return APIError(405, f"{request.method} is not allowed on {request.url.path}; use {allowed}",
                            headers=e.headers).response()
        return APIError(e.status_code, f"the body cannot be read: {e.detail} (send UTF-8 JSON, nested at most a few "
                                       "hundred levels)", headers=e.headers).response()

    health_routes = sorted({"/health", os.environ.get("AIP_HEALTH_ROUTE", "/health")})
    for route in health_routes:
        app.add_api_route(route, _health(state), methods=["GET"])
    app.add_api_route("/livez", _live(state), methods=["GET"])
    app.add_api_route("/metrics", lambda: Response(state.metrics.render(), media_type=state.metrics.content_type),
                      methods=["GET"])
    routes.add(app, state)
    return app


def _health(state: ServerState):
    async def health():
        if state.draining and not state.failed:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        if state.loop is None and not state.failed:
            return JSONResponse({"status": "loading"}, status_code=503)
        return _liveness(state)

    return health


def _live(state):
    async def live():
        return _liveness(state)

    return live


def _liveness(state):
    """503 naming why when the engine is stuck (trainer.serve.loop: no step completed, nor an idle turn, for
    --step-timeout seconds) or the group failed; else 200."""
    if state.failed:
        return JSONResponse({"status": "failed", "reason": state.failed}, status_code=503)
    stuck = state.loop.stuck() if state.loop is not None else None
    if stuck:
        return JSONResponse({"status": "stuck", "reason": stuck}, status_code=503)
    return {"status": "ok"}
