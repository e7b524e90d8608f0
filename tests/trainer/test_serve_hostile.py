"""The server under hostile input, in-process over the shared small engine: deeply nested JSON, lone
surrogates, bodies past the limit, bodies whose announced length never arrives, and a tokenizer slow on a huge
prompt: each gets its 4xx (or nothing, for a client that went away), never a 500 or a traceback, and /health
keeps answering meanwhile."""

import asyncio
import logging
import time

import httpx
import pytest

from trainer.serve.loop import EngineLoop
from trainer.serve.server import ServerState, create_app

pytestmark = pytest.mark.compile_bound

JSON = {"content-type": "application/json"}


@pytest.mark.parametrize(("path", "body", "status", "needle"), [
    ("/v1/completions", b'{"prompt": ' + b"[" * 50000 + b"]" * 50000 + b"}", 400, "nested at most"),
    ("/predict", b'{"instances": ' + b"[" * 50000 + b"]" * 50000 + b"}", 400, "nests deeper"),
    ("/v1/completions", b'{"prompt": "a", "model": "\\ud800"}', 404, "does not exist"),
    ("/v1/completions", b'{"prompt": "\\ud800"}', 400, "surrogates not allowed"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', 400, "surrogates"),
    ("/tokenize", b'{"prompt": "\\ud800"}', 400, "surrogates"),
    ("/v1/completions", b'{"prompt": "' + b"x" * (2**20 + 10) + b'"}', 413, "this server takes at most 1,048,576"),
], ids=["nested-completions", "nested-predict", "surrogate-model", "surrogate-prompt", "surrogate-chat",
        "surrogate-tokenize", "past-the-limit"])
def test_hostile_bodies_get_their_4xx_and_no_traceback(served, caplog, path, body, status, needle):
    client, _ = served
    with caplog.at_level(logging.WARNING):
        r = client.post(path, content=body, headers=JSON)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]["message"]
    assert not [rec for rec in caplog.records if rec.exc_info], "a traceback in the log"


def test_a_body_past_the_limit_without_a_length_is_cut_off_as_it_arrives(served):
    client, _ = served

    def chunks():
        for _ in range(40):
            yield b"x" * 65536

    r = client.post("/v1/completions", content=chunks(), headers=JSON)
    assert r.status_code == 413 and "bytes or more" in r.json()["error"]["message"]


def test_a_client_gone_before_its_body_arrived_gets_nothing_and_runs_nothing(served, caplog):
    _, state = served
    app = create_app(ServerState("tiny", encode=state.encode, decode=state.decode))
    messages = [{"type": "http.request", "body": b'{"prompt": "a", "max', "more_body": True},
                {"type": "http.disconnect"}]
    sent = []

    async def receive():
        return messages.pop(0)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/predict", "raw_path": b"/predict", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")], "http_version": "1.1",
             "scheme": "http", "server": ("t", 80), "client": ("c", 1), "root_path": ""}
    with caplog.at_level(logging.WARNING):
        asyncio.run(app(scope, receive, send))
    assert sent == [] and not caplog.records


def test_a_slow_tokenizer_on_a_huge_prompt_does_not_stall_health(served):
    """Tokenizing runs on a worker thread past a few kilobytes: /health answers while it goes on."""
    _, state = served

    def slow_encode(text):
        if len(text) > 10000:
            time.sleep(1.0)  # a tokenizer's second for a megabyte
        return state.encode(text)

    slow = ServerState("tiny", encode=slow_encode, decode=state.decode)
    app = create_app(slow)
    slow.loop = state.loop

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            huge = asyncio.ensure_future(c.post("/v1/completions", json={"prompt": "x" * 500_000}))
            await asyncio.sleep(0.2)
            started = time.perf_counter()
            health = await c.get("/health")
            return health, time.perf_counter() - started, await huge

    health, waited, huge = asyncio.run(scenario())
    assert health.status_code == 200 and waited < 0.5
    assert huge.status_code == 400 and huge.json()["error"]["param"] == "prompt"


def test_a_non_streaming_client_that_vanishes_leaves_no_traceback_and_frees_its_slot(served, caplog):
    """A completion whose client goes away mid-answer is cancelled: nothing raised out of the app (a server logs
    that as a traceback), nothing sent, its request cancelled."""
    _, state = served
    gone = ServerState("tiny", encode=state.encode, decode=state.decode)
    app = create_app(gone)
    gone.loop = EngineLoop(state.loop.engine)  # not started: the request waits until its client goes away
    body = b'{"prompt": "a", "max_tokens": 250, "temperature": 0, "ignore_eos": true}'
    messages = [{"type": "http.request", "body": body, "more_body": False}]
    sent, seen = [], []

    async def receive():
        if messages:
            return messages.pop(0)
        seen.extend(gone.open)
        if seen:
            return {"type": "http.disconnect"}  # the client went away once its request was queued
        await asyncio.sleep(0.05)
        return {"type": "http.disconnect"} if seen else await receive()

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "raw_path": b"/v1/completions",
             "query_string": b"", "headers": [(b"content-type", b"application/json")], "http_version": "1.1",
             "scheme": "http", "server": ("t", 80), "client": ("c", 1), "root_path": ""}
    with caplog.at_level(logging.WARNING):
        asyncio.run(app(scope, receive, send))
    assert not [rec for rec in caplog.records if rec.exc_info], "a traceback in the log"
    assert seen and all(req.cancelled for req in seen) and not gone.open
    assert all(message.get("status", 499) == 499 for message in sent)


@pytest.mark.parametrize("field", ["temperature", "top_p", "n", "stream", "stream_options", "max_tokens", "seed",
                                   "stop", "logprobs", "echo", "best_of", "user", "top_k", "ignore_eos", "suffix",
                                   "logit_bias", "presence_penalty", "response_format"])
def test_optional_fields_sent_as_null_are_fields_not_given(served, field):
    """OpenAI's clients send null for what their caller left unset."""
    client, _ = served
    r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2, field: None})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_chat_fields_sent_as_null_are_fields_not_given_and_a_required_one_is_refused(served):
    client, _ = served
    nulls = {"temperature": None, "top_p": None, "n": None, "stream": None, "logprobs": None, "top_logprobs": None,
             "max_completion_tokens": None, "stop": None, "seed": None, "tools": None, "tool_choice": None}
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a", "name": None}],
                                                  "max_tokens": 2, **nulls})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length", r.text
    r = client.post("/v1/completions", json={"prompt": None})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize("stop", ["", [""], ["", "\x00\x01never"]])
def test_an_empty_stop_string_is_no_stop_string(served, stop):
    client, _ = served
    plain = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 6, "temperature": 0}).json()
    r = client.post("/v1/completions", json={"prompt": "ab", "max_tokens": 6, "temperature": 0, "stop": stop})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length" and choice["text"] == plain["choices"][0]["text"]
