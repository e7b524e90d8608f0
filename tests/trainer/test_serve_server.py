"""The OpenAI-compatible server, in-process over a small engine: the openai client's completions and chat
completions (streaming and not), errors as OpenAI error objects, health, metrics, Vertex AI's predict."""

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from trainer.serve.engine import Request, SamplingParams
from trainer.serve.loop import EngineLoop
from trainer.serve.server import ServerState, create_app

pytestmark = pytest.mark.compile_bound


def test_the_openai_client_gets_completions_and_chat_completions(served):
    client, state = served
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client)
    done = api.completions.create(model="tiny", prompt="The cat", max_tokens=9, temperature=0)
    assert done.choices[0].finish_reason == "length"
    assert done.usage.prompt_tokens == 7 and done.usage.completion_tokens == 9 and done.usage.total_tokens == 16
    pieces = list(api.completions.create(model="tiny", prompt="The cat", max_tokens=9, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == done.choices[0].text
    assert pieces[-1].choices[0].finish_reason == "length"
    chat = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens == 5
    assert chat.usage.prompt_tokens == len("user: hi\nassistant:")
    streamed = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                           max_tokens=5, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == chat.choices[0].message.content
    assert [m.id for m in api.models.list().data] == ["tiny"]


def test_stream_is_server_sent_events_ending_done(served):
    client, _ = served
    with client.stream("POST", "/v1/completions", json={"prompt": "ab", "max_tokens": 3, "stream": True}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.headers["content-type"].startswith("text/event-stream")
    assert all(line.startswith("data: ") for line in lines) and lines[-1] == "data: [DONE]"


def test_a_stream_reader_that_lags_is_woken_once_for_every_token_since_and_misses_none():
    """The engine thread's wake-ups to a stream's reader on the event loop: 50 tokens while the loop is busy are
    one wake-up, not 50; one after the reader cleared it (before it reads) is another; none is lost."""
    from trainer.serve.streams import Wake

    async def main():
        events = asyncio.Queue()
        wake, produced, read = Wake(asyncio.get_running_loop(), events), [], []
        for tokens in (range(50), range(50, 51), range(51, 90)):
            await _engine_thread(wake, produced, tokens)
            assert events.qsize() == 1
            await events.get()
            wake.pending = False  # as the stream's reader does, before it reads
            read.extend(produced[len(read):])
        assert read == list(range(90)) and events.empty()

    asyncio.run(main())


def test_tokens_within_the_stream_interval_wait_for_a_later_signal_and_the_end_always_signals():
    """With --stream-interval, a token within the interval of the last wake-up signals nothing (the reader takes
    it with a later one); once the interval has passed the next token signals; a request's end signals at
    once, however soon."""
    import time

    from trainer.serve.streams import Wake

    async def main():
        events = asyncio.Queue()
        wake, produced = Wake(asyncio.get_running_loop(), events, interval=0.2), []
        await _engine_thread(wake, produced, range(3))  # the first signals; the next two are within 0.2 s
        assert events.qsize() == 1
        await events.get()
        wake.pending = False
        await _engine_thread(wake, produced, range(3, 6))
        assert events.empty()  # read by nobody yet: they wait
        time.sleep(0.25)
        await _engine_thread(wake, produced, range(6, 7))  # past the interval: this one signals, for all since
        assert events.qsize() == 1
        await events.get()
        wake.pending = False
        await _engine_thread(wake, produced, range(7, 8), final=True)  # the end: at once
        assert events.qsize() == 1 and produced == list(range(8))

    asyncio.run(main())


def test_a_streams_chunks_come_at_most_once_an_interval_and_carry_the_same_text(served):
    """The server's stream interval (serve --stream-interval): with a second, a stream of 30 tokens that takes
    less is its first token's chunk and then one with the rest; with none, its chunks add up to the same text."""
    client, state = served
    body = {"prompt": "interval", "max_tokens": 30, "temperature": 0, "stream": True, "ignore_eos": True}

    def texts(interval: float) -> list[str]:
        state.stream_interval = interval
        with client.stream("POST", "/v1/completions", json=body) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines() if line and line != "data: [DONE]"]
        return [c["choices"][0]["text"] for c in chunks if c["choices"][0]["text"]]

    default = state.stream_interval
    try:
        started = time.perf_counter()
        slow = texts(1.0)
        took, each = time.perf_counter() - started, texts(0.0)
    finally:
        state.stream_interval = default
    assert "".join(slow) == "".join(each)
    if took < 1.0:  # a machine so loaded that 30 tokens take a second gets a third chunk, rightly
        assert len(slow) <= 2 < len("".join(slow)), slow  # the first token's text (unless empty), then the rest


async def _engine_thread(wake, produced: list, tokens, final: bool = False) -> None:
    """`tokens` from another thread, as the engine's emits them, the event loop not running meanwhile (a reader
    that lags); then one turn of the loop, which runs what the thread scheduled."""
    import threading

    def engine():
        for token in tokens:
            produced.append(token)
            wake(final)

    thread = threading.Thread(target=engine)
    thread.start()
    thread.join()
    await asyncio.sleep(0)


def test_bad_requests_get_openai_error_objects_and_the_server_stays_up(served):
    client, _ = served
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client)
    with pytest.raises(openai.BadRequestError) as e:
        api.completions.create(model="tiny", prompt="x" * 260, max_tokens=40)
    assert "maximum context length of 288 tokens" in e.value.body["message"]
    with pytest.raises(openai.NotFoundError) as e:
        api.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "model_not_found" and "'tiny'" in e.value.body["message"]
    bad = [({"prompt": "a", "max_tokens": 0}, 400, "max_tokens"), ({"max_tokens": 2}, 400, "prompt"),
           ({"prompt": "a", "temperature": -1}, 400, "temperature"), ({"prompt": "a", "n": 0}, 400, "n"),
           ({"prompt": [1, 999]}, 400, "token ids")]
    for round_ in range(10):  # 50 bad requests between good ones
        for body, status, needle in bad:
            r = client.post("/v1/completions", json=body)
            assert r.status_code == status, (body, r.text)
            assert needle in r.json()["error"]["message"] and r.json()["error"]["type"] == "invalid_request_error"
        good = client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2, "seed": round_})
        assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2
    assert client.post("/v1/completions", content=b"{not json").status_code == 400
    assert client.get("/nowhere").json()["error"]["type"] == "not_found_error"


