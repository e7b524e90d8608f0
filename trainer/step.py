"""The jitted pieces of a run: the optimizer and its schedule, the state's initialisation and the train step
(pure, jitted once with explicit shardings), their compilation, and the accelerator's memory; the loop around
them is trainer/train.py."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from trainer import program_cache, sharding
from trainer.config import Config, OptimConfig
from trainer.model import ParamCodec, Transformer, abstract_split, step_rngs
from trainer.moe.layer import ExpertBias

# {"step": int32 [], "params": {name: array}, "opt_state": optax state}, and "moe_bias": {name: float32 [E]}
# when MoE layers balance with a bias (moe.balance: bias or both).
State = dict[str, Any]


def lr_schedule(cfg: OptimConfig, total_steps: int) -> Callable[[jax.Array], jax.Array]:
    """Linear warm-up to `lr`, then cosine decay to `lr * min_lr_ratio` at `decay_steps`."""
    decay_steps = cfg.decay_steps or total_steps
    warmup = cfg.warmup_steps

    def schedule(step):
        s = jnp.asarray(step, jnp.float32)
        warm = cfg.lr * jnp.minimum(1.0, (s + 1.0) / max(warmup, 1))
        progress = jnp.clip((s - warmup) / max(decay_steps - warmup, 1), 0.0, 1.0)
        cosine = cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * 0.5 * (1.0 + jnp.cos(math.pi * progress))
        return jnp.where(s < warmup, warm, cfg.lr * cosine)

    return schedule


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """AdamW (no decay on vectors: norms) after global-norm clipping."""
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    adamw = optax.adamw(lr_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                        weight_decay=cfg.weight_decay, mask=decay_mask)
    clip = optax.clip_by_global_norm(cfg.clip_norm) if cfg.clip_norm > 0 else optax.identity()
    return optax.chain(clip, adamw)


# ----------------------------------------------------------------------------- model state

# XLA's options for a program that runs once on a CPU, where optimising it costs more than it saves: most
# optimisation passes off (what `jax_disable_most_optimizations` sets), and XLA's older CPU code generator,
# which compiles unoptimised programs about three times faster than its fusion emitters (measured: 5.1 ->
# 1.7 CPU s for tiny's dropless step on data=2,model=4).
CPU_FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_llvm_disable_expensive_passes": True,
                    "xla_cpu_use_fusion_emitters": False}

# XLA's options for the first steps' program on an accelerator while the optimised one compiles (TieredStep):
# optimisation level O1 (19 is XLA's EffortLevel O1, as jax's `jax_optimization_level` names it). moe-1b's step
# on one v5e chip (2026-12-07, benchmarks/compile_effort.py): compiled in 13.6 s against 21.1, a step 469 ms
# against 311; at exec_time_optimization_effort -1 or O0 12.1-12.6 s and 818 ms.
QUICK_STEP_OPTIONS = {"optimization_level": 19}


@dataclasses.dataclass
class Trainer:
    """The jitted pieces of a run: state init, train step, and their shardings."""

    cfg: Config
    mesh: Mesh
    graphdef: nnx.GraphDef
    codec: ParamCodec
    rest: nnx.State
    optimizer: optax.GradientTransformation
    schedule: Callable
    state_shardings: Any
    abstract_state: Any
    batch_sharding: NamedSharding
    init_fn: Callable[[], State]
    step_fn: Callable[[State, jax.Array], tuple[State, dict]]
    step_compiling: StepCompiles | None = None  # compile_in_background's
    program_keys: dict[str, str] = dataclasses.field(default_factory=dict)  # program_cache's, where it is on
    loaded: set[str] = dataclasses.field(default_factory=set)  # the programs program_cache gave

    def cached_program(self, kind: str):
        """Program `kind` ("init", "step") as an earlier run of the same make compiled it; None where none is kept."""
        compiled = program_cache.load(self.program_keys[kind], self.mesh) if kind in self.program_keys else None
        if compiled is not None:
            self.loaded.add(kind)
        return compiled

    def compile_and_keep(self, kind: str, lowered, wait: bool = True, **options):
        """`lowered` compiled with `options`, and kept for the next run where program_cache may keep it (on a
        thread of its own unless `wait`)."""
        return program_cache.compile_and_keep(self.program_keys.get(kind), lowered, wait, **options)

    def initial_state(self) -> State:
        """Step 0's state, from `init_fn`. On a CPU (dry runs, tests) its program is compiled with XLA's
        optimisations off: it runs once, in milliseconds either way, and compiling it optimised took 3 to 5
        times as long (measured on 2 cores: tiny 5.0 -> 1.0 CPU s, deepseek-tiny 7.6 -> 1.5; the values
        differ by float rounding only). Elsewhere it is compiled as usual: on a TPU its fusions keep a large
        model's initialisation within memory (moe-1b's compile took 28 s on a v5e chip before its draws went in
        slabs, trainer/initializers.py: 19 -> 6 s of CPU ahead of time; the train step compiles beside it,
        compile_in_background)."""
        on_cpu = self.mesh.devices.flat[0].platform == "cpu"
        if not on_cpu and "init" not in self.program_keys:
            return self.init_fn()
        compiled = self.cached_program("init")
        if compiled is None:
            lowered = self.init_fn.lower()
            compiled = self.compile_and_keep("init", lowered, wait=False,
                                             compiler_options=CPU_FAST_COMPILE if on_cpu else None)
        return compiled()


def build_trainer(cfg: Config, mesh: Mesh, total_steps: int) -> Trainer:
    def make_model():  # on the mesh: the draws loop over the axes it leaves whole (trainer/initializers.py)
        with nnx.use_eager_sharding(False), sharding.logical_mesh(mesh):
            return Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(cfg.train.seed))

    graphdef, abstract_params, abstract_biases, rest = abstract_split(make_model)
    codec = ParamCodec(abstract_params)
    bias_codec = ParamCodec(abstract_biases)  # no names unless moe.balance uses the bias
    optimizer = make_optimizer(cfg.optim, total_steps)

    def init() -> State:
        _, params, biases, _ = nnx.split(make_model(), nnx.Param, ExpertBias, ...)
        flat = codec.flatten(params)
        state = {"step": jnp.zeros((), jnp.int32), "params": flat, "opt_state": optimizer.init(flat)}
        if bias_codec.names:
            state["moe_bias"] = bias_codec.flatten(biases)
        return state

    abstract_state = jax.eval_shape(init)
    state_shardings = _state_shardings(abstract_state, codec, optimizer, mesh, cfg.train.fsdp)
    abstract_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                  abstract_state, state_shardings)
    batch_sharding = sharding.batch_sharding(mesh)
    schedule = lr_schedule(cfg.optim, total_steps)
    step = make_train_step(graphdef, codec, rest, optimizer, schedule, bias_codec, cfg.train.loss_chunk)
    # The run's length is in the programs through the schedule alone (its decay, unless optim.decay_steps is set).
    decay = cfg.optim.decay_steps or total_steps
    keys = ({kind: program_cache.key(kind, cfg, mesh, decay_steps=decay) for kind in ("init", "step")}
            if program_cache.enabled(cfg) else {})
    return Trainer(
        cfg=cfg, mesh=mesh, graphdef=graphdef, codec=codec, rest=rest, optimizer=optimizer,
        schedule=schedule, state_shardings=state_shardings, abstract_state=abstract_state,
        batch_sharding=batch_sharding, init_fn=jax.jit(init, out_shardings=state_shardings),
        step_fn=jax.jit(step, in_shardings=(state_shardings, batch_sharding),
                        out_shardings=(state_shardings, sharding.replicated(mesh)), donate_argnums=(0,)),
        program_keys=keys,
    )


def _state_shardings(abstract_state: State, codec: ParamCodec, optimizer, mesh: Mesh, fsdp: bool) -> State:
    specs = sharding.param_specs(codec.variables, mesh, fsdp)
    params = {name: NamedSharding(mesh, specs[name]) for name in codec.names}
    replicated = sharding.replicated(mesh)
    opt_state = optax.tree_map_params(optimizer, lambda _, s: s, abstract_state["opt_state"], params,
                                      transform_non_params=lambda _: replicated)
    shardings = {"step": replicated, "params": params, "opt_state": opt_state}
    if "moe_bias" in abstract_state:
        shardings["moe_bias"] = {name: replicated for name in abstract_state["moe_bias"]}
    return shardings


def make_train_step(graphdef: nnx.GraphDef, codec: ParamCodec, rest: nnx.State,
                    optimizer: optax.GradientTransformation, schedule: Callable, bias_codec: ParamCodec | None = None,
                    loss_chunk: int = 0):
    """train_step(state, batch_BxT) -> (state, metrics); pure, for jax.jit.

    The MoE balancing biases (state["moe_bias"]) are no argument of the gradient: the forward
    pass routes with them and returns them moved towards that step's load (trainer/moe/layer.py).
    """
    bias_states = (bias_codec,) if bias_codec is not None and bias_codec.names else ()

    def loss_fn(params: dict, tokens_BxT: jax.Array, step: jax.Array, biases: dict):
        model = nnx.merge(graphdef, codec.unflatten(params), *(c.unflatten(biases) for c in bias_states),
                          step_rngs(rest, step))
        x_BxLxD, aux = model.features(tokens_BxT[:, :-1], train=True)
        ce = model.cross_entropy(x_BxLxD, tokens_BxT[:, 1:], loss_chunk)
        new_biases = {n: v for c in bias_states for n, v in c.flatten(nnx.state(model, ExpertBias)).items()}
        return ce + aux["aux_loss"] + aux["z_loss"], (ce, aux, new_biases)

    def train_step(state: State, tokens_BxT: jax.Array) -> tuple[State, dict]:
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (total, (ce, aux, biases)), grads = grad_fn(state["params"], tokens_BxT, state["step"],
                                                    state.get("moe_bias", {}))
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        grad_norm = optax.tree.norm(grads)
        metrics = {"loss": ce, "total_loss": total, "grad_norm": grad_norm, "lr": schedule(state["step"]),
                   "finite": jnp.isfinite(total) & jnp.isfinite(grad_norm), **aux}
        new_state = {"step": state["step"] + 1, "params": params, "opt_state": opt_state}
        if bias_states:
            new_state["moe_bias"] = biases
        return new_state, metrics

    return train_step


def compile_step(trainer: Trainer, notify: Callable[[str], None] | None = None):
    """The train step compiled ahead of the loop, so that no logged step time includes compilation (the one
    `compile_in_background` started, where it did: the optimised program, or a TieredStep that runs the first
    steps on the quick one while it compiles; `notify` hears when the optimised one takes over)."""
    if trainer.step_compiling is not None:
        compiles, trainer.step_compiling = trainer.step_compiling, None
        return compiles.program(notify)
    cached = trainer.cached_program("step")
    return cached if cached is not None else trainer.compile_and_keep("step", _lowered_step(trainer))


@dataclasses.dataclass
class StepCompiles:
    """The train step's compiles under way: the optimised program, and the quick one beside it (or None)."""

    full: concurrent.futures.Future
    quick: concurrent.futures.Future | None = None
    started: float = dataclasses.field(default_factory=time.perf_counter)

    def program(self, notify: Callable[[str], None] | None = None):
        """The optimised program once compiled; while a quick one is under way, a TieredStep on whichever
        is ready first. A failed quick compile leaves the optimised one to wait for."""
        if self.quick is None:
            return self.full.result()
        concurrent.futures.wait([self.full, self.quick], return_when=concurrent.futures.FIRST_COMPLETED)
        if self.full.done() or self.quick.exception() is not None:
            return self.full.result()
        return TieredStep(self.full, self.quick.result(), self.started, notify)


