"""The server's OpenAI conformance and log-probabilities, in-process over the shared small engine (`served`,
bytes as tokens): lm-evaluation-harness's own loglikelihood payload against a full teacher-forced forward
pass, echo without generation, n choices with a seed, a list of prompts, the end-of-document token,
streaming usage as the openai client reads it, vLLM's tokenizer routes, and the grace period running out."""

import asyncio
import json
import logging
import time

import httpx
import jax
import jax.numpy as jnp
import numpy as np
import openai
import pytest

from trainer.serve.server import ServerState, create_app

pytestmark = pytest.mark.compile_bound

PADDED = 64  # the teacher-forced forward's length: one compilation, the sequences padded (causal)


@pytest.fixture(scope="module")
def teacher(served):
    """log-softmax of the full forward pass over a sequence, float32 [len, vocab]."""
    engine = served[1].loop.engine
    forward = jax.jit(lambda w, t: jax.nn.log_softmax(engine.model.module(w)(t, train=False)[0], axis=-1))

    def logprobs(sequence):
        padded = jnp.asarray([list(sequence) + [0] * (PADDED - len(sequence))], jnp.int32)
        return np.asarray(forward(engine.weights, padded)[0, :len(sequence)])

    return logprobs


def lm_eval_payload(prompts):
    """What lm-evaluation-harness's local-completions sends for loglikelihood requests (lm-eval 0.4)."""
    return {"model": "tiny", "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}


def test_lm_eval_loglikelihood_payload_scores_each_prompt_as_the_full_forward_pass(served, teacher):
    client, _ = served
    rng = np.random.RandomState(3)
    prompts = [rng.randint(0, 256, n).tolist() for n in (5, 17, 33, 2)]  # one and three prefill chunks
    r = client.post("/v1/completions", json=lm_eval_payload(prompts))
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2, 3]
    for prompt, choice in zip(prompts, choices, strict=True):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(prompt) + 1 == len(lp["top_logprobs"]) == len(lp["tokens"])
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        generated = int(np.argmax(teacher(prompt)[-1]))  # greedy: the argmax after the prompt
        sequence = prompt + [generated]
        expected = teacher(sequence)
        want = [float(expected[i - 1, sequence[i]]) for i in range(1, len(sequence))]
        np.testing.assert_allclose(lp["token_logprobs"][1:], want, atol=1e-4, rtol=0)
        for i, top in enumerate(lp["top_logprobs"][1:], start=1):  # lm-eval's is_greedy reads these
            best = float(expected[i - 1].max())
            assert max(top.values()) == pytest.approx(best, abs=1e-4)
        assert lp["text_offset"] == list(np.cumsum([0] + [len(t) for t in lp["tokens"][:-1]]))
        assert choice["text"] == "".join(lp["tokens"]) or "\ufffd" in choice["text"]
    alone = client.post("/v1/completions", json=lm_eval_payload([prompts[2]])).json()["choices"][0]["logprobs"]
    np.testing.assert_allclose(alone["token_logprobs"][1:], choices[2]["logprobs"]["token_logprobs"][1:],
                               atol=1e-5, rtol=0)


def test_echo_without_generation_scores_the_prompt_and_disturbs_no_other_request(served, teacher):
    client, state = served
    prompt = list(b"the prompt to score")
    scored = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 2})
    assert scored.status_code == 200, scored.text
    choice = scored.json()["choices"][0]
    expected = teacher(prompt)
    assert choice["text"] == "the prompt to score" and scored.json()["usage"]["completion_tokens"] == 0
    np.testing.assert_allclose(choice["logprobs"]["token_logprobs"][1:],
                               [expected[i - 1, prompt[i]] for i in range(1, len(prompt))], atol=1e-4, rtol=0)
    greedy = {"prompt": "running alongside", "max_tokens": 24, "temperature": 0}
    alone = client.post("/v1/completions", json=greedy).json()["choices"][0]["text"]
    shared = ServerState("tiny", encode=state.encode, decode=state.decode, max_waiting=16)
    app = create_app(shared)
    shared.loop = state.loop

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            scoring = [c.post("/v1/completions", json={"prompt": prompt[:k], "max_tokens": 0, "echo": True,
                                                       "logprobs": 0}) for k in range(2, 12)]
            return await asyncio.gather(c.post("/v1/completions", json=greedy), *scoring)

    together, *scores = asyncio.run(scenario())
    assert together.json()["choices"][0]["text"] == alone
    assert all(s.status_code == 200 and s.json()["usage"]["completion_tokens"] == 0 for s in scores)
    refused = client.post("/v1/completions", json={"prompt": "a", "max_tokens": 0})
    assert refused.status_code == 400 and "0 only with echo and logprobs" in refused.json()["error"]["message"]