def test_health_metrics_and_vertex_predict(served):
    client, _ = served
    assert client.get("/health").status_code == 200
    r = client.post("/predict", json={"instances": [{"prompt": "a", "max_tokens": 2},
                                                    {"messages": [{"role": "user", "content": "b"}],
                                                     "max_tokens": 3}]})
    assert r.status_code == 200, r.text
    predictions = r.json()["predictions"]
    assert [p["usage"]["completion_tokens"] for p in predictions] == [2, 3]
    assert client.post("/predict", json={"rows": []}).status_code == 400
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds", "vllm:time_per_output_token_seconds",
                 "vllm:e2e_request_latency_seconds", "vllm:prompt_tokens", "vllm:generation_tokens"):
        assert name in families, name
    generated = [s.value for s in families["vllm:generation_tokens"].samples if s.name.endswith("_total")]
    assert generated[0] >= 5
    # The prefix cache counts tokens, as vLLM's does: a prompt of 3 whole blocks asked twice finds them the second time.
    total = lambda name: [s.value for s in families[name].samples if s.name.endswith("_total")][0]  # noqa: E731
    before = {n: total(n) for n in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits")}
    prompt = "".join(chr(65 + i * 7 % 26) for i in range(50))  # 50 bytes: 3 blocks and 2 tokens
    for _ in range(2):
        assert client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}).status_code == 200
    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
    assert total("vllm:prefix_cache_queries") - before["vllm:prefix_cache_queries"] == 100
    assert total("vllm:prefix_cache_hits") - before["vllm:prefix_cache_hits"] == 48


def _held_request(max_tokens: int = 2):
    """A request whose listener, on the engine's thread inside its step, holds at the first token until released."""
    inside, release = threading.Event(), threading.Event()

    def hold(_):
        if not inside.is_set():
            inside.set()
            release.wait(30)

    return Request(list(b"held"), SamplingParams(max_tokens=max_tokens), listener=hold), inside, release


