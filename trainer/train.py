"""The train step (pure, jitted once with explicit shardings) and the loop around it (all the I/O)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import signal
import time
from collections.abc import Callable
from typing import Any, Literal

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from trainer import meshspec, sharding
from trainer.checkpoint import Checkpointer
from trainer.config import Config, ConfigError, OptimConfig
from trainer.data import DataIterator, open_data
from trainer.divergence import Diverged, loss_ceiling
from trainer.fits import check_fits
from trainer.metrics import Reporter
from trainer.model import ParamCodec, Transformer, step_rngs
from trainer.moe.layer import ExpertBias
from trainer.outputs import RunDirectory
from trainer.resume import check_resumable, checkpoint_meta
from trainer.sharding import global_batch  # noqa: F401 - the loop's callers place batches as it does
from trainer.status import RunStatus
from trainer.step_timing import Feed, Pending, Profiler, StepTimer, seconds_since_start

# {"step": int32 [], "params": {name: array}, "opt_state": optax state}, and "moe_bias": {name: float32 [E]}
# when MoE layers balance with a bias (moe.balance: bias or both).
State = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """Everything one training run needs, built by the CLI (or a test) from flags and the config."""

    config: Config
    steps: int
    mesh_shape: dict[str, int] | None = None  # None: all devices on data
    output_dir: str | None = None
    resume: Literal["auto", "never"] = "auto"
    metrics_path: str | None = None
    profile_steps: tuple[int, int] | None = None
    num_devices: int | None = None  # use the first N devices (None: all)
    allow_data_change: bool = False  # resume on data whose fingerprint is not the checkpoint's (trainer/resume.py)


@dataclasses.dataclass(frozen=True)
class RunResult:
    step: int  # the last step trained
    loss: float | None
    stopped_by_signal: bool  # stopped before spec.steps (SIGTERM, SIGINT, a preemption notice)
    checkpoint_step: int | None
    start_step: int = 0  # the checkpoint it resumed from (0: fresh)
    stop_reason: str | None = None  # "SIGTERM", "SIGINT" or "a preemption notice"


# ----------------------------------------------------------------------------- optimizer


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
    step_compiling: concurrent.futures.Future | None = None  # compile_in_background's

    def initial_state(self) -> State:
        """Step 0's state, from `init_fn`. On a CPU (dry runs, tests) its program is compiled with XLA's
        optimisations off: it runs once, in milliseconds either way, and compiling it optimised took 3 to 5
        times as long (measured on 2 cores: tiny 5.0 -> 1.0 CPU s, deepseek-tiny 7.6 -> 1.5; the values
        differ by float rounding only). Elsewhere it is compiled as usual: on a TPU
        its fusions keep a large model's initialisation within memory, and compiling is not the cost."""
        if self.mesh.devices.flat[0].platform != "cpu":
            return self.init_fn()
        return self.init_fn.lower().compile(compiler_options=CPU_FAST_COMPILE)()


