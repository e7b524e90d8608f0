"""`python -m trainer` / `moe-train` / `moe-tpu train`: parse flags, build a RunSpec, run, report.

jax is imported only inside the command body, after `--devices` has set XLA_FLAGS.

Exit codes: 0 finished every step; 143 stopped by SIGTERM (or a preemption notice) and 130 by SIGINT, after
saving a checkpoint, not finished; 2 a usage or config error; 1 any other failure. The status file
(trainer/status.py) says the same with its final state and exit code.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
import threading
import time

import click

from trainer import startup
from trainer.config import MAX_SEED, MAX_STEPS, NAMED_CONFIGS, printable
from trainer.outputs import STATUS_FILE, RunDirectory, join
from trainer.status import (
    EXIT_FAILED,
    EXIT_FINISHED,
    EXIT_INTERRUPTED,
    EXIT_STOPPED,
    EXIT_USAGE,
    FAILED,
    FINISHED,
    STOPPED,
    RunStatus,
    StatusError,
)

EXIT_RUNTIME = EXIT_FAILED
__all__ = ["EXIT_FINISHED", "EXIT_RUNTIME", "EXIT_STOPPED", "EXIT_USAGE", "main", "train_command"]


def set_fake_devices(n: int, env=os.environ) -> None:
    """N fake CPU devices: must happen before jax starts (replaces any count already in XLA_FLAGS)."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", env.get("XLA_FLAGS", ""))
    env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    env["JAX_PLATFORMS"] = "cpu"


def parse_profile_steps(text: str | None) -> tuple[int, int] | None:
    if not text:
        return None
    from trainer.config import parse_steps_range

    try:
        return parse_steps_range(text)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--profile-steps") from None


def _jax_started() -> bool:
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
    except ImportError:  # a private module; if jax did start, the device-count check still catches it
        return False
    return bool(getattr(xla_bridge, "_backends", None))


@click.command("train", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--config", "config_name", default="tiny", show_default=True, metavar="NAME|PATH",
              help=f"A named config ({', '.join(NAMED_CONFIGS)}) or a YAML file.")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
              help="Override a config key, e.g. --set moe.top_k=1 (repeatable).")
@click.option("--steps", type=click.IntRange(min=0, max=MAX_STEPS), default=None,
              help="Train up to this step [config].")
@click.option("--devices", type=click.IntRange(min=1), default=None,
              help="CPU only: run on N fake XLA devices.")
@click.option("--mesh", "mesh_text", default=None, metavar="data=D,expert=E,model=T",
              help="Device mesh; the product is the device count [all devices on data].")
@click.option("--output-dir", envvar="AIP_CHECKPOINT_DIR", default=None, metavar="DIR",
              help="Checkpoints (and profiles): a local path or gs:// [$AIP_CHECKPOINT_DIR; none].")
@click.option("--resume", type=click.Choice(["auto", "never"]), default="auto", show_default=True,
              help="auto: continue from the latest checkpoint in --output-dir.")
@click.option("--init-from", "init_from", default=None, metavar="DIR",
              help="Start a fresh run from another run's latest parameters (its output or checkpoints "
                   "directory): a fine-tune with a new optimizer and data stream [train.init_from].")
@click.option("--allow-data-change", is_flag=True, default=False,
              help="Resume even though the data's fingerprint is not the checkpoint's: the model and optimizer "
                   "continue, the data stream starts at the beginning of the data now configured.")
@click.option("--metrics", "metrics_path", default=None, metavar="FILE",
              help="Write JSON-lines metrics here; - for stdout [stdout, unless it is a terminal].")
@click.option("--seed", type=click.IntRange(0, MAX_SEED), default=None,
              help=f"Seed for parameters and data, 0 to {MAX_SEED} [config].")
@click.option("--profile-steps", default=None, metavar="A:B",
              help="Write a jax profiler trace of steps A..B to OUTPUT_DIR/profile.")
@click.option("--status-file", envvar="MOE_TPU_STATUS_FILE", default=None, metavar="PATH",
              help="Also write this process's status JSON here (every process; OUTPUT_DIR/status.json is "
                   "process 0's) [$MOE_TPU_STATUS_FILE].")
