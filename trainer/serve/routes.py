"""The server's routes over the engine: OpenAI's completions and chat completions (a choice per prompt and
per `n`, log-probabilities, streaming), models, Vertex AI's predict, and vLLM's tokenizer routes.

Each route parses with trainer.serve.protocol, queues engine requests (`admit`), waits for them on asyncio
queues their listeners signal, and answers with trainer.serve.responses' pieces. `state` is the server's
ServerState.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import random
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import ValidationError

from trainer.serve import chat, responses, tokenizer_routes
from trainer.serve.protocol import APIError, ChatRequest, CompletionRequest, invalid
from trainer.serve.request import Request as EngineRequest
from trainer.serve.streams import Wake
from trainer.serve.tokenizer_routes import encode


def add(app: FastAPI, state) -> None:
    app.add_api_route("/v1/models", _models(state), methods=["GET"])
    app.add_api_route("/v1/completions", _completions(state), methods=["POST"])
    app.add_api_route("/v1/chat/completions", _chat(state), methods=["POST"])
    app.add_api_route(os.environ.get("AIP_PREDICT_ROUTE", "/predict"), _predict(state), methods=["POST"])
    tokenizer_routes.add(app, state)


def _models(state):
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "moe-tpu", "max_model_len": state.max_len}]}

    return models


def _completions(state):
    async def completions(body: CompletionRequest, request: Request):
        prompts = await prompt_ids(state, body.prompt)
        want = body.logprobs
        return await _answer(state, body, prompts, body.max_tokens, request, chat=False, logprobs=want,
                             echo=body.echo)

    return completions


def _chat(state):
    async def chat(body: ChatRequest, request: Request):
        prompts = [await _chat_ids(state, body)]
        want = (body.top_logprobs or 0) if body.logprobs else None
        return await _answer(state, body, prompts, body.max_completion_tokens or body.max_tokens, request,
                             chat=True, logprobs=want, echo=False)

    return chat


async def _chat_ids(state, body: ChatRequest) -> list[int]:
    """The conversation's prompt: --chat-template's format, or an imported model's own Jinja template
    (trainer/serve/chat.py); a conversation the template refuses is a 400 naming `messages`."""
    try:
        text = chat.render(state.chat_template, body.messages)
    except chat.ChatTemplateError as e:
        raise APIError(400, str(e), param="messages") from None
    try:
        return (await prompt_ids(state, text))[0]
    except APIError as e:
        e.param = "messages" if e.param == "prompt" else e.param
        raise


async def prompt_ids(state, prompt) -> list[list[int]]:
    """Each prompt of a request as token ids: a text, a list of texts, token ids, or a list of those."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [prompt]
    texts = prompt if isinstance(prompt, list) else [prompt]
    if not texts:
        raise APIError(400, "prompt: an empty list; give a text, token ids or a list of them", param="prompt")
    if state.encode is None:
        raise APIError(503, "the model is loading", kind="service_unavailable")
    return [await encode(state, text) for text in texts]


@dataclasses.dataclass(eq=False)
class ServedRequest(EngineRequest):
    """An engine request with what the HTTP front end keeps beside it (the engine never reads these)."""

    events: asyncio.Queue | None = None  # what its listener signals on, from the engine's thread
    wake: Wake | None = None  # and how (trainer/serve/streams.py: at most one wake-up an interval)
    counted: bool = False  # in the server's metrics already
    first_sent: float | None = None  # when the first token's text left (streaming): the TTFT a client sees


def admit(state, body, ids: list[int], max_tokens: int | None, arrival: float, *, index: int = 0,
          logprobs: int | None = None, echo: bool = False, chat: bool = False, constraint=None):
    """A request checked and queued in the engine, with an asyncio queue its listener signals on: at each token
    when it streams, else once, when it is done (an answer waits for the whole text: a wake-up a token would
    be the event loop's work for nothing, on the engine's interpreter lock). Choice `index` of a request with a
    seed draws with seed + index: the same request gets the same choices. `constraint`: its structured output's
    matcher (`constraints`, compiled off the event loop)."""
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
    seed = (body.seed + index) if body.seed is not None else random.getrandbits(31)
    room = max(state.max_len - len(ids), 1)  # none: the engine blames the prompt
    # Chat's default is OpenAI's, the rest of the context; completions' is OpenAI's 16, within the context.
    limit = max_tokens if max_tokens is not None else room if chat else min(state.default_max_tokens, room)
    sampling = SamplingParams(max_tokens=limit, temperature=body.temperature, top_k=body.top_k, top_p=body.top_p,
                              seed=seed, stop=stop, logprobs=logprobs, prompt_logprobs=echo and logprobs is not None,
                              ignore_eos=body.ignore_eos)
    try:
        state.loop.engine.check(ids, sampling)
    except RequestError as e:
        param = "messages" if chat and e.param == "prompt" else e.param
        raise APIError(400, str(e), param=param) from None
    events: asyncio.Queue = asyncio.Queue()
    wake = Wake(asyncio.get_running_loop(), events, state.stream_interval)
    streams = bool(body.stream)
    req = ServedRequest(ids, sampling, listener=lambda r: wake(r.finish_reason is not None) if streams or
                        r.finish_reason is not None else None, arrival=arrival, constraint=constraint,
                        events=events, wake=wake)
    state.open.add(req)
    state.loop.submit(req)
    return req


