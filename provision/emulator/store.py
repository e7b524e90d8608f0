"""The world's file, shared by concurrent processes.

Every transaction takes an exclusive flock on a sibling lock file (`emulator.json.lock`), reloads
the world if another process saved it since this one last read or wrote it, and saves it
atomically (temp file + os.replace: a kill never leaves half a file). Each save writes a fresh
token into the lock file; a different token (or a different file) tells a process to reload.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from provision.errors import MoeTpuError, UsageError
from provision.statefiles import check_regular, echo, open_lock

T = TypeVar("T")
TOKEN_BYTES = 64
# After the token, the lock file names the process that holds the lock (for a message to whoever waits).
PID_BYTES = 16
# A transaction holds the lock for milliseconds, a few hundred on a machine busy with two dry runs'
# trainers: a wait this long is a holder that is stuck (suspended with Ctrl-Z, stopped in a debugger),
# not a run beside this one. Whoever waits hears of it then and gives up after the bound.
LOCK_NOTICE_S = 2.0
LOCK_WAIT_S = 60.0
# The world is a few kilobytes per resource; a file past this is not one (and is not read whole).
MAX_STATE_BYTES = 64 * 1024 * 1024


class LockTimeout(MoeTpuError):
    """Another process held the world's lock past LOCK_WAIT_S (exit 1)."""


class Store:
    """The JSON file behind a world, or nothing (state_path None: the world lives in memory)."""

    def __init__(self, path: Path | None, notice: Callable[[str], None] | None = None) -> None:
        self.path = path
        self.notice = notice or (lambda message: print(f"warning: {message}", file=sys.stderr, flush=True))
        self.lock_path = path.with_name(path.name + ".lock") if path is not None else None
        self._fd: int | None = None
        self._seen: tuple | None = None  # the version this process holds; None: reload
        self._text: str | None = None  # that version's text

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the exclusive lock (not reentrant: the caller nests transactions itself)."""
        if self.path is None:
            yield
            return
        fd = open_lock(self.lock_path)
        try:
            self._acquire(fd)
            self._fd = fd
            yield
        finally:
            self._fd = None
            os.close(fd)  # closing the last descriptor releases the lock

    def _acquire(self, fd: int) -> None:
        """The exclusive flock; a holder that does not let go is named within LOCK_NOTICE_S and given up
        on after LOCK_WAIT_S (LockTimeout)."""
        start, told = time.monotonic(), False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            waited = time.monotonic() - start
            holder = os.pread(fd, PID_BYTES, TOKEN_BYTES).decode("ascii", errors="replace").strip()
            who = f"another moe-tpu command (pid {holder})" if holder.isdigit() else "another moe-tpu command"
            if waited >= LOCK_WAIT_S:
                raise LockTimeout(f"gave up after {LOCK_WAIT_S:g}s waiting for {who} that holds {self.lock_path}",
                                  hint=f"resume or end that command (`fg`, or `kill {holder}` if it is stuck), "
                                       "then run this one again" if holder.isdigit() else
                                       "resume or end that command, then run this one again")
            if not told and waited >= LOCK_NOTICE_S:
                told = True
                self.notice(f"waiting for {who} that holds {self.lock_path} (at most {LOCK_WAIT_S:g}s)")
            time.sleep(0.05)
        self._write_pid(fd)

    @staticmethod
    def _write_pid(fd: int) -> None:
        os.pwrite(fd, f"{os.getpid():<{PID_BYTES - 1}}\n".encode(), TOKEN_BYTES)

    def changed(self) -> bool:
        """Whether the file differs from the version this process last read or wrote (under the lock)."""
        return self.path is not None and self._version() != self._seen

    def forget(self) -> None:
        """The world in memory is not the saved one any more: reload on the next transaction."""
        self._seen, self._text = None, None

    def load(self, parse: Callable[[dict], T]) -> T | None:
        """parse(the saved JSON), or None when there is no file; a UsageError naming the file when it
        cannot be read or parsed."""
        if self.path is None:
            return None
        version = self._version()
        if not check_regular(self.path, "emulator state file"):
            self._seen = version
            return None
        try:
            with open(self.path, "rb") as handle:
                raw = handle.read(MAX_STATE_BYTES + 1)
        except FileNotFoundError:
            self._seen = version
            return None
        except OSError as exc:
            raise UsageError(f"cannot read the emulator state {echo(self.path)}: {exc.strerror or exc}",
                             hint=f"delete {echo(self.path)} to start a fresh emulated world") from None
        if len(raw) > MAX_STATE_BYTES:
            raise UsageError(f"the emulator state {echo(self.path)} is over {MAX_STATE_BYTES >> 20} MiB: not a world "
                             "this tool wrote", hint=f"delete {echo(self.path)} to start a fresh emulated world")
        text = raw.decode("utf-8", errors="replace")
        try:
            world = parse(json.loads(text))
        except RecursionError:
            raise UsageError(f"cannot read the emulator state {echo(self.path)}: it nests lists or objects deeper "
                             "than a world this tool writes",
                             hint=f"delete {self.path} to start a fresh emulated world") from None
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UsageError(f"cannot read the emulator state {echo(self.path)}: {echo(exc)}",
                             hint=f"delete {self.path} to start a fresh emulated world") from exc
        self._seen, self._text = version, text
        return world

    def save(self, data: dict) -> None:
        if self.path is None:
            return
        text = json.dumps(data, indent=1, sort_keys=True)
        if text == self._text and not self.changed():
            return  # a transaction that only read: the file already holds this world
        check_regular(self.path, "emulator state file")
        fd, tmp = tempfile.mkstemp(prefix=".emulator-", suffix=".tmp", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w") as handle:
                handle.write(text)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            self.forget()
            raise
        if self._fd is not None:
            os.ftruncate(self._fd, 0)
            os.pwrite(self._fd, os.urandom(TOKEN_BYTES // 2).hex().encode(), 0)
            self._write_pid(self._fd)
        self._seen, self._text = self._version(), text

    def _version(self) -> tuple:
        token = os.pread(self._fd, TOKEN_BYTES, 0) if self._fd is not None else b""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return token, None
        return token, (st.st_ino, st.st_mtime_ns, st.st_size)
