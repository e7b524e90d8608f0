"""The files this tool keeps on the user's disk (.moe-tpu/, `render --out`): never written through.

A state file is a regular file or nothing. A symlink, a FIFO, a device or a directory where one
should be is refused with a message naming the path (writing through a symlink would change the
file it points to; opening a FIFO or a device would hang or fill the disk). Every write is atomic:
a temporary file in the same directory, then a rename over the old one, so a kill never leaves half
a file and a reader never sees one.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from provision.errors import UsageError

# What a message echoes of a value it refuses: enough to recognise it, never a screenful.
MAX_ECHO = 200


def echo(value: object, width: int = MAX_ECHO) -> str:
    """A value for a message: control characters escaped (never raw to a terminal), cut to `width`."""
    text = str(value)
    escaped = "".join(ch if ch.isprintable() or ch == " " else ch.encode("unicode_escape").decode("ascii")
                      for ch in text[: width + 1])
    return escaped if len(escaped) <= width and len(text) <= width else escaped[: width - 3] + "..."


def file_kind(mode: int) -> str | None:
    """What a non-regular file is, in words; None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    for test, name in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def check_regular(path: Path, what: str = "state file") -> bool:
    """Whether `path` exists as a regular file (False: nothing there); a UsageError naming it when
    something else is there. Does not follow a symlink."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return False
    except NotADirectoryError:
        raise UsageError(f"{echo(path)}: a parent of this {what} is a file, not a directory",
                         hint="move or delete that file") from None
    except OSError as exc:
        raise UsageError(f"cannot use {echo(path)} as a {what}: {exc.strerror or exc}") from None
    kind = file_kind(mode)
    if kind is not None:
        raise UsageError(f"{echo(path)} is {kind}, not a {what}: refusing to write through it",
                         hint=f"move or delete {echo(path)}")
    return True


def input_problem(path: Path, max_bytes: int) -> str | None:
    """What keeps a file that is to be read from being read at once and whole (a FIFO waits for a writer,
    a device never ends, a directory is no file, a huge file is no config); None when nothing does, or
    when there is no file (the reader says so)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot read it: {exc.strerror or exc}"
    kind = file_kind(st.st_mode)
    if kind is not None:
        return f"is {kind}, not a file"
    if st.st_size > max_bytes:
        return f"is {st.st_size:,} bytes; a config file is at most {max_bytes:,} (they are a few kilobytes)"
    if not os.access(path, os.R_OK):
        return "cannot read it: permission denied"
    return None


def ensure_dir(path: Path) -> None:
    """Create the directory (and its parents); a UsageError naming it when it cannot be one."""
    try:
        if path.is_symlink() and not path.is_dir():
            raise UsageError(f"{echo(path)} is a dangling symbolic link, not a directory",
                             hint=f"move or delete {echo(path)}")
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        kind = file_kind(os.stat(path).st_mode) if path.exists() else None
        if kind is not None:  # a device, a FIFO or a socket is nobody's to delete for this
            raise UsageError(f"{echo(path)} is {kind}, not a directory", hint="name a directory") from None
        raise UsageError(f"{echo(path)} is a file, not a directory", hint=f"move or delete the file {echo(path)}") \
            from None
    except OSError as exc:
        raise UsageError(f"cannot create {echo(path)}: {exc.strerror or exc}",
                         hint="run in a directory you can write to") from None


def user_cache_dir(env, *parts: str) -> Path:
    """$XDG_CACHE_HOME/PARTS (~/.cache by default): where moe-tpu keeps, for every directory it runs in, what
    it could compute again (the dry run's compiled train steps, the planner's answers)."""
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache").joinpath(*parts)


def write_atomic(path: Path, text: str, what: str = "state file") -> None:
    """Replace the regular file at `path` (or create it) with `text`: a temporary file in the same
    directory, then a rename. Whatever else is at `path` is refused (UsageError), not written through."""
    path = Path(path)
    check_regular(path, what)
    ensure_dir(path.parent)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise UsageError(f"cannot write {echo(path)}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def open_lock(path: Path) -> int:
    """A descriptor on the lock file at `path` (created if need be), never through a symlink, a FIFO
    or a device: the caller flocks it and closes it."""
    path = Path(path)
    check_regular(path, "lock file")
    ensure_dir(path.parent)
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0) | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o644)
    except OSError as exc:
        raise UsageError(f"cannot open the lock file {echo(path)}: {exc.strerror or exc}",
                         hint=f"move or delete {echo(path)}") from None
    kind = file_kind(os.fstat(fd).st_mode)
    if kind is not None:  # replaced between the check and the open
        os.close(fd)
        raise UsageError(f"{echo(path)} is {kind}, not a lock file", hint=f"move or delete {echo(path)}")
    return fd
