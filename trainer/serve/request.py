"""The engine's request and its sampling (plain dataclasses, no jax): what a caller submits to the engine
(trainer/serve/engine.py) and reads back as it decodes. A front end that keeps its own state beside a request
(the HTTP server's event queue: trainer/serve/routes.py ServedRequest) extends it rather than adding here."""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from trainer.serve.logprobs import Logprob


class RequestError(ValueError):
    """A request the engine cannot take (too long, bad sampling values); the message says why, `param`
    which field of the request it is about."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: the whole vocabulary
    top_p: float = 1.0
    seed: int = 0
    stop: tuple[str, ...] = ()  # the text stops before the first of these (needs the engine's detokenize)
    logprobs: int | None = None  # each generated token's logprob and this many best alternatives (<= TOP)
    prompt_logprobs: bool = False  # the prompt's too (`echo`): then max_tokens may be 0, scoring the prompt
    ignore_eos: bool = False  # go on past the end-of-document token


_ids = itertools.count()


@dataclasses.dataclass(eq=False)
class Request:
    prompt: list[int]
    sampling: SamplingParams = SamplingParams()
    # Called on the engine's thread after each new token (finish_reason None) and once at the end.
    listener: Callable[[Request], None] | None = None
    id: int = dataclasses.field(default_factory=lambda: next(_ids))
    output: list[int] = dataclasses.field(default_factory=list)
    text: str | None = None  # the output's text so far, cut before a stop string (with a detokenize)
    finish_reason: str | None = None  # "length", "stop", "cancelled", "error"
    error: str | None = None
    cancelled: bool = False  # set from any thread: the slot is freed at the next step
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    token_times: list[float] = dataclasses.field(default_factory=list)
    slot: int | None = None
    prefilled: int = 0  # prompt tokens already in the cache
    logprobs: list[Logprob] = dataclasses.field(default_factory=list)  # one a generated token, when asked
    prompt_logprobs: list[Logprob] = dataclasses.field(default_factory=list)  # prompt tokens 1.. (echo)
    eos: bool = False  # stopped at the end-of-document token (the last of `output`, which has no text)
    detokenizer: object = None  # the output processor's incremental text state
    constraint: object = None  # the grammar its text keeps to (trainer.serve.structured.Constraint), or None
    prefix_queried: int = 0  # prompt tokens looked up in the prefix cache (vllm:prefix_cache_queries)
    cached_tokens: int = 0  # ... of which were found there, not prefilled (vllm:prefix_cache_hits)

    @property
    def text_ids(self) -> list[int]:
        """The output tokens that make its text: all but an end-of-document token it stopped at."""
        return self.output[:-1] if self.eos else self.output