@click.pass_context
def train_command(ctx, config_name, overrides, steps, devices, mesh_text, output_dir, resume, metrics_path, seed,
                  profile_steps, status_file, init_from, allow_data_change):
    """Train the MoE language model (the container's entry point; runs on CPU, GPU and TPU).

    Exits 0 when every step is done, 143 when SIGTERM (130 when Ctrl-C) stopped it after saving a checkpoint (run
    the same command again to continue), 2 on a usage or config error, 1 on any other failure.
    """
    status = RunStatus()
    try:
        if status_file:
            _add_status_target(status, status_file, param_hint="--status-file")
        result = _train(status, config_name, overrides, steps, devices, mesh_text, output_dir, resume,
                        metrics_path, seed, profile_steps, init_from, allow_data_change)
    except click.ClickException as e:
        e.message = printable(e.message)  # config values echoed in it may hold terminal escapes
        status.end(FAILED, e.exit_code, e.format_message())
        if e.exit_code == EXIT_USAGE:  # refused (a bad --init-from, data, config): no half-made run is left
            _release_output_dir()
            _remove_refused_output_dir()
        raise
    except KeyboardInterrupt:  # before the loop's own handler is in place
        status.end(FAILED, EXIT_RUNTIME, "interrupted")
        raise
    except Exception as e:  # only with MOE_TRAIN_DEBUG=1, which shows the traceback
        status.end(FAILED, EXIT_RUNTIME, f"{type(e).__name__}: {e}")
        raise
    finally:
        _release_output_dir()
        _made.clear()
    if result.stopped_by_signal:
        code = stopped_exit_code(result.stop_reason)
        status.end(STOPPED, code, step=result.step)
        ctx.exit(code)
    status.end(FINISHED, EXIT_FINISHED, step=result.step)


def stopped_exit_code(reason: str | None) -> int:
    """A stop's exit code: 130 for Ctrl-C, 143 for SIGTERM and a preemption notice (128 + the signal)."""
    return EXIT_INTERRUPTED if reason == "SIGINT" else EXIT_STOPPED


def _train(status, config_name, overrides, steps, devices, mesh_text, output_dir, resume, metrics_path, seed,
           profile_steps, init_from=None, allow_data_change=False):
    startup.mark("cli")
    profile = parse_profile_steps(profile_steps)
    if init_from is not None and not init_from.strip():
        raise click.BadParameter("an empty path names no run", param_hint="--init-from")
    num_devices = None
    if devices is not None:
        if _jax_started():
            num_devices = devices  # jax already runs (in-process use): take the first N devices
        else:
            set_fake_devices(devices)
    else:
        _initialize_distributed()
        startup.mark("distributed")
        startup.start_backend()  # on a thread, while the trainer's modules import
    output_dir = _check_output_dir(output_dir, status)
    _check_path(metrics_path, "--metrics", writes=True)
    if os.sep in config_name or os.path.exists(config_name):
        _check_path(config_name, "--config", writes=False)
    spec = _build_spec(config_name, overrides, steps, num_devices or devices, mesh_text, output_dir, resume,
                       metrics_path, seed, profile, in_process=num_devices is not None, init_from=init_from)
    spec = dataclasses.replace(spec, allow_data_change=allow_data_change)
    startup.mark("spec")
    try:
        status.start(spec.steps)
        _save_config(spec)
    except StatusError as e:
        raise click.ClickException(str(e)) from None
    return _run(spec, status)


def _check_path(path: str | None, param_hint: str, writes: bool) -> None:
    """A local file argument that would hang or never end (a FIFO waits for a peer, /dev/zero never ends,
    a directory is no file) is a usage error naming it, before anything starts. A device is fine to
    write to (/dev/null; a full /dev/full fails at its first write, with a message)."""
    from trainer.files import kind_of

    if not path or "://" in path or path == "-":  # `--metrics -`: stdout
        return
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as e:
        raise click.BadParameter(f"cannot use {path}: {e.strerror}", param_hint=param_hint) from None
    kind = kind_of(mode)
    if kind and not (writes and kind == "a device"):
        raise click.BadParameter(f"{path} is {kind}, not a file", param_hint=param_hint)
    if not writes and not os.access(path, os.R_OK):
        raise click.BadParameter(f"{path} cannot be read (permission denied)", param_hint=param_hint)


