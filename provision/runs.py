"""`moe-tpu run`: provision, follow training, recover from preemption, tear down.

The loop holds a target (provision/kinds/) and calls only what `Target` declares. Every
step lands on a timeline with its time and the cost so far; the trainer's own reports
(step, loss, tokens/s) drive the progress line and the ETA.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from provision import goodput
from provision.cloud import storage
from provision.core import Report, Target
from provision.errors import CloudError, MoeTpuError, UsageError
from provision.resources import Resource, short
from provision.waiting import PollPolicy, format_duration, poll
from trainer import signals
from trainer.outputs import METRICS_FILE, STATUS_FILE, Phase
from trainer.signals import Signalled  # noqa: F401 - raised at the run's waits by SIGTERM and SIGHUP

# While a trainer runs, its reports are read this often (and more often at first).
FOLLOW_POLICY = PollPolicy(initial_s=2.0, factor=1.5, cap_s=30.0, jitter=0.0)
# Time for the trainer to appear after the slice or job is up (image pull, start-up, compile).
START_TIMEOUT_S = 3 * 3600.0
# The phases of a report that end a follow (Runner._follow).
FOLLOW_ENDS = (Phase.FINISHED, Phase.FAILED, Phase.PREEMPTED, Phase.RESTARTED, Phase.DELETED)


class RunFailed(CloudError):
    """Training failed, or preemptions outnumbered recovery.max_restarts (exit 1)."""


class Interrupted(MoeTpuError):
    exit_code = 130


class Terminated(MoeTpuError):
    """SIGTERM or SIGHUP ended the run (a CI cancel, a supervisor, a closed terminal): exit 143."""

    exit_code = 143


@contextmanager
def terminate_on_signals() -> Iterator[None]:
    """Ctrl-C, SIGTERM and SIGHUP recorded for the run (trainer/signals.py: the handlers raise nothing, so
    none can be dropped where it lands, a garbage-collection callback included): every wait of the run
    (its clock's sleep) wakes at once and raises it there, as KeyboardInterrupt or `Signalled`, again at
    every wait until the run acts on it (Runner._guarded); then later ones are ignored so that the
    teardown finishes. The previous handlers come back afterwards."""
    with signals.latch():
        yield


@dataclass
class RunTimeline:
    """What happened when in a run, and what it had cost by then (the emulator's scripted phases of
    a resource are another thing: provision.emulator.scenarios.Timeline)."""

    clock: Any
    usd_per_hour: float
    events: list[dict[str, Any]] = field(default_factory=list)
    start: float = 0.0
    _billed_s: float = 0.0
    _billing_since: float | None = None

    def __post_init__(self) -> None:
        self.start = self.clock.now()

    def cost(self) -> float:
        running = self.clock.now() - self._billing_since if self._billing_since is not None else 0.0
        return (self._billed_s + running) * self.usd_per_hour / 3600.0

    def billing(self, on: bool) -> None:
        now = self.clock.now()
        if on and self._billing_since is None:
            self._billing_since = now
        elif not on and self._billing_since is not None:
            self._billed_s += now - self._billing_since
            self._billing_since = None

    def add(self, event: str, console=None, **details: Any) -> dict[str, Any]:
        now = self.clock.now()
        entry = {"event": event,
                 "at": dt.datetime.fromtimestamp(now, dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
                 "elapsed_s": round(now - self.start, 1), "cost_usd": round(self.cost(), 2), **details}
        self.events.append(entry)
        if console is not None:
            text = " ".join(f"{k}={v}" for k, v in details.items() if v is not None)
            console.info(f"[{format_duration(entry['elapsed_s']):>7}] {event}" + (f": {text}" if text else ""))
        return entry


@dataclass
class Training:
    """The training figures of the whole run, across restarts."""

    first_loss: float | None = None
    final_loss: float | None = None
    steps: int = 0
    total_steps: int | None = None
    restarts: int = 0
    resumed_from_step: int | None = None
    eval_loss: float | None = None  # the last evaluation's, from the metrics file
    goodput: dict[str, Any] | None = None  # provision/goodput.py, once the metrics file is read

    def see(self, report: Report, attempt: int) -> None:
        if report.loss is not None:
            if self.first_loss is None:
                self.first_loss = report.loss
            self.final_loss = report.loss
        if report.step is not None:
            self.steps = max(self.steps, report.step)
        if report.total_steps:
            self.total_steps = report.total_steps
        if attempt > 0 and report.start_step and self.resumed_from_step is None:
            self.resumed_from_step = report.start_step

    def from_metrics(self, rows: list[dict]) -> None:
        """The exact figures from the trainer's metrics file, when it can be read."""
        losses = [(r["step"], r["loss"]) for r in rows if isinstance(r.get("loss"), (int, float))
                  and isinstance(r.get("step"), int)]
        if losses:
            self.first_loss = min(losses)[1]
            self.final_loss = max(losses)[1]
            self.steps = max(self.steps, max(losses)[0])
        evals = [r["eval_loss"] for r in rows if isinstance(r.get("eval_loss"), (int, float))]
        self.eval_loss = evals[-1] if evals else self.eval_loss

    def as_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "first_loss": self.first_loss, "final_loss": self.final_loss,
                "eval_loss": self.eval_loss, "restarts": self.restarts, "resumed_from_step": self.resumed_from_step,
                "goodput": self.goodput}