def build_trainer(cfg: Config, mesh: Mesh, total_steps: int) -> Trainer:
    def make_model():
        with nnx.use_eager_sharding(False):
            return Transformer(cfg, mesh=mesh, rngs=nnx.Rngs(cfg.train.seed))

    graphdef, abstract_params, abstract_biases, _ = nnx.split(nnx.eval_shape(make_model), nnx.Param, ExpertBias, ...)
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

    # Non-parameter state: only RNG streams (MoE router jitter); the step folds into their keys.
    rest = jax.jit(lambda: nnx.split(make_model(), nnx.Param, ExpertBias, ...)[3])()
    abstract_state = jax.eval_shape(init)
    state_shardings = _state_shardings(abstract_state, codec, optimizer, mesh, cfg.train.fsdp)
    abstract_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                  abstract_state, state_shardings)
    batch_sharding = sharding.batch_sharding(mesh)
    schedule = lr_schedule(cfg.optim, total_steps)
    step = make_train_step(graphdef, codec, rest, optimizer, schedule, bias_codec, cfg.train.loss_chunk)
    return Trainer(
        cfg=cfg, mesh=mesh, graphdef=graphdef, codec=codec, rest=rest, optimizer=optimizer,
        schedule=schedule, state_shardings=state_shardings, abstract_state=abstract_state,
        batch_sharding=batch_sharding, init_fn=jax.jit(init, out_shardings=state_shardings),
        step_fn=jax.jit(step, in_shardings=(state_shardings, batch_sharding),
                        out_shardings=(state_shardings, sharding.replicated(mesh)), donate_argnums=(0,)),
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


# ----------------------------------------------------------------------------- the loop


class StopSignal:
    """Set by SIGTERM (the preemption notice on TPU VMs and Vertex) or SIGINT; the loop saves and stops.

    The handler only records (one that raised could be dropped where it landed, a garbage collection
    among them); the loop looks before every step. Once it has acted (it is saving the checkpoint), a
    second SIGINT stops at once (KeyboardInterrupt), for a user who will not wait for the checkpoint.
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.requested = False
        self.acted = False  # the loop has stopped for it
        self.reason: str | None = None

    def install(self) -> Callable[[], None]:
        def handler(signum, frame):
            if self.acted and signum == signal.SIGINT:
                raise KeyboardInterrupt
            self.requested = True
            self.reason = self.reason or signal.Signals(signum).name

        previous = {sig: signal.signal(sig, handler) for sig in self.SIGNALS}

        def restore() -> None:
            for sig, old in previous.items():
                signal.signal(sig, old)

        return restore


def should_stop(stop: StopSignal, step: int) -> bool:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        if multihost_utils.reached_preemption_sync_point(step):
            stop.reason = stop.reason or "a preemption notice"
            return True
    return stop.requested


def run(spec: RunSpec, reporter: Reporter, stop: StopSignal | None = None,
        status: RunStatus | None = None) -> RunResult:
    """Trains up to step `spec.steps` (resuming past ones), checkpointing and reporting as it goes.

    Returns when done or stopped by a signal (a checkpoint saved either way, given an output directory);
    `status` hears of the resumed step and every logged step.
    """
    stop = stop or StopSignal()
    status = status or RunStatus()
    restore_handler = stop.install() if jax.process_count() == 1 else (lambda: None)
    ckpt = None
    try:
        cfg = spec.config
        devices = jax.devices()[: spec.num_devices] if spec.num_devices else jax.devices()
        mesh_shape = spec.mesh_shape or {"data": len(devices), "expert": 1, "model": 1}
        check_divisibility(cfg, mesh_shape)
        check_fits(cfg, mesh_shape, devices)
        mesh = sharding.make_mesh(mesh_shape, devices)
        data, eval_data = open_data(cfg, cfg.train.seed, process_index=jax.process_index(),
                                    process_count=jax.process_count(), with_eval=cfg.train.eval_every > 0)
        if spec.output_dir:
            ckpt = Checkpointer(RunDirectory.at(spec.output_dir).checkpoints,
                                every=cfg.train.checkpoint_every, keep=cfg.train.keep_checkpoints)
            done = _already_finished(ckpt, spec, reporter, status)
            if done is not None:
                return done
        built = time.perf_counter()
        try:
            trainer = build_trainer(cfg, mesh, spec.steps)
        except ValueError as e:  # the MoE block and shape checks reject configs that cannot work
            raise ConfigError(f"the model cannot be built from this config and mesh: {e}") from None
        started = time.perf_counter()
        trainer.step_compiling = compile_in_background(trainer)
        state = _initial_state(trainer, ckpt, data, spec, reporter, status)
        restore_s = time.perf_counter() - started if int(jax.device_get(state["step"])) else 0.0
        startup = {"restore_s": restore_s, "init_s": time.perf_counter() - built}
        evaluator = None
        if eval_data is not None:
            from trainer.evaluation import Evaluator

            evaluator = Evaluator(trainer, eval_data, every=cfg.train.eval_every, batches=cfg.train.eval_batches,
                                  total_steps=spec.steps)
        return _loop(trainer, state, data, ckpt, spec, reporter, stop, status, entropy_floor=data.entropy_floor,
                     evaluator=evaluator, startup=startup)
    finally:
        restore_handler()
        if ckpt is not None:
            ckpt.close()


def check_divisibility(cfg: Config, mesh_shape: dict[str, int]) -> None:
    """Refuses a mesh the config cannot run on, naming the number to change (meshspec.config_problems)."""
    problems = meshspec.config_problems(cfg, mesh_shape)
    if problems:
        raise ConfigError("; ".join(problems))


def _already_finished(ckpt: Checkpointer, spec: RunSpec, reporter: Reporter,
                      status: RunStatus) -> RunResult | None:
    """A run whose latest checkpoint is at (or past) the last step has nothing to train: one line, and a
    result, before anything is built or compiled. None: there is training to do."""
    latest = ckpt.latest_step()
    if latest is None or latest < spec.steps or spec.resume != "auto":
        return None
    status.resumed(latest)
    reporter.info(f"already finished: the latest checkpoint in {ckpt.directory} is at step {latest} of "
                  f"{spec.steps}; nothing to train")
    return RunResult(step=latest, loss=None, stopped_by_signal=False, checkpoint_step=latest, start_step=latest)


def _initial_state(trainer: Trainer, ckpt: Checkpointer | None, data: DataIterator, spec: RunSpec,
                   reporter: Reporter, status: RunStatus) -> State:
    latest = ckpt.latest_step() if ckpt else None
    if latest is not None and spec.resume == "never":
        raise ConfigError(f"{ckpt.directory} already holds checkpoints (latest step {latest}); use "
                         "--resume auto to continue, or another --output-dir")
    same_data = True
    if latest is not None:
        saved = ckpt.saved_meta(latest)
        if saved is not None:
            same_data = check_resumable(saved, trainer.cfg, data, spec.steps, reporter, spec.allow_data_change)
    restored = ckpt.restore_latest(trainer.abstract_state, trainer.cfg.model) if latest is not None else None
    init_from = trainer.cfg.train.init_from
    if restored is None:
        return _fresh_state(trainer, init_from, reporter, status, spec.output_dir)
    if init_from:
        reporter.info(f"note: train.init_from ({init_from}) is used at a run's first start only; this run "
                      "resumes from its own checkpoints")
    for step, why, moved_to in restored.unreadable:
        reporter.info(f"the checkpoint at step {step} ({ckpt.step_path(step)}) cannot be restored: {why}; "
                      f"moved it to {moved_to} and resumed from step {restored.step} instead")
    if same_data:  # a position in other data means nothing: that stream starts at its beginning
        data.restore(restored.data_state)
    reporter.info(f"resumed from {ckpt.directory} at step {restored.step}")
    return restored.state


def _fresh_state(trainer: Trainer, init_from: str | None, reporter: Reporter, status: RunStatus,
                 output_dir: str | None = None) -> State:
    """Step 0: a new model, or (train.init_from) another run's parameters with a fresh optimizer, and its side
    files (tokenizer, chat template, generation defaults: trainer/sidefiles.py) in the run's own."""
    if not init_from:
        return trainer.initial_state()
    from trainer import init_from as fine_tune
    from trainer import sidefiles

    state, source = fine_tune.initial_state(trainer, init_from)
    if output_dir and jax.process_index() == 0:
        try:
            carried = sidefiles.carry(init_from, output_dir)
        except OSError as e:  # a full disk: a runtime failure (exit 1), said in the system's words
            from trainer.checkpoint import CheckpointError

            raise CheckpointError(f"cannot copy the model's own files (tokenizer, chat template) from {init_from} "
                                  f"into {output_dir}: {e.strerror or e}") from None
        if carried:
            reporter.info(f"carried the model's own files from {init_from}: {', '.join(carried)}")
    status.initialized_from(source.as_dict())
    reporter.info(f"initialized from {source.as_dict()['path']} ({source.fingerprint}): its parameters only, with "
                  "a fresh optimizer and data stream from step 0")
    return state


def compile_step(trainer: Trainer):
    """The train step compiled ahead of the loop, so that no logged step time includes compilation (the one
    `compile_in_background` started, where it did)."""
    if trainer.step_compiling is not None:
        future, trainer.step_compiling = trainer.step_compiling, None
        return future.result()
    return _lowered_step(trainer).compile()


def _lowered_step(trainer: Trainer):
    batch = jax.ShapeDtypeStruct((trainer.cfg.data.global_batch_size, trainer.cfg.data.seq_len + 1),
                                 jnp.int32, sharding=trainer.batch_sharding)
    return trainer.step_fn.lower(trainer.abstract_state, batch)


def compile_in_background(trainer: Trainer) -> concurrent.futures.Future | None:
    """On an accelerator, the train step's XLA compilation started on a thread of its own (traced here), so
    that it runs while the initial state's program compiles and runs: on one v5e chip moe-1b's two compiles
    took 28 and 30 s one after the other (benchmarks/train_step.py, 2026-12-06). Not on a CPU, where the
    compiles share the cores the tests run on."""
    if trainer.mesh.devices.flat[0].platform == "cpu":
        return None
    try:
        lowered = _lowered_step(trainer)
    except ValueError:  # a shape check at trace time: compile_step raises it again where it is reported
        return None
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="compile-step").submit(lowered.compile)


