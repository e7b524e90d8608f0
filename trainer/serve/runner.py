"""The engine's model runner: the key/value cache, the jitted programs with fixed shapes (a prefill chunk
into one slot, a decode step for the first slots, each in one program per span of the cache it reads and, for
the decode, per row count) and the host copies of each slot's decode inputs.

A decode step is dispatched (`dispatch`) apart from reading its tokens back (`collect`), so that the engine
can dispatch the next step before it reads this one's: a slot that `follow`s takes its next input token from
the previous step's output on the device (each step returns every slot's last token, S wide whatever rows it
ran), never from the host.

A steady decode step (every live slot following, none starting or ending, no grammar) sends the device
nothing. What changes from step to step, each row's input token, position, whether it follows and whether the
step wants log-probabilities, is packed in one small array (`step_inputs`), and each step returns on the
device the array the next step would pass if every live row follows (`following`); the host passes that one
where its own packed array equals it, else uploads its own (a slot started, ended or took a host token). What
a slot keeps, its sampling and its mask of allowed tokens, stays on the device S wide, uploaded again only
after its host copy changed (occupy, vacate, fill_mask); each program reads its rows of it.

It runs what the scheduler asks and returns tokens and log-probability records; it knows nothing of requests'
lifetimes, text or stop strings (trainer.serve.output).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np

from trainer import program_cache
from trainer.serve.latentcache import CacheLayout
from trainer.serve.logprobs import Logprob, records, token_logprobs
from trainer.serve.sampling import allowed, sample_tokens
from trainer.serve.spans import MIN_SPAN, ladder, programs, row_counts
from trainer.serve.structured import words
from trainer.serve.weights import ServingModel


@dataclasses.dataclass
class Chunk:
    """A prefill chunk's inputs to its program (ModelRunner.chunk_of) and, once run, its outputs there."""

    inputs: tuple
    start: int  # the chunk's first position
    size: int  # its prompt's tokens (the rest of the chunk is padding)
    final: bool  # it ends the prompt
    want: bool  # it returns log-probability records
    prompt_scores: bool  # each position's (else the drawn token's alone)
    top: int | None
    outputs: tuple | None = None