@dataclass
class RunOutcome:
    """How a run ended, as the control plane saw it (the trainer's own: trainer.train.RunResult)."""

    ok: bool
    timeline: RunTimeline
    training: Training
    resources: list[Resource]
    error: str | None = None


class Runner:
    """One run of training on a target, start to end."""

    def __init__(self, context, target: Target, *, output_dir: str, keep: bool = False,
                 confirm_teardown=None) -> None:
        """`context`: the command's provision.context.RunContext (the config, the session and its
        clock, the console); `target`: where it trains (provision.kinds.for_config)."""
        self.cfg = context.config
        self.target = target
        self.session = context.session
        self.clock = context.clock
        self.console = context.console
        self.output_dir = output_dir
        self.keep = keep
        self.confirm_teardown = confirm_teardown or (lambda: True)
        self.timeline = RunTimeline(self.clock, target.price())
        self.training = Training()
        self.resources: list[Resource] = []
        self.trained = False  # a trainer of this run reported running at least once

    # --- the loop --------------------------------------------------------------------
    def run(self, finished: dict | None = None) -> RunOutcome:
        """Provision, train, follow, recover and tear down; where the run finished earlier (`finished`: its
        trainer's status, finished_earlier's), train nothing, but take down what it left up."""
        return self._guarded(self._attempts) if finished is None else self.finished_before(finished)

    def _guarded(self, body) -> RunOutcome:
        """`body()`, with Ctrl-C, SIGTERM and SIGHUP ending it as the run's own end would (one that came
        after the body's last wait is acted on too)."""
        try:
            outcome = body()
            signals.checkpoint()
            return outcome
        except KeyboardInterrupt:
            signals.acted()
            self.timeline.add("interrupted", self.console)
            if self.confirm_teardown():
                self._teardown("deleted after interrupt")
                raise Interrupted("interrupted; everything this run created is deleted") from None
            raise Interrupted("interrupted; the run's resources are left as they are",
                              hint="run `moe-tpu down` to delete them") from None
        except Signalled as exc:  # what Ctrl-C with --yes does, unless --keep
            signals.acted()
            self.timeline.add("terminated", self.console, signal=exc.name)
            if not self.keep:
                self._teardown("deleted after signal")
                raise Terminated(f"terminated by {exc.name}; everything this run created is deleted") from None
            raise Terminated(f"terminated by {exc.name}; the run's resources are left as they are (--keep)",
                             hint="run `moe-tpu run` again to follow the training, or `moe-tpu down` to "
                                  "delete them") from None

    def _attempts(self) -> RunOutcome:
        max_restarts = self.cfg.recovery.max_restarts
        attempt = 0
        while True:
            self.timeline.add("provisioning", self.console, target=self.target.describe(), attempt=attempt + 1)
            try:
                self.resources = self.target.provision(attempt)
            except MoeTpuError as exc:
                self.timeline.add("failed", self.console, detail=exc.message)
                self._teardown("deleted")
                if isinstance(exc, UsageError):  # the API refused the request: a config problem (exit 2)
                    raise
                return self._failed(f"provisioning failed: {exc.message}")
            self.timeline.billing(True)
            where = ", ".join(f"{r.kind} {short(r.name)}" for r in self.resources[:2])
            self.timeline.add("provisioned" if attempt == 0 else "recovered", self.console, resources=where)
            outcome = self._follow(attempt)
            while outcome.phase == Phase.RESTARTED:  # the target recovered in place (a JobSet's failure policy)
                self.timeline.add("preempted", self.console, detail=outcome.detail, step=outcome.step)
                if attempt >= max_restarts:
                    self._teardown("deleted")
                    return self._failed(f"preempted {attempt + 1} time(s); recovery.max_restarts is {max_restarts}")
                attempt += 1
                self.training.restarts = attempt
                self.timeline.add("restarted", self.console, attempt=attempt + 1)
                outcome = self._follow(attempt)
            if outcome.phase == Phase.FINISHED:
                self.timeline.add("finished", self.console, step=outcome.step, loss=_round(outcome.loss))
                self._read_metrics()
                if not self.keep:
                    self._teardown("deleted")
                return RunOutcome(True, self.timeline, self.training, self.resources)
            if outcome.phase == Phase.DELETED:  # by a person (`moe-tpu down`, the console), not by the service
                self.timeline.add("deleted elsewhere", self.console, detail=outcome.detail)
                self._teardown("deleted")
                return self._failed(f"the run's resources were deleted while it ran ({outcome.detail}); a "
                                    "deletion somebody asked for is not a preemption, so nothing is recreated")
            if outcome.phase == Phase.PREEMPTED:
                self.timeline.add("preempted", self.console, detail=outcome.detail, step=outcome.step)
                self._teardown("deleted")
                if attempt >= max_restarts:
                    return self._failed(f"preempted {attempt + 1} time(s); recovery.max_restarts is {max_restarts}")
                attempt += 1
                self.training.restarts = attempt
                continue
            self.timeline.add("failed", self.console, worker=outcome.worker, detail=outcome.detail)
            self._teardown("deleted")
            where = f" on {outcome.worker}" if outcome.worker else ""
            return self._failed(f"training failed{where}: {outcome.detail or 'no detail'}")

    def _failed(self, message: str) -> RunOutcome:
        if self.trained:  # a run that never trained has no figures (the output may hold an earlier run's)
            self._read_metrics()
        return RunOutcome(False, self.timeline, self.training, self.resources, error=message)

    def finished_before(self, status: dict) -> RunOutcome:
        """A run whose trainer finished while no `run` followed it (the run was killed, or its
        terminal closed, before training ended): its figures from the metrics file, and what it left
        up on the placement torn down as at the run's own end (unless keep), verified gone."""
        return self._guarded(lambda: self._finished_before(status))

    def _finished_before(self, status: dict) -> RunOutcome:
        self.timeline.add("already finished", self.console, step=status.get("step"), loss=_round(status.get("loss")))
        self._read_metrics()
        self.training.goodput = None  # this re-run saw none of the run's time
        self.resources = self.target.left()
        if not self.resources or self.keep:
            return RunOutcome(True, self.timeline, self.training, self.resources)
        names = ", ".join(f"{r.kind} {short(r.name)}" for r in self.resources)
        self.console.info(f"run {self.cfg.run} finished while nobody followed it but left up {names}: "
                          "deleting them as the run does at its end")
        self._teardown("deleted")
        still = self.target.left()
        if still:
            raise CloudError(f"still up after teardown: {', '.join(f'{r.kind} {short(r.name)}' for r in still)}",
                             hint="run `moe-tpu down`; if it persists, delete them in the console")
        self.console.text(f"deleted what run {self.cfg.run} left up: {names}")
        return RunOutcome(True, self.timeline, self.training, self.resources)

    # --- following ---------------------------------------------------------------------
    def _follow(self, attempt: int) -> Report:
        """Read the target's reports until training ends on it; show step, loss, tokens/s, ETA."""
        started = False
        waited_since = self.clock.now()
        rate = _Rate()

        def look() -> Report:
            nonlocal started
            report = self.target.report()
            self.training.see(report, attempt)
            if report.phase in (Phase.RUNNING, Phase.FINISHED) and not started:
                started = self.trained = True
                self.timeline.add("training started", self.console, step=report.start_step or report.step)
            if (report.phase not in (*FOLLOW_ENDS, Phase.RUNNING)
                    and self.clock.now() - waited_since > START_TIMEOUT_S):
                return Report(Phase.FAILED,
                              detail=f"the trainer did not start within {format_duration(START_TIMEOUT_S)}")
            return report

        with self.console.progress("  waiting for the trainer to start") as bar:
            return poll(look, lambda report: report.phase in FOLLOW_ENDS, self.clock, timeout_s=float("inf"),
                        describe=lambda report, _: self._progress_line(report, rate) if report.phase == Phase.RUNNING
                        else None, progress=bar, policy=FOLLOW_POLICY, what="the trainer")

    def _progress_line(self, report: Report, rate: _Rate) -> str:
        parts = [f"  step {report.step}/{report.total_steps or '?'}"]
        if report.loss is not None:
            parts.append(f"loss {report.loss:.4f}")
        if report.tokens_per_s:
            parts.append(f"{report.tokens_per_s:,.0f} tok/s")
        eta = rate.eta(self.clock.now(), report.step, report.total_steps)
        if eta is not None:
            parts.append(f"ETA {format_duration(eta)}")
        parts.append(f"${self.timeline.cost():.2f} so far")
        return "  ".join(parts)

    # --- the end -------------------------------------------------------------------------
    def _teardown(self, event: str) -> None:
        deleted = self.target.teardown()
        self.timeline.billing(False)
        self.timeline.add(event, self.console, resources=len(deleted))

    def _read_metrics(self) -> None:
        try:
            rows = self.session.storage.read_jsonl(storage.join(self.output_dir, METRICS_FILE))
        except MoeTpuError as exc:
            self.console.detail(f"could not read the trainer's metrics: {exc.message}")
            return
        self.training.from_metrics(rows)
        self.training.goodput = goodput.compute(self.timeline.events, rows)


