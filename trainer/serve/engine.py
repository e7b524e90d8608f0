"""The continuous-batching engine: fixed decode slots over one key/value cache, prompts prefilled in
chunks between decode steps, two jitted programs with fixed shapes.

Verbs: `submit` a request (it waits), `step` (one prefill chunk of the request being admitted into a free
slot, then one decode step for every slot), and `run` (steps until every request is done). A step never
waits on a long prompt: it prefills at most one chunk, so the running streams get a token each step.
The engine is synchronous and single-threaded; trainer.serve.server drives it from a thread.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from trainer.serve.kvcache import KVCache
from trainer.serve.logprobs import TOP, Logprob, records, token_logprobs
from trainer.serve.sampling import sample_tokens
from trainer.serve.weights import ServingModel


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
    text: str | None = None  # the output's text, cut before a stop string (with a detokenize)
    finish_reason: str | None = None  # "length", "stop", "cancelled", "error"
    error: str | None = None
    cancelled: bool = False  # set from any thread: the slot is freed at the next step
    arrival: float = dataclasses.field(default_factory=time.perf_counter)
    token_times: list[float] = dataclasses.field(default_factory=list)
    slot: int | None = None
    prefilled: int = 0  # prompt tokens already in the cache
    events: object = None  # the server's asyncio queue its listener signals on
    counted: bool = False  # in the server's metrics already
    first_sent: float | None = None  # when the server sent the first token's text (streaming)
    logprobs: list[Logprob] = dataclasses.field(default_factory=list)  # one a generated token, when asked
    prompt_logprobs: list[Logprob] = dataclasses.field(default_factory=list)  # prompt tokens 1.. (echo)
    eos: bool = False  # stopped at the end-of-document token (the last of `output`, which has no text)

    @property
    def text_ids(self) -> list[int]:
        """The output tokens that make its text: all but an end-of-document token it stopped at."""
        return self.output[:-1] if self.eos else self.output


class Engine:
    def __init__(self, model: ServingModel, weights: dict, *, slots: int = 8, max_len: int = 512, chunk: int = 64,
                 kv_dtype=None, detokenize: Callable[[list[int]], str] | None = None, eos_id: int | None = None):
        m = model.cfg.model
        shards = model.mesh.shape.get("expert", 1) * model.mesh.shape.get("data", 1)
        if slots % shards or chunk % shards:
            raise RequestError(f"slots ({slots}) and the prefill chunk ({chunk}) must be multiples of the mesh's "
                               f"{shards} devices (the MoE layers split tokens over them)")
        self.model, self.weights, self.detokenize, self.eos_id = model, weights, detokenize, eos_id
        self.slots, self.max_len, self.chunk = slots, max_len, chunk
        self.kv_dtype = jnp.dtype(kv_dtype or model.cfg.dtype)
        replicated = jax.sharding.NamedSharding(model.mesh, jax.sharding.PartitionSpec())
        cache_sharding = KVCache.sharding(model.mesh, m.kv_heads, self.kv_dtype)
        self.cache = jax.jit(lambda: KVCache.empty(m.num_layers, slots, max_len, m.kv_heads, m.head_size,
                                                   self.kv_dtype), out_shardings=cache_sharding)()
        # Outputs pinned to one layout: a cache coming back laid out otherwise would compile the step again.
        self._prefill = jax.jit(self._prefill_fn, donate_argnums=(1,), out_shardings=(replicated, cache_sharding))
        self._decode = jax.jit(self._decode_fn, donate_argnums=(1,), out_shardings=(replicated, cache_sharding))
        self.waiting: collections.deque[Request] = collections.deque()
        self.admitting: Request | None = None  # the request being prefilled, chunk by chunk
        self.active: dict[int, Request] = {}
        self.free = list(range(slots))
        # Host copies of each slot's decode inputs; an idle slot sits at position max_len, whose cache
        # writes are dropped.
        self.tokens_S = np.zeros(slots, np.int32)
        self.positions_S = np.full(slots, max_len, np.int32)
        self.temperature_S = np.zeros(slots, np.float32)
        self.top_k_S = np.zeros(slots, np.int32)
        self.top_p_S = np.ones(slots, np.float32)
        self.seed_S = np.zeros(slots, np.int32)

    # ------------------------------------------------------------------ the jitted programs

    def _prefill_fn(self, weights, cache, tokens_1xC, targets_C, start_1, slot_1, last, sampling, want):
        """The next token after position `last` of the chunk, and (when `want`) each position's logprob of
        its target, the token after it (a target < 0: the token drawn here)."""
        logits_1xCxV, cache = self.model.module(weights).decode(tokens_1xC, cache, start_1, slot_1)
        logits_1xV = jax.lax.dynamic_index_in_dim(logits_1xCxV, last, axis=1, keepdims=False)
        token_1 = sample_tokens(logits_1xV, *sampling, start_1 + last + 1)
        targets_C = jnp.where(targets_C < 0, token_1[0], targets_C)
        return (token_1, token_logprobs(logits_1xCxV[0], targets_C, want)), cache

    def _decode_fn(self, weights, cache, tokens_S, positions_S, sampling, want):
        logits_Sx1xV, cache = self.model.module(weights).decode(tokens_S[:, None], cache, positions_S)
        next_S = sample_tokens(logits_Sx1xV[:, 0], *sampling, positions_S + 1)
        return (next_S, token_logprobs(logits_Sx1xV[:, 0], next_S, want)), cache

    def compilations(self) -> int:
        """Programs compiled so far by the two steps (fixed shapes: 2 after warm-up)."""
        return self._prefill._cache_size() + self._decode._cache_size()

    def warm_up(self) -> None:
        """Compiles both steps (an idle decode step writes nothing; the prefill's writes into slot 0 are
        overwritten by its next request before they are read)."""
        sampling = _sampling_arrays([SamplingParams()])
        tokens, self.cache = self._prefill(self.weights, self.cache, np.zeros((1, self.chunk), np.int32),
                                           np.zeros(self.chunk, np.int32), np.zeros(1, np.int32),
                                           np.zeros(1, np.int32), np.int32(0), sampling, np.bool_(False))
        tokens, self.cache = self._decode(self.weights, self.cache, self.tokens_S, self.positions_S,
                                          self._slot_sampling(), np.bool_(False))
        jax.block_until_ready(tokens)

    # ------------------------------------------------------------------ requests

    def check(self, prompt: list[int], sampling: SamplingParams) -> None:
        """Raises RequestError when the engine cannot take this request."""
        vocab = self.model.cfg.model.vocab_size
        if not prompt:
            raise RequestError("the prompt has no tokens; give it some text", param="prompt")
        if min(prompt) < 0 or max(prompt) >= vocab:
            culprit = next(t for t in prompt if not 0 <= t < vocab)
            raise RequestError(f"token ids must be in [0, {vocab}), got {culprit} in the prompt", param="prompt")
        if sampling.max_tokens < (0 if sampling.prompt_logprobs else 1):
            raise RequestError(f"max_tokens must be at least 1 (0 only with echo and logprobs, scoring the prompt), "
                               f"got {sampling.max_tokens}", param="max_tokens")
        if len(prompt) >= self.max_len:
            raise RequestError(f"the prompt's {len(prompt)} tokens leave no room for a token in this server's "
                               f"maximum context length of {self.max_len} tokens; shorten the prompt", param="prompt")
        if len(prompt) + sampling.max_tokens > self.max_len:
            raise RequestError(f"the prompt's {len(prompt)} tokens plus max_tokens={sampling.max_tokens} exceed "
                               f"this server's maximum context length of {self.max_len} tokens", param="max_tokens")
        if sampling.temperature < 0 or not 0 < sampling.top_p <= 1 or sampling.top_k < 0:
            raise RequestError("temperature must be >= 0, top_p in (0, 1] and top_k >= 0")
        if sampling.stop and self.detokenize is None:
            raise RequestError("stop strings need a tokenizer, and this model has none", param="stop")
        if sampling.logprobs is not None and not 0 <= sampling.logprobs <= TOP:
            raise RequestError(f"logprobs must be in [0, {TOP}], got {sampling.logprobs}", param="logprobs")

    def submit(self, request: Request) -> Request:
        self.check(request.prompt, request.sampling)
        self.waiting.append(request)
        return request

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.admitting or self.active)

    def used_positions(self) -> int:
        """Cache positions holding live requests' tokens (the KV cache usage)."""
        held = sum(len(r.prompt) + len(r.output) for r in self.active.values())
        return held + (self.admitting.prefilled if self.admitting else 0)

    def run(self) -> None:
        while self.busy:
            self.step()

    # ------------------------------------------------------------------ one step

    def step(self) -> None:
        """One prefill chunk (when a request waits and a slot is free), then one decode step."""
        self._drop_cancelled()
        if self.admitting is None and self.waiting and self.free:
            self.admitting = self.waiting.popleft()
            self.admitting.slot = self.free.pop(0)
        if self.admitting is not None:
            self._prefill_chunk(self.admitting)
        if self.active:
            self._decode_all()

    def _prefill_chunk(self, req: Request) -> None:
        start, s = req.prefilled, req.sampling
        piece = req.prompt[start:start + self.chunk]
        final = start + len(piece) == len(req.prompt)
        tokens = np.zeros((1, self.chunk), np.int32)
        tokens[0, :len(piece)] = piece
        targets = np.zeros(self.chunk, np.int32)  # the token after each position; -1: the one drawn
        after = req.prompt[start + 1:start + len(piece) + 1]
        targets[:len(after)] = after
        targets[len(piece) - 1] = -1 if final else targets[len(piece) - 1]
        want = s.prompt_logprobs or (final and s.logprobs is not None)
        (token_1, scored), self.cache = self._prefill(
            self.weights, self.cache, tokens, targets, np.asarray([start], np.int32),
            np.asarray([req.slot], np.int32), np.int32(len(piece) - 1), _sampling_arrays([s]), np.bool_(want))
        req.prefilled += len(piece)
        token = int(np.asarray(token_1)[0])
        targets[len(piece) - 1] = token if final else targets[len(piece) - 1]
        scored = records(targets[:len(piece)], *scored, s.logprobs or 0) if want else None
        if s.prompt_logprobs:
            req.prompt_logprobs.extend(scored[:len(piece) - final])
        if not final:
            return
        self.admitting = None
        slot = req.slot
        self.active[slot] = req
        self.temperature_S[slot], self.top_k_S[slot], self.top_p_S[slot] = s.temperature, _top_k(s.top_k), s.top_p
        self.seed_S[slot] = np.int32(s.seed & 0x7FFFFFFF)
        if s.max_tokens == 0:  # the prompt scored (echo): nothing to generate
            req.finish_reason = "length"
            self._notify(req)
            self._release(req)
            return
        self._emit(req, token, scored[-1] if scored else None)

    def _decode_all(self) -> None:
        wanted = [slot for slot, req in self.active.items() if req.sampling.logprobs is not None]
        (tokens_S, scored), self.cache = self._decode(self.weights, self.cache, self.tokens_S, self.positions_S,
                                                      self._slot_sampling(), np.bool_(bool(wanted)))
        tokens_S = np.asarray(tokens_S)
        scored = [np.asarray(a) for a in scored] if wanted else None
        for slot, req in list(self.active.items()):
            top = req.sampling.logprobs
            record = None if top is None else records([tokens_S[slot]], *(a[slot:slot + 1] for a in scored), top)[0]
            self._emit(req, int(tokens_S[slot]), record)

    def _emit(self, req: Request, token: int, record: Logprob | None = None) -> None:
        """Records the request's new token; finishes it at max_tokens, the end-of-document token or a stop
        string; else the token is its slot's next input."""
        req.output.append(token)
        req.token_times.append(time.perf_counter())
        if record is not None:
            req.logprobs.append(record)
        try:
            reason = self._finished(req)
            if reason is None:
                self.tokens_S[req.slot] = token
                self.positions_S[req.slot] = len(req.prompt) + len(req.output) - 1
            else:
                req.finish_reason = reason
            if req.listener is not None:
                req.listener(req)
        except Exception as e:  # noqa: BLE001 - one request's failure (its listener, its text) is its own
            req.finish_reason, req.error = "error", f"{type(e).__name__}: {e}"
        if req.finish_reason is not None:
            self._release(req)

    def _finished(self, req: Request) -> str | None:
        s = req.sampling
        if req.output[-1] == self.eos_id and not s.ignore_eos:
            req.eos = True
            return "stop"
        if s.stop:
            text = self.detokenize(req.output)
            cut = min((i for i in (text.find(stop) for stop in s.stop) if i >= 0), default=-1)
            if cut >= 0:
                req.text = text[:cut]
                return "stop"
        if len(req.output) >= s.max_tokens:
            return "length"
        return None

    def _release(self, req: Request) -> None:
        slot = req.slot
        if slot is None:
            return
        self.active.pop(slot, None)
        self.positions_S[slot] = self.max_len
        self.temperature_S[slot] = 0
        self.free.append(slot)
        req.slot = None

    def _drop_cancelled(self) -> None:
        for req in [r for r in (*self.active.values(), self.admitting, *self.waiting) if r and r.cancelled]:
            if req is self.admitting:
                self.admitting = None
            elif req in self.waiting:
                self.waiting.remove(req)
            req.finish_reason = "cancelled"
            self._release(req)
            self._notify(req)

    @staticmethod
    def _notify(req: Request) -> None:
        """Tells a finished request's listener (the request is over whatever it does)."""
        if req.listener is not None:
            try:
                req.listener(req)
            except Exception:  # noqa: BLE001 - the request is gone either way
                pass

    def _slot_sampling(self):
        return self.temperature_S, self.top_k_S, self.top_p_S, self.seed_S


def _top_k(k: int) -> int:
    """A request's top_k as the int32 the steps take: any k beyond the vocabulary means all of it (the
    sampler clamps to the vocabulary), and one beyond int32 would fail the step of every request in it."""
    return min(k, np.iinfo(np.int32).max)


def _sampling_arrays(params: list[SamplingParams]):
    return (np.asarray([p.temperature for p in params], np.float32),
            np.asarray([_top_k(p.top_k) for p in params], np.int32),
            np.asarray([p.top_p for p in params], np.float32),
            np.asarray([p.seed & 0x7FFFFFFF for p in params], np.int32))
