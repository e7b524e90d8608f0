"""The guest attributes through which every TPU VM worker reports its trainer's state.

The startup script's watcher copies these fields of the trainer's status file
(trainer/status.py) into the worker's guest attributes, under NAMESPACE, with dashes for
underscores; `moe-tpu run` reads them back (provision/kinds/tpu_vm/kind.py), and in a dry run
the local trainer publishes the same ones into the emulator. Written once, here.
"""

from __future__ import annotations

NAMESPACE = "moe-tpu"
FIELDS = ("state", "step", "total_steps", "start_step", "loss", "tokens_per_s", "exit_code", "error")


def key(field: str) -> str:
    """The guest attribute's key of a status field."""
    return field.replace("_", "-")


def pairs() -> tuple[tuple[str, str], ...]:
    """(status field, attribute key) for every field the watcher publishes."""
    return tuple((field, key(field)) for field in FIELDS)
