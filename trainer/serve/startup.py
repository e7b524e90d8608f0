"""Start-up of `python -m trainer.serve`: the run's config, the mesh, the memory plan, the weights, the
engine. Every problem a user can fix raises ServeError (exit 2) naming the flag, file or value."""

from __future__ import annotations

import dataclasses
import itertools
import math
import threading
from collections.abc import Callable

import click

from trainer.run_loader import end_of_document  # noqa: F401 - the server's stop, read where `sample` reads it
from trainer.serve.memory import HEADROOM, device_memory, load_peak, memory_plan
from trainer.status import EXIT_USAGE


class ServeError(click.UsageError):
    """A problem the user can fix (a flag, the checkpoint, the memory plan): exit code 2, no traceback."""

    exit_code = EXIT_USAGE


@dataclasses.dataclass
class Loaded:
    cfg: object
    engine: object
    encode: Callable[[str], list[int]]
    decode: Callable[[list[int]], str]
    step: int
    eos_token: str | None = None
    tokenizer_class: str = "bytes"
    chat_template: object = None  # an imported model's own (trainer/serve/chat.py), or None
    tokenizer: object = None  # the codec's tokenizers.Tokenizer, if it has one (structured output)


def planned(model, slots: int, max_len: int, kv, quantized: str | None, prefix_tokens: int) -> dict[str, int]:
    """memory_plan's bytes a device, with the prefix cache's own pool; ServeError for weights the format cannot
    hold (--weights mxfp4 on experts whose inputs are not whole blocks of 32)."""
    from trainer.serve.prefix import BLOCK

    try:
        plan = memory_plan(model, slots, max_len, kv, quantized)
    except ValueError as e:
        raise ServeError(str(e)) from None
    plan["prefix_cache"] = plan["kv_cache"] // (slots * max_len) * (prefix_tokens // BLOCK * BLOCK)
    return plan


def load(directory: str, *, tokenizer_path, mesh_text, slots: int, max_len: int, chunk: int, kv_dtype,
         quantized: str | None, device_memory_gb, progress, prefix_tokens: int = 0, decode_steps: int = 1,
         mixed_prefill: bool | None = None) -> Loaded:
    from trainer.startup import start_backend

    start_backend()  # the accelerator's runtime starts while the server's modules import and the run is read
    import jax

    from trainer import sharding
    from trainer.run_loader import Codec, context_of, find_run, load_run_config
    from trainer.serve.engine import Engine, RequestError
    from trainer.serve.prefix import unsupported
    from trainer.serve.weights import WeightsError, build_serving_model, restore_weights

    run = find_run(directory, progress=progress)  # a Hugging Face directory: its import (trainer/hf/cache.py)
    checkpoints, cfg = run.checkpoints, load_run_config(run.config)
    from trainer.sidefiles import stop_token_ids, tokenizer_file  # the model's own (an import, a fine-tune of one)

    codec = Codec(cfg, tokenizer_path or tokenizer_file(run), checkpoints=checkpoints)
    chat_template = _hub_chat_template(run)
    eos_id, eos_token = end_of_document(cfg, codec, run)
    stop_ids = stop_token_ids(run, codec.tokenizer)  # a family's other end tokens (GPT-OSS's <|call|>)
    context, what = context_of(cfg, run)  # as `sample` reads it
    if max_len > context:
        progress(f"note: --max-len {max_len:,} reaches past the model's context ({what}); a request may use "
                 "positions the model never learnt")
    devices = jax.devices()
    from trainer.distributed import use_compilation_cache

    # The trainer's persistent compilation cache (~/.cache/moe-tpu/jax, or JAX_COMPILATION_CACHE_DIR): a
    # restarted server, on a CPU too, loads the programs it compiled before.
    use_compilation_cache(devices[0].platform, cpu=True)
    mesh_shape = serving_mesh(cfg, mesh_text, len(devices))
    mesh = sharding.make_mesh(mesh_shape, devices)
    try:
        model = build_serving_model(cfg, mesh)
    except WeightsError as e:
        raise ServeError(str(e)) from None
    kv = kv_dtype or cfg.dtype
    if prefix_tokens and unsupported(cfg.model):
        progress(f"note: {unsupported(cfg.model)}")
        prefix_tokens = 0
    plan = planned(model, slots, max_len, kv, quantized, prefix_tokens)
    progress(f"{cfg.name}: {plan['weights'] / 2**20:,.1f} MiB of weights a device"
             f"{f' ({quantized})' if quantized else ''}; KV cache {slots} slots x {max_len} tokens = "
             f"{slots * max_len:,} positions, {plan['kv_cache'] / 2**20:,.1f} MiB ({kv}); prefix cache "
             f"{prefix_tokens:,} tokens, {plan['prefix_cache'] / 2**20:,.1f} MiB; mesh {mesh_shape}")
    limit = device_memory_gb if device_memory_gb else memory_of(jax.local_devices())  # this process's devices
    check_fits(plan, limit, slots, max_len, kv, quantized)
    progress(f"reading the parameters from {checkpoints}")

    def make_engine(weights):
        try:
            return Engine(model, weights, slots=slots, max_len=max_len, chunk=chunk, kv_dtype=kv,
                          detokenize=codec.decode, eos_id=eos_id, prefix_cache=prefix_tokens, stop_ids=stop_ids,
                          decode_steps=decode_steps, mixed_prefill=mixed_prefill)
        except RequestError as e:
            raise ServeError(f"--slots/--chunk: {e}") from None

    early = EarlyEngine(model, make_engine, alone=jax.process_count() == 1)
    try:
        weights, step = restore_weights(model, checkpoints, quantized,  # int8, int4, mxfp4 (--weights): by array
                                        on_checked=early.start)
        engine = early.take(weights) or make_engine(weights)
        progress(f"read the checkpoint at step {step}")
    except WeightsError as e:
        early.halt()
        raise ServeError(str(e)) from None
    except BaseException:
        early.halt()
        raise
    early.let_go()
    return Loaded(cfg, engine, codec.encode, codec.decode, step, eos_token, codec.kind, chat_template, codec.tokenizer)