def peak_memory_gib(mesh: Mesh) -> float | None:
    """The most memory one of this process's accelerators has held (GiB); None on a CPU or where the platform
    keeps no such count."""
    device = next((d for d in mesh.devices.flat if d.process_index == jax.process_index()), None)
    if device is None or device.platform == "cpu":
        return None
    peak = (device.memory_stats() or {}).get("peak_bytes_in_use")
    return None if peak is None else peak / 2**30


def _loop(trainer: Trainer, state: State, data: DataIterator, ckpt: Checkpointer | None, spec: RunSpec,
          reporter: Reporter, stop: StopSignal, status: RunStatus, entropy_floor: float | None,
          evaluator=None, startup: dict | None = None) -> RunResult:
    """Steps until spec.steps or a stop. The host never waits on a step it need not read: each step is
    dispatched with the batch placed while the one before ran (Feed), and the steps' metrics are read
    together (Pending) only at a logged row, a checkpoint, an evaluation or the end, where every step read is
    checked for divergence in order, before anything of it is saved. The first row also says how this process
    started (`startup`: restore_s, init_s; compile_s, and first_step_s from the process's start to the first
    step's dispatch)."""
    cfg = trainer.cfg
    step = saved = start_step = int(jax.device_get(state["step"]))
    if start_step:
        status.resumed(start_step)
    step_fn, compile_s = _compiled(trainer, reporter, step, spec, ckpt)
    timer = StepTimer(cfg, trainer.mesh.size, jax.devices()[0].device_kind, start_step)
    # For goodput and time to the first step: how this process started.
    first_row = {"start_step": start_step, "restore_s": 0.0, **(startup or {}), "compile_s": compile_s}
    profiler = Profiler(spec.profile_steps, spec.output_dir)
    feed, pending, ceiling = Feed(trainer, data), Pending(), loss_ceiling(cfg.model.vocab_size)
    last_loss, stopped = None, False
    try:
        while step < spec.steps:
            if should_stop(stop, step):
                stopped = stop.acted = True
                break
            profiler.before(step)
            batch = feed.take()
            if step == start_step:  # this process's first step: how long it took to get here
                first_row["first_step_s"] = seconds_since_start()
            state, metrics = step_fn(state, batch)
            step += 1
            pending.add(step, metrics)
            if step < spec.steps:
                feed.fill()  # the next batch goes to the devices while this step runs
            evaluate = evaluator is not None and evaluator.due(step)
            checkpoint = ckpt is not None and step % cfg.train.checkpoint_every == 0
            log = step % cfg.train.log_every == 0 or step == spec.steps or evaluate
            host = _read_checked(pending, ckpt, ceiling) if log or checkpoint else None
            if log:
                row = timer.row(step, host, entropy_floor)
                if evaluate:
                    row.update(evaluator(state))
                    status.evaluated(step, row["eval_loss"])
                    timer.restart()  # the evaluation's time is no step's
                if first_row and (peak := peak_memory_gib(trainer.mesh)) is not None:
                    first_row["peak_hbm_gib"] = peak  # the accelerator's peak so far: the steps' own, by now
                row.update(first_row)
                first_row, last_loss = {}, row["loss"]
                _report(reporter, status, row, spec.steps)
            profiler.after(step)
            if checkpoint:
                ckpt.save(step, state, checkpoint_meta(cfg, spec.steps, feed), force=True)
                saved = step
                reporter.checkpointed(step)
        _read_checked(pending, ckpt, ceiling)  # the steps since the last read, before the last save
    finally:
        profiler.close()
    if ckpt is not None:
        if saved != step or ckpt.latest_step() is None:
            ckpt.save(step, state, checkpoint_meta(cfg, spec.steps, feed), force=True)
        ckpt.wait()
        ckpt.verify(step)
    _report_end(reporter, ckpt, step, spec.steps, stop.reason if stopped else None, last_loss)
    return RunResult(step=step, loss=last_loss, stopped_by_signal=stopped,
                     checkpoint_step=step if ckpt is not None else None, start_step=start_step,
                     stop_reason=stop.reason if stopped else None)


