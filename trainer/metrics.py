"""The one object that prints: JSON-lines metrics (a file or stdout) and a progress line on stderr.

Only the writer process (jax.process_index() == 0) prints anything; the others stay silent. With an
output directory the writer also keeps every metrics row in `{output_dir}/metrics.jsonl` and, asked to,
writes them as TensorBoard events (trainer/tensorboard.py).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Callable
from typing import IO, Any

from trainer.outputs import METRICS_FILE
from trainer.status import StatusError, is_remote, reason, write_whole


def _clean(value: Any) -> Any:
    """JSON-safe: NaN and infinities become null, numpy scalars and arrays become Python values."""
    if hasattr(value, "tolist"):
        value = value.tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def metrics_log_path(output_dir: str) -> str:
    if is_remote(output_dir):
        return f"{output_dir.rstrip('/')}/{METRICS_FILE}"
    return os.path.join(os.path.abspath(output_dir), METRICS_FILE)


class NotAFile(StatusError):
    """A metrics path that is no file (a FIFO, a directory): the user's to fix (exit 2)."""


def _no_fifo(path: str) -> None:
    """A FIFO or socket where the metrics go would block the trainer at its first line: refused by name
    (a device such as /dev/null is fine to append to)."""
    import stat

    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or stat.S_ISDIR(mode):
        kind = "a FIFO" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a directory"
        raise NotAFile(f"cannot write the metrics file {path}: it is {kind}, not a file")


