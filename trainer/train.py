"""The training loop (all the I/O) around the jitted pieces of trainer/step.py."""

from __future__ import annotations

import dataclasses
import signal
import time
from collections.abc import Callable
from typing import Literal

import jax

from trainer import meshspec, sharding, startup
from trainer.checkpoint import Checkpointer
from trainer.config import Config, ConfigError
from trainer.data import DataIterator, open_data
from trainer.divergence import Diverged, check_state, loss_ceiling
from trainer.fits import check_fits
from trainer.metrics import Reporter
from trainer.outputs import RunDirectory
from trainer.resume import check_resumable, checkpoint_meta
from trainer.sharding import global_batch  # noqa: F401 - the loop's callers place batches as it does
from trainer.status import RunStatus
from trainer.step import State, Trainer, build_trainer, compile_in_background, compile_step, peak_memory_gib
from trainer.step_timing import Feed, Pending, Profiler, StepTimer


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
        startup.mark("fit_checked")
        mesh = sharding.make_mesh(mesh_shape, devices)
        data, eval_data = open_data(cfg, cfg.train.seed, process_index=jax.process_index(),
                                    process_count=jax.process_count(), with_eval=cfg.train.eval_every > 0)
        startup.mark("data")
        if spec.output_dir:
            ckpt = Checkpointer(RunDirectory.at(spec.output_dir).checkpoints, every=cfg.train.checkpoint_every,
                                keep=cfg.train.keep_checkpoints, compression=cfg.train.checkpoint_compression)
            done = _already_finished(ckpt, spec, reporter, status)
            if done is not None:
                return done
        built = time.perf_counter()
        try:
            trainer = build_trainer(cfg, mesh, spec.steps)
        except ValueError as e:  # the MoE block and shape checks reject configs that cannot work
            raise ConfigError(f"the model cannot be built from this config and mesh: {e}") from None
        startup.mark("built")
        started = time.perf_counter()
        trainer.step_compiling = compile_in_background(trainer)
        startup.mark("step_lowered")
        state = _initial_state(trainer, ckpt, data, spec, reporter, status)
        startup.mark("state")
        restore_s = time.perf_counter() - started if int(jax.device_get(state["step"])) else 0.0
        begun = {"restore_s": restore_s, "init_s": time.perf_counter() - built}
        evaluator = None
        if eval_data is not None:
            from trainer.evaluation import Evaluator

            evaluator = Evaluator(trainer, eval_data, every=cfg.train.eval_every, batches=cfg.train.eval_batches,
                                  total_steps=spec.steps)
        return _loop(trainer, state, data, ckpt, spec, reporter, stop, status, entropy_floor=data.entropy_floor,
                     evaluator=evaluator, begun=begun)
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