async def constraints(state, body, count: int) -> list:
    """`count` matchers of the grammar the request's response_format or structured_outputs asks for (Nones for
    none), compiled on a worker thread as tokenizing is: a grammar, and the first one's tables of the
    tokenizer's tokens (about a second for a large vocabulary), would stall every open stream on the event
    loop. Nothing is compiled while the server cannot serve (admit answers 503)."""
    if (body.response_format is None and body.structured_outputs is None) or not state.ready or \
            (body.model and body.model != state.model_name):  # admit refuses it
        return [None] * count
    return await asyncio.to_thread(_compile, state, body, count)


def _compile(state, body, count: int) -> list:
    from trainer.serve.structured import StructuredError

    try:
        grammar = state.grammars.grammar(body.response_format, body.structured_outputs)
        return [state.grammars.constraint(grammar) if grammar is not None else None for _ in range(count)]
    except StructuredError as e:
        raise APIError(400, str(e), param=e.param) from None


def admit_all(state, parsed: list[tuple], arrival: float, name=None) -> list:
    """Every (body, ids, max_tokens, options) queued, or none: a refusal part-way cancels those queued, so
    a 400 or a 429 leaves nothing decoding for an answer that is never sent. `name(error, i)` names the
    refused one."""
    admitted = []
    try:
        for i, (body, ids, limit, options) in enumerate(parsed):
            try:
                admitted.append(admit(state, body, ids, limit, arrival, **options))
            except APIError as e:
                raise (name(e, i) if name else e) from None
    except APIError:
        for req in admitted:
            req.cancelled = True
            state.open.discard(req)
        raise
    return admitted


async def run_to_end(state, req) -> Any:
    try:
        while req.finish_reason is None and not state.expired:
            await req.events.get()
    finally:
        state.open.discard(req)
        if req.finish_reason is None:
            req.cancelled = True  # the client went away (or the grace ran out): its slot frees at the next step
    state.metrics.finished(req)
    if cut_short(state, req):
        raise APIError(503, _cut_short(state, "request"), kind="service_unavailable")
    if req.finish_reason == "error":
        raise APIError(500, f"the request failed: {req.error}", kind="server_error")
    return req


def cut_short(state, req) -> bool:
    """Whether the server ended the request before the engine finished it: still open, or ended by the engine
    as cancelled after the server cut it (expire marks it cancelled, and the engine's next step may end it
    before the route reads its event)."""
    return req.finish_reason is None or (state.expired and req.finish_reason == "cancelled")


def _cut_short(state, what: str) -> str:
    """Why the server ended a request before the engine did: the group failed, or the grace period ran out."""
    if state.failed:
        return f"the request failed: {state.failed}"
    return f"the server is shutting down and this {what} did not finish within its grace period (--grace-seconds)"


def _check_choices(state, body, prompts: list, logprobs: int | None, echo: bool) -> None:
    count = len(prompts) * body.n
    if count > state.max_waiting:  # a 429 would say "retry", which could never help
        raise APIError(400, f"{len(prompts)} prompt(s) x n={body.n} is {count} choices; this server queues at "
                            f"most {state.max_waiting} (--max-waiting): send fewer at a time",
                       param="n" if body.n > 1 else "prompt")
    if body.stream and count > 1:
        raise APIError(400, "stream: true takes one prompt and n: 1 on this server; send the others as requests "
                            "of their own", param="n" if body.n > 1 else "prompt")
    if body.stream and echo:
        raise APIError(400, "echo: not with stream: true on this server; leave stream out", param="echo")


