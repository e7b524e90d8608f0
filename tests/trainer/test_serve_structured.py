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