def _report(reporter: Reporter, status: RunStatus, row: dict, total: int) -> None:
    reporter.metrics(row)
    reporter.progress(row, total)
    status.running(row["step"], row["loss"], row["tokens_per_s"])


def _compiled(trainer: Trainer, reporter: Reporter, step: int, spec: RunSpec, ckpt: Checkpointer | None):
    start = time.perf_counter()
    try:
        step_fn = compile_step(trainer)
    except ValueError as e:  # shape checks at trace time reject configs that cannot work
        raise ConfigError(f"the train step cannot be built for this config and mesh: {e}") from None
    reporter.info(f"compiled the train step in {time.perf_counter() - start:.1f}s; mesh "
                  f"{dict(trainer.mesh.shape)}; training steps {step + 1}..{spec.steps}"
                  + ("" if ckpt is not None else f"; {NOTHING_SAVED}"))
    return step_fn, time.perf_counter() - start


def _read_checked(pending: Pending, ckpt: Checkpointer | None, ceiling: float) -> dict | None:
    """Reads the pending steps' metrics; Diverged at the first step whose loss or gradient norm is not finite
    or whose loss passed `ceiling`. Returns the last step's metrics (None: none pending)."""
    host = None
    for step, host in pending.read():
        if not host["finite"] or host["loss"] > ceiling:
            raise Diverged(step, host, ckpt, ceiling)
    return host


NOTHING_SAVED = "no checkpoint is saved (no --output-dir: give one to keep the run and resume it)"


def _report_end(reporter: Reporter, ckpt: Checkpointer | None, step: int, total: int, stop_reason: str | None,
                loss: float | None = None):
    """One line: how far the run got, its last loss and where the checkpoint is (or that none was saved);
    after a stop also that the run is not finished and how to go on."""
    where = f"checkpoint at step {step} in {ckpt.step_path(step)}" if ckpt else NOTHING_SAVED
    if stop_reason is None:
        reporter.info(f"finished step {step} of {total}{f', loss {loss:.4f}' if loss is not None else ''}; {where}")
        return
    again = "; run the same command again (--resume auto) to continue" if ckpt is not None else ""
    reporter.info(f"stopped by {stop_reason} at step {step} of {total}, not finished; {where}{again}")
