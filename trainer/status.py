"""The run's status for supervisors: one small JSON object, rewritten whole at each change.

Targets: `{output_dir}/status.json` (process 0) and `--status-file PATH` (every process). Local paths are
written to a temporary file and renamed over the old one, so a reader never sees half an object; gs://
paths get one whole-object write (through etils.epath), at most every `remote_every_s` while running.

    {"state": "starting"|"running"|"finished"|"stopped"|"failed", "step": int, "total_steps": int,
     "start_step": int, "loss": float|null, "tokens_per_s": float|null, "eval_loss": float|null,
     "eval_step": int|null, "time": unix seconds, "exit_code": int|null, "error": str|null}
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

from trainer.files import not_a_file
from trainer.outputs import ENDED, Phase  # noqa: F401 - ENDED: the trainer's end states, named here too

EXIT_FINISHED = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_STOPPED = 143  # 128 + SIGTERM: stopped (checkpoint saved), not finished; run again to continue
EXIT_INTERRUPTED = 130  # 128 + SIGINT: the same stop, by Ctrl-C

# The states of the status file, which the control plane reads back (and the guest attributes carry):
# the trainer's phases of trainer/outputs.py.
STARTING, RUNNING, FINISHED, STOPPED, FAILED = (Phase.STARTING, Phase.RUNNING, Phase.FINISHED, Phase.STOPPED,
                                                Phase.FAILED)
# The state an exit code means; any other code is FAILED.
STATE_OF_EXIT = {EXIT_FINISHED: FINISHED, EXIT_STOPPED: STOPPED, EXIT_INTERRUPTED: STOPPED}


class StatusError(OSError):
    """A status or metrics file that cannot be written; the message names the path."""


def is_remote(path: str) -> bool:
    return "://" in path


def write_whole(path: str, text: str) -> None:
    """Replaces the file at `path` with `text` in one step: temp file + rename locally, one object on gs://."""
    if is_remote(path):
        from etils import epath

        epath.Path(path).write_text(text)
        return
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def reason(error: BaseException) -> str:
    return getattr(error, "strerror", None) or str(error) or type(error).__name__


def _finite(value: Any) -> float | None:
    return float(value) if value is not None and math.isfinite(float(value)) else None


class RunStatus:
    """Holds the status object and writes it to every target; a cheap no-op without targets."""

    def __init__(self, paths: Iterable[str] = (), *, remote_every_s: float = 10.0,
                 warn: Callable[[str], None] | None = None, clock: Callable[[], float] = time.time):
        self.paths: list[str] = []
        self.record: dict[str, Any] = {"state": STARTING, "step": 0, "total_steps": 0, "start_step": 0,
                                       "loss": None, "tokens_per_s": None, "eval_loss": None, "eval_step": None,
                                       "time": None, "exit_code": None, "error": None}
        self.remote_every_s, self.clock = remote_every_s, clock
        self.warn = warn or (lambda message: print(message, file=sys.stderr, flush=True))
        self._last_write: dict[str, float] = {}
        self._warned: set[str] = set()
        for path in paths:
            self.add(path)

    def add(self, path: str) -> None:
        """A new target; a local one's directory is created now (an error here names the path)."""
        if not is_remote(path):
            path = os.path.abspath(path)
            kind = not_a_file(path)  # a FIFO or device there would be renamed over, a directory refuses it
            if kind:
                raise StatusError(f"the status file {path} is {kind}, not a file: name a file")
            try:
                os.makedirs(os.path.dirname(path), exist_ok=True)
            except OSError as e:
                raise StatusError(f"cannot write the status file {path}: {reason(e)}") from None
        if path not in self.paths:
            self.paths.append(path)

    def start(self, total_steps: int) -> None:
        """Writes "starting" to every target; raises `StatusError` naming a target that cannot be written."""
        self._set(state=STARTING, total_steps=total_steps)
        text = self._text()
        for path in self.paths:
            try:
                write_whole(path, text)
            except Exception as e:  # noqa: BLE001 - OSError locally; gcsfs and google-auth errors remotely
                raise StatusError(f"cannot write the status file {path}: {reason(e)}") from None
            self._last_write[path] = self.clock()

    def resumed(self, step: int) -> None:
        self._set(step=step, start_step=step)
        self._write(throttle=False)

    def running(self, step: int, loss: float | None, tokens_per_s: float | None) -> None:
        """After each logged step: local targets every time, remote ones at most every `remote_every_s`."""
        self._set(state=RUNNING, step=step, loss=_finite(loss), tokens_per_s=_finite(tokens_per_s))
        self._write(throttle=True)

    def initialized_from(self, source: dict[str, Any]) -> None:
        """The checkpoint a fine-tune started from (trainer/init_from.py), kept in the record."""
        self._set(init_from=source)
        self._write(throttle=False)

    def evaluated(self, step: int, loss: float | None) -> None:
        """After an evaluation at `step` (the `running` of that step writes it)."""
        self._set(eval_loss=_finite(loss), eval_step=step)

    def end(self, state: str, exit_code: int, error: str | None = None, step: int | None = None) -> None:
        """The final state; a target that cannot be written gets a warning, never an exception."""
        assert state in ENDED, state
        self._set(state=state, exit_code=exit_code, error=error, **({} if step is None else {"step": step}))
        self._write(throttle=False)

    def _set(self, **fields: Any) -> None:
        self.record.update(fields)
        self.record["time"] = round(self.clock(), 3)

    def _text(self) -> str:
        return json.dumps(self.record) + "\n"

    def _write(self, throttle: bool) -> None:
        if not self.paths:
            return
        text, now = self._text(), self.clock()
        for path in self.paths:
            if throttle and is_remote(path) and now - self._last_write.get(path, -math.inf) < self.remote_every_s:
                continue
            try:
                write_whole(path, text)
                self._last_write[path] = now
            except Exception as e:  # noqa: BLE001 - the status is advisory: training goes on
                if path not in self._warned:
                    self._warned.add(path)
                    self.warn(f"warning: cannot write the status file {path}: {reason(e)}")