async def _answer(state, body, prompts: list[list[int]], max_tokens, request: Request, *, chat: bool,
                  logprobs: int | None, echo: bool):
    _check_choices(state, body, prompts, logprobs, echo)
    options = {"logprobs": logprobs, "echo": echo, "chat": chat}
    matchers = iter(await constraints(state, body, len(prompts) * body.n))
    parsed = [(body, ids, max_tokens, {**options, "index": i, "constraint": next(matchers)}) for ids in prompts
              for i in range(body.n)]
    reqs = admit_all(state, parsed, request.state.arrival)
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{reqs[0].id}"
    if body.stream:
        usage = body.stream_options is not None and body.stream_options.include_usage
        return StreamingResponse(_events(state, reqs[0], rid, chat, usage, logprobs),
                                 media_type="text/event-stream")
    task = asyncio.ensure_future(asyncio.gather(*(run_to_end(state, req) for req in reqs)))
    while not task.done():  # a client that disconnects cancels its requests
        await asyncio.wait({task}, timeout=0.5)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            await asyncio.wait({task})
            with contextlib.suppress(asyncio.CancelledError):
                task.exception()  # retrieved: asyncio logs one never retrieved as a traceback
            return Response(status_code=499)  # to no one: nginx's "client closed request", and no traceback
    done = task.result()
    choices = [_choice(state, req, i, chat, logprobs, echo) for i, req in enumerate(done)]
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": state.model_name, "choices": choices, "usage": responses.usage(done, prompts)}