class TieredStep:
    """The train step while its optimised program compiles: each call runs the quickly compiled program
    (QUICK_STEP_OPTIONS) until the optimised one is ready, then that one for good. Both are the same step,
    compiled from one lowering with the same shardings and donation, so the state passes from one to the
    other; XLA's fusions differ between them, so their results may differ in the last bits (a float32
    rounding), as two compilers' would. On one v5e chip moe-1b's first step comes after the quick program's
    compile rather than the optimised one's: 13.6 against 21.1 s alone (benchmarks/compile_effort.py), and the
    steps taken meanwhile are steps the run would otherwise have waited for."""

    def __init__(self, full: concurrent.futures.Future, quick, started: float,
                 notify: Callable[[str], None] | None = None):
        self.full, self.current, self.started, self.notify = full, quick, started, notify
        self.quick_steps = 0  # steps dispatched on the quick program

    @property
    def optimised(self) -> bool:
        return self.full is None

    def __call__(self, state, batch):
        if self.full is not None and self.full.done():
            self.current, self.full = self.full.result(), None
            if self.notify:
                self.notify(f"the optimised train step is ready {time.perf_counter() - self.started:.1f}s after its "
                            f"compile began; the {self.quick_steps} step(s) before it ran on the quickly compiled one")
        if self.full is not None:
            self.quick_steps += 1
        return self.current(state, batch)