def test_n_choices_with_a_seed_reproduce_and_prompts_answer_in_their_order(served):
    client, _ = served
    body = {"prompt": "seeded", "max_tokens": 6, "temperature": 1.0, "n": 3, "seed": 11}
    first, again = (client.post("/v1/completions", json=body).json() for _ in range(2))
    texts = [c["text"] for c in first["choices"]]
    assert [c["index"] for c in first["choices"]] == [0, 1, 2]
    assert texts == [c["text"] for c in again["choices"]] and len(set(texts)) > 1
    assert first["usage"] == {"prompt_tokens": 6, "completion_tokens": 18, "total_tokens": 24}
    greedy = {"max_tokens": 4, "temperature": 0}
    each = [client.post("/v1/completions", json={"prompt": p, **greedy}).json()["choices"][0]["text"]
            for p in ("one", "two", "three")]
    listed = client.post("/v1/completions", json={"prompt": ["one", "two", "three"], **greedy}).json()
    assert [c["text"] for c in listed["choices"]] == each
    ids = client.post("/v1/completions", json={"prompt": [list(b"one"), list(b"two")], **greedy}).json()
    assert [c["text"] for c in ids["choices"]] == each[:2]


def test_chat_logprobs_and_its_default_length_is_the_rest_of_the_context(served, teacher):
    client, state = served
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client)
    chat = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], temperature=0,
                                       logprobs=True, top_logprobs=3, max_tokens=4)
    prompt = list(b"user: hi\nassistant:")
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(len(c.top_logprobs) == 3 for c in content)
    assert content[0].logprob == pytest.approx(float(teacher(prompt)[-1].max()), abs=1e-4)  # greedy: the best
    as_completion = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0,
                                                        "logprobs": 3}).json()["choices"][0]["logprobs"]
    np.testing.assert_allclose([c.logprob for c in content], as_completion["token_logprobs"], atol=1e-6, rtol=0)
    for c, top in zip(content, as_completion["top_logprobs"], strict=True):
        assert c.top_logprobs[0].logprob == pytest.approx(c.logprob, abs=1e-6) == max(top.values())
    endless = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], temperature=0)
    assert endless.usage.completion_tokens == state.max_len - len(prompt)  # OpenAI's default, not 16
    assert endless.choices[0].finish_reason == "length"


def test_the_end_of_document_token_stops_generation_with_finish_reason_stop(served):
    client, state = served
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client)
    free = api.completions.create(model="tiny", prompt="The end", max_tokens=8, temperature=0,
                                  logprobs=0).choices[0]
    tokens = [int(bytes(t, "latin-1")[0]) if len(t) == 1 and ord(t) < 256 else None
              for t in free.logprobs.tokens]
    ends = next(i for i, t in enumerate(tokens) if t is not None and t < 128 and i > 0)
    engine = state.loop.engine
    engine.eos_id = tokens[ends]
    try:
        stopped = api.completions.create(model="tiny", prompt="The end", max_tokens=8, temperature=0)
        ignored = api.completions.create(model="tiny", prompt="The end", max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True})
    finally:
        engine.eos_id = None
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop" and stopped.usage.completion_tokens == ends + 1
    assert choice.text == "".join(free.logprobs.tokens[:ends])  # the token itself has no text
    assert ignored.choices[0].finish_reason == "length" and ignored.choices[0].text == free.text


