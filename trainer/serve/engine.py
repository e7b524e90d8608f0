"""The continuous-batching engine: fixed decode slots over one key/value cache, prompts prefilled in
chunks between decode steps, jitted programs with fixed shapes (one per span of the cache a step reads and,
decoding, per row count: a lone request's step runs its slot's row alone).

Verbs: `submit` a request (it waits), `step` (one prefill chunk of the request being admitted into a free
slot, then one decode step for every slot), and `run` (steps until every request is done). A step never
waits on a long prompt: it prefills at most one chunk, so the running streams get a token each step. With
`mixed_prefill` (an accelerator's default) the chunk of a request admitted while others decode goes with
their decode step in one program (trainer.serve.runner's dispatch with a Chunk), which reads the weights once
for both; the request then starts decoding once that step is read.

The host stays off the device's critical path: a step dispatches the next decode step, its continuing slots'
input tokens taken on the device from the step before (trainer.serve.runner's follow), and only then reads
that step's tokens and emits them, while the new one runs. A slot's next input that needs the host first
keeps the step synchronous (decode, read, emit): a grammar's mask of the next token, and a group over several
processes, whose inputs travel from host data (see _overlaps). With `decode_steps` > 1 (serve --decode-steps),
while a lone stream decodes and nothing waits for a slot, one program runs that many steps (a burst,
trainer.serve.runner's Steps.burst): there a step is shorter than the host's work for it (one v5e chip, moe-1b:
the engine's step 1.02-1.21 ms against 0.77-1.06 ms of the device's), and with bursts of 8 the device, not
the host, sets the pace (bf16 1.21 -> 1.11 ms a token, int8 1.09 -> 0.86).

The engine is synchronous and single-threaded; trainer.serve.loop drives it from a thread, and after each
step it publishes a `Snapshot` (running, waiting, cache positions held) that other threads read whole.

Three parts: the scheduler (trainer.serve.scheduler: admission, slots), the model runner
(trainer.serve.runner: the compiled programs and the cache) and the output processor (trainer.serve.output:
text, stop strings, when a request is done). The engine wires them and keeps the requests' lifecycle.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from trainer.serve.logprobs import TOP, Logprob
from trainer.serve.output import OutputProcessor
from trainer.serve.prefix import PrefixCache, unsupported

# The engine's requests (trainer/serve/request.py), re-exported: callers import them from here as from there.
from trainer.serve.request import Request, RequestError, SamplingParams  # noqa: F401
from trainer.serve.runner import MIN_SPAN, ModelRunner
from trainer.serve.scheduler import Scheduler
from trainer.serve.weights import ServingModel

log = logging.getLogger("trainer.serve")


@dataclasses.dataclass(frozen=True)
class Flight:
    """A decode step dispatched and not yet read: its outputs on the device, the requests it ran by slot, the
    slots whose log-probability records it returns (slot -> how many alternatives)."""

    outputs: tuple
    ran: dict
    wanted: dict
    steps: int = 1  # a burst's steps (ModelRunner.decode_steps): as many tokens for each slot it ran
    chunk: tuple | None = None  # (the request being admitted, the prefill chunk of it the step took along)


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """What the engine holds after a step, published whole for other threads (/metrics)."""

    running: int = 0
    waiting: int = 0  # queued or being prefilled
    used_positions: int = 0  # cache positions holding live requests' tokens


class Engine:
    def __init__(self, model: ServingModel, weights: dict, *, slots: int = 8, max_len: int = 512, chunk: int = 64,
                 kv_dtype=None, detokenize: Callable[[list[int]], str] | None = None, eos_id: int | None = None,
                 prefix_cache: int = 0, min_span: int = MIN_SPAN, stop_ids: tuple[int, ...] = (),
                 decode_steps: int = 1, mixed_prefill: bool | None = None):
        """`prefix_cache`: the tokens of prompt prefixes kept for later prompts (trainer.serve.prefix; 0: none);
        `min_span`: the shortest span of the cache a step reads (trainer.serve.runner.ModelRunner.spans);
        `stop_ids`: tokens that end a request as eos_id does (trainer.serve.output.OutputProcessor);
        `decode_steps`: decode steps a program may run when nothing waits (_steps; 1: one a program);
        `mixed_prefill`: a prefill chunk goes with the decode step while requests decode (one program, the
        weights read once for both: a long prompt admitted barely slows the streams), None: where the model
        runs on an accelerator (mixed_default)."""
        shards = model.mesh.shape.get("expert", 1) * model.mesh.shape.get("data", 1)
        if slots % shards or chunk % shards:
            raise RequestError(f"slots ({slots}) and the prefill chunk ({chunk}) must be multiples of the mesh's "
                               f"{shards} devices (the MoE layers split tokens over them)")
        self.runner = ModelRunner(model, weights, slots=slots, max_len=max_len, chunk=chunk, kv_dtype=kv_dtype,
                                  min_span=min_span, decode_steps=decode_steps,
                                  mixed=mixed_default(model) if mixed_prefill is None else mixed_prefill)
        self.scheduler = Scheduler(slots)
        self.output = OutputProcessor(detokenize, eos_id, stop_ids)
        if prefix_cache and unsupported(model.cfg.model):
            log.warning("%s", unsupported(model.cfg.model))
            prefix_cache = 0
        self.prefix = PrefixCache(self.runner.cache, prefix_cache) if prefix_cache else None
        self.model, self.slots, self.max_len, self.chunk = model, slots, max_len, chunk
        self.snapshot = Snapshot()
        self.on_publish: Callable[[Snapshot], None] | None = None  # told each snapshot (trainer.serve.loop)
        self.flight: Flight | None = None  # the decode step dispatched and not yet read

    # The parts' state that callers read: the runner's weights and cache, the output's codec and end token.
    weights = property(lambda self: self.runner.weights, lambda self, v: setattr(self.runner, "weights", v))
    cache = property(lambda self: self.runner.cache, lambda self, v: setattr(self.runner, "cache", v))
    detokenize = property(lambda self: self.output.detokenize,
                          lambda self, v: setattr(self.output, "detokenize", v))
    eos_id = property(lambda self: self.output.eos_id, lambda self, v: setattr(self.output, "eos_id", v))
    free = property(lambda self: self.scheduler.free)
    busy = property(lambda self: self.scheduler.busy)

    def compilations(self) -> int:
        return self.runner.compilations()

    def warm_up(self, every_span: bool = False, between=None) -> None:
        """Compiles the steps before the first request (ModelRunner.warm_up; `between()` before each program)."""
        self.runner.warm_up(every_span, between)
        if self.prefix is not None:
            (between or (lambda: None))()
            self.runner.cache = self.prefix.warm_up(self.runner.cache)

    def compile_ahead(self, between=None, names=None) -> int:
        """Compiles the steps' programs not compiled yet (or those of `names`), without running them
        (ModelRunner.compile_ahead): on a thread of its own while the engine serves."""
        return self.runner.compile_ahead(between, names)

    def used_positions(self) -> int:
        return self.scheduler.used_positions()

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
        self.scheduler.waiting.append(request)
        return request

    def run(self) -> None:
        while self.busy:
            self.step()

    # ------------------------------------------------------------------ one step

    def step(self) -> None:
        """One prefill chunk (when a request waits and a slot is free), then one decode step; then the
        snapshot."""
        for req in self.scheduler.cancelled():
            self._end(req, "cancelled")
        req = self.scheduler.next_prefill()
        if req is not None and req.prefilled == len(req.prompt):
            req = None  # its last chunk went with the step in flight: it decodes once that step is read
        if req is not None and self.runner.mixed and self.scheduler.active:
            self._decode_all(req)  # the chunk goes with the decode step: the weights read once for both
        else:
            if req is not None:
                self._prefill_chunk(req)
            if self.scheduler.active or self.flight is not None:
                self._decode_all()
        self.publish()

    def publish(self) -> None:
        s = self.scheduler
        self.snapshot = Snapshot(len(s.active), len(s.waiting) + (s.admitting is not None), s.used_positions())
        if self.on_publish is not None:
            self.on_publish(self.snapshot)

    def _prefill_chunk(self, req: Request) -> None:
        """The request's next prefill chunk, in a program of its own."""
        chunk = self._next_chunk(req)
        self._chunk_done(req, chunk, *self.runner.run_chunk(chunk))

    def _next_chunk(self, req: Request):
        """The request's next prefill chunk (trainer.serve.runner.Chunk), counted as prefilled."""
        s = req.sampling
        if req.prefilled == 0 and self.prefix is not None and not s.prompt_logprobs and not req.prefix_queried:
            # Admission: the longest cached prefix is copied in, and the prefill goes on after it.
            req.prefix_queried = len(req.prompt)
            self.runner.cache, req.cached_tokens = self.prefix.load(self.runner.cache, req.prompt, req.slot)
            req.prefilled = req.cached_tokens
        chunk = self.runner.chunk_of(req.prompt, req.prefilled, req.slot, _row(s), top=s.logprobs,
                                     prompt_scores=s.prompt_logprobs,
                                     mask_W=req.constraint.row if req.constraint is not None else None)
        req.prefilled = min(req.prefilled + self.chunk, len(req.prompt))
        return chunk

    def _chunk_done(self, req: Request, chunk, token: int, scored) -> None:
        """A prefill chunk's results: its prompt log-probabilities kept; after the last chunk the request
        decodes from the next step, its first token emitted."""
        s = req.sampling
        if s.prompt_logprobs:
            req.prompt_logprobs.extend(scored[:len(scored) - chunk.final])
        if not chunk.final:
            return
        if self.prefix is not None:
            self.prefix.store(self.runner.cache, req.prompt, req.slot)
        self.scheduler.start_decoding(req)
        self.runner.occupy(req.slot, _row(s))
        if s.max_tokens == 0:  # the prompt scored (echo): nothing to generate
            self._end(req, "length")
            return
        self._emit(req, token, scored[-1] if scored else None)

    def _decode_all(self, admitting: Request | None = None) -> None:
        """One decode step (with `admitting`, the request's next prefill chunk in the same program). Overlapped:
        the next step dispatched, then the one in flight read and its tokens emitted while the new one runs.
        Otherwise the one in flight read first, then a step run and read."""
        previous, self.flight = self.flight, None
        if self._overlaps():
            self.flight = self._dispatch(previous, bursts=True, admitting=admitting)
            self._read(previous)
            if self.flight is not None and self.flight.chunk is None and not any(
                    self.scheduler.active.get(slot) is req for slot, req in self.flight.ran.items()):
                self.flight = None  # every request it ran has ended: nothing of it is read
            return
        self._read(previous)
        self._fill_masks()
        self._read(self._dispatch(None, admitting=admitting))

    def _overlaps(self) -> bool:
        """Whether the next step may be dispatched before the last one's tokens are read: not with a grammar's
        mask to fill (the mask of a slot's next token depends on its last), nor across processes (the inputs
        are made global from host data: ModelRunner.run)."""
        return self.runner.can_follow and all(
            req.constraint is None for req in self.scheduler.active.values())

    def _dispatch(self, previous: Flight | None, bursts: bool = False,
                  admitting: Request | None = None) -> Flight | None:
        """Dispatches a decode step of the running requests. A request that `previous` (still in flight) ran
        follows it: its input is the token that step draws, on the device. One whose token there is its last
        (max_tokens) sits this step out. One whose token there ends it otherwise (eos, a stop string) runs
        here too, unknown yet: its token here is never emitted (_read), and its cache write, past its last
        position, lands before anything its slot's next request writes there (that request's prefill is
        dispatched later, and the device runs the steps in the order dispatched), so no request reads it.
        With `bursts`, a burst of steps where _steps allows one. With `admitting`, that request's next prefill
        chunk goes in the same program (ModelRunner.dispatch; in a program of its own when no request runs)."""
        ran, done = {}, {}
        for slot, req in self.scheduler.active.items():
            done[slot] = len(req.output)
            if previous is not None and previous.ran.get(slot) is req:
                done[slot] += previous.steps
                if done[slot] >= req.sampling.max_tokens:
                    self.runner.hold(slot)
                    continue
                self.runner.follow(slot, previous.steps)
            ran[slot] = req
        if not ran:
            if admitting is not None:
                self._prefill_chunk(admitting)
            return None
        wanted = {slot: req.sampling.logprobs for slot, req in ran.items() if req.sampling.logprobs is not None}
        steps = self._steps(ran, done) if bursts and not wanted else 1
        chunk = self._next_chunk(admitting) if admitting is not None else None
        return Flight(self.runner.dispatch(bool(wanted), steps, chunk), ran, wanted, steps,
                      (admitting, chunk) if chunk is not None else None)

    def _steps(self, ran: dict, done: dict) -> int:
        """The steps of the next decode: a burst (the runner's decode_steps) when the requests fit the fewest
        rows (a lone stream: ModelRunner.burst_fits), nothing waits for a slot or its prefill (a burst would
        hold it back) and every request it runs wants at least that many more
        tokens (so none is drawn past a request's max_tokens, nor its position past the cache); else one. A
        burst's tokens past a request's end (eos, a stop string, a cancellation) are never emitted, as a
        step's past the end are not (_dispatch)."""
        steps = self.runner.decode_steps
        if not self.runner.burst_fits(ran) or self.scheduler.waiting or self.scheduler.admitting is not None:
            return 1
        return steps if all(req.sampling.max_tokens - done[slot] >= steps for slot, req in ran.items()) else 1

    def _read(self, flight: Flight | None) -> None:
        """Reads a dispatched step's tokens (waiting for it) and emits those of the requests still running in
        the slots it ran (one ended since, by a token read before or a cancellation, gets nothing)."""
        if flight is None:
            return
        tokens, scored = self.runner.collect(flight.outputs, flight.wanted)
        tokens_KxS = tokens.reshape(flight.steps, -1)  # a step's [S], a burst's [steps, R]
        for slot, req in flight.ran.items():
            for k in range(flight.steps):
                if self.scheduler.active.get(slot) is not req:
                    break  # ended by a token before, or cancelled
                self._emit(req, int(tokens_KxS[k, slot]), scored.get(slot))
        if flight.chunk is not None:
            req, chunk = flight.chunk
            token, records = self.runner.chunk_result(chunk)
            if self.scheduler.admitting is req:  # not cancelled since
                self._chunk_done(req, chunk, token, records)

    def _fill_masks(self) -> None:
        """Each constrained slot's mask of its next token, after the token it took, written in place into the
        decode step's input (the runner's mask rows, uploaded again for the step). A request whose grammar's end
        alone may follow is done.

        Not overlapped with the device's forward pass (the step split in two, masks computed between): on the
        CPU the split step cost more than the masks it hid (8 slots at a 32,768-token vocabulary, measured
        interleaved: 3.4 ms of CPU against 2.8 ms for the one program and the masks computed before it)."""
        for slot, req in list(self.scheduler.active.items()):
            if req.constraint is not None and not self.runner.fill_mask(slot, req.constraint.fill):
                self._end(req, self.output.complete(req))

    def _emit(self, req: Request, token: int, record: Logprob | None = None) -> None:
        """Records the request's new token; ends it when the output processor says it is done, else the token
        is its slot's next input."""
        req.token_times.append(time.perf_counter())
        try:
            reason = self.output.on_token(req, token, record)
            if reason is None:
                self.runner.advance(req.slot, token, len(req.prompt) + len(req.output) - 1)
                if req.listener is not None:
                    req.listener(req)
                return
        except Exception as e:  # noqa: BLE001 - one request's failure (its listener, its text) is its own
            reason, req.error = "error", f"{type(e).__name__}: {e}"
        self._end(req, reason)

    def _end(self, req: Request, reason: str) -> None:
        """Finishes the request: its slot freed, its listener told (the request is over whatever it does)."""
        req.finish_reason = reason
        slot = self.scheduler.release(req)
        if slot is not None:
            self.runner.vacate(slot)
        # Counted as gone before anyone hears of its end: a client answered here may send its next request at
        # once, and the waiting queue's limit (429) must not count this one still waiting or running.
        self.publish()
        if req.listener is not None:
            try:
                req.listener(req)
            except Exception:  # noqa: BLE001 - the request is gone either way
                pass

    def fail_all(self, reason: str) -> None:
        """Fails every request, the waiting ones too (the engine cannot step again)."""
        waiting = list(self.scheduler.waiting)
        self.scheduler.waiting.clear()
        for req in waiting:
            req.error = reason
            self._end(req, "error")
        self.fail_in_flight(reason)

    def fail_in_flight(self, reason: str) -> None:
        """Fails every request holding a slot (a step that raised): each ends with `reason` as its error."""
        self.flight = None
        for req in self.scheduler.in_flight():
            req.error = reason
            self._end(req, "error")
        self.publish()


def mixed_default(model: ServingModel) -> bool:
    """Whether a prefill chunk goes with the decode step by default: on an accelerator, where a step's time is
    the weights it reads, so that admitting a prompt while streams decode does not read them twice (on one
    v5e chip, moe-1b, 8 streams: benchmarks/serve_interference.py); not on a CPU, where the tests and the dry
    runs serve and the fused step would be one more program a span to compile."""
    return model.mesh.devices.flat[0].platform != "cpu"


def _row(s: SamplingParams) -> tuple:
    """The request's sampling as the steps' row: (temperature, top_k, top_p, seed), each in int32 range (a
    top_k beyond the vocabulary means all of it: the sampler clamps; one beyond int32 would fail the step of
    every request in it)."""
    return s.temperature, min(s.top_k, 2**31 - 1), s.top_p, s.seed & 0x7FFFFFFF
