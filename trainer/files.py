"""What a local path is when it is no regular file, found without opening it (a FIFO waits for a writer for
ever, a device never ends, a directory is no file): one wording for every command of the trainer's side that
refuses one. The control plane's is provision/statefiles.py (the trainer's side imports nothing of it)."""

from __future__ import annotations

import os
import stat


def kind_of(mode: int) -> str | None:
    """What a file of this st_mode is, in words, when it is no regular file; None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    return ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "a device")


def not_a_file(path: str) -> str | None:
    """What `path` is when something other than a regular file is there; None for a regular file, or for
    nothing there (or nothing that can be looked at: the reader that follows says why)."""
    try:
        return kind_of(os.stat(path).st_mode)
    except OSError:
        return None
