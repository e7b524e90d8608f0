"""Publishing: the dataset directory, local (an flock, a `.partial-*` directory renamed in) or gs:// (a lock
object, uploads with the manifest last), written whole or not at all."""

from __future__ import annotations

import contextlib
import errno
import glob
import json
import os
import shutil
import sys
import tempfile
import time

import click

from trainer.files import not_a_file
from trainer.prepare.errors import PrepareError, PrepareFailure
from trainer.prepare.shards import MANIFEST


class OutputDir:
    """The local dataset directory, held by one `data prepare` at a time (an flock on the directory) and
    written whole or not at all: every file goes to a `.partial-*` directory inside it first and is moved
    in when all are written, the manifest last, so no reader ever sees a manifest before its shards."""

    def __init__(self, output: str):
        if not output.strip():
            raise PrepareError("--output is empty: name the dataset directory")
        self.output, self.path = output, os.path.abspath(output)
        if os.path.lexists(self.path) and not os.path.isdir(self.path):
            what = "a link to nothing" if not os.path.exists(self.path) else not_a_file(self.path) or "a file"
            raise PrepareError(f"--output {output} is {what}, not a directory")
        self.created = not os.path.exists(self.path)
        self._fd: int | None = None
        self.partial: str | None = None

    def __enter__(self) -> OutputDir:
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as e:
            raise write_error(e, f"cannot create the output directory {self.output}") from None
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise PrepareError(f"--output {self.output} is not writable (permission denied)")
        self._lock()
        if os.path.lexists(os.path.join(self.path, "manifest.json")):
            raise PrepareError(f"{self.output} already holds a dataset (manifest.json); choose another --output")
        for stale in glob.glob(os.path.join(self.path, ".partial-*")):  # a killed prepare's: we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        try:
            self.partial = tempfile.mkdtemp(prefix=".partial-", dir=self.path)
        except OSError as e:
            raise write_error(e, f"cannot write in {self.output}") from None
        return self

    def _lock(self) -> None:
        import fcntl

        self._fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PrepareError(f"another `data prepare` is writing to {self.output}; wait for it to finish, or "
                               "choose another --output") from None

    def publish(self, names: list[str]) -> None:
        """Moves the finished files in (a rename each, never following a link that is there), the manifest last."""
        for name in sorted(names, key=lambda n: n == MANIFEST):
            os.replace(os.path.join(self.partial, name), os.path.join(self.path, name))

    def __exit__(self, *exc) -> None:
        if self.partial is not None:
            shutil.rmtree(self.partial, ignore_errors=True)
        if exc[0] is not None and self.created:
            with contextlib.suppress(OSError):
                os.rmdir(self.path)  # only if empty: what we created and left nothing in
        if self._fd is not None:
            os.close(self._fd)


def write_error(error: OSError, what: str) -> click.ClickException:
    """A full disk is a runtime failure (exit 1); a path that cannot be written is the user's to fix (exit 2)."""
    if error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return PrepareFailure(f"{what}: {os.strerror(error.errno)}; nothing was written (free some space, or "
                              "choose another --output)")
    hint = " (a part of the path is a file)" if error.errno == errno.ENOTDIR else ""
    return PrepareError(f"{what}: {error.strerror or error}{hint}")


class RemoteOutput:
    """A dataset under gs:// (or another fsspec URL), held by one `data prepare` at a time and published
    whole. An object store has no flock and no rename, so: the lock is an object created only where none is
    (Cloud Storage's ifGenerationMatch=0: of two writers exactly one succeeds), removed at the end; files a
    stopped prepare left there are overwritten under the lock. The files are written locally, then uploaded
    with the manifest last, itself created only where none is, so a reader who finds a manifest finds its
    shards and no writer replaces a manifest another one published. A prepare that fails or is stopped
    removes what it uploaded and its lock."""

    LOCK = ".prepare-lock"

    def __init__(self, output: str):
        import fsspec

        self.output = output.rstrip("/")
        try:
            self.fs, self.prefix = fsspec.core.url_to_fs(self.output)
        except (ImportError, ValueError) as e:
            raise PrepareError(f"--output {output}: {e}") from None
        self.exclusive = "gs" in _protocols(self.fs)  # the only store here whose writes take a precondition
        self.partial: str | None = None
        self.locked, self.uploaded, self.published = False, [], False

    def _path(self, name: str) -> str:
        return f"{self.prefix.rstrip('/')}/{name}"

    def _create(self, name: str, data: bytes | None = None, local: str | None = None) -> None:
        """Writes the object only if none is there (FileExistsError if one is)."""
        if not self.exclusive and self.fs.exists(self._path(name)):  # elsewhere: checked, then written
            raise FileExistsError(self._path(name))
        kw = {"mode": "create"} if self.exclusive else {}
        if local is None:
            self.fs.pipe_file(self._path(name), data, **kw)
        else:
            self.fs.put_file(local, self._path(name), **kw)

    def __enter__(self) -> RemoteOutput:
        import socket

        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": started}
        try:
            self._create(self.LOCK, json.dumps(holder).encode())
        except FileExistsError:
            raise PrepareError(f"another `data prepare` is writing to {self.output} ({self._holder()}); wait for it "
                               f"to finish, or, if that prepare no longer runs, delete {self.output}/{self.LOCK}") \
                from None
        except OSError as e:
            raise write_error(e, f"cannot write to {self.output}") from None
        self.locked = True
        try:
            if self.fs.exists(self._path(MANIFEST)):
                raise PrepareError(f"{self.output} already holds a dataset (manifest.json); choose another --output")
            self.partial = tempfile.mkdtemp(prefix="moe-tpu-prepare-")
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def _holder(self) -> str:
        """Who holds the lock, as its object says (best effort: it may be gone by now)."""
        try:
            held = json.loads(self.fs.cat_file(self._path(self.LOCK))[:4096])
            return f"its lock says host {held['host']}, process {held['pid']}, since {held['started']}"
        except Exception:  # noqa: BLE001 - only a detail of the message
            return f"it holds {self.output}/{self.LOCK}"

    def publish(self, names: list[str]) -> None:
        """Uploads the finished files, the manifest last and only where no manifest is."""
        for name in sorted(names, key=lambda n: (n == MANIFEST, n)):
            local = os.path.join(self.partial, name)
            if name == MANIFEST:
                try:
                    self._create(name, local=local)
                except FileExistsError:  # only where the lock was deleted under a running prepare
                    self.uploaded = []  # under another's manifest now: not ours to remove
                    raise PrepareFailure(f"another prepare published a dataset in {self.output} while this one "
                                         f"wrote (its lock {self.LOCK} was deleted while it ran), and this one's "
                                         "shards replaced some of its shards: prepare it again into a new --output") \
                        from None
                self.published = True
            else:
                self.fs.put_file(local, self._path(name))
                self.uploaded.append(name)

    def __exit__(self, *exc) -> None:
        if self.partial is not None:
            shutil.rmtree(self.partial, ignore_errors=True)
        if not self.published:
            for name in self.uploaded:
                with contextlib.suppress(Exception):
                    self.fs.rm_file(self._path(name))
        if self.locked:
            with contextlib.suppress(Exception):
                self.fs.rm_file(self._path(self.LOCK))
            self.locked = False


def _protocols(fs) -> set[str]:
    protocol = fs.protocol
    return {protocol} if isinstance(protocol, str) else set(protocol)
