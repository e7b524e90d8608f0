"""The workload of a dry run: the trainer, really run on this machine while an emulated slice or job is up.

What a TPU VM's startup script, a Vertex AI container or a GKE trainer pod does in the cloud,
this does here: when the run's emulated nodes are READY (or its custom job is RUNNING, or its
JobSet's trainer pod is Running: the head's trainer for Pathways, slice 0's pod 0 for
multi-controller JAX) it starts the same trainer argv as a subprocess, made small enough for a
CPU by the config's `dry_run` section; it publishes the trainer's status file as the guest
attributes the startup script's watcher would write (namespace `moe-tpu`), and ends the
emulated job or pod with the trainer's exit code. Under `--scenario preempt` it plays a spot
preemption once: SIGTERM to the trainer (which saves a checkpoint and exits 143), then the
queued resource is suspended, the job fails as preempted, or a spot node of the JobSet's pools
goes (its pods fail, the JobSet restarts). While the trainer runs, the emulated clock follows
real time (SimClock.gate).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from provision.emulator.workloads import PLAYS, Placed, Play
from trainer import signals
from trainer.outputs import ENDED, STATUS_FILE, TRAINER_LOG, Phase

RUNS_DIR = "runs"
# Beside the output directory: the pid of the trainer that a run started, so that a re-run after a
# kill follows it (instead of starting a second one on the same checkpoints) and `down` stops it.
TRAINER_RECORD = "trainer.json"
SYNC_INTERVAL_S = 0.05
GATE_MAX_WAIT_S = 0.5
SIGNAL_LOOK_S = 0.05  # how often a wait for the trainer looks for a signal to act on
KILL_GRACE_S = 10.0
LOG_TAIL_LINES = 12
# JAX's persistent compilation cache for the dry run's trainer, unless the environment names one: a
# trainer restarted after a preemption, and every later dry run of the same model, load the compiled
# train step instead of compiling it again (most of a small dry run's time on a CPU).
COMPILATION_CACHE = ("moe-tpu", "jax")


def compilation_cache_env(env) -> dict[str, str]:
    """The JAX_* variables that give the local trainer a persistent compilation cache, for `env`:
    $XDG_CACHE_HOME/moe-tpu/jax (~/.cache by default); none where `env` already names a cache."""
    if env.get("JAX_COMPILATION_CACHE_DIR"):
        return {}
    from provision.statefiles import user_cache_dir

    return {"JAX_COMPILATION_CACHE_DIR": str(user_cache_dir(env, *COMPILATION_CACHE))}


def local_output_dir(state_dir: Path, run: str) -> Path:
    """Where a dry run's trainer writes checkpoints, status.json, metrics.jsonl and trainer.log."""
    return Path(state_dir) / RUNS_DIR / run / "output"


def trainer_record(output_dir: Path) -> Path:
    return Path(output_dir).parent / TRAINER_RECORD


class _Adopted:
    """A trainer started by an earlier process of the run (killed since): not our child, so it is
    watched by pid, and its exit code is the one its status file records."""

    def __init__(self, pid: int, output_dir: Path) -> None:
        self.pid = pid
        self.output_dir = output_dir
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and not _alive(self.pid, self.output_dir):
            try:
                status = json.loads((self.output_dir / STATUS_FILE).read_text())
            except (OSError, ValueError):
                status = {}
            code = status.get("exit_code") if isinstance(status, dict) else None
            self.returncode = code if isinstance(code, int) else 1
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self.poll() is None:
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.05)
        return self.returncode


def _alive(pid: int, output_dir: Path) -> bool:
    """Whether `pid` still runs this output directory's trainer (not a zombie, not a reused pid)."""
    return process_runs(pid, str(output_dir))