def _choice(state, req, index: int, chat: bool, logprobs: int | None, echo: bool) -> dict:
    text = responses.final_text(state.decode, req)
    if chat:
        lp = None if logprobs is None else responses.chat_logprobs(state.decode, req, logprobs)
        choice = {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": lp}
    else:
        text = responses.text_of(state.decode, req.prompt) + text if echo else text
        lp = None if logprobs is None else responses.completion_logprobs(state.decode, req, logprobs, echo)
        choice = {"index": index, "text": text, "logprobs": lp}
    choice["finish_reason"] = responses.finish_reason(req)
    return choice


async def _events(state, req, rid: str, chat: bool, include_usage: bool, logprobs: int | None = None):
    """Server-sent events: a chunk per new piece of text (with the log-probabilities of the tokens since the
    last chunk, when asked), the last with the finish reason; with `stream_options.include_usage`, then a
    chunk of usage and no choices, as OpenAI sends it."""
    sent, scored, obj = 0, 0, "chat.completion.chunk" if chat else "text_completion"
    reader = _TextReader(state, req)
    # Every chunk's fields but its choices (and usage), as json.dumps writes them, encoded once: a chunk a token.
    head = json.dumps({"id": rid, "object": obj, "created": int(time.time()), "model": state.model_name})[:-1]

    def frame(choices: list, usage=None) -> bytes:
        tail = f', "usage": {json.dumps(usage)}' if include_usage else ""
        return f'data: {head}, "choices": {json.dumps(choices)}{tail}}}\n\n'.encode()

    def chunk(text: str, finish: str | None, end: int | None) -> str:
        nonlocal scored
        lp = None
        if logprobs is not None:
            lp = (responses.chat_logprobs(state.decode, req, logprobs, scored, end) if chat else
                  responses.completion_logprobs(state.decode, req, logprobs, False, scored, end, sent))
            scored = len(req.logprobs) if end is None else end
        delta = {"index": 0, "finish_reason": finish, "logprobs": lp}
        delta.update({"delta": {"content": text} if text or finish is None else {}} if chat else {"text": text})
        return frame([delta])

    try:
        if chat:  # the first chunk of a chat stream names the role
            yield frame([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        while req.finish_reason is None and not state.expired:
            await req.events.get()
            req.wake.pending = False
            if req.finish_reason is not None or state.expired:
                break
            end = len(req.logprobs)
            new = reader.new()
            if new:
                yield chunk(new, None, end)
                sent += len(new)
                req.first_sent = req.first_sent or time.perf_counter()
    finally:
        state.open.discard(req)
        if req.finish_reason is None:
            req.cancelled = True
    state.metrics.finished(req)
    if req.finish_reason == "error" or cut_short(state, req):
        message = f"the request failed: {req.error}" if req.finish_reason == "error" else _cut_short(state, "stream")
        error = {"message": message, "type": "server_error", "param": None, "code": None}
        yield f"data: {json.dumps({'error': error})}\n\n"
    else:
        yield chunk(responses.final_text(state.decode, req)[sent:], responses.finish_reason(req), None)
        if include_usage:
            yield frame([], responses.usage([req], [req.prompt]))
    yield "data: [DONE]\n\n"


class _TextReader:
    """A stream's new text at each token, less what may yet turn out to start a stop string. From the pieces
    the engine's output processor appends (O(new text) a token); without them (no detokenize in the
    engine), from the whole output decoded here, less half a character at its end."""

    def __init__(self, state, req):
        self.state, self.req, self.pieces, self.sent, self.held = state, req, 0, 0, ""
        self.hold = max((len(s) - 1 for s in req.sampling.stop), default=0)

    def new(self) -> str:
        state = self.req.detokenizer
        if state is not None:
            pieces = state.pieces
            count = len(pieces)  # once: the engine's thread may add a piece meanwhile, which the next call reads
            text, self.pieces = self.held + "".join(pieces[self.pieces:count]), count
            cut = len(text) - self.hold if self.hold else len(text)
            self.held = text[max(cut, 0):]
            return text[:max(cut, 0)]
        text = responses.text_of(self.state.decode, self.req.text_ids)
        text = (text[:len(text) - self.hold] if self.hold else text).rstrip("\ufffd")
        new, self.sent = text[self.sent:], max(self.sent, len(text))
        return new


def _predict(state):
    async def predict(request: Request):
        try:
            body = await request.json()
        except ValueError:
            raise APIError(400, "the body is not JSON") from None
        except RecursionError:
            raise APIError(400, "the body's JSON nests deeper than this server parses") from None
        instances = body.get("instances") if isinstance(body, dict) else None
        if not isinstance(instances, list) or not instances:
            raise APIError(400, 'the body must be {"instances": [request, ...]}', param="instances")
        if len(instances) > state.max_waiting:  # a 429 would say "retry", which could never help
            raise APIError(400, f"{len(instances)} instances in one request; this server queues at most "
                                f"{state.max_waiting} (--max-waiting): send them in requests of at most that many",
                           param="instances")
        # Every instance is checked before any is queued.
        parsed = [await _predict_instance(state, instance, i) for i, instance in enumerate(instances)]
        admitted = admit_all(state, parsed, request.state.arrival, name=_of_instance)
        done = await asyncio.gather(*(run_to_end(state, req) for req in admitted))
        predictions = []
        for (_, _, _, options), req in zip(parsed, done, strict=True):
            chat, logprobs = options["chat"], options["logprobs"]
            prediction = {"text": responses.final_text(state.decode, req),
                          "finish_reason": responses.finish_reason(req), "usage": responses.usage([req], [req.prompt])}
            if logprobs is not None:
                prediction["logprobs"] = (responses.chat_logprobs(state.decode, req, logprobs) if chat else
                                          responses.completion_logprobs(state.decode, req, logprobs, False))
            predictions.append(prediction)
        return {"predictions": predictions}

    return predict


async def _predict_instance(state, instance: Any, index: int) -> tuple:
    """One instance of a predict body as (the request, its prompt's ids, its max tokens, admit's options); a
    400 names the instance and its field."""
    if not isinstance(instance, dict):
        raise APIError(400, f"instances[{index}] must be an object with a prompt or messages",
                       param=f"instances[{index}]")
    chat = "messages" in instance
    model = ChatRequest if chat else CompletionRequest
    try:
        body = model.model_validate({**instance, "stream": False})
    except ValidationError as e:
        raise invalid(e.errors()[0], f"instances[{index}]", model.model_fields) from None
    try:
        if chat:
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
            ids, limit = await _chat_ids(state, body), body.max_completion_tokens or body.max_tokens
        else:
            prompts, logprobs, limit = await prompt_ids(state, body.prompt), body.logprobs, body.max_tokens
            if len(prompts) != 1 or body.echo:
                raise APIError(400, "one prompt and no echo per instance; send each prompt as an instance",
                               param="prompt")
            ids = prompts[0]
        if body.n != 1:
            raise APIError(400, "n: one choice per instance; send an instance for each", param="n")
        constraint = (await constraints(state, body, 1))[0]
    except APIError as e:
        raise _of_instance(e, index) from None
    return body, ids, limit, {"logprobs": logprobs, "chat": chat, "constraint": constraint}


def _of_instance(error: APIError, index: int) -> APIError:
    """A refusal of one instance of a predict body, naming it (a field unnamed is its prompt)."""
    error.message, error.param = f"instances[{index}]: {error.message}", f"instances[{index}].{error.param or 'prompt'}"
    return error