class ModelRunner:
    def __init__(self, model: ServingModel, weights: dict, *, slots: int, max_len: int, chunk: int, kv_dtype,
                 min_span: int = MIN_SPAN, decode_steps: int = 1, mixed: bool = False):
        """`decode_steps`: the most decode steps one program runs (a burst, "decode/<span>/<rows>/<steps>":
        the host's work a step, dispatching and reading, done once for them all; 1: none). `mixed`: a decode
        step may take a prefill chunk along ("mixed/<span>/<decode span>", dispatch), one more program a pair
        of spans."""
        m = model.cfg.model
        if decode_steps < 1:
            raise ValueError(f"decode_steps must be at least 1, got {decode_steps}")
        self.decode_steps, self.mixed = decode_steps, mixed
        self.model, self.weights = model, weights
        self.slots, self.max_len, self.chunk = slots, max_len, chunk
        self.min_span = min_span  # the shortest span (spans); max_len or more: one span, every step reads it all
        self.kv_dtype = jnp.dtype(kv_dtype or model.cfg.dtype)
        replicated = jax.sharding.NamedSharding(model.mesh, jax.sharding.PartitionSpec())
        layout = CacheLayout.of(m)  # keys and values per head, or latent attention's latents
        cache_sharding = layout.sharding(model.mesh, self.kv_dtype, max_len)
        self.cache = jax.jit(lambda: layout.empty(slots, max_len, self.kv_dtype), out_shardings=cache_sharding)()
        self._cache_sharding = cache_sharding
        # What fixes a program's inputs and outputs besides its name: an engine of the model's with the same ones runs
        # the jits an earlier one made (program). The weights' shapes, types and shardings count too, so that another
        # engine's weights never add to this one's compilations().
        self._shapes = (slots, max_len, chunk, self.kv_dtype, jax.tree.structure(weights),
                        tuple((a.shape, a.dtype, getattr(a, "sharding", None)) for a in jax.tree.leaves(weights)))
        # The data and expert axes split a step's tokens: a decode step runs a multiple of their devices' rows.
        self._shards = model.mesh.shape.get("expert", 1) * model.mesh.shape.get("data", 1)
        # "prefill/<span>" and "decode/<span>/<rows>", made on first use (program), their compiled programs
        # (executable), and how often each ran.
        self.programs: dict = {}
        self.executables: dict = {}
        self.calls: collections.Counter = collections.Counter()
        # The programs compiled (or being compiled) by a call or ahead of one (compile_ahead), those compile_ahead
        # is compiling now (a call waits for it rather than compile it twice), and the programs' first calls,
        # which may compile or wait for a compilation (the engine's loop allows such a step longer:
        # trainer/serve/loop.py).
        self.compiled: set[str] = set()
        self._ahead: dict[str, threading.Event] = {}
        self.first_calls = 0
        self._lock = threading.Lock()  # compile_ahead runs on a thread of its own
        self._not_compiling = threading.Event()  # cleared while a call compiles its program
        self._not_compiling.set()
        self._cache_spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                                        self.cache)
        # A multi-host group's leader hands each call to its workers first (trainer.serve.multihost).
        self.on_call = None
        self._replicated = replicated
        self._spans_processes = jax.process_count() > 1
        # Host copies of each slot's decode inputs; an idle slot sits at position max_len, whose cache
        # writes are dropped, and samples greedily (an argmax: the cheapest).
        self.tokens_S = np.zeros(slots, np.int32)
        self.positions_S = np.full(slots, max_len, np.int32)
        self.temperature_S = np.zeros(slots, np.float32)
        self.top_k_S = np.zeros(slots, np.int32)
        self.top_p_S = np.ones(slots, np.float32)
        self.seed_S = np.zeros(slots, np.int32)
        # Each slot's mask of the tokens it may draw next (trainer.serve.structured); all set: any.
        self.mask_SxW = np.full((slots, words(m.vocab_size)), -1, np.int32)
        self.any_1xW = self.mask_SxW[:1].copy()
        # The device copies of the sampling rows and the masks, S wide (resident); a name in `_stale`: its host
        # copy changed since its upload, which the next decode step makes.
        self._resident: dict[str, object] = {}
        self._stale = {"sampling", "mask"}
        # The last dispatched step's `following` inputs: (their host copy's bytes, on the device); None before one.
        self._next_step: tuple | None = None
        # A slot whose next input is the token the last dispatched step drew for it (follow): that step's
        # output, on the device, rather than tokens_S. A group over several processes never follows (its
        # inputs are made global from host data: run), so it passes host zeros in their place.
        self.can_follow = not self._spans_processes
        self.follow_S = np.zeros(slots, np.bool_)
        self.last_S = (np.zeros(slots, np.int32) if self._spans_processes
                       else jax.device_put(np.zeros(slots, np.int32), replicated))

    # ------------------------------------------------------------------ the jitted programs

    def run(self, name: str, *inputs):
        """Runs program `name` of `programs` on the weights, the cache and the host arrays `inputs`, keeps the
        cache it returns and returns its other outputs. Every program call comes here: in a multi-host group
        the leader's `on_call` hands (name, inputs) to the workers, which run the same call on their devices
        (each call's inputs are then global arrays, the same on every process)."""
        if self.on_call is not None:
            self.on_call(name, inputs)
        with self._lock:
            ahead = self._ahead.get(name)
            compiles = name not in self.compiled
            self.compiled.add(name)
        if not self.calls[name]:  # compiled here, or by compile_ahead, or (in a group) still on a worker
            self.first_calls += 1
        if ahead is not None:
            ahead.wait()
        if self._spans_processes:
            inputs = jax.tree.map(
                lambda x: jax.make_array_from_process_local_data(self._replicated, np.asarray(x)), inputs)
        if compiles:  # compile_ahead waits meanwhile: the cores go to the program a request waits for
            self._not_compiling.clear()
        try:
            # Across processes the jit (its inputs are global arrays made here), else the compiled program.
            run = self.program(name) if self._spans_processes else self.executable(name)
            outputs, self.cache = run(self.weights, self.cache, *inputs)
        finally:
            self._not_compiling.set()
        self.calls[name] += 1
        return outputs

    def program(self, name: str):
        """Program `name`, "prefill/<span>", "decode/<span>/<rows>[/<steps>]" or "mixed/<span>/<decode span>":
        the step attending over the first <span> positions of the cache (a bucket: span_for), the decode for
        the first <rows> slots (rows_for; a burst of <steps>), the fused step's rows over their own span, jitted
        on first use, on a group's workers as on its leader. Steps read only their live span and rows, so a
        short request's step costs what its tokens need whatever max_len is, and a lone stream's what one
        row needs whatever the slots; the buckets keep the programs few (programs_bound). The model keeps the jit
        (ServingModel.programs): an earlier engine of its with the same shapes may have traced and compiled it."""
        with self._lock:  # one jit a name: compile_ahead's thread and the engine's share it
            if name not in self.programs:
                key = (name, *self._shapes)
                if key not in self.model.programs:
                    step, span, *rest = name.split("/")
                    steps = Steps(self.model, self.max_len)
                    if step == "mixed":  # the chunk's span, then the decode rows'
                        fn = functools.partial(steps.mixed, span=int(span), decode_span=int(rest[0]))
                    elif len(rest) > 1:  # a burst of decode steps
                        fn = functools.partial(steps.burst, span=int(span), steps=int(rest[1]))
                    else:
                        fn = functools.partial({"prefill": steps.prefill, "decode": steps.decode}[step],
                                               span=int(span))
                    # Outputs pinned to one layout: a cache coming back laid out otherwise would compile the step
                    # again. setdefault: another engine's thread may have made it meanwhile.
                    self.model.programs.setdefault(key, jax.jit(fn, donate_argnums=(1,),
                                                                out_shardings=(self._replicated, self._cache_sharding)))
                self.programs[name] = self.model.programs[key]
            return self.programs[name]

    def executable(self, name: str):
        """Program `name` compiled for this runner's weights, cache and inputs: one an engine of the model's with
        the same shapes compiled or loaded before, else one kept by an earlier process of the same make
        (trainer/program_cache.py: on a v5e chip a warm server traced and lowered moe-1b's first two programs
        for 7.5 s before jax's own cache could serve them), else compiled here and kept. One caller a name at a
        time (run and compile_ahead see to it)."""
        with self._lock:
            found = self.executables.get(name)
        if found is not None:
            return found
        jitted = self.program(name)  # every name run has its jit in `programs`, compiled here or not
        key = (name, *self._shapes)
        compiled = self.model.executables.get(key)
        if compiled is None:
            keep = self._program_key(name)
            compiled = program_cache.load(keep, self.model.mesh) if keep else None
            if compiled is None:  # kept beside the serving (a request waits for no disk)
                compiled = program_cache.compile_and_keep(keep, jitted.lower(
                    self.weights, self._cache_spec, *self._abstract(self.example_inputs(name))), wait=False)
            if not _lie_as_compiled(compiled, self.weights):  # the jit, which lays them out as it calls
                compiled = jitted
            compiled = self.model.executables.setdefault(key, compiled)  # another engine's thread may have one
        with self._lock:
            self.executables[name] = compiled
        return compiled

    def _program_key(self, name: str) -> str | None:
        """program_cache's key of program `name` at this runner's shapes; None where nothing is kept."""
        if not program_cache.enabled(self.model.cfg):
            return None
        return program_cache.key(f"serve:{name}", self.model.cfg, self.model.mesh, shapes=repr(self._shapes))

    def spans(self) -> list[int]:
        """The spans a step may read (trainer/serve/spans.py)."""
        return ladder(self.chunk, self.max_len, self.min_span)

    def span_for(self, length: int) -> int:
        """The shortest span covering positions 0..length."""
        return next(span for span in self.spans() if span >= min(length, self.max_len))

    def rows(self) -> list[int]:
        """The row counts a decode step runs (trainer/serve/spans.py)."""
        return row_counts(self.slots, self._shards)

    def rows_for(self, slots: int) -> int:
        """The fewest rows covering slots 0..slots - 1."""
        return next(rows for rows in self.rows() if rows >= slots)

    def programs_bound(self) -> int:
        """The most programs the steps compile however long the server runs: the prefill at every span, the
        decode (and a burst's) at every span and row count (trainer/serve/spans.py, as a deploy's startup
        estimate counts them)."""
        return programs(self.chunk, self.max_len, self.slots, self._shards, self.min_span, self.decode_steps,
                        self.mixed)

    def compilations(self) -> int:
        """Programs compiled (or loaded) so far by the steps: one a step, span and (decode) row count used (2
        after the smallest warm-up; at most programs_bound() however long the server runs). Across processes
        the jits' own count: a call with inputs of another type or layout would add one."""
        return sum(1 if self.executables.get(name, program) is not program else program._cache_size()
                   for name, program in self.programs.items())

    def warm_up_order(self) -> list[str]:
        """Every program a step may run, in the order traffic first needs them: at the shortest span a short
        request's prefill, a lone stream's decode (the two FIRST_PROGRAMS), the decode of every slot, then the
        same at each longer span."""
        return [name for span in self.spans()
                for name in (f"prefill/{span}", *(f"decode/{span}/{rows}" for rows in self.rows()),
                             *self._burst(span), *self._mixed(span))]

    def _mixed(self, span: int) -> list[str]:
        """The fused steps whose chunk attends over `span` (where the engine runs them): one for each decode
        span up to it (decode rows reaching further take the chunk's span up to theirs: dispatch)."""
        return [f"mixed/{span}/{own}" for own in self.spans() if own <= span] if self.mixed else []

    def _burst(self, span: int) -> list[str]:
        """The burst's program at `span` (a lone stream's rows: burst_fits), where the engine runs them."""
        return [f"decode/{span}/{self.rows()[0]}/{self.decode_steps}"] if self.decode_steps > 1 else []

    def first_programs(self) -> list[str]:
        """The programs a short request and a lone stream need first, at the shortest span: the prefill, the lone
        decode, and its burst where the engine runs them (spans.programs_before_ready counts them)."""
        span = self.spans()[0]
        return [f"prefill/{span}", f"decode/{span}/{self.rows()[0]}", *self._burst(span)]

    def warm_up(self, every_span: bool = False, between=None) -> None:
        """Runs both steps at the smallest span, the one short requests use, the decode for the fewest rows,
        a lone request's, and with `every_span` at every span (a long prompt's later chunks reach each as a long
        output's steps do) and the decode at every row count, so that no request waits on a compilation, nor
        any stream between two of its tokens (an idle decode step writes nothing; the prefill's writes into
        slot 0 are overwritten by its next request before they are read). Without it the other spans and row
        counts compile ahead (compile_ahead) or when a step first reaches them. `between()` is called before
        each program (it raises to stop the warm-up: a signal came)."""
        between = between or (lambda: None)
        order = self.warm_up_order()
        for name in order if every_span else self.first_programs():
            between()
            outputs = self.run(name, *self.example_inputs(name))
        jax.block_until_ready(outputs)

    def compile_ahead(self, between=None, names=None) -> int:
        """Compiles, without running them, the programs that no call has compiled yet, in warm_up_order (or
        those of `names`); meant for a thread of its own while the engine serves (a step reaching a program this
        is compiling waits for it rather than compile it twice; one reaching a later one compiles it itself, and
        this waits until it has before the next). Threads may share the work: each takes the programs no other
        has. `between()` is called before each (it raises to stop). Returns how many it compiled."""
        done = 0
        for name in self.warm_up_order() if names is None else names:
            (between or (lambda: None))()
            self._not_compiling.wait()
            with self._lock:
                if name in self.compiled:
                    continue
                self.compiled.add(name)
                ahead = self._ahead[name] = threading.Event()
            try:
                if self._spans_processes:  # jax keeps it: the program's first call finds it
                    self.program(name).lower(self.weights, self._cache_spec, *self._abstract(
                        self.example_inputs(name))).compile()
                else:
                    self.executable(name)
                done += 1
            except BaseException:
                with self._lock:
                    self.compiled.discard(name)  # a call compiles it then
                raise
            finally:
                with self._lock:
                    del self._ahead[name]
                ahead.set()
        return done

    def example_inputs(self, name: str) -> tuple:
        """Inputs of program `name` as its steps pass them: a prefill of padding into slot 0, a decode of the
        idle slots (positions max_len: it writes nothing)."""
        step, _, *rows = name.split("/")
        rows = [] if step == "mixed" else rows  # a fused step runs every slot's row
        chunk = (np.zeros((1, self.chunk), np.int32), np.zeros(self.chunk, np.int32), np.zeros(1, np.int32),
                 np.zeros(1, np.int32), np.int32(0), sampling_arrays([(0.0, 0, 1.0, 0)]), np.bool_(False),
                 self.mask_SxW[:1].copy())
        if step == "prefill":
            return chunk
        # as decode_inputs passes them, none kept (this may run on another thread)
        inputs = (self.step_inputs(int(rows[0]) if rows else self.slots, False), self.slot_sampling(), self.mask_SxW,
                  self.last_S)
        if self._spans_processes:
            inputs = jax.tree.map(np.array, inputs)
        else:
            inputs = (*jax.device_put(jax.tree.map(np.array, inputs[:3]), self._replicated), inputs[3])
        return (*inputs, *chunk) if step == "mixed" else inputs

    def _abstract(self, inputs: tuple) -> tuple:
        """What jax lowers a call of `inputs` with: the arrays themselves, or across processes the global
        arrays `run` makes of them."""
        if not self._spans_processes:
            return inputs
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype,
                                                           sharding=self._replicated), inputs)

    # ------------------------------------------------------------------ steps

    def prefill(self, prompt: list[int], start: int, slot: int, sampling: tuple, *, top: int | None,
                prompt_scores: bool, mask_W: np.ndarray | None = None) -> tuple[int, list[Logprob] | None]:
        """One chunk of `prompt` from `start` into `slot`, in a program of its own: (the token drawn after the
        chunk, which counts only when the chunk ends the prompt, among those `mask_W` allows; each position's
        record of the token after it when `prompt_scores`, or the drawn token's alone when `top` is not None
        and the chunk is the last, else None)."""
        return self.run_chunk(self.chunk_of(prompt, start, slot, sampling, top=top, prompt_scores=prompt_scores,
                                            mask_W=mask_W))

    def run_chunk(self, chunk: Chunk) -> tuple[int, list[Logprob] | None]:
        """Runs `chunk` (chunk_of) in its own program and returns what `prefill` does."""
        chunk.outputs = self.run(f"prefill/{self.span_for(chunk.start + self.chunk)}", *chunk.inputs)
        return self.chunk_result(chunk)

    def chunk_of(self, prompt: list[int], start: int, slot: int, sampling: tuple, *, top: int | None,
                 prompt_scores: bool, mask_W: np.ndarray | None = None) -> Chunk:
        """The prefill chunk of `prompt` from `start` into `slot` (`prefill`'s arguments), for `prefill` or
        for a decode step to take along (dispatch)."""
        piece = prompt[start:start + self.chunk]
        final = start + len(piece) == len(prompt)
        tokens = np.zeros((1, self.chunk), np.int32)
        tokens[0, :len(piece)] = piece
        targets = np.zeros(self.chunk, np.int32)  # the token after each position; -1: the one drawn
        after = prompt[start + 1:start + len(piece) + 1]
        targets[:len(after)] = after
        if final:
            targets[len(piece) - 1] = -1
        want = prompt_scores or (final and top is not None)
        inputs = (tokens, targets, np.asarray([start], np.int32), np.asarray([slot], np.int32),
                  np.int32(len(piece) - 1), sampling_arrays([sampling]), np.bool_(want),
                  self.any_1xW if mask_W is None else mask_W[None])
        return Chunk(inputs, start, len(piece), final, want, prompt_scores, top)

    def chunk_result(self, chunk: Chunk) -> tuple[int, list[Logprob] | None]:
        """A run chunk's token and records (`prefill` says which), read from the device (this waits)."""
        token_1, scored = chunk.outputs
        token = int(host(token_1)[0])
        if not chunk.want:
            return token, None
        targets, size = chunk.inputs[1].copy(), chunk.size
        if chunk.final:
            targets[size - 1] = token
        rows = targets[:size] if chunk.prompt_scores else targets[size - 1:size]
        scored = [host(a)[:size] if chunk.prompt_scores else host(a)[size - 1:size] for a in scored]
        return token, records(rows, *scored, chunk.top or 0)

    def decode(self, wanted: dict[int, int]) -> tuple[np.ndarray, dict[int, Logprob]]:
        """One decode step of the first slots, as many as cover every live one (rows_for): (each slot's last
        token, the records of the slots in `wanted`, a slot -> how many alternatives). `dispatch` then
        `collect`."""
        return self.collect(self.dispatch(bool(wanted)), wanted)

    def dispatch(self, want: bool, steps: int = 1, chunk: Chunk | None = None):
        """Starts one decode step of the first slots, as many as cover every live one (rows_for), or a burst of
        `steps` (decode_steps, of the fewest rows only: burst_fits; never with `want`), and returns its outputs,
        still on the device (collect reads them). With `chunk` (chunk_of, into a slot that does not decode) the
        step runs every slot's row and the chunk in one program ("mixed/<span>/<decode span>", Steps.mixed:
        the chunk's span covers the decode rows' too), the chunk's outputs left in it (chunk_result reads
        them)."""
        if steps not in (1, self.decode_steps) or (want and steps > 1) or (chunk is not None and steps > 1):
            raise ValueError(f"a decode runs 1 or {self.decode_steps} steps, log-probabilities or a prefill chunk "
                             f"in 1; got {steps}")
        live_S = np.flatnonzero(self.positions_S < self.max_len)  # an idle slot's position is max_len
        reach = int(self.positions_S[live_S].max()) + steps if live_S.size else 1
        rows = self.rows_for(int(live_S[-1]) + 1 if live_S.size else 1)
        if steps > 1 and rows != self.rows()[0]:
            raise ValueError(f"a burst runs the fewest rows ({self.rows()[0]}), not {rows}")
        if chunk is None:
            name = f"decode/{self.span_for(reach)}/{rows}" + (f"/{steps}" if steps > 1 else "")
        else:  # every slot's row (an idle one writes nothing) over the rows' span, the chunk over its own
            own = self.span_for(reach)
            name, rows = f"mixed/{self.span_for(max(reach, chunk.start + self.chunk))}/{own}", self.slots
        step_4xR = self.step_inputs(rows, want)
        outputs = self.run(name, *self._inputs(step_4xR), *(chunk.inputs if chunk is not None else ()))
        if chunk is not None:
            outputs, chunk.outputs = outputs[:3], outputs[3]
            if not self._spans_processes:
                chunk.outputs[0].copy_to_host_async()  # its token, on the host when the step ends
        if not self._spans_processes:
            after = following(step_4xR, self.max_len, steps)
            self.last_S, self._next_step = outputs[0], (after.tobytes(), outputs[2])
            for x in (jax.tree.leaves(outputs[:2]) if want else [outputs[0]]) + list(outputs[3:]):
                x.copy_to_host_async()  # on the host as soon as the step ends, not when collect asks
        self.follow_S[:] = False
        return outputs

    def collect(self, outputs, wanted: dict[int, int]) -> tuple[np.ndarray, dict[int, Logprob]]:
        """A dispatched step's tokens on the host (this waits for the step), every slot's last one, and the
        records of the slots in `wanted`; a burst's, [steps, R]: each step's token of each row it ran."""
        if len(outputs) > 3:
            return host(outputs[3]), {}
        tokens_S, scored, _ = outputs
        tokens_S = host(tokens_S)
        if not wanted:
            return tokens_S, {}
        scored = [host(a) for a in scored]
        return tokens_S, {slot: records([tokens_S[slot]], *(a[slot:slot + 1] for a in scored), top)[0]
                          for slot, top in wanted.items()}

    # ------------------------------------------------------------------ slots

    def occupy(self, slot: int, sampling: tuple) -> None:
        self.temperature_S[slot], self.top_k_S[slot], self.top_p_S[slot], self.seed_S[slot] = sampling
        self._stale.add("sampling")

    def advance(self, slot: int, token: int, position: int) -> None:
        """The slot's next decode input: `token` at `position`. Written after the slot's next step was
        dispatched (follow) it changes nothing that step reads: the same position, and a token it ignores."""
        self.tokens_S[slot], self.positions_S[slot] = token, position

    def burst_fits(self, slots) -> bool:
        """Whether a burst may run these slots: they are all in the fewest rows a decode runs (a lone stream's).
        Only there is the host's work a step longer than the device's: on one v5e chip, moe-1b, bursts of 8
        made a lone stream's step 1.09x (bf16) and 1.27x (int8) faster, and at 8 and 32 slots 0.96-1.01x
        (benchmarks/serve_weights.py --decode-steps 1,8, 2026-12-06)."""
        return self.decode_steps > 1 and max(slots) < self.rows()[0]

    def follow(self, slot: int, steps: int = 1) -> None:
        """The slot's next decode input: the token the last dispatched step (a burst of `steps`) draws last for
        it, on the device, at the position after that step's."""
        self.follow_S[slot] = True
        self.positions_S[slot] += steps

    def hold(self, slot: int) -> None:
        """The slot sits out the next decode step (its request ends with the token the step in flight draws)."""
        self.follow_S[slot] = False
        self.positions_S[slot] = self.max_len

    def vacate(self, slot: int) -> None:
        self.follow_S[slot] = False
        self.positions_S[slot] = self.max_len
        self.temperature_S[slot] = 0
        self.mask_SxW[slot] = -1
        self._stale.update(("sampling", "mask"))

    def fill_mask(self, slot: int, fill) -> bool:
        """`fill(row)` writes the slot's mask of its next token into its host row; returns what it returns."""
        self._stale.add("mask")
        return fill(self.mask_SxW[slot])

    def slot_sampling(self):
        """The host copies of each slot's sampling, S wide. The device keeps the rows of the last upload until
        occupy or vacate changes one: a caller writing them directly calls `changed` after."""
        return self.temperature_S, self.top_k_S, self.top_p_S, self.seed_S

    def changed(self) -> None:
        """The host copies of the slots' sampling or masks were written directly: the next step uploads both."""
        self._stale.update(("sampling", "mask"))

    def step_inputs(self, rows: int, want: bool) -> np.ndarray:
        """What changes every decode step, packed in one new int32 array [4, rows]: each of the first `rows`
        slots' input token (0 where it follows: the step takes the last one's), position and whether it
        follows (1), and in every column whether the step wants log-probabilities (1)."""
        step_4xR = np.empty((4, rows), np.int32)
        follow_R = self.follow_S[:rows]
        step_4xR[0], step_4xR[1] = np.where(follow_R, 0, self.tokens_S[:rows]), self.positions_S[:rows]
        step_4xR[2], step_4xR[3] = follow_R, want
        return step_4xR

    def decode_inputs(self, rows: int, want: bool) -> tuple:
        """The decode step's inputs for the first `rows` slots: step_inputs, every slot's sampling and mask
        (S wide), the last step's tokens (S wide)."""
        return self._inputs(self.step_inputs(rows, want))

    def _inputs(self, step_4xR: np.ndarray) -> tuple:
        """The decode inputs of `step_4xR`. On one process all on the device: the last step's `following`
        inputs where they equal `step_4xR` (no transfer), else `step_4xR` uploaded; the sampling and masks as
        last uploaded (again where a host copy changed). Across processes host copies (`run` makes them
        global), the last tokens zeros (no slot follows)."""
        if self._spans_processes:
            return step_4xR, tuple(a.copy() for a in self.slot_sampling()), self.mask_SxW.copy(), self.last_S
        for name in self._stale:  # copies: jax may alias a host array on the CPU, and the host writes these
            arrays = tuple(a.copy() for a in self.slot_sampling()) if name == "sampling" else self.mask_SxW.copy()
            self._resident[name] = jax.device_put(arrays, self._replicated)
        self._stale.clear()
        if self._next_step is not None and self._next_step[0] == step_4xR.tobytes():  # as many rows: as many bytes
            step = self._next_step[1]
        else:
            step = jax.device_put(step_4xR, self._replicated)
        return step, self._resident["sampling"], self._resident["mask"], self.last_S