def test_streaming_usage_comes_in_a_final_chunk_without_choices_only_when_asked(served):
    client, _ = served
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client)
    for chat in (False, True):
        create = api.chat.completions.create if chat else api.completions.create
        prompt = {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
        chunks = list(create(model="tiny", max_tokens=5, temperature=0, stream=True,
                             stream_options={"include_usage": True}, **prompt))
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5
        assert all(c.usage is None for c in chunks[:-1]) and chunks[-2].choices[0].finish_reason == "length"
        plain = list(create(model="tiny", max_tokens=5, temperature=0, stream=True, **prompt))
        assert all(c.choices and c.usage is None for c in plain)


def test_tokenizer_routes_answer_in_vllms_shapes(served):
    client, state = served
    r = client.post("/tokenize", json={"prompt": "héllo", "add_special_tokens": False})
    assert r.json() == {"count": 6, "max_model_len": 288, "tokens": list("héllo".encode()), "token_strs": None}
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    assert chat["tokens"] == list(b"user: hi\nassistant:")
    assert client.post("/detokenize", json={"tokens": list("héllo".encode())}).json() == {"prompt": "héllo"}
    bad = client.post("/detokenize", json={"tokens": [1, 256]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    info = client.get("/tokenizer_info").json()
    assert "eos_token" in info and info["model_max_length"] == 288
    import jinja2

    rendered = jinja2.Template(info["chat_template"]).render(messages=[{"role": "user", "content": "hi"}],
                                                             add_generation_prompt=True)
    assert rendered == "user: hi\nassistant:"


def test_a_grace_period_that_runs_out_ends_each_stream_with_an_error_event_and_logs_nothing_per_stream(served, caplog):
    _, state = served
    closing = ServerState("tiny", encode=state.encode, decode=state.decode, max_waiting=8)
    app = create_app(closing)
    closing.loop = state.loop

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            async def stream():
                body = {"prompt": "long", "max_tokens": 250, "stream": True, "ignore_eos": True}
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    return [line async for line in r.aiter_lines() if line]

            async def plain():
                return await c.post("/v1/completions", json={"prompt": "long", "max_tokens": 250})

            tasks = [asyncio.ensure_future(stream()) for _ in range(3)] + [asyncio.ensure_future(plain())]
            while len(closing.open) < 4 or any(not r.output for r in closing.open):
                await asyncio.sleep(0.01)
            closing.draining = True
            cut = closing.expire()
            return cut, *await asyncio.gather(*tasks)

    with caplog.at_level(logging.WARNING):
        cut, *streams, plain = asyncio.run(scenario())
    for lines in streams:
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert "grace period" in error["message"]
    assert plain.status_code == 503 and "grace period" in plain.json()["error"]["message"]
    assert cut == 4 and not caplog.records  # the server's one line is its caller's (trainer.serve.cli)
    assert not closing.open
    assert drained(state.loop)  # the engine frees the cut requests' slots at its next step


def drained(loop, timeout_s: float = 60.0) -> bool:
    """Whether the engine loop holds no request, running or waiting, within `timeout_s` (a step under way when
    requests were cut still counts them until it ends)."""
    deadline = time.monotonic() + timeout_s
    while loop.counts()[:2] != (0, 0):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_metrics_under_100_concurrent_streams_never_errors_and_each_scrape_agrees_with_itself(served):
    """/metrics reads one view of the engine per scrape (the snapshot it publishes after each step, never its
    slots mid-step): running, waiting and the cache's usage agree within a scrape."""
    from prometheus_client.parser import text_string_to_metric_families

    _, state = served
    assert drained(state.loop)  # requests another test left are not counted among these 100
    busy = ServerState("tiny", encode=state.encode, decode=state.decode, max_waiting=100)
    app = create_app(busy)
    busy.loop = state.loop

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            async def stream(i):
                body = {"prompt": f"stream {i}", "max_tokens": 12, "stream": True, "temperature": 1.0, "seed": i}
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    return r.status_code, [line async for line in r.aiter_lines() if line][-1]

            streams = asyncio.ensure_future(asyncio.gather(*(stream(i) for i in range(100))))
            scrapes = []
            while not streams.done():
                scrapes.append(await c.get("/metrics"))
                await asyncio.sleep(0.005)
            return await streams, scrapes

    ended, scrapes = asyncio.run(scenario())
    assert ended == [(200, "data: [DONE]")] * 100
    assert len(scrapes) > 5 and all(r.status_code == 200 for r in scrapes)
    names = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    seen = [{f.name: f.samples[0].value for f in text_string_to_metric_families(r.text) if f.name in names}
            for r in scrapes]
    assert max(s[names[0]] for s in seen) == 8  # every slot was busy at some scrape
    for s in seen:
        running, waiting, usage = (s[n] for n in names)
        assert 0 <= running <= 8 and 0 <= waiting and running + waiting <= 100, s
        assert (usage > 0) >= (running > 0), s  # a running request holds cache positions


def test_lm_evaluation_harness_scores_continuations_as_the_full_forward_pass(served, teacher):
    """lm-evaluation-harness's own local-completions client (its remote tokenizer through /tokenize, its
    loglikelihood payload, its parsing of the answer) against the server: each continuation's summed logprob
    and whether it is greedy, as a full teacher-forced forward pass says."""
    import threading

    import uvicorn
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    _, state = served
    harnessed = ServerState("tiny", encode=state.encode, decode=state.decode, max_waiting=8)
    harnessed.loop = state.loop
    server = uvicorn.Server(uvicorn.Config(create_app(harnessed), host="127.0.0.1", port=0, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        port = server.servers[0].sockets[0].getsockname()[1]
        lm = LocalCompletionsAPI(model="tiny", base_url=f"http://127.0.0.1:{port}/v1/completions",
                                 tokenizer_backend="remote", tokenized_requests=True, batch_size=4, max_retries=1)
        pairs = [("The cat sat on the", " mat"), ("Paris is the capital of", " France"), ("1 2 3", " 4 5"),
                 ("ab", "c")]
        requests = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
        scored = lm.loglikelihood(requests, disable_tqdm=True)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    for (context, continuation), (logprob, greedy) in zip(pairs, scored, strict=True):
        ids = list((context + continuation).encode())
        start = len(context.encode())
        expected = teacher(ids)
        want = sum(float(expected[i - 1, ids[i]]) for i in range(start, len(ids)))
        assert logprob == pytest.approx(want, abs=1e-4)
        assert greedy == all(expected[i - 1].argmax() == ids[i] for i in range(start, len(ids)))


def test_streamed_logprobs_are_the_answers_logprobs_chunk_by_chunk(served):
    client, _ = served
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client)
    whole = api.completions.create(model="tiny", prompt="stream me", max_tokens=10, temperature=0, logprobs=2)
    pieces = list(api.completions.create(model="tiny", prompt="stream me", max_tokens=10, temperature=0,
                                         logprobs=2, stream=True))
    streamed = [v for p in pieces if p.choices[0].logprobs for v in p.choices[0].logprobs.token_logprobs]
    assert streamed == whole.choices[0].logprobs.token_logprobs and len(streamed) == 10
    messages = [{"role": "user", "content": "hi"}]
    chat = api.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=2)
    chunks = list(api.chat.completions.create(model="tiny", messages=messages, max_tokens=6, temperature=0,
                                              logprobs=True, top_logprobs=2, stream=True))
    content = [c for k in chunks if k.choices and k.choices[0].logprobs for c in k.choices[0].logprobs.content]
    assert [c.logprob for c in content] == [c.logprob for c in chat.choices[0].logprobs.content]
