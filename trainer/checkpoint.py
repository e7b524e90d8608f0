"""Asynchronous orbax checkpoints of the train state and the data iterator's position, local or gs://."""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import orbax.checkpoint as ocp

from trainer.config import ConfigError


def _directory(path: str) -> str:
    """Absolute local path, or a gs:// URL once the file-system layer for it is importable."""
    if "://" not in path:
        return os.path.abspath(path)
    if path.startswith("gs://") and not any(importlib.util.find_spec(m) for m in ("gcsfs", "tensorflow")):
        raise ConfigError(f"checkpoints in {path} need the gcsfs package (pip install 'moe-tpu[trainer]'): "
                          "orbax reaches gs:// through etils.epath and fsspec")
    return path


class Checkpointer:
    """Saves every `every` steps (and when forced), keeps the last `keep`, restores the latest."""

    def __init__(self, directory: str, *, every: int, keep: int, async_save: bool = True):
        self.directory = _directory(directory)
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=every, max_to_keep=keep, enable_async_checkpointing=async_save, create=True)
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data"))

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return list(self.manager.all_steps())

    def save(self, step: int, state: Any, data_state: dict, *, force: bool = False) -> bool:
        """Starts an asynchronous save when `step` is due (or `force`); returns whether it saved."""
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state))
        return self.manager.save(step, args=args, force=force)

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """The state at `step`, laid out as `abstract_state` (ShapeDtypeStructs with shardings)."""
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore())
        restored = self.manager.restore(step, args=args)
        return restored["state"], dict(restored["data"])

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()