def test_a_step_that_does_not_return_turns_health_503_and_the_engines_thread_alone_fails_the_requests(served):
    """The progress signal: idle past --step-timeout is healthy, a step held past it is not (/health and /livez
    503 naming why), and healthy again once it returns. A failure signalled meanwhile (`fail`, as a group's
    watchdog does) changes nothing until the engine's thread is back, which then fails every request."""
    client, state = served
    engine = state.loop.engine
    state.loop.stop()
    loop = state.loop = EngineLoop(engine, step_timeout=0.4).start()
    req, inside, release = _held_request()
    try:
        time.sleep(0.6)  # idle past --step-timeout: an idle turn is progress
        assert client.get("/health").status_code == client.get("/livez").status_code == 200
        loop.submit(req)
        assert inside.wait(30)
        time.sleep(0.6)
        for path in ("/health", "/livez"):
            r = client.get(path)
            assert r.status_code == 503 and r.json()["reason"].startswith("no engine step completed for "), r.text
        release.set()
        while req.finish_reason is None:
            time.sleep(0.01)
        assert req.finish_reason == "length" and client.get("/health").status_code == 200

        req, inside, release = _held_request(max_tokens=8)
        queued = Request(list(b"queued"), SamplingParams(max_tokens=2))
        loop.submit(req)
        assert inside.wait(30)
        loop.submit(queued)
        loop.fail("the group failed")
        time.sleep(0.1)
        assert req.finish_reason is None and queued.finish_reason is None  # nothing done from this thread
        release.set()
        loop.thread.join(30)
        assert not loop.thread.is_alive() and not engine.busy
        assert [(r.finish_reason, r.error) for r in (req, queued)] == [("error", "the group failed")] * 2
    finally:
        release.set()
        loop.stop()
        state.loop = EngineLoop(engine).start()


def test_a_failed_step_with_on_failed_step_fails_every_request_and_ends_the_loop(served):
    """As a multi-host group's leader runs it: a step that raises fails every request, the waiting ones too, and
    the loop ends after telling its owner, on the engine's thread (where the single-process server goes on)."""
    _, state = served
    engine = state.loop.engine
    state.loop.stop()
    told = []

    def step_fails(name, inputs):  # the runner's on_call (a group's leader hands the call to its workers there)
        raise RuntimeError("the step failed")

    loop = EngineLoop(engine, on_failed_step=lambda reason: told.append((reason, threading.current_thread().name)))
    requests = [Request(list(b"abc"), SamplingParams(max_tokens=2)) for _ in range(3)]
    for req in requests:
        loop.submit(req)
    engine.runner.on_call = step_fails
    try:
        loop.start().thread.join(30)
        assert not loop.thread.is_alive() and not engine.busy
        assert told == [("RuntimeError: the step failed", "moe-tpu-engine")]
        assert [(r.finish_reason, r.error) for r in requests] == [("error", "RuntimeError: the step failed")] * 3
    finally:
        engine.runner.on_call = None
        loop.stop()
        state.loop = EngineLoop(engine).start()


def test_beyond_the_waiting_queue_requests_get_429_with_retry_after(served):
    _, state = served
    full = ServerState("tiny", encode=state.encode, decode=state.decode, max_waiting=2)
    app = create_app(full)
    paused = EngineLoop(state.loop.engine)  # not started: what it is given waits

    async def scenario():
        full.loop = paused
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            queued = [asyncio.ensure_future(client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2}))
                      for _ in range(2)]
            while paused.waiting() < 2:
                await asyncio.sleep(0)
            refused = await client.post("/v1/completions", json={"prompt": "a", "max_tokens": 2})
            for task in queued:
                task.cancel()
            await asyncio.gather(*queued, return_exceptions=True)
            return refused

    refused = asyncio.run(scenario())
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "rate_limit_error" and "2 requests are waiting" in \
        refused.json()["error"]["message"]