def process_runs(pid: int, marker: str) -> bool:
    """Whether `pid` is alive, ours, not a zombie, and has `marker` in its command line (so a pid reused by
    another process does not pass for the one recorded)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return False  # another user's process: not ours
    proc = Path("/proc") / str(pid)
    if not proc.is_dir():
        return True  # no /proc (macOS): the pid answers, take it
    try:
        if proc.joinpath("stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            return False
        cmdline = proc.joinpath("cmdline").read_bytes()
        # Empty for a moment while the kernel builds a just-started program's (exec): it runs.
        return not cmdline or marker.encode() in cmdline
    except (OSError, IndexError):
        return False


def trainers_of(output_dir: Path, found: tuple[_Adopted, dict] | None) -> list[_Adopted]:
    """The recorded trainer into `output_dir` (`found`) first, then any with it as `--output-dir` that no record
    names (a run killed before recording its trainer's pid leaves one, in a session of its own; needs /proc)."""
    recorded = [found[0]] if found is not None else []
    skip = (os.getpid(), *(proc.pid for proc in recorded))
    wanted = b"\0--output-dir\0%s\0" % os.fsencode(str(output_dir))

    def ours(entry: Path) -> bool:
        try:
            return entry.stat().st_uid == os.getuid() and wanted in entry.joinpath("cmdline").read_bytes()
        except OSError:
            return False  # gone meanwhile

    pids = [int(e.name) for e in Path("/proc").glob("[0-9]*") if int(e.name) not in skip and ours(e)]
    return recorded + [_Adopted(pid, Path(output_dir)) for pid in pids if _alive(pid, Path(output_dir))]


def recorded_trainer(output_dir: Path) -> tuple[_Adopted, dict] | None:
    """The trainer an earlier process of the run started, if it still runs: (process, its record)."""
    try:
        record = json.loads(trainer_record(output_dir).read_text())
    except (OSError, ValueError):
        return None
    pid = record.get("pid") if isinstance(record, dict) else None
    if not isinstance(pid, int) or pid <= 0 or not _alive(pid, Path(output_dir)):
        return None
    return _Adopted(pid, Path(output_dir)), record


def stop_recorded(state_dir: Path, run: str) -> int | None:
    """Stop the local trainers a dry run of `run` left running, killed before it could: SIGTERM, then SIGKILL.
    Returns the recorded one's pid (or another's), None when none runs."""
    output_dir = local_output_dir(state_dir, run)
    running = trainers_of(output_dir, recorded_trainer(output_dir))
    for proc in running:
        _terminate(proc)
    trainer_record(output_dir).unlink(missing_ok=True)
    return running[0].pid if running else None


def local_argv(argv: list[str] | tuple[str, ...], cfg, output_dir: Path) -> list[str]:
    """The container's argv for this machine: the trainer's made small by the config's dry_run section;
    another of the image's commands (the server) as it is, on this interpreter."""
    from provision.container import TRAINER_COMMAND

    if tuple(argv[:len(TRAINER_COMMAND)]) != TRAINER_COMMAND:
        return [sys.executable if arg == "python" and i == 0 else arg for i, arg in enumerate(argv)]
    small = cfg.dry_run
    replace = {"--config": small.trainer_config, "--output-dir": str(output_dir), "--steps": str(small.steps),
               "--devices": str(small.devices), "--mesh": small.mesh}
    out: list[str] = []
    args = list(argv)
    i = 0
    while i < len(args):
        if args[i] in replace and i + 1 < len(args):
            out += [args[i], replace.pop(args[i])]
            i += 2
            continue
        out.append(args[i])
        i += 1
    for flag, value in replace.items():
        out += [flag, value]
    if out[:1] == ["python"]:
        out[0] = sys.executable
    return out + ["--set", f"train.checkpoint_every={small.checkpoint_every}"]


@dataclass
class _Workload:
    """One trainer process, the emulated resource it runs for and the service that placed it there."""

    placed: Placed
    play: Play
    proc: subprocess.Popen | _Adopted
    preempting: bool = False
    published: str = ""

    @property
    def key(self) -> str:
        return self.placed.key


def others_training(state_dir: Path, run: str | None = None) -> bool:
    """Whether a dry run's trainer of a run other than `run` runs in this state directory (a record names it)."""
    try:
        names = [entry.name for entry in (Path(state_dir) / RUNS_DIR).iterdir() if entry.name != run]
    except OSError:
        return False
    return any(recorded_trainer(local_output_dir(state_dir, name)) is not None for name in names)


class OthersGate:
    """The clock gate of a dry-run command that runs no trainer of its own. All commands in a directory
    share one emulated clock: while another run's trainer runs there in real time, this command's waits
    take real time too (a queue of hours waited here pauses meanwhile), or its leaps would age that run
    by hours (its trainer's start timeout, its cost) in a few seconds. The command's own run's trainer
    does not count: `down` stops it anyway."""

    def __init__(self, state_dir: Path, run: str | None = None) -> None:
        self.state_dir, self.run = Path(state_dir), run

    def active(self) -> bool:
        return others_training(self.state_dir, self.run)

    def wait(self, seconds: float) -> None:
        signals.sleep(min(seconds, GATE_MAX_WAIT_S))  # a command's signal ends it at once


class LocalTrainer:
    """Runs the run's trainer beside an emulator started with external_workloads=True."""

    def __init__(self, cfg, output_dir: Path, console=None) -> None:
        self.cfg = cfg
        self.output_dir = Path(output_dir)
        self.console = console
        self.emulator = None
        self.current: _Workload | None = None
        self.done: set[str] = set()  # resources whose trainer has ended (until they are gone)
        self.preempted_once = False
        self.expecting = False  # the run's slice or job is up and its trainer is about to start
        self._changed = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # --- wiring ----------------------------------------------------------------------
    def attach(self, emulator) -> None:
        """Watch `emulator` (started, external_workloads=True) and tie its clock to the trainer."""
        self.emulator = emulator
        if hasattr(emulator.clock, "gate"):
            emulator.clock.gate = self
        self._thread = threading.Thread(target=self._loop, name="moe-tpu-local-trainer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop watching and stop the trainer if it still runs (SIGTERM, then SIGKILL)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        with self._lock:
            if self.current is not None:
                _terminate(self.current.proc)
                self.current = None
                trainer_record(self.output_dir).unlink(missing_ok=True)
        if self.emulator is not None and getattr(self.emulator.clock, "gate", None) is self:
            self.emulator.clock.gate = None

    # --- the clock gate --------------------------------------------------------------
    def active(self) -> bool:
        """Real time counts while the run's slice or job is up to run a trainer, or one runs (this run's or another's
        in this directory). Asked before every sleep of the emulated clock, so it looks at the world first: a
        slice that just came up starts its trainer now, not after simulated minutes."""
        self._sync_once()
        # Another run's trainer in this directory counts too (OthersGate): the clock is the world's.
        return (self.current is not None or self.expecting
                or others_training(self.output_dir.parents[2], self.cfg.run))

    def wait(self, seconds: float) -> None:
        """Wait in real time until the trainer reports (or ends), at most `seconds`; a command's signal is
        acted on within SIGNAL_LOOK_S."""
        deadline = time.monotonic() + min(seconds, GATE_MAX_WAIT_S)
        while not self._changed.wait(max(0.0, min(SIGNAL_LOOK_S, deadline - time.monotonic()))):
            signals.checkpoint()
            if time.monotonic() >= deadline:
                break
        self._changed.clear()

    # --- watching --------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._sync_once()
            self._stop.wait(SYNC_INTERVAL_S)

    def _sync_once(self) -> None:
        if self.emulator is None or self._stop.is_set():
            return
        try:
            with self._lock:
                self.sync()
        except Exception as exc:  # noqa: BLE001 - a dry run's workload never takes the command down
            self._say(f"local trainer: {type(exc).__name__}: {exc}")

    def sync(self) -> None:
        """One look: start the trainer where the run's slice or job is up, report, end, preempt."""
        run = self.cfg.run
        placed = self.emulator.world_call(lambda world, now: [  # one transaction for all looks
            (play, play.placed(world, now, run)) for play in PLAYS])
        up = {p.key for _, found in placed for p in found}
        self.done &= up  # a resource that is gone may come back under the same name: run it again then
        self.expecting = bool(up - self.done)
        current = self.current
        if current is None:
            self._start(placed)
            return
        code = current.proc.poll()
        if current.key not in up and code is None:
            _terminate(current.proc)  # torn down under it, as a deleted VM stops its container
            code = current.proc.poll()
        status = self._status()
        if code is None:
            self._publish(current, status)
            self._maybe_preempt(current, status)
            return
        self._finish(current, code, status, still_up=current.key in up)

    def _start(self, placed: list[tuple[Play, list[Placed]]]) -> None:
        """Start the workload of the first service (in PLAYS order) whose resource is up and not done."""
        ready = next(((play, found[0]) for play, found in placed if found and found[0].key not in self.done), None)
        if ready is None:
            return
        play, where = ready
        found = recorded_trainer(self.output_dir)
        if found is not None and found[1].get("key") == where.key:
            # A run killed without a chance to stop its trainer: follow that one; a second trainer on
            # the same output directory would write over its checkpoints.
            self.current = _Workload(placed=where, play=play, proc=found[0])
            if self.console is not None:
                self.console.info(f"  [dry run] following the trainer already running on this machine "
                                  f"(pid {found[0].pid}), which an earlier `run` started")
            self._changed.set()
            return
        # One that ran for a resource now gone (as a deleted VM's container stops), or that no record names.
        for proc in trainers_of(self.output_dir, found):
            _terminate(proc)
        self.current = _Workload(placed=where, play=play, proc=self._spawn(where, play))
        log_path = str(self.output_dir / TRAINER_LOG)
        self.emulator.world_call(lambda world, now: play.started(world, now, where, log_path))
        self._changed.set()

    def _spawn(self, where: Placed, play: Play) -> subprocess.Popen:
        """The container's command (the config's trainer container where the resource carries none),
        made small for this machine, as a child process that writes to the output directory."""
        from provision.container import trainer_container

        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / STATUS_FILE).unlink(missing_ok=True)
        argv = where.argv if where.argv is not None else trainer_container(self.cfg, "").argv
        command = local_argv(argv, self.cfg, self.output_dir)
        log = open(self.output_dir / TRAINER_LOG, "a")  # noqa: SIM115 - the child holds it
        env = dict(os.environ, JAX_PLATFORMS="cpu", MOE_TPU_RUN=self.cfg.run, **compilation_cache_env(os.environ))
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)
        log.close()
        from provision.statefiles import write_atomic

        write_atomic(trainer_record(self.output_dir),
                     json.dumps({"pid": proc.pid, "key": where.key, "kind": play.name}) + "\n")
        self._say(f"  [dry run] trainer started on this machine (pid {proc.pid}): {' '.join(command[1:])}")
        return proc

    def _status(self) -> dict:
        try:
            value = json.loads((self.output_dir / STATUS_FILE).read_text())
        except (OSError, ValueError):
            return {}
        return value if isinstance(value, dict) else {}

    def _publish(self, current: _Workload, status: dict) -> None:
        """The status where the service shows it (a slice: the guest attributes each worker's watcher
        would write), once per change."""
        text = json.dumps(status, sort_keys=True)
        if not status or text == current.published:
            return
        current.published = text
        self._changed.set()
        if current.play.publishes:
            self.emulator.world_call(lambda world, now: current.play.publish(world, now, current.placed, status))

    def _maybe_preempt(self, current: _Workload, status: dict) -> None:
        """`--scenario preempt`: once, after the first checkpoint, the spot VM's notice: SIGTERM."""
        if self.emulator.scenario != "preempt" or self.preempted_once or current.preempting:
            return
        step = status.get("step") if status.get("state") == Phase.RUNNING else None
        if isinstance(step, int) and step >= self.cfg.dry_run.checkpoint_every + 1:
            self._say(f"  [dry run] preempting at step {step}: SIGTERM to the trainer")
            current.preempting = True
            self.preempted_once = True
            current.proc.send_signal(signal.SIGTERM)

    def _finish(self, current: _Workload, code: int, status: dict, still_up: bool) -> None:
        """The trainer ended: say so where the target reports, then the emulated resource follows."""
        self.current = None
        self.done.add(current.key)
        trainer_record(self.output_dir).unlink(missing_ok=True)
        self._changed.set()
        if not still_up:
            return
        final = dict(status)
        if final.get("state") not in ENDED:
            final.update(state=Phase.FAILED, exit_code=code, error=self._log_tail() or f"exit code {code}")
        elif final.get("state") == Phase.FAILED and not final.get("error"):
            final["error"] = self._log_tail()
        current.published = ""
        self._publish(current, final)
        log_path = str(self.output_dir / TRAINER_LOG)
        self.emulator.world_call(lambda world, now: current.play.ended(world, now, current.placed, code, final,
                                                                      current.preempting, log_path))

    def _log_tail(self) -> str:
        try:
            lines = (self.output_dir / TRAINER_LOG).read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-LOG_TAIL_LINES:])

    def _say(self, message: str) -> None:
        if self.console is not None:
            self.console.detail(message)


def _terminate(proc: subprocess.Popen | _Adopted) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=KILL_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