def _lowered_step(trainer: Trainer):
    batch = jax.ShapeDtypeStruct((trainer.cfg.data.global_batch_size, trainer.cfg.data.seq_len + 1),
                                 jnp.int32, sharding=trainer.batch_sharding)
    return trainer.step_fn.lower(trainer.abstract_state, batch)


def compile_in_background(trainer: Trainer, on_cpu: bool = False,
                          quick: bool | None = None) -> StepCompiles | None:
    """On an accelerator, the train step's XLA compilation started on a thread of its own (traced here), so
    that it runs while the initial state's program compiles and runs: on one v5e chip moe-1b's two compiles
    took 28 and 30 s one after the other, 51 s to the first step; 37 s for both together (2026-12-06,
    benchmarks/train_step.py). With train.quick_compile (or `quick`), the quick program (TieredStep) compiles
    first, on the same thread. Not on a CPU (unless `on_cpu`), where the compiles share the cores the tests
    run on."""
    if trainer.mesh.devices.flat[0].platform == "cpu" and not on_cpu:
        return None
    if program_cache.kept(trainer.program_keys.get("step")):  # an earlier run of the same make kept it
        # Loaded on a thread while the initial state's program loads and runs (on one v5e chip moe-1b's took
        # 1.6 s, then the initial state's 2.0 s, one after the other); one that fails to load is traced and
        # compiled there instead.
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="load-step")
        loading = pool.submit(lambda: trainer.cached_program("step")
                              or trainer.compile_and_keep("step", _lowered_step(trainer)))
        pool.shutdown(wait=False)
        return StepCompiles(loading)
    try:
        lowered = _lowered_step(trainer)
    except ValueError:  # a shape check at trace time: compile_step raises it again where it is reported
        return None
    quick = trainer.cfg.train.quick_compile if quick is None else quick
    # One thread: with a quick program, it compiles first and the optimised one after it, so that the quick
    # one and the initial state's share the host's cores with nothing else (on one v5e chip, 2026-12-07: all
    # three at once took 22.1, 18.8 and 29.8 s against 13.6, 13.3 and 21.1 alone).
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compile-step")
    quick_future = pool.submit(lowered.compile, compiler_options=QUICK_STEP_OPTIONS) if quick else None
    compiles = StepCompiles(pool.submit(trainer.compile_and_keep, "step", lowered), quick_future)
    pool.shutdown(wait=False)  # its thread ends with the compiles
    return compiles


def peak_memory_gib(mesh: Mesh) -> float | None:
    """The most memory one of this process's accelerators has held (GiB); None on a CPU or where the platform
    keeps no such count."""
    device = next((d for d in mesh.devices.flat if d.process_index == jax.process_index()), None)
    if device is None or device.platform == "cpu":
        return None
    peak = (device.memory_stats() or {}).get("peak_bytes_in_use")
    return None if peak is None else peak / 2**30