@contextmanager
def run_lock(state_dir, run: str) -> Iterator[None]:
    """Hold the run's lock in this directory for the whole `run`: a second copy of the same run (which
    would train over the first one's checkpoints) is refused at once, naming the first by its pid. The
    lock goes with the process, also when it is killed."""
    import fcntl
    import os
    from pathlib import Path

    from provision.statefiles import open_lock

    path = Path(state_dir) / f"run-{run}.lock"
    fd = open_lock(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", errors="replace").strip() or "unknown"
        os.close(fd)
        raise UsageError(f"run {run} is already running from this directory (moe-tpu pid {holder} holds {path}); "
                         "a second copy would train over its checkpoints",
                         hint=f"wait for it, or stop it (Ctrl-C there, or `kill {holder}`); a different run "
                              "needs its own `run:` name") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def planned_steps(cfg, dry_run: bool) -> int | None:
    """The step the run's trainer trains to: dry_run.steps, trainer.steps, or the trainer config's own."""
    if dry_run:
        return cfg.dry_run.steps
    if cfg.trainer.steps is not None:
        return cfg.trainer.steps
    try:
        from trainer.config import ConfigError, load_config
    except ImportError:  # without the trainer's package the status file's own total decides
        return None
    try:
        return load_config(cfg.trainer.config, [f for f in cfg.trainer.set_flags() if f != "--set"]).train.steps
    except ConfigError:
        return None


def finished_earlier(context, output_dir: str, *, restart: bool, dry_run: bool) -> dict | None:
    """The trainer's status when the run finished before (said on the console: nothing is trained, and
    Runner.run takes down what the run left up), else None; `restart` moves the finished output aside
    first, so that the trainer starts from step 0 (previous_finish's policy)."""
    store = context.session.storage if output_dir.startswith("gs://") else storage.LOCAL
    status, moved = previous_finish(store, output_dir, context.config, dry_run=dry_run, restart=restart)
    if moved is not None:
        context.console.info(f"--restart: moved the finished run's output to {moved}; training from step 0")
    if status is None:
        return None
    when = status.get("time")
    on = (" on " + dt.datetime.fromtimestamp(when, dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
          if isinstance(when, (int, float)) else "")
    flag = "--dry-run run --restart" if dry_run else "run --restart"
    context.console.text(f"run {context.config.run} already finished at step {status['step']}{on} ({output_dir}); "
                         f"nothing to train; `moe-tpu {flag}` trains it again from step 0")
    return status


def previous_finish(store, output_dir: str, cfg, *, dry_run: bool, restart: bool) -> tuple[dict | None, str | None]:
    """The restart policy of `run`: (its status, None) when the run finished before and trains nothing
    again; (None, where) when `restart` moved its finished output aside (a sibling directory, or
    objects beside it in its bucket) so that the trainer starts from step 0; (None, None) otherwise."""
    status = finished_status(store, output_dir, planned_steps(cfg, dry_run))
    if status is None:
        return None, None
    if restart:
        return None, store.move_aside(output_dir)
    return status, None


def finished_status(store, output_dir: str, steps: int | None) -> dict | None:
    """The trainer's status file (read by `store`, a provision.cloud.storage.Storage) when it says that
    the run finished every one of `steps` steps (None: its own total), else None: there is training to do."""
    try:
        status = store.read_json(storage.join(output_dir, STATUS_FILE))
    except MoeTpuError:
        return None
    if not status or status.get("state") != Phase.FINISHED:
        return None
    step, total = status.get("step"), status.get("total_steps")
    want = steps if steps is not None else total
    if not isinstance(step, int) or not isinstance(want, int) or step < want:
        return None
    return status


class _Rate:
    """Steps per second from the reports seen, for an ETA."""

    def __init__(self) -> None:
        self.first: tuple[float, int] | None = None

    def eta(self, now: float, step: int | None, total: int | None) -> float | None:
        if step is None or not total:
            return None
        if self.first is None or step < self.first[1]:
            self.first = (now, step)
            return None
        t0, s0 = self.first
        if step == s0 or now <= t0:
            return None
        return (total - step) * (now - t0) / (step - s0)


def _round(value: float | None) -> float | None:
    return round(value, 4) if value is not None else None