def _loop(trainer: Trainer, state: State, data: DataIterator, ckpt: Checkpointer | None, spec: RunSpec,
          reporter: Reporter, stop: StopSignal, status: RunStatus, entropy_floor: float | None,
          evaluator=None, begun: dict | None = None) -> RunResult:
    """Steps until spec.steps or a stop. The host never waits on a step it need not read: each step is
    dispatched with the batch placed while the one before ran (Feed), and the steps' metrics are read
    together (Pending) only at a logged row, a checkpoint, an evaluation or the end, where every step read is
    checked for divergence in order, before anything of it is saved. The first row also says how this process
    started (`begun`: restore_s, init_s; compile_s, first_step_s from the process's start to the first step's
    dispatch, and trainer.startup's marks on the way)."""
    cfg = trainer.cfg
    step = saved = start_step = int(jax.device_get(state["step"]))
    if start_step:
        status.resumed(start_step)
    step_fn, compile_s = _compiled(trainer, reporter, step, spec, ckpt)
    startup.mark("compiled")
    timer = StepTimer(cfg, trainer.mesh.size, jax.devices()[0].device_kind, start_step)
    # For goodput and time to the first step: how this process started.
    first_row = {"start_step": start_step, "restore_s": 0.0, **(begun or {}), "compile_s": compile_s}
    profiler = Profiler(spec.profile_steps, spec.output_dir)
    feed, pending, ceiling = Feed(trainer, data), Pending(), loss_ceiling(cfg.model.vocab_size)
    last_loss, stopped, quick_seen = None, False, 0
    try:
        while step < spec.steps:
            if should_stop(stop, step):
                stopped = stop.acted = True
                break
            profiler.before(step)
            batch = feed.take()
            if step == start_step:  # this process's first step: how long it took to get here
                first_row["first_step_s"] = startup.elapsed()
                first_row.update(startup.marks())
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
                row = _row(trainer, timer, step, host, entropy_floor, state, evaluator if evaluate else None, status,
                           first=bool(first_row))
                quick = getattr(step_fn, "quick_steps", 0)  # a TieredStep's: steps run on its quick program
                if quick > quick_seen:
                    row["quick_steps"], quick_seen = quick - quick_seen, quick
                row.update(first_row)
                first_row, last_loss = {}, row["loss"]
                _report(reporter, status, row, spec.steps)
            profiler.after(step)
            if checkpoint:
                _save(ckpt, step, state, checkpoint_meta(cfg, spec.steps, feed))
                saved = step
                reporter.checkpointed(step)
        _read_checked(pending, ckpt, ceiling)  # the steps since the last read, before the last save
    finally:
        profiler.close()
    if ckpt is not None:
        _save_last(ckpt, step, saved, state, checkpoint_meta(cfg, spec.steps, feed))
    _report_end(reporter, ckpt, step, spec.steps, stop.reason if stopped else None, last_loss)
    return RunResult(step=step, loss=last_loss, stopped_by_signal=stopped,
                     checkpoint_step=step if ckpt is not None else None, start_step=start_step,
                     stop_reason=stop.reason if stopped else None)


def _row(trainer: Trainer, timer: StepTimer, step: int, host: dict | None, entropy_floor: float | None, state: State,
         evaluator, status: RunStatus, first: bool) -> dict:
    """A logged step's row: its timing and metrics, the evaluation where one is due (`evaluator`), and on the
    process's first row the accelerator's peak memory so far (by then the steps' own)."""
    row = timer.row(step, host, entropy_floor)
    if evaluator is not None:
        row.update(evaluator(state))
        status.evaluated(step, row["eval_loss"])
        timer.restart()  # the evaluation's time is no step's
    if first and (peak := peak_memory_gib(trainer.mesh)) is not None:
        row["peak_hbm_gib"] = peak
    return row


def _save_last(ckpt: Checkpointer, step: int, saved: int, state: State, meta: dict) -> None:
    """The last step saved, unless it already was, then every save finished and the last one verified."""
    if saved != step or ckpt.latest_step() is None:
        _save(ckpt, step, state, meta)
    ckpt.wait()
    ckpt.verify(step)


def _save(ckpt: Checkpointer, step: int, state: State, meta: dict) -> None:
    """A checkpoint of a state whose every value is finite (check_state), never of one that is not: its save
    would rotate a good checkpoint out."""
    check_state(step, state, ckpt)
    ckpt.save(step, state, meta, force=True)


def _report(reporter: Reporter, status: RunStatus, row: dict, total: int) -> None:
    reporter.metrics(row)
    reporter.progress(row, total)
    status.running(row["step"], row["loss"], row["tokens_per_s"])


def _compiled(trainer: Trainer, reporter: Reporter, step: int, spec: RunSpec, ckpt: Checkpointer | None):
    start = time.perf_counter()
    try:
        step_fn = compile_step(trainer, notify=reporter.info)
    except ValueError as e:  # shape checks at trace time reject configs that cannot work
        raise ConfigError(f"the train step cannot be built for this config and mesh: {e}") from None
    made = "loaded the train step an earlier run of this config compiled" if "step" in trainer.loaded else \
        "compiled the train step"
    reporter.info(f"{made} in {time.perf_counter() - start:.1f}s; mesh "
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
