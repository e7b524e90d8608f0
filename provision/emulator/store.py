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
LOCK_WAIT_ENV = "MOE_TPU_LOCK_WAIT"  # seconds to wait instead of LOCK_WAIT_S
# The world is a few kilobytes per resource; a file past this is not one (and is not read whole).
MAX_STATE_BYTES = 64 * 1024 * 1024


class LockTimeout(MoeTpuError):
    """Another process held the world's lock past LOCK_WAIT_S (exit 1)."""


class Store:
    """The JSON file behind a world, or nothing (state_path None: the world lives in memory)."""

    def __init__(self, path: Path | None, notice: Callable[[str], None] | None = None) -> None:
        self.path = path
        self.lock_wait = lock_wait_from(os.environ)  # None: LOCK_WAIT_S
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
        """The exclusive flock; a holder that does not let go is named (pid and command) within LOCK_NOTICE_S,
        given up on at once when it is stopped (Ctrl-Z: it would never let go), else after the bound
        (MOE_TPU_LOCK_WAIT, or LOCK_WAIT_S): LockTimeout, exit 1."""
        limit = self.lock_wait if self.lock_wait is not None else LOCK_WAIT_S
        start, told = time.monotonic(), False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            waited = time.monotonic() - start
            holder = os.pread(fd, PID_BYTES, TOKEN_BYTES).decode("ascii", errors="replace").strip()
            pid = int(holder) if holder.isdigit() else None
            if waited >= limit or (waited >= min(LOCK_NOTICE_S, limit) and process_state(pid) in STOPPED):
                raise self._given_up(pid, waited, limit)
            if not told and waited >= LOCK_NOTICE_S:
                told = True
                self.notice(f"waiting for {holder_words(pid)} that holds {self.lock_path} (at most {limit:g}s; "
                            f"{LOCK_WAIT_ENV} sets how long)")
            time.sleep(0.05)
        self._write_pid(fd)

    def _given_up(self, pid: int | None, waited: float, limit: float) -> LockTimeout:
        who, where = holder_words(pid), self.lock_path
        resume = f"`fg` in its terminal, or `kill -CONT {pid}`" if pid else "`fg` in its terminal"
        end = f"`kill {pid}`" if pid else "end it"
        if process_state(pid) in STOPPED:
            return LockTimeout(f"{who} holds {where} and is stopped (Ctrl-Z or SIGSTOP): it lets go only once it "
                               f"runs again; gave up after {waited:.0f}s",
                               hint=f"resume that command ({resume}) or end it ({end}), then run this one again")
        return LockTimeout(f"gave up after {limit:g}s waiting for {who} that holds {where}",
                           hint=f"resume or end that command ({resume}; {end} if it is stuck), then run this one "
                                f"again; {LOCK_WAIT_ENV}=SECONDS waits longer")

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


STOPPED = ("T", "t")  # /proc/PID/stat's states of a process stopped by a signal or a tracer


def lock_wait_from(env) -> float | None:
    """The seconds MOE_TPU_LOCK_WAIT asks to wait for another command's lock (None: unset); a UsageError
    naming the variable when it is no number of seconds."""
    text = env.get(LOCK_WAIT_ENV)
    if text is None or not text.strip():
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds <= 86_400:
        raise UsageError(f"{LOCK_WAIT_ENV}={echo(text, 40)}: give the seconds to wait for another command's lock, "
                         "0 to 86400", hint=f"e.g. {LOCK_WAIT_ENV}=120, or unset it for {LOCK_WAIT_S:g}s")
    return seconds


def process_state(pid: int | None) -> str | None:
    """The state letter /proc gives the process (R, S, T: stopped, Z, ...); None where it cannot be read."""
    if pid is None:
        return None
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def holder_words(pid: int | None) -> str:
    """The command holding a lock, for a message: its pid and command line (as far as /proc tells)."""
    if pid is None:
        return "another moe-tpu command"
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        argv = []
    argv = [a for a in argv if a]
    if len(argv) > 2 and argv[1:3] == ["-m", "provision"]:  # the entry point run as a module
        argv = ["moe-tpu", *argv[3:]]
    elif argv:
        argv[0] = os.path.basename(argv[0])
    return f"another moe-tpu command (pid {pid}: {echo(' '.join(argv), 100)})" if argv else \
        f"another moe-tpu command (pid {pid})"

