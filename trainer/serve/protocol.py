"""The OpenAI requests the server takes, validated strictly as OpenAI's API does, and their refusals.

Every field of OpenAI's (and the few of vLLM's) that the server knows is either honoured or refused with a
400 naming it when asked for; a key it does not know is a 400 naming it and the closest known key. Nothing
is silently ignored, but for what asks for nothing, as OpenAI takes it: an optional field sent as null (the
value OpenAI's clients send for one left unset) and an empty stop string (which would end every completion
before its first character).
"""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from trainer.serve.logprobs import TOP


class APIError(Exception):
    def __init__(self, status: int, message: str, *, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers or {}

    def response(self):
        import json

        from fastapi.responses import Response

        # ASCII JSON: a message quoting the request (a model name, a field) may hold a lone surrogate, which
        # UTF-8 cannot encode (FastAPI's JSONResponse failed on it with a 500).
        body = {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}
        return Response(json.dumps(body), status_code=self.status, headers=self.headers,
                        media_type="application/json")


class _Strict(BaseModel):
    """Strict, as OpenAI's API is; an optional field sent as null is a field not given (OpenAI's clients send
    null for what their caller left unset), while a required one sent as null is refused naming it."""

    # Numbers finite: a NaN (which Python's JSON reads) is no temperature, and no bound names what is wrong with it.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_given(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {key: value for key, value in data.items()
                if value is not None or key not in cls.model_fields or cls.model_fields[key].is_required()}


class StreamOptions(_Strict):
    include_usage: bool = False


# OpenAI's fields this server does not offer, and the value of each that asks for nothing: any other value
# is refused, naming the field.
NOT_OFFERED = {"logit_bias": (None, {}), "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
               "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
               "function_call": (None, "none"), "parallel_tool_calls": (None,), "suffix": (None, "")}


class _Sampling(_Strict):
    # Strict, as OpenAI's API is: "5" is no max_tokens and true no token id (pydantic's lax mode took both).
    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # vLLM's: 0 the whole vocabulary
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=128)
    user: str | None = None  # an end user's id for OpenAI's abuse monitoring: it changes no answer
    ignore_eos: bool = False  # vLLM's: go on past the end-of-document token
    logit_bias: Any = None
    presence_penalty: Any = None
    frequency_penalty: Any = None
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    response_format: Any = None  # OpenAI's, and vLLM's structured_outputs: trainer.serve.structured reads both
    structured_outputs: Any = None

    @field_validator(*(name for name in NOT_OFFERED if name != "suffix"))
    @classmethod
    def _not_offered(cls, value: Any, info: ValidationInfo) -> Any:
        return _neutral_or_refused(value, info.field_name)

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, value: str | list[str] | None) -> str | list[str] | None:
        """An empty stop string would end every completion before its first character: it is no stop string
        (as OpenAI ignores it)."""
        if isinstance(value, str):
            return value or None
        return [s for s in value if s] if value is not None else None

    @model_validator(mode="after")
    def _stream_options_with_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only with stream: true")
        return self


def _neutral_or_refused(value: Any, name: str) -> Any:
    if any(value == neutral and type(value) is type(neutral) for neutral in NOT_OFFERED[name]) or \
            (value == 0 and name.endswith("_penalty") and type(value) in (int, float)):
        return value
    raise ValueError(f"this server does not offer {name}; leave it out")


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(None, ge=0, le=TOP)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    suffix: Any = None

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: Any) -> Any:
        return _neutral_or_refused(value, "suffix")

    @field_validator("best_of")
    @classmethod
    def _best_of_one(cls, value: int | None) -> int | None:
        if value not in (None, 1):
            raise ValueError(f"this server does not offer best_of above 1 (got {value}); ask for n choices "
                             "with logprobs and pick among them")
        return value


class ChatMessage(_Strict):
    role: str
    content: str
    name: str | None = None


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=TOP)

    @model_validator(mode="after")
    def _top_logprobs_with_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: only with logprobs: true")
        return self


def invalid(error: dict, prefix: str | None = None, fields=()) -> APIError:
    """A 400 from pydantic's first error, naming the field (`stop.str` for a union's branch is `stop`); an
    unknown key names the closest of `fields`."""
    loc = [str(p) for p in error.get("loc", ())]
    if loc and loc[0] == "body":
        loc = loc[1:]
    loc = [p for p in loc if p not in ("str", "int", "list[int]", "list[str]", "list[list[int]]")]
    field = ".".join(loc)
    param = ".".join(p for p in (prefix, field) if p) or None
    message = str(error.get("msg", "")).removeprefix("Value error, ")
    if param is None:  # the body as a whole: empty, not an object, or not sent as JSON (curl -d without -H)
        if message.startswith(("stream_options", "top_logprobs")):
            param = message.split(":")[0]
            return APIError(400, message, param=param)
        return APIError(400, f"the body must be a JSON object sent with content-type: application/json "
                             f"({message})")
    if error.get("type") == "extra_forbidden":
        close = difflib.get_close_matches(loc[-1], list(fields), n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        return APIError(400, f"{param}: unknown field; this server does not offer it, leave it out{hint}",
                        param=param)
    return APIError(400, f"{param}: {message}", param=param)