def test_a_requests_arrival_is_stamped_when_its_first_bytes_come_not_when_its_headers_end():
    """TTFT on /metrics counts from the arrival stamp, so it must be when the request reached the process.
    The request's first line is sent, then the rest of its headers 0.3 s later: the server's protocol
    stamps the first; the app alone (uvicorn's own protocol) could stamp no earlier than the second."""
    import socket
    import threading
    import time

    import uvicorn

    from trainer.serve.server import _Arrival, http_protocol

    async def app(scope, receive, send):
        body = repr(scope["state"]["arrival"]).encode()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    def arrival_of_a_slow_request(http) -> tuple[float, float]:
        server = uvicorn.Server(uvicorn.Config(_Arrival(app), host="127.0.0.1", port=0, http=http,
                                              log_level="warning", lifespan="off"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        try:
            while not server.started:
                time.sleep(0.01)
            port = server.servers[0].sockets[0].getsockname()[1]
            with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
                first = time.perf_counter()
                conn.sendall(b"GET / HTTP/1.1\r\n")
                time.sleep(0.3)
                conn.sendall(b"Host: test\r\nConnection: close\r\n\r\n")
                answer = b""
                while chunk := conn.recv(4096):
                    answer += chunk
            return first, float(answer.split(b"\r\n\r\n", 1)[1])
        finally:
            server.should_exit = True
            thread.join(timeout=10)

    first, arrival = arrival_of_a_slow_request(http_protocol())
    assert first <= arrival < first + 0.1
    first, arrival = arrival_of_a_slow_request("h11")  # the app's stamp alone: after the headers end
    assert arrival >= first + 0.3


def test_a_top_k_beyond_int32_means_the_whole_vocabulary_and_fails_no_request(served):
    """Before: the engine's int32 slot arrays overflowed, failing the step of every request in it (500)."""
    client, _ = served
    body = {"prompt": "ab", "max_tokens": 4, "temperature": 1.0, "seed": 7}
    huge = client.post("/v1/completions", json={**body, "top_k": 2**40})
    assert huge.status_code == 200, huge.text
    assert huge.json()["choices"][0]["text"] == client.post("/v1/completions", json=body).json()["choices"][0]["text"]


@pytest.mark.parametrize(("method", "path", "kwargs", "status", "message", "param"), [
    ("POST", "/v1/completions", {"content": b'{"prompt": "a",}', "headers": {"content-type": "application/json"}},
     400, "the body is not JSON", None),
    ("POST", "/v1/completions", {"content": b'{"prompt": "a"}', "headers": {"content-type": "text/plain"}}, 400,
     "content-type: application/json", None),
    ("POST", "/v1/completions", {"content": b'{"prompt": "\xff"}', "headers": {"content-type": "application/json"}},
     400, "send UTF-8 JSON", None),
    ("GET", "/v1/completions", {}, 405, "GET is not allowed on /v1/completions; use POST", None),
    ("POST", "/v1/completions", {"json": {"prompt": ""}}, 400, "the prompt has no tokens", "prompt"),
    ("POST", "/v1/completions", {"json": {"prompt": [5, 300]}}, 400, "got 300 in the prompt", "prompt"),
    ("POST", "/v1/completions", {"json": {"prompt": "a", "stop": 5}}, 400, "stop: ", "stop"),
    ("POST", "/v1/completions", {"json": {"prompt": "a", "max_tokens": "5"}}, 400, "max_tokens: ", "max_tokens"),
    ("POST", "/v1/completions", {"json": {"prompt": [True]}}, 400, "prompt", "prompt"),
    ("POST", "/v1/completions", {"json": {"prompt": "a", "logprobs": 21}}, 400,
     "logprobs: Input should be less than or equal to 20", "logprobs"),
    # Python's JSON reads NaN: it was "should be less than or equal to 2", which no NaN can mend
    ("POST", "/v1/completions", {"content": b'{"prompt": "a", "temperature": NaN}',
                                 "headers": {"content-type": "application/json"}}, 400,
     "temperature: Input should be a finite number", "temperature"),
    ("POST", "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": "a"}], "echo": True}}, 400,
     "echo: unknown field; this server does not offer it, leave it out", "echo"),
    ("POST", "/v1/completions", {"json": {"prompt": "a", "tempurature": 0}}, 400,
     "tempurature: unknown field; this server does not offer it, leave it out (did you mean 'temperature'?)",
     "tempurature"),
    ("POST", "/v1/completions", {"json": {"prompt": "a", "logit_bias": {"5": 100}}}, 400,
     "logit_bias: this server does not offer logit_bias; leave it out", "logit_bias"),
    ("POST", "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": "a"}],
                                               "presence_penalty": 0.5}}, 400,
     "presence_penalty: this server does not offer presence_penalty", "presence_penalty"),
    ("POST", "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": "a"}],
                                               "frequency_penalty": -1}}, 400,
     "frequency_penalty: this server does not offer frequency_penalty", "frequency_penalty"),
    ("POST", "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": "a"}],
                                               "tools": [{"type": "function", "function": {"name": "f"}}]}}, 400,
     "tools: this server does not offer tools", "tools"),
    ("POST", "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": "a"}],
                                               "response_format": {"type": "json_schema"}}}, 400,
     "response_format.json_schema: want {", "response_format"),
    ("POST", "/v1/completions", {"json": {"prompt": "a", "best_of": 2}}, 400,
     "best_of: this server does not offer best_of above 1", "best_of"),
    ("POST", "/v1/completions", {"json": {"prompt": "a", "stream_options": {"include_usage": True}}}, 400,
     "stream_options: only with stream: true", "stream_options"),
    ("POST", "/v1/completions", {"json": {"prompt": "x" * 300, "max_tokens": 1}}, 400,
     "the prompt's 300 tokens leave no room", "prompt"),
    ("POST", "/v1/chat/completions", {"json": {"messages": [{"role": "user", "content": "x" * 300}]}}, 400,
     "the prompt's 317 tokens leave no room", "messages"),
    ("POST", "/predict", {"json": {"instances": [{"prompt": "a"}, {"prompt": "a", "top_p": 2}]}}, 400,
     "instances[1].top_p: ", "instances[1].top_p"),
    ("POST", "/predict", {"json": {"instances": [{"prompt": "a", "max_tokens": 10**6}]}}, 400,
     "instances[0]: the prompt's 1 tokens", "instances[0].max_tokens"),
    ("POST", "/predict", {"json": {"instances": [{"prompt": "a"}] * 9}}, 400,
     "9 instances in one request; this server queues at most 8 (--max-waiting)", "instances"),
])
def test_refusals_are_openai_errors_naming_the_field(served, method, path, kwargs, status, message, param):
    client, _ = served
    r = client.request(method, path, **kwargs)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert message in error["message"] and error["param"] == param, error
    assert "Value error" not in error["message"]