@dataclasses.dataclass(frozen=True, eq=False)
class Steps:
    """The functions of the steps' programs (ModelRunner.program jits them), of the model and max_len alone: the
    programs the model keeps for its engines (ServingModel.programs) hold no runner, and so no engine's cache."""

    model: ServingModel
    max_len: int

    def prefill(self, weights, cache, tokens_1xC, targets_C, start_1, slot_1, last, sampling, want, mask_1xW,
                *, span):
        """The next token after position `last` of the chunk, and (when `want`) each position's logprob of
        its target, the token after it (a target < 0: the token drawn here)."""
        logits_1xCxV, cache = self.model.module(weights).decode(tokens_1xC, cache, start_1, slot_1, span,
                                                                lengths_B=(last + 1)[None])
        return _chunk_outputs(logits_1xCxV, targets_C, start_1, last, sampling, want, mask_1xW), cache

    def decode(self, weights, cache, step_4xR, sampling_S, mask_SxW, last_S, *, span):
        """The next token of each of the first R slots (R: `step_4xR`'s rows, step_inputs: each row's input
        token, position, whether it follows, whether the step wants log-probabilities), written into their
        cache rows in place (the cache is donated; the other slots' rows are neither read nor copied), drawn
        with the first R rows of the slots' sampling and masks (S wide). A following row takes as its input its
        slot's token in `last_S` (the previous step's output). Returns every slot's last token, S wide: these R
        rows' new ones over `last_S`'s, so that the next step finds its followers' inputs whatever rows either
        ran (one shape: no more programs than before); the log-probability records; the next step's inputs
        where every live row follows (`following`)."""
        tokens_R, positions_R = _step_tokens(step_4xR, last_S), step_4xR[1]
        logits_Rx1xV, cache = self.model.module(weights).decode(tokens_R[:, None], cache, positions_R, span=span)
        return self.step_outputs(logits_Rx1xV, step_4xR, sampling_S, mask_SxW, last_S), cache

    def step_outputs(self, logits_Rx1xV, step_4xR, sampling_S, mask_SxW, last_S) -> tuple:
        """A decode step's outputs from its rows' logits (decode)."""
        rows, positions_R, want_R = step_4xR.shape[1], step_4xR[1], step_4xR[3]
        sampling_R = tuple(a[:rows] for a in sampling_S)
        next_R = sample_tokens(allowed(logits_Rx1xV[:, 0], mask_SxW[:rows]), *sampling_R, positions_R + 1)
        next_S = jax.lax.dynamic_update_slice_in_dim(last_S, next_R.astype(last_S.dtype), 0, axis=0)
        scored = token_logprobs(logits_Rx1xV[:, 0], next_R, want_R[0] != 0)
        return next_S, scored, following(step_4xR, self.max_len)

    def mixed(self, weights, cache, step_4xR, sampling_S, mask_SxW, last_S, tokens_1xC, targets_C, start_1,
              slot_1, last, sampling_1, want, mask_1xW, *, span, decode_span):
        """A prefill chunk (prefill's inputs, into a slot no row of the step decodes) and a decode step of
        every slot (decode's) in one pass over the weights (Transformer.decode_groups: the chunk attends
        first, as when its own program ran before the step's; the FFNs, the experts and the head take both's
        tokens at once): a step that admits a request reads its weights once, not twice. The chunk attends
        over `span` positions, the decode rows over `decode_span`, their own: a long prompt's chunk does not
        make every stream read the cache up to its end (on a v5e chip that was most of the fused step at a
        2,000-token prompt's end). Returns the decode step's outputs then the chunk's."""
        (logits_1xCxV, logits_Rx1xV), cache = self.model.module(weights).decode_groups(
            [(tokens_1xC, start_1, slot_1, (last + 1)[None]),
             (_step_tokens(step_4xR, last_S)[:, None], step_4xR[1], None, None)], cache, (span, decode_span))
        return (*self.step_outputs(logits_Rx1xV, step_4xR, sampling_S, mask_SxW, last_S),
                _chunk_outputs(logits_1xCxV, targets_C, start_1, last, sampling_1, want, mask_1xW)), cache

    def burst(self, weights, cache, step_4xR, sampling_S, mask_SxW, last_S, *, span, steps):
        """`steps` decode steps in one program (a scan of decode, each step's rows following the one
        before), for the host to dispatch and read once: the same tokens as `steps` programs of one step (each
        token is drawn with its position's key). Returns the last step's tokens and `following` inputs as a step
        does, no log-probability records (a burst never asks for them: collect reads none), and each step's
        tokens of the R rows, [steps, R]."""
        rows = step_4xR.shape[1]

        def one(carry, _):
            cache, last_S, step_4xR = carry
            (next_S, _, after_4xR), cache = self.decode(weights, cache, step_4xR, sampling_S, mask_SxW, last_S,
                                                        span=span)
            return (cache, next_S, after_4xR), next_S[:rows]

        (cache, last_S, after_4xR), tokens_KxR = jax.lax.scan(one, (cache, last_S, step_4xR), None, length=steps)
        return (last_S, (), after_4xR, tokens_KxR), cache


