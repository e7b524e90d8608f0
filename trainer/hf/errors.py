"""The one error of the interchange: bad input (a file, a key, a value), exit 2."""

from __future__ import annotations


class HFError(ValueError):
    """A Hugging Face checkpoint (or a trainer checkpoint to export) that cannot be converted; the message
    names the file and the key."""


class WriteError(RuntimeError):
    """The output could not be written (a full disk, a file-system error): exit 1, nothing left of it."""
