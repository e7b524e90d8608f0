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
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

from provision.errors import UsageError

T = TypeVar("T")
TOKEN_BYTES = 64


class Store:
    """The JSON file behind a world, or nothing (state_path None: the world lives in memory)."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
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
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            self._fd = fd
            yield
        finally:
            self._fd = None
            os.close(fd)  # closing the last descriptor releases the lock

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
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            self._seen = version
            return None
        try:
            world = parse(json.loads(text))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise UsageError(f"cannot read the emulator state {self.path}: {exc}",
                             hint=f"delete {self.path} to start a fresh emulated world") from exc
        self._seen, self._text = version, text
        return world

    def save(self, data: dict) -> None:
        if self.path is None:
            return
        text = json.dumps(data, indent=1, sort_keys=True)
        if text == self._text and not self.changed():
            return  # a transaction that only read: the file already holds this world
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
        self._seen, self._text = self._version(), text

    def _version(self) -> tuple:
        token = os.pread(self._fd, TOKEN_BYTES, 0) if self._fd is not None else b""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return token, None
        return token, (st.st_ino, st.st_mtime_ns, st.st_size)
