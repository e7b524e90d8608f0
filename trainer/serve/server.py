"""The OpenAI-compatible HTTP server (FastAPI): completions, chat completions, models, health, metrics,
and Vertex AI's custom-container predict route.

Routes:
  POST /v1/completions, /v1/chat/completions   OpenAI's request and response shapes; `stream: true` answers
                                               server-sent events ending `data: [DONE]`. Beyond OpenAI's
                                               fields: `top_k` (0: all tokens). Not offered, and refused
                                               (400) when asked for: logprobs, top_logprobs, echo,
                                               best_of, suffix.
  GET  /v1/models                              the one model served
  GET  /health (and $AIP_HEALTH_ROUTE)         503 until the weights are loaded and the steps compiled
  GET  /metrics                                Prometheus text, vLLM's metric names
  POST $AIP_PREDICT_ROUTE (default /predict)   {"instances": [completion or chat request, ...]} ->
                                               {"predictions": [{"text", "finish_reason", "usage"}, ...]}

The models are base models, so chat messages are laid out by a template: each message as
`"{role}: {content}\\n"`, then `"assistant:"` for the model to continue. `--chat-template FILE` replaces it
with a JSON object {"message": "...{role}...{content}...", "generation": "..."}.

Errors are OpenAI's error objects {"error": {"message", "type", "param", "code"}}: 400 for a bad request
(naming the field or the limit), 404 for an unknown model or route, 429 with Retry-After when the waiting
queue is full, 503 while loading or shutting down, 500 for a request the engine failed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import os
import random
import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator
from starlette.exceptions import HTTPException

from trainer.serve.metrics import ServingMetrics

DEFAULT_CHAT_TEMPLATE = {"message": "{role}: {content}\n", "generation": "assistant:"}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers or {}

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


class _Sampling(BaseModel):
    # Strict, as OpenAI's API is: "5" is no max_tokens and true no token id (pydantic's lax mode took both).
    model_config = ConfigDict(extra="ignore", strict=True)
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    n: int = Field(1, ge=1, le=1)
    # OpenAI's fields that this server does not offer: refused when asked for, not ignored (an answer with
    # `"logprobs": null` would read as if none had been asked for).
    logprobs: Any = None
    top_logprobs: Any = None
    echo: Any = False
    best_of: Any = None
    suffix: Any = None

    @field_validator("logprobs", "top_logprobs", "echo", "best_of", "suffix")
    @classmethod
    def _not_offered(cls, value: Any, info: ValidationInfo) -> Any:
        neutral = {"best_of": 1, "top_logprobs": 0}.get(info.field_name)  # what asks for nothing more
        if value is None or value is False or (type(value) is int and value == neutral):
            return value
        raise ValueError(f"this server does not offer {info.field_name}; leave it out")


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str]


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


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
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    metrics: ServingMetrics = None  # set by create_app

    @property
    def ready(self) -> bool:
        return self.loop is not None and not self.draining


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

    app.add_middleware(_Arrival)

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def bad_body(_: Request, e: RequestValidationError):
        first = e.errors()[0]
        if first.get("type") == "json_invalid":  # its loc holds the character where the JSON breaks
            at = first.get("loc", (None, None))[-1]
            reason = (first.get("ctx") or {}).get("error", "invalid")
            return APIError(400, f"the body is not JSON: {reason} at character {at}").response()
        return _invalid(first).response()

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
        return APIError(e.status_code, f"the body cannot be read: {e.detail} (send UTF-8 JSON)",
                        headers=e.headers).response()

    health_routes = sorted({"/health", os.environ.get("AIP_HEALTH_ROUTE", "/health")})
    for route in health_routes:
        app.add_api_route(route, _health(state), methods=["GET"])
    app.add_api_route("/metrics", lambda: Response(state.metrics.render(), media_type=state.metrics.content_type),
                      methods=["GET"])
    app.add_api_route("/v1/models", _models(state), methods=["GET"])
    app.add_api_route("/v1/completions", _completions(state), methods=["POST"])
    app.add_api_route("/v1/chat/completions", _chat(state), methods=["POST"])
    app.add_api_route(os.environ.get("AIP_PREDICT_ROUTE", "/predict"), _predict(state), methods=["POST"])
    return app


def _health(state: ServerState):
    async def health():
        if state.draining:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        if state.loop is None:
            return JSONResponse({"status": "loading"}, status_code=503)
        return {"status": "ok"}

    return health


def _models(state: ServerState):
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "moe-tpu"}]}

    return models


def _completions(state: ServerState):
    async def completions(body: CompletionRequest, request: Request):
        return await _serve(state, body, _prompt_ids(state, body.prompt), body.max_tokens, request, chat=False)

    return completions


def _chat(state: ServerState):
    async def chat(body: ChatRequest, request: Request):
        ids = _prompt_ids(state, _chat_text(state, body.messages))
        return await _serve(state, body, ids, body.max_completion_tokens or body.max_tokens, request, chat=True)

    return chat


def _predict(state: ServerState):
    async def predict(request: Request):
        try:
            body = await request.json()
        except ValueError:
            raise APIError(400, "the body is not JSON") from None
        instances = body.get("instances") if isinstance(body, dict) else None
        if not isinstance(instances, list) or not instances:
            raise APIError(400, 'the body must be {"instances": [request, ...]}', param="instances")
        if len(instances) > state.max_waiting:  # a 429 would say "retry", which could never help
            raise APIError(400, f"{len(instances)} instances in one request; this server queues at most "
                                f"{state.max_waiting} (--max-waiting): send them in requests of at most that many",
                           param="instances")
        # Every instance is checked before any is queued, and a refusal part-way cancels those queued: a
        # 400 or a 429 leaves nothing decoding for an answer that is never sent.
        parsed = [_predict_instance(state, instance, i) for i, instance in enumerate(instances)]
        admitted = []
        try:
            for i, (body, ids, limit) in enumerate(parsed):
                try:
                    admitted.append(_admit(state, body, ids, limit, request.state.arrival))
                except APIError as e:
                    raise _of_instance(e, i) from None
        except APIError:
            for req in admitted:
                req.cancelled = True
            raise
        done = await asyncio.gather(*(_run_to_end(state, req) for req in admitted))
        return {"predictions": [{"text": _final_text(state, req), "finish_reason": _finish(req),
                                 "usage": _usage(req)} for req in done]}

    return predict


def _predict_instance(state: ServerState, instance: Any, index: int) -> tuple[_Sampling, list[int], int | None]:
    """One instance of a predict body as (the request, its prompt's ids, its max tokens); a 400 names the
    instance and its field."""
    if not isinstance(instance, dict):
        raise APIError(400, f"instances[{index}] must be an object with a prompt or messages",
                       param=f"instances[{index}]")
    chat = "messages" in instance
    try:
        body = (ChatRequest if chat else CompletionRequest).model_validate({**instance, "stream": False})
    except ValidationError as e:
        raise _invalid(e.errors()[0], f"instances[{index}]") from None
    try:
        if chat:
            return body, _prompt_ids(state, _chat_text(state, body.messages)), \
                body.max_completion_tokens or body.max_tokens
        return body, _prompt_ids(state, body.prompt), body.max_tokens
    except APIError as e:
        raise _of_instance(e, index) from None


def _of_instance(error: APIError, index: int) -> APIError:
    """A refusal of one instance of a predict body, naming it (a field unnamed is its prompt)."""
    error.message, error.param = f"instances[{index}]: {error.message}", f"instances[{index}].{error.param or 'prompt'}"
    return error


def _invalid(error: dict, prefix: str | None = None) -> APIError:
    """A 400 from pydantic's first error, naming the field (`stop.str` for a union's branch is `stop`)."""
    loc = [str(p) for p in error.get("loc", ())]
    if loc and loc[0] == "body":
        loc = loc[1:]
    loc = [p for p in loc if p not in ("str", "list[int]", "list[str]")]
    field = ".".join(loc)
    param = ".".join(p for p in (prefix, field) if p) or None
    if param is None:  # the body as a whole: empty, not an object, or not sent as JSON (curl -d without -H)
        return APIError(400, f"the body must be a JSON object sent with content-type: application/json "
                             f"({error.get('msg')})")
    return APIError(400, f"{param}: {error.get('msg')}", param=param)


def _chat_text(state: ServerState, messages) -> str:
    """The conversation as the prompt: --chat-template's format, or an imported model's own Jinja template
    (trainer/serve/chat.py); a conversation the template refuses is a 400 naming `messages`."""
    from trainer.serve.chat import ChatTemplateError, render

    try:
        return render(state.chat_template, messages)
    except ChatTemplateError as e:
        raise APIError(400, str(e), param="messages") from None


def _prompt_ids(state: ServerState, prompt) -> list[int]:
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise APIError(400, "one prompt per request", param="prompt")
        prompt = prompt[0]
    if state.encode is None:
        raise APIError(503, "the model is loading", kind="service_unavailable")
    try:
        return state.encode(prompt)
    except Exception as e:  # noqa: BLE001 - the codec's own message says what it wanted
        reason = str(getattr(e, "message", None) or e).removeprefix("--prompt: ").removeprefix("--prompt ")
        raise APIError(400, f"prompt: {reason}", param="prompt") from None


def _admit(state: ServerState, body: _Sampling, ids: list[int], max_tokens: int | None, arrival: float):
    """A request checked and queued in the engine, with an asyncio queue its tokens arrive on."""
    from trainer.serve.engine import Request as EngineRequest
    from trainer.serve.engine import RequestError, SamplingParams

    if body.model and body.model != state.model_name:
        raise APIError(404, f"the model '{body.model}' does not exist; this server serves '{state.model_name}'",
                       kind="not_found_error", param="model", code="model_not_found")
    if not state.ready:
        raise APIError(503, "the server is " + ("shutting down" if state.draining else "loading"),
                       kind="service_unavailable")
    if state.loop.waiting() >= state.max_waiting:
        raise APIError(429, f"{state.max_waiting} requests are waiting already; retry later",
                       kind="rate_limit_error", headers={"Retry-After": "1"})
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    seed = body.seed if body.seed is not None else random.getrandbits(31)
    sampling = SamplingParams(max_tokens=max_tokens or state.default_max_tokens, temperature=body.temperature,
                              top_k=body.top_k, top_p=body.top_p, seed=seed, stop=stop)
    try:
        state.loop.engine.check(ids, sampling)
    except RequestError as e:
        raise APIError(400, str(e), param=e.param) from None
    events: asyncio.Queue = asyncio.Queue()
    aio = asyncio.get_running_loop()
    req = EngineRequest(ids, sampling, listener=lambda r: aio.call_soon_threadsafe(events.put_nowait, None))
    req.events = events
    req.arrival = arrival
    state.loop.submit(req)
    return req


async def _run_to_end(state: ServerState, req) -> Any:
    try:
        while req.finish_reason is None:
            await req.events.get()
    finally:
        if req.finish_reason is None:
            req.cancelled = True  # the client went away: its slot frees at the next step
    state.metrics.finished(req)
    if req.finish_reason == "error":
        raise APIError(500, f"the request failed: {req.error}", kind="server_error")
    return req


async def _serve(state: ServerState, body: _Sampling, ids: list[int], max_tokens, request: Request, *, chat: bool):
    req = _admit(state, body, ids, max_tokens, request.state.arrival)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{req.id}"
    if body.stream:
        return StreamingResponse(_events(state, req, rid, chat), media_type="text/event-stream")
    task = asyncio.ensure_future(_run_to_end(state, req))
    while not task.done():  # a client that disconnects cancels its request
        await asyncio.wait({task}, timeout=0.5)
        if not task.done() and await request.is_disconnected():
            task.cancel()
    req = task.result()
    text = _final_text(state, req)
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat
              else {"index": 0, "text": text, "logprobs": None})
    choice["finish_reason"] = _finish(req)
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": state.model_name, "choices": [choice], "usage": _usage(req)}


async def _events(state: ServerState, req, rid: str, chat: bool):
    """Server-sent events: a chunk per new piece of text, the last one with the finish reason and usage."""
    sent, obj = 0, "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str, finish: str | None, usage=None) -> str:
        delta = {"index": 0, "finish_reason": finish}
        delta.update({"delta": {"content": text} if text or finish is None else {}} if chat
                     else {"text": text, "logprobs": None})
        body = {"id": rid, "object": obj, "created": int(time.time()), "model": state.model_name, "choices": [delta]}
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    try:
        if chat:  # the first chunk of a chat stream names the role
            opening = {"id": rid, "object": obj, "created": int(time.time()), "model": state.model_name,
                       "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}
            yield f"data: {json.dumps(opening)}\n\n"
        while req.finish_reason is None:
            await req.events.get()
            if req.finish_reason is not None:
                break
            text = _safe_text(state, req)
            if len(text) > sent:
                yield chunk(text[sent:], None)
                sent = len(text)
                req.first_sent = req.first_sent or time.perf_counter()
    finally:
        if req.finish_reason is None:
            req.cancelled = True
    state.metrics.finished(req)
    if req.finish_reason == "error":
        error = {"message": f"the request failed: {req.error}", "type": "server_error", "param": None, "code": None}
        yield f"data: {json.dumps({'error': error})}\n\n"
    else:
        text = _final_text(state, req)
        yield chunk(text[sent:], _finish(req), _usage(req))
    yield "data: [DONE]\n\n"


def _safe_text(state: ServerState, req) -> str:
    """The text so far, less what may yet turn out to start a stop string or to be half a character."""
    text = _decode(state, req.output)
    hold = max((len(s) - 1 for s in req.sampling.stop), default=0)
    text = text[:len(text) - hold] if hold else text
    return text.rstrip("\ufffd")


def _final_text(state: ServerState, req) -> str:
    return req.text if req.text is not None else _decode(state, req.output)


def _decode(state: ServerState, ids: list[int]) -> str:
    return state.decode(ids) if state.decode is not None else " ".join(map(str, ids))


def _finish(req) -> str:
    return "stop" if req.finish_reason == "stop" else "length"


def _usage(req) -> dict:
    return {"prompt_tokens": len(req.prompt), "completion_tokens": len(req.output),
            "total_tokens": len(req.prompt) + len(req.output)}