def test_a_predict_refused_part_way_leaves_nothing_queued(served):
    """An instance refused after others were queued (here: beyond the context) cancels those: nothing decodes
    for an answer that is never sent."""
    _, state = served
    held = ServerState("tiny", encode=state.encode, decode=state.decode)
    app = create_app(held)
    held.loop = paused = EngineLoop(state.loop.engine)  # not started: what it is given stays in its inbox

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post("/predict", json={"instances": [{"prompt": "a", "max_tokens": 200},
                                                                     {"prompt": "b", "max_tokens": 10**6}]})

    refused = asyncio.run(scenario())
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "instances[1].max_tokens"
    queued = []
    while not paused.inbox.empty():
        queued.append(paused.inbox.get_nowait())
    assert all(req.cancelled for req in queued), queued


def test_a_scrape_counts_each_request_once_while_the_engine_holds_them_between_its_inbox_and_its_next_step(served):
    """Requests the engine's thread took from the inbox for a step that has not yet published its snapshot are
    waiting, in the same scrape as that snapshot's running count and cache usage (they were counted nowhere)."""
    from fastapi.testclient import TestClient

    from trainer.serve.engine import Request as EngineRequest
    from trainer.serve.engine import SamplingParams

    _, state = served
    scraped = ServerState("tiny", encode=state.encode, decode=state.decode)
    app = create_app(scraped)
    scraped.loop = held = EngineLoop(state.loop.engine)  # not started: the test takes its inbox as its thread would
    requests = [EngineRequest([97 + i], SamplingParams(max_tokens=1)) for i in range(3)]
    for req in requests:
        held.submit(req)
    try:
        held.take()  # the engine's thread, before its next step
        families = {f.name: f for f in text_string_to_metric_families(TestClient(app).get("/metrics").text)}
        value = lambda name: families[name].samples[0].value  # noqa: E731
        assert (value("vllm:num_requests_running"), value("vllm:num_requests_waiting")) == (0, 3)
        assert value("vllm:kv_cache_usage_perc") == 0
    finally:
        for req in requests:
            state.loop.engine.scheduler.waiting.remove(req)


def test_a_request_is_counted_gone_by_the_time_its_end_is_heard(served):
    """The waiting queue's limit (429) and /metrics count a request gone by the time anyone hears of its end: a
    client answered may send its next request at once (lm-eval's batches do) and must not find its last one
    still counted waiting or running. One request ends in its prefill (a prompt scored, echo), one in a decode
    step."""
    _, state = served
    heard = []

    def listener(req):
        if req.finish_reason is not None:
            heard.append((req.finish_reason, state.loop.counts()[:2]))

    for sampling in (SamplingParams(max_tokens=0, logprobs=0, prompt_logprobs=True), SamplingParams(max_tokens=3)):
        req = Request([97, 98, 99], sampling)
        req.listener = listener
        state.loop.submit(req)
        deadline = time.monotonic() + 60
        while req.finish_reason is None and time.monotonic() < deadline:
            time.sleep(0.01)
    assert heard == [("length", (0, 0)), ("length", (0, 0))]