EARLY_THREAD = "moe-tpu-compile-first"  # EarlyEngine's compile


def compiling_early() -> bool:
    """Whether EarlyEngine's thread is still compiling (a process exiting through it would abort: exit past
    it, http_serve.exit_past_threads)."""
    return any(t.name == EARLY_THREAD and t.is_alive() for t in threading.enumerate())


class _Enough(Exception):
    """Raised between two programs to end EarlyEngine's compile."""


class EarlyEngine:
    """The engine built on the weights' shapes while the checkpoint is read, its first programs (the ones its
    warm-up runs first: a short request's prefill, a lone stream's decode) compiling meanwhile, each on a thread
    of its own (Engine.compile_ahead), then handed the weights read: the restore's seconds and the programs'
    tracing, lowering and compiling (or loading: on a v5e chip a kept prefill took 2.2 s to load and its decode
    1.3 s, one after the other, and the second one ended after the read) side by side rather than one after the
    other. The warm-up then finds them compiled, or waits for the ones still compiling. Only in a process of its
    own (`alone`: a group's processes load as before) and where restore_weights says the checkpoint holds the
    arrays as the model does (on_checked): a refused checkpoint is refused before anything compiles."""

    def __init__(self, model, make_engine: Callable, alone: bool):
        self.model, self.make_engine, self.alone = model, make_engine, alone
        self.engine = None
        self.threads: list[threading.Thread] = []
        self.stop = threading.Event()

    def start(self, step: int) -> None:
        """restore_weights' on_checked: the engine on abstract weights, its leading first programs compiling."""
        if not self.alone:
            return
        self.engine = self.make_engine(self.model.abstract())
        runner = self.engine.runner
        first = set(runner.first_programs())
        leading = list(itertools.takewhile(first.__contains__, runner.warm_up_order()))

        def between():  # before the program: not once the load ended (let_go, halt)
            if self.stop.is_set():
                raise _Enough

        def run(name):
            try:
                self.engine.compile_ahead(between, [name])
            except Exception:  # noqa: BLE001 - _Enough ends it; a failure the warm-up meets again and reports
                pass

        self.threads = [threading.Thread(target=run, args=(name,), name=EARLY_THREAD, daemon=True)
                        for name in leading]
        for thread in self.threads:
            thread.start()

    def take(self, weights):
        """The engine, now holding the weights read (None: none was built early)."""
        if self.engine is not None:
            self.engine.weights = weights
        return self.engine

    def let_go(self) -> None:
        """No program after the ones compiling now (the warm-up waits for those, or compiles the rest)."""
        self.stop.set()

    def halt(self) -> None:
        """The load failed: the compiles end after their programs now (exiting inside XLA's compiler would abort
        the process), and are waited for."""
        self.stop.set()
        for thread in self.threads:
            thread.join()