def _save_config(spec) -> None:
    """OUTPUT_DIR/config.json (process 0): the config that trained the checkpoints, for trainer.sample."""
    import json

    import jax

    from trainer.status import reason, write_whole

    if not spec.output_dir or jax.process_index() != 0:
        return
    path = RunDirectory.at(spec.output_dir).config
    try:
        write_whole(path, json.dumps(spec.config.to_dict(), indent=1) + "\n")
    except Exception as e:  # noqa: BLE001 - OSError locally; gcsfs and google-auth errors remotely
        raise StatusError(f"cannot write {path}: {reason(e)}") from None


def _add_status_target(status: RunStatus, path: str, param_hint: str) -> None:
    try:
        status.add(path)
    except StatusError as e:
        raise click.BadParameter(str(e), param_hint=param_hint) from None


def _check_output_dir(output_dir: str | None, status: RunStatus) -> str | None:
    """The output directory, checked before anything is built; process 0 keeps its status.json there."""
    if not output_dir:
        return None
    import jax

    from trainer.checkpoint import check_directory
    from trainer.config import ConfigError

    try:
        output_dir = check_directory(output_dir)
    except ConfigError as e:
        raise click.BadParameter(str(e), param_hint="--output-dir") from None
    if jax.process_index() == 0:
        if "://" not in output_dir:
            _hold_output_dir(output_dir)
        _add_status_target(status, join(output_dir, STATUS_FILE), param_hint="--output-dir")
    return output_dir


_held: list[int] = []  # the output directory's lock, held while the command trains
_made: list[tuple[str, str]] = []  # (the local output directory, the outermost of it this command made)


def _release_output_dir() -> None:
    while _held:
        os.close(_held.pop())


def _remove_refused_output_dir() -> None:
    """The output directory this command made, removed when the run was refused before its first checkpoint:
    what it holds (status.json, config.json, the lock) is this command's alone, and describes no run."""
    import shutil

    while _made:
        output_dir, outermost = _made.pop()
        checkpoints = RunDirectory.at(output_dir).checkpoints
        if not (os.path.isdir(checkpoints) and any(name.isdigit() for name in os.listdir(checkpoints))):
            shutil.rmtree(outermost, ignore_errors=True)


