"""Structured output: completions held to a JSON schema parse and validate (jsonschema, not this project's
reading of the schema) at temperature 0 and 1; regexes, choices and chat's json_object; a schema llguidance
cannot compile is a 400 naming the field."""

import json
import re

import jsonschema
import pytest
from fastapi.testclient import TestClient

from trainer.serve.server import ServerState, create_app

pytestmark = pytest.mark.compile_bound

# Nested objects, enums, arrays, numbers; strings, arrays and numbers bounded so a random model's output ends.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "weight": {"type": "number", "minimum": -5, "maximum": 100, "multipleOf": 0.25},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
        "owner": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                                   "active": {"type": "boolean"}},
                  "required": ["id", "active"], "additionalProperties": False},
    },
    "required": ["name", "kind", "age", "weight", "tags", "owner"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(served):
    """The shared engine behind a state that queues 50 choices of one request."""
    _, state = served
    mine = ServerState("tiny", encode=state.encode, decode=state.decode, max_waiting=64)
    mine.loop = state.loop
    with TestClient(create_app(mine)) as c:
        yield c


@pytest.mark.parametrize("temperature", [0, 1])
def test_fifty_completions_parse_and_validate_against_the_schema(client, temperature):
    r = client.post("/v1/completions", json={
        "prompt": [f"record {i}:" for i in range(50)], "max_tokens": 200, "temperature": temperature, "seed": 7,
        "response_format": {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 50
    for choice in choices:
        jsonschema.validate(json.loads(choice["text"]), SCHEMA)
        assert choice["finish_reason"] == "stop"
    if temperature:
        assert len({c["text"] for c in choices}) > 25  # the mask leaves the draw its randomness


def test_regex_choice_and_chat_json_object(client):
    r = client.post("/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 20, "temperature": 1,
                                             "structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}})
    assert r.status_code == 200, r.text
    assert all(re.fullmatch("[0-9]{3}-[a-z]{2}", c["text"]) for c in r.json()["choices"])
    r = client.post("/v1/completions", json={"prompt": "pick", "max_tokens": 20, "n": 4, "temperature": 1,
                                             "seed": 1, "structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert {c["text"] for c in r.json()["choices"]} <= {"yes", "no", "maybe"}
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 120, "temperature": 0,
        "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]["content"]
    if r.json()["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(message), dict)
    else:  # out of tokens inside the object: what there is begins one
        assert message.startswith("{")


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {
        "type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}}}},
     "response_format", "cannot compile"),
    ({"structured_outputs": {"regex": "(("}}, "structured_outputs.regex", "cannot compile"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one of"),
    ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
])
def test_what_cannot_be_compiled_is_a_400_naming_it(client, body, param, words):
    r = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_a_grammar_compiles_off_the_event_loop_so_health_answers_meanwhile(served):
    """A grammar, and the first one's tables of the tokenizer's tokens (about a second for a large vocabulary:
    here a sleep stands in for it), compile on a worker thread, as tokenizing does."""
    import asyncio
    import time

    import httpx

    from trainer.serve.structured import Grammars

    class SlowGrammars(Grammars):
        def grammar(self, response_format, structured_outputs):
            time.sleep(1.0)
            return super().grammar(response_format, structured_outputs)

    _, state = served
    slow = ServerState("tiny", encode=state.encode, decode=state.decode)
    app = create_app(slow)
    slow.loop = state.loop
    engine = state.loop.engine
    slow.grammars = SlowGrammars("bytes", engine.model.cfg.model.vocab_size, engine.eos_id)

    async def scenario():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            body = {"prompt": "a", "max_tokens": 3, "structured_outputs": {"regex": "[0-9]{3}"}}
            held = asyncio.ensure_future(c.post("/v1/completions", json=body))
            started = time.perf_counter()  # before the sleep: a compile on the loop would hold the sleep too
            await asyncio.sleep(0.2)
            health = await c.get("/health")
            return health, time.perf_counter() - started, await held

    health, waited, held = asyncio.run(scenario())
    assert health.status_code == 200 and waited < 0.7, waited
    assert held.status_code == 200 and re.fullmatch("[0-9]{3}", held.json()["choices"][0]["text"]), held.text
