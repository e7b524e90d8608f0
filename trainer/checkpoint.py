"""Asynchronous orbax checkpoints of the train state and the data iterator's position, local or gs://."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.util
import logging
import os
import sys
import time
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from trainer.config import ConfigError


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message names the step and the path."""


def check_directory(path: str) -> str:
    """Absolute local path, or a gs:// URL once the file-system layer for it is importable."""
    if "://" not in path:
        path = os.path.abspath(path)
        if os.path.exists(path) and not os.path.isdir(path):
            raise ConfigError(f"{path} is a file, not a directory")
        return path
    if path.startswith("gs://") and not any(importlib.util.find_spec(m) for m in ("gcsfs", "tensorflow")):
        raise ConfigError(f"checkpoints in {path} need the gcsfs package (pip install 'moe-tpu[trainer]'): "
                          "orbax reaches gs:// through etils.epath and fsspec")
    return path


def _reason(error: BaseException) -> str:
    """The first line of the error's root cause, short: orbax wraps tensorstore's, which run to pages."""
    while error.__cause__ is not None:
        error = error.__cause__
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."


@contextlib.contextmanager
def _failures_reported_once():
    """A failed restore leaves orbax's other reads failing unobserved: asyncio logs each one and each
    coroutine's collection prints a traceback. The caller reports the failure once, by step and path."""
    log = logging.getLogger("asyncio")
    level, hook = log.level, sys.unraisablehook
    log.setLevel(logging.CRITICAL)
    sys.unraisablehook = lambda unraisable: None
    try:
        yield
    finally:
        gc.collect()  # the failed reads go now, while nobody listens
        sys.unraisablehook = hook
        log.setLevel(level)


@dataclasses.dataclass(frozen=True)
class Restored:
    step: int
    state: Any
    data_state: dict
    unreadable: tuple[tuple[int, str, str], ...]  # newer ones that failed: (step, reason, moved to)


class Checkpointer:
    """Saves every `every` steps (and when forced), keeps the last `keep`, restores the latest intact one.

    A save that fails raises `CheckpointError` in the calling thread. Step directories are created
    synchronously, so a bad directory fails at `save` and leaves no orbax thread waiting for it.
    """

    def __init__(self, directory: str, *, every: int, keep: int, async_save: bool = True):
        self.directory = check_directory(directory)
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=every, max_to_keep=keep, enable_async_checkpointing=async_save, create=True,
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False))
        try:
            self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=("state", "data"))
        except Exception as e:  # noqa: BLE001 - any file-system error: one message naming the path
            raise CheckpointError(f"cannot use {self.directory} for checkpoints: {_reason(e)}") from None
        self._pending: int | None = None  # the step whose asynchronous write is in flight
        self.broken = False

    def step_path(self, step: int) -> str:
        return os.path.join(self.directory, str(step)) if "://" not in self.directory else \
            f"{self.directory.rstrip('/')}/{step}"

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: Any, data_state: dict, *, force: bool = False) -> bool:
        """Starts an asynchronous save when `step` is due (or `force`); returns whether it saved."""
        args = ocp.args.Composite(state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state))
        try:
            saved = self.manager.save(step, args=args, force=force)
        except Exception as e:  # noqa: BLE001 - also the previous asynchronous save's failure, raised here
            raise self._failed(step, e) from None
        if saved:
            self._pending = step
        return saved

    def wait(self) -> None:
        """Blocks until the last save is on disk; raises `CheckpointError` if it failed."""
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise self._failed(self._pending, e) from None
        self._pending = None

    def verify(self, step: int) -> None:
        """Raises `CheckpointError` unless the finished checkpoint at `step` is listed in the directory."""
        self.manager.reload()
        if step not in self.manager.all_steps():
            raise CheckpointError(f"the checkpoint at step {step} is missing from {self.directory} after saving")

    def _failed(self, step: int | None, error: BaseException) -> CheckpointError:
        self.broken = True
        at = f" at step {step}" if step is not None else ""
        return CheckpointError(f"cannot save the checkpoint{at} to {self.directory}: {_reason(error)}")

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """The state at `step`, laid out as `abstract_state` (ShapeDtypeStructs with shardings)."""
        args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state), data=ocp.args.JsonRestore())
        restored = self.manager.restore(step, args=args)
        return restored["state"], dict(restored["data"])

    def restore_latest(self, abstract_state: Any) -> Restored | None:
        """The newest checkpoint that restores; None when there is none.

        A newer one that fails to restore while an older one restores is damaged (the older one proves
        that the config matches): it is renamed `STEP.unreadable-TIME`, out of the way of the step that
        training saves again. When none restores, nothing moves and `CheckpointError` lists each reason.
        """
        unreadable: list[tuple[int, str]] = []
        for step in reversed(self.all_steps()):
            reason = self._try_restore(step, abstract_state)
            if isinstance(reason, tuple):
                (state, data_state), reason = reason, None
            if not _everywhere(reason is None):  # each process reads its own shards: all must succeed
                unreadable.append((step, reason or "another process could not read its part"))
                continue
            moved = self._move_aside([bad for bad, _ in unreadable]) if unreadable else []
            return Restored(step, state, data_state,
                            tuple((bad, why, to) for (bad, why), to in zip(unreadable, moved, strict=True)))
        if unreadable:
            reasons = "; ".join(f"step {s} ({self.step_path(s)}): {r}" for s, r in unreadable)
            raise CheckpointError(f"no checkpoint in {self.directory} can be restored with this config: {reasons}")
        return None

    def _try_restore(self, step: int, abstract_state: Any) -> tuple[Any, dict] | str:
        """The state and data state at `step`, or why they cannot be read."""
        with _failures_reported_once():
            try:
                state, data_state = self.restore(step, abstract_state)
                if int(state["step"]) != step:
                    raise ValueError(f"it holds step {int(state['step'])}")
                return state, data_state
            except Exception as e:  # noqa: BLE001 - tensorstore, JSON and file errors alike
                reason = _reason(e)
        return reason

    def _move_aside(self, steps: list[int]) -> list[str]:
        """Renames each step's directory (process 0 does, the others wait); returns the new paths."""
        stamp = int(time.time())
        moved = [f"{self.step_path(step)}.unreadable-{stamp}" for step in steps]
        if jax.process_index() == 0:
            for step, to in zip(steps, moved, strict=True):
                path = epath.Path(self.step_path(step))
                try:
                    path.rename(to)
                except Exception as e:  # noqa: BLE001
                    raise CheckpointError(f"the checkpoint at step {step} ({path}) cannot be restored, nor moved "
                                          f"out of the way: {_reason(e)}; move or delete it, then run again") from None
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("moe-tpu: unreadable checkpoints moved")
        self.manager.reload()
        return moved

    def close(self) -> None:
        """Waits for the last save and releases orbax; after a failed save it only releases."""
        try:
            if not self.broken:
                self.wait()
        finally:
            try:
                self.manager.close()
            except Exception:  # noqa: BLE001 - the failure that matters was raised already
                if not self.broken:
                    raise


def _everywhere(ok: bool) -> bool:
    """Whether `ok` holds on every process (a collective with several processes)."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.asarray(ok))))