def _hold_output_dir(output_dir: str) -> None:
    """One trainer per local output directory: a second one would write over the first one's checkpoints.
    The lock (an flock on OUTPUT_DIR/.lock) goes when the command ends, or with the process when it is killed."""
    import fcntl

    path = os.path.join(output_dir, ".lock")
    try:
        outermost = os.path.abspath(output_dir)  # the outermost directory this command makes
        while not os.path.lexists(os.path.dirname(outermost)):
            outermost = os.path.dirname(outermost)
        if not os.path.lexists(outermost):
            _made.append((os.path.abspath(output_dir), outermost))
        os.makedirs(output_dir, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC, 0o644)
    except OSError as e:
        raise click.BadParameter(f"cannot use {output_dir}: {e.strerror}", param_hint="--output-dir") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", errors="replace").strip() or "unknown"
        os.close(fd)
        raise click.UsageError(f"another trainer (pid {holder}) is training in {output_dir}; a second one would "
                               "write over its checkpoints. Wait for it, or use another --output-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _held.append(fd)


def _initialize_distributed() -> None:
    from trainer import distributed

    try:
        distributed.initialize()
    except Exception as e:  # noqa: BLE001 - any start-up failure is reported, not traced back
        raise click.ClickException(f"multi-host start-up failed: {e}") from None


def _build_spec(config_name, overrides, steps, devices, mesh_text, output_dir, resume, metrics_path, seed,
                profile, in_process, init_from=None):
    import jax

    from trainer import sharding
    from trainer.config import NO_DATA, ConfigError, load_config, with_absolute_paths
    from trainer.train import RunSpec

    extra = [f"train.seed={seed}"] if seed is not None else []
    try:
        cfg = load_config(config_name, [*overrides, *extra])
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    if cfg.data.source == "none":  # an import's config: the data is the user's choice, never a silent default
        raise click.UsageError(NO_DATA)
    if init_from is not None:  # a path as given (no YAML reading of it, as --set would do)
        cfg = cfg.model_copy(update={"train": cfg.train.model_copy(update={"init_from": init_from})})
    cfg = with_absolute_paths(cfg)  # the run's config.json then works from any directory
    startup.mark("config")
    available = len(jax.devices())
    startup.mark("backend")
    from trainer.distributed import use_compilation_cache

    use_compilation_cache(jax.devices()[0].platform)
    if devices is not None and devices > available:
        raise click.UsageError(f"--devices {devices}: jax already runs with {available} devices")
    count = devices if devices is not None else available
    try:
        mesh_shape = sharding.parse_mesh(mesh_text, count)
    except ValueError as e:
        raise click.UsageError(f"{e}{sharding.devices_hint(mesh_text, count)}") from None
    profile = profile or cfg.train.profile_steps
    return RunSpec(config=cfg, steps=cfg.train.steps if steps is None else steps, mesh_shape=mesh_shape,
                   output_dir=output_dir or None, resume=resume, metrics_path=metrics_path,
                   profile_steps=profile, num_devices=devices if in_process else None)


def _quiet_library_logs() -> None:
    """File-system libraries log each retry with a traceback; the user gets one message from us instead."""
    if os.environ.get("MOE_TRAIN_DEBUG") != "1":
        for name in ("gcsfs", "fsspec"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _run(spec, status: RunStatus):
    import jax

    from trainer.checkpoint import CheckpointError
    from trainer.config import ConfigError
    from trainer.data import DataError
    from trainer.divergence import Diverged
    from trainer.metrics import NotAFile, Reporter
    from trainer.train import run

    _quiet_library_logs()
    try:
        reporter = Reporter(spec.metrics_path, is_writer=jax.process_index() == 0, output_dir=spec.output_dir,
                            tensorboard=spec.config.train.tensorboard)
    except NotAFile as e:  # OUTPUT_DIR/metrics.jsonl is a FIFO or a directory
        raise click.UsageError(str(e)) from None
    except StatusError as e:  # OUTPUT_DIR/metrics.jsonl
        raise click.ClickException(str(e)) from None
    except OSError as e:
        raise click.BadParameter(f"cannot write {spec.metrics_path}: {e.strerror}", param_hint="--metrics") from None
    try:
        return run(spec, reporter, status=status)
    except ConfigError as e:
        raise click.UsageError(str(e)) from None
    except DataError as e:  # the data is at fault, not the command line: exit 2 without the usage banner
        bad_data = click.ClickException(str(e))
        bad_data.exit_code = EXIT_USAGE
        raise bad_data from None
    except (CheckpointError, Diverged, StatusError) as e:
        raise click.ClickException(str(e)) from None
    except KeyboardInterrupt:
        interrupted = click.ClickException("interrupted twice: stopped without waiting for a checkpoint")
        interrupted.exit_code = EXIT_INTERRUPTED
        raise interrupted from None
    except Exception as e:  # noqa: BLE001 - no traceback for users; MOE_TRAIN_DEBUG=1 shows it
        if os.environ.get("MOE_TRAIN_DEBUG") == "1":
            raise
        raise click.ClickException(f"training failed: {type(e).__name__}: {e}") from None
    finally:
        reporter.close()


def main(args: list[str] | None = None, prog_name: str | None = None) -> None:
    """The `moe-train` script and `python -m trainer`: the command, then an exit that never hangs.

    After a failure, a library thread may still wait on work that will never come (orbax waits up to
    five minutes for a checkpoint directory that could not be made): the process exits without it.
    """
    startup.runtime_defaults()  # before any command starts jax's backend
    try:
        train_command.main(args=args, prog_name=prog_name or os.environ.get("MOE_TRAIN_PROG", "moe-train"))
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else EXIT_RUNTIME)
        if code != EXIT_FINISHED:
            _exit_now_if_threads_linger(code)
        raise


def _exit_now_if_threads_linger(code: int, grace_s: float = 3.0) -> None:
    deadline = time.monotonic() + grace_s
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join(max(0.0, deadline - time.monotonic()))
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