class MetricsLog:
    """Metrics rows kept beside the checkpoints: appended to a local file; for gs:// the whole object is
    rewritten (it cannot be appended to), at most every `remote_every_s` and at `close`."""

    def __init__(self, path: str, *, warn: Callable[[str], None], remote_every_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        self.path, self.warn, self.remote_every_s, self.clock = path, warn, remote_every_s, clock
        self._file: IO[str] | None = None
        self._text, self._dirty, self._last, self._failed = "", False, -math.inf, False
        try:
            if is_remote(path):
                from etils import epath

                if epath.Path(path).exists():  # a resumed run continues the file
                    self._text = epath.Path(path).read_text()
            else:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                _no_fifo(path)
                self._file = open(path, "a", buffering=1)
        except StatusError:
            raise
        except Exception as e:  # noqa: BLE001 - OSError locally; gcsfs and google-auth errors remotely
            raise StatusError(f"cannot write the metrics file {path}: {reason(e)}") from None

    def write(self, line: str) -> None:
        if self._file is not None:
            try:
                self._file.write(line)
            except OSError as e:
                self._warn(e)
            return
        self._text += line
        self._dirty = True
        if self.clock() - self._last >= self.remote_every_s:
            self._flush()

    def _flush(self) -> None:
        if not self._dirty:
            return
        try:
            write_whole(self.path, self._text)
            self._dirty, self._last = False, self.clock()
        except Exception as e:  # noqa: BLE001 - the log is a copy: training goes on
            self._warn(e)

    def _warn(self, error: BaseException) -> None:
        if not self._failed:
            self._failed = True
            self.warn(f"warning: cannot write the metrics file {self.path}: {reason(error)}")

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        else:
            self._flush()


# `--metrics -`: the JSON rows on stdout even when it is a terminal.
STDOUT = "-"


def format_eta(seconds: float) -> str:
    """45s, 3m05s, 2h10m: as long as a glance at a progress line needs."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class Reporter:
    """Metrics rows as JSON lines (to --metrics, or to stdout when it is no terminal: a terminal gets
    the progress line instead, and `--metrics -` asks for the rows there too), and a progress line
    with the loss, the last evaluation, the ETA and the last checkpoint on stderr."""

    def __init__(self, metrics_path: str | None = None, *, is_writer: bool = True,
                 stderr: IO[str] | None = None, stdout: IO[str] | None = None, output_dir: str | None = None,
                 tensorboard: bool = False, clock: Callable[[], float] = time.monotonic):
        self.is_writer = is_writer
        self.err = stderr or sys.stderr
        self.metrics_path = metrics_path if metrics_path != STDOUT else None
        self.clock = clock
        self._own = None
        self.out = None
        if is_writer and self.metrics_path:
            self._own = self.out = open(self.metrics_path, "a", buffering=1)
        elif is_writer:
            out = stdout or sys.stdout
            self.out = out if metrics_path == STDOUT or not _terminal(out) else None
        self.log = None
        path = metrics_log_path(output_dir) if output_dir else None
        same = path and self.metrics_path and not is_remote(path) and os.path.abspath(self.metrics_path) == path
        if is_writer and path and not same:
            try:
                self.log = MetricsLog(path, warn=self.info)
            except StatusError:
                self.close()
                raise
        if is_writer and self.out is None:
            kept = f"kept in {path}" if path else "not kept (no --output-dir)"
            self.info(f"metrics rows: {kept}; --metrics FILE writes them to a file, --metrics - here")
        self.events = None
        if is_writer and tensorboard:
            from trainer.tensorboard import open_writer

            self.events = open_writer(output_dir, True, warn=self.info)
        self._since: tuple[float, int] | None = None  # (clock, step) at the first progress line
        self._eval_loss: float | None = None
        self._checkpoint: int | None = None

    def metrics(self, row: dict[str, Any]) -> None:
        if not self.is_writer:
            return
        line = json.dumps({k: _clean(v) for k, v in row.items()}) + "\n"
        if self.out is not None:
            try:
                self.out.write(line)
                self.out.flush()
            except OSError as e:  # a full disk, a closed pipe: the metrics are the run's output, so it stops
                where = self.metrics_path or "stdout"
                raise StatusError(f"cannot write the metrics to {where}: {reason(e)}") from None
        if self.log is not None:
            self.log.write(line)
        if self.events is not None:
            self.events.write(row)

    def checkpointed(self, step: int) -> None:
        """A checkpoint of `step` was started: the progress line names the last one."""
        self._checkpoint = step

    def progress(self, row: dict[str, Any], total_steps: int) -> None:
        if not self.is_writer:
            return
        parts = [f"step {row['step']}/{total_steps}", f"loss {row['loss']:.4f}"]
        if row.get("eval_loss") is not None:
            self._eval_loss = row["eval_loss"]
        if self._eval_loss is not None:
            parts.append(f"eval {self._eval_loss:.4f}")
        if row.get("entropy_floor") is not None:
            parts.append(f"floor {row['entropy_floor']:.4f}")
        parts += [f"aux {row['aux_loss']:.4f}", f"drop {row['drop_fraction']:.3f}",
                  f"{row['tokens_per_s']:,.0f} tok/s", f"{row['step_time_s'] * 1e3:.1f} ms/step"]
        if row.get("mfu") is not None:
            parts.append(f"mfu {row['mfu']:.1%}")
        eta = self._eta(row["step"], total_steps)
        if eta is not None:
            parts.append(f"ETA {format_eta(eta)}")
        if self._checkpoint is not None:
            parts.append(f"ckpt {self._checkpoint}")
        self.info("  ".join(parts))

    def _eta(self, step: int, total_steps: int) -> float | None:
        """Seconds left at the pace since the first progress line (evaluations and saves included)."""
        now = self.clock()
        if self._since is None:
            self._since = (now, step)
            return None
        start, first = self._since
        return (now - start) / (step - first) * (total_steps - step) if step > first else None

    def info(self, message: str) -> None:
        if self.is_writer:
            print(message, file=self.err, flush=True)

    def close(self) -> None:
        if self._own is not None:
            own, self._own = self._own, None
            try:
                own.close()
            except OSError:  # what could not be flushed failed a write already, which said so
                pass
        if self.log is not None:
            self.log.close()
            self.log = None
        if getattr(self, "events", None) is not None:
            self.events.close()
            self.events = None


def _terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False