def serving_mesh(cfg, mesh_text: str | None, devices: int) -> dict[str, int]:
    """The server's mesh: --mesh, or by default the experts spread over as many devices as divide them and the
    rest replicating them (data); ServeError where the model cannot be split so."""
    from trainer import meshspec, sharding

    expert = math.gcd(devices, cfg.moe.num_experts)
    try:
        mesh_shape = sharding.parse_mesh(mesh_text or f"data={devices // expert},expert={expert}", devices)
    except ValueError as e:
        raise ServeError((str(e) if str(e).startswith("--mesh") else f"--mesh: {e}")
                         + sharding.devices_hint(mesh_text, devices)) from None
    if cfg.moe.num_experts % mesh_shape["expert"]:
        raise ServeError(f"--mesh expert={mesh_shape['expert']} must divide moe.num_experts={cfg.moe.num_experts}")
    problems = meshspec.tensor_problems(cfg, mesh_shape["model"])  # heads and hidden sizes over `model`
    if problems:
        raise ServeError(f"--mesh model={mesh_shape['model']}: " + "; ".join(problems))
    return mesh_shape


def memory_of(devices) -> int | None:
    """The bytes one device can hold: what it reports, else on CPU the host's memory shared by its (fake)
    devices, so a cache the host cannot hold is refused before it is allocated."""
    from trainer.serve.memory import host_memory

    reported = device_memory(devices[0])
    if reported is not None or devices[0].platform != "cpu":
        return reported
    host = host_memory()
    return host // len(devices) if host else None


def _hub_chat_template(run):
    """The chat template an imported Hugging Face model keeps in its run (trainer/serve/chat.py), or None."""
    from trainer.serve.chat import hub_chat_template

    try:
        return hub_chat_template(run.hub)
    except ValueError as e:
        raise ServeError(str(e)) from None


def check_fits(plan: dict[str, int], limit, slots: int, max_len: int, kv_dtype, quantized: str | None) -> None:
    if limit is None:
        return
    if isinstance(limit, float):  # --device-memory-gb
        limit = int(limit * 2**30)
    if load_peak(plan) <= limit * (1 - HEADROOM):
        return
    gib = lambda n: f"{n / 2**30:.2f} GiB"  # noqa: E731
    loading = ""
    if plan.get("loading", 0) > plan["kv_cache"] + plan.get("prefix_cache", 0):
        loading = f" (loading: one float weight of {gib(plan['loading'])} beside the weights, before the caches)"
    advice = ["lower --slots or --max-len (the cache is slots x max-len)"]
    if plan.get("prefix_cache"):
        advice.append("lower --prefix-cache-tokens or --no-enable-prefix-caching")
    if str(kv_dtype) != "int8":
        advice.append("--kv-cache-dtype int8 (half of bfloat16)")
    if quantized != "int4":
        advice.append("--weights int4 (about a quarter of bfloat16)" if quantized else "--weights int8 or int4")
    advice.append("or put more devices on `expert` (--mesh) to split the experts")
    raise ServeError(f"the model does not fit a device: weights {gib(plan['weights'])} + KV cache "
                     f"{gib(plan['kv_cache'])} ({slots} slots x {max_len} tokens, {kv_dtype}) + prefix cache "
                     f"{gib(plan.get('prefix_cache', 0))}{loading} > "
                     f"{gib(limit * (1 - HEADROOM))} ({100 - HEADROOM * 100:.0f}% of the device's {gib(limit)}); "
                     + "; ".join(advice))