def _lie_as_compiled(compiled, weights) -> bool:
    """Whether the weights' arrays lie as `compiled` takes them: an executable refuses arrays of another layout
    where a jit relays them (on a CPU a jnp.int4 array lies a byte a value, and XLA compiles for two a byte).
    Abstract weights (a server compiling while it reads them) lie as XLA's default."""
    from jax.experimental.layout import Format

    wanted = jax.tree.leaves(compiled.input_formats[0][0], is_leaf=lambda x: isinstance(x, Format))
    return all(not isinstance(a, jax.Array) or f.layout is None or a.format.layout == f.layout
               for f, a in zip(wanted, jax.tree.leaves(weights), strict=True))


# What `following` does to a live row of step_inputs, by row (token, position, follow, want): the rows it clears,
# then what it adds (so: token 0, position + 1, follow 1, want as it was).
_CLEARED_4x1 = np.array([[1], [0], [1], [0]], np.int32)
_ADDED_4x1 = np.array([[0], [1], [1], [0]], np.int32)


def following(step_4xR, max_len: int, steps: int = 1):
    """The inputs (ModelRunner.step_inputs) that a decode step of `step_4xR` (or `steps` of them, each
    following the one before) leaves the next one when each of its live rows (position < max_len) follows it:
    token 0, the next position, following; the other rows as they were. The decode program computes them on
    the device, the runner on the host (numpy arrays or jax's: the same int32 arithmetic)."""
    for _ in range(steps):
        live_R = step_4xR[1] < max_len
        step_4xR = step_4xR + live_R * (_ADDED_4x1 - step_4xR * _CLEARED_4x1)
    return step_4xR


def _step_tokens(step_4xR, last_S):
    """Each decode row's input token: its own, or where it follows, its slot's last token on the device."""
    tokens_R, follow_R = step_4xR[0], step_4xR[2]
    return jnp.where(follow_R != 0, last_S[:tokens_R.shape[0]], tokens_R)


def _chunk_outputs(logits_1xCxV, targets_C, start_1, last, sampling, want, mask_1xW) -> tuple:
    """A prefill chunk's outputs from its logits (Steps.prefill): the token drawn after position
    `last`, and each position's log-probability records of its target (the drawn token where it is < 0)."""
    logits_1xV = jax.lax.dynamic_index_in_dim(logits_1xCxV, last, axis=1, keepdims=False)
    token_1 = sample_tokens(allowed(logits_1xV, mask_1xW), *sampling, start_1 + last + 1)
    targets_C = jnp.where(targets_C < 0, token_1[0], targets_C)
    return token_1, token_logprobs(logits_1xCxV[0], targets_C, want)


def host(x) -> np.ndarray:
    """A step's replicated output on the host: on a mesh over several processes the array is not wholly
    addressable here, but this process's first shard holds all of it."""
    return np.asarray(x if x.is_fully_addressable else x.addressable_shards[0].data)


def sampling_arrays(rows: list[tuple]):
    """(temperature, top_k, top_p, seed) rows as the steps' arrays."""
    return (np.asarray([r[0] for r in rows], np.float32), np.asarray([r[1] for r in rows], np.int32),
            np.asarray([r[2] for r in rows], np.float32), np.asarray([r[3] for r in rows], np.int32))
