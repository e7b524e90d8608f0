"""Asynchronous orbax checkpoints of the train state and the data iterator's position, local or gs://."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.util
import inspect
import logging
import os
import re
import sys
import time
import warnings
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from trainer import stacks
from trainer.config import ConfigError


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message names the step and the path."""


@contextlib.contextmanager
def quiet_orbax():
    """Orbax logs a warning (through absl) for each item and option a read-only restore leaves alone; they say
    nothing to whoever trains or serves."""
    log = logging.getLogger("absl")
    level = log.level
    log.setLevel(logging.ERROR)
    quiet_late_callbacks()
    try:
        yield
    finally:
        log.setLevel(level)


def quiet_late_callbacks() -> None:
    """A read that fails part-way (a damaged step) leaves tensorstore's other reads of it running; each, when it
    ends, calls back into the event loop orbax ran them on and has closed since, and Python prints that as
    a traceback ("Event loop is closed", many of them, after the message naming the step). Those alone are
    dropped, for the rest of the process (they may come at exit); anything else goes to the hook there was."""
    if not getattr(sys.unraisablehook, "drops_closed_loops", False):
        sys.unraisablehook = _dropping_closed_loops(sys.unraisablehook)


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


def short_reason(error: BaseException) -> str:
    """The first line of the error's root cause, short: orbax wraps tensorstore's, which run to pages. An
    operating-system error inside them (a full disk) is said in the system's words."""
    while error.__cause__ is not None:
        error = error.__cause__
    code = re.search(r"os_error_code='(\d+)'", str(error))
    if code:
        return f"{os.strerror(int(code.group(1)))} (os error {code.group(1)})"
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    head, dot, _ = text.partition(". ")
    if len(text) > 120 and dot and len(head) >= 20:  # the first sentence: orbax's advice names its own API
        text = head + "."
    return text if len(text) <= 300 else text[:297] + "..."


def _unretrieved(record: logging.LogRecord) -> bool:
    return "exception was never retrieved" not in str(record.msg)


def _dropping_closed_loops(previous):
    """An unraisable-exception hook that drops the reads of a failed restore finishing after orbax closed
    their event loop (they arrive until the process exits), and the coroutines of its reads that failed
    collected after the restore's own collection (a later one prints each with its traceback: "Exception
    ignored in: <coroutine object _read_array_index_and_device_put ...>"), and passes on everything else."""

    def hook(unraisable):
        error, source = unraisable.exc_value, unraisable.object
        closed_loop = isinstance(error, RuntimeError) and str(error) == "Event loop is closed"
        failed_read = (isinstance(error, Exception) and inspect.iscoroutine(source)
                       and f"{os.sep}orbax{os.sep}checkpoint{os.sep}" in source.cr_code.co_filename)
        if not (closed_loop or failed_read):
            previous(unraisable)

    hook.drops_closed_loops = True
    return hook


@contextlib.contextmanager
def failures_reported_once():
    """A failed restore leaves orbax's other reads failing unobserved: asyncio logs each one as it is
    collected (now or at exit) and each coroutine's collection prints a traceback. The caller reports the
    failure once, by step and path; from the first restore on, asyncio's "never retrieved" logs are dropped.
    The failure must leave the block as an exception: only then are the failed reads collected, at once (a full
    collection, which in a process holding many objects takes a good part of a second: not after every read)."""
    log = logging.getLogger("asyncio")
    if _unretrieved not in log.filters:
        log.addFilter(_unretrieved)
    quiet_late_callbacks()
    hook = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "coroutine ... was never awaited"
            try:
                yield
            except BaseException:
                gc.collect()  # the failed reads go now, while nobody listens
                raise
    finally:
        sys.unraisablehook = hook


def _from_orbax_threads(record: logging.LogRecord) -> bool:
    """Orbax logs a failed background save with a traceback from each of its threads; the Checkpointer
    raises the failure once, by step and path, so those records are dropped (MOE_TRAIN_DEBUG=1 keeps them)."""
    return not (record.levelno >= logging.ERROR and "orbax" in record.pathname)


# Orbax writes an array that several devices hold alike (replicated over `data`) in parallel: each replica
# slices out a part and writes it. Each slice is an operation on the device, compiled once per shape: for
# the many small arrays of a state (norms, biases, a small model's every weight) that is compiling, not
# writing. Measured on 8 CPU devices, tiny on data=2,expert=4: the first save took 3.0 s, nearly all of it
# compiling slices, against 0.1 s on one device. Parallel writing pays for large arrays only.
REPLICA_PARALLEL_MIN_BYTES = 4 << 20
# Each array written in chunks of at most this many bytes (orbax's SaveArgs.chunk_byte_size). Otherwise a
# device's part of an array is one chunk, compressed on save and read and decompressed on restore by one thread:
# moe-1b's stacked experts, hundreds of MiB an array on one chip, made its restore wait on one core while the
# others idled. Chunks let tensorstore spread both over the host's cores (benchmarks/checkpoint_codec.py
# --chunk-mib). A checkpoint written before, one chunk a part, restores as it was.
CHUNK_BYTES = 32 << 20


def _replica_parallel_for_large_arrays_only() -> None:
    """Orbax's handler for jax.Array as orbax registers it (with its store of array metadata, which only
    an internal module makes), replica-parallel only where a replica's part is at least
    REPLICA_PARALLEL_MIN_BYTES. Where that module has moved, orbax's own handler stays: slower, as right."""
    from orbax.checkpoint import type_handlers

    try:
        from orbax.checkpoint._src.metadata import array_metadata_store

        handler = type_handlers.ArrayHandler(min_slice_bytes_for_replica_parallel=REPLICA_PARALLEL_MIN_BYTES,
                                             array_metadata_store=array_metadata_store.Store())
    except (ImportError, AttributeError, TypeError):
        return
    with quiet_orbax():  # orbax warns of every override (absl, at every start); this one is meant
        type_handlers.register_type_handler(jax.Array, handler, override=True)


def _quiet_failed_saves() -> None:
    if os.environ.get("MOE_TRAIN_DEBUG") == "1":
        return
    for name in ("absl", ""):
        log = logging.getLogger(name)
        if _from_orbax_threads not in log.filters:
            log.addFilter(_from_orbax_threads)
    log = logging.getLogger("asyncio")  # each of the failed write's tasks, collected now or at exit
    if _unretrieved not in log.filters:
        log.addFilter(_unretrieved)
    if not getattr(sys.unraisablehook, "drops_closed_loops", False):  # a failed write's late callbacks
        sys.unraisablehook = _dropping_closed_loops(sys.unraisablehook)


def _walk(tree: Any, on_names) -> Any:
    """`tree` with every dict keyed by parameter names ("params", "moe_bias", an optimizer's moments) replaced
    by on_names(that dict); the rest (optax's named tuples among them) rebuilt as it is."""
    if isinstance(tree, dict):
        if any(isinstance(k, str) and (stacks.is_stacked(k) or k.startswith(stacks.LAYER_PREFIX)) for k in tree):
            return on_names(tree)
        return {k: _walk(v, on_names) for k, v in tree.items()}
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(_walk(v, on_names) for v in tree))
    if isinstance(tree, (tuple, list)):
        return type(tree)(_walk(v, on_names) for v in tree)
    return tree


def per_layer_layout(model, abstract: Any) -> Any:
    """An abstract state (ShapeDtypeStructs) of the stacked layout (trainer/stacks.py) as the per-layer layout
    that checkpoints written before it hold (`blocks.{i}.…`), each layer's array laid out as its slice."""
    from jax.sharding import NamedSharding, PartitionSpec

    def layer(a):
        where = getattr(a, "sharding", None)
        if isinstance(where, NamedSharding):
            where = NamedSharding(where.mesh, PartitionSpec(*tuple(where.spec)[1:]))
        return jax.ShapeDtypeStruct(a.shape[1:], a.dtype, sharding=where)

    def on_names(flat: dict) -> dict:
        out = {}
        for name, a in flat.items():
            out.update({n: layer(a) for n in stacks.layer_names(model, name)} if stacks.is_stacked(name) else
                       {name: a})
        return out

    return _walk(abstract, on_names)


def stacked_layout(model, restored: Any, abstract: Any) -> Any:
    """A state restored in the per-layer layout, converted to the stacked one and laid out as `abstract`."""
    import jax.numpy as jnp

    converted = _walk(restored, lambda flat: stacks.stack_flat(model, flat, jnp.stack))
    return jax.tree.map(lambda value, a: jax.device_put(value, a.sharding), converted, abstract)


def holds_per_layer_layout(saved: Any) -> bool:
    """Whether a checkpoint's state metadata names its layers' parameters one layer at a time (`blocks.{i}.…`,
    written before the layers were stacked): readers restore it so and convert (stacked_layout)."""
    params = saved.get("params") if hasattr(saved, "get") else None
    return hasattr(params, "keys") and any(str(k).startswith(stacks.LAYER_PREFIX) for k in params.keys())


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

    def __init__(self, directory: str, *, every: int, keep: int, async_save: bool = True, compression: bool = True):
        """`compression`: each array written with zstd (train.checkpoint_compression); a checkpoint of either
        kind restores."""
        self.directory = check_directory(directory)
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=every, max_to_keep=keep, enable_async_checkpointing=async_save, create=True,
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False))
        try:
            self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers={
                "state": ocp.PyTreeCheckpointHandler(use_compression=compression),
                "data": ocp.JsonCheckpointHandler()})
        except Exception as e:  # noqa: BLE001 - any file-system error: one message naming the path
            raise CheckpointError(f"cannot use {self.directory} for checkpoints: {short_reason(e)}") from None
        self._pending: int | None = None  # the step whose asynchronous write is in flight
        self.broken = False
        _quiet_failed_saves()
        _replica_parallel_for_large_arrays_only()

    def step_path(self, step: int) -> str:
        return os.path.join(self.directory, str(step)) if "://" not in self.directory else \
            f"{self.directory.rstrip('/')}/{step}"

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: Any, data_state: dict, *, force: bool = False) -> bool:
        """Starts an asynchronous save when `step` is due (or `force`); returns whether it saved."""
        save_args = jax.tree.map(lambda _: ocp.SaveArgs(chunk_byte_size=CHUNK_BYTES), state)
        args = ocp.args.Composite(state=ocp.args.PyTreeSave(state, save_args=save_args),
                                  data=ocp.args.JsonSave(data_state))
        try:
            if self._pending is not None:
                self.manager.check_for_errors()
            saved = self.manager.save(step, args=args, force=force)
        except Exception as e:  # noqa: BLE001 - also the previous asynchronous save's failure, raised here
            pending = self._pending is not None and self.step_path(self._pending) in _chain_text(e)
            raise self._failed(self._pending if pending else step, e) from None
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
        """The error to raise for a failed save: the step, the reason, the last good checkpoint (kept); the
        failed save's temporary directory is removed, so that nothing half-written stays in the way."""
        self.broken = True
        at = f" at step {step}" if step is not None else ""
        if step is not None:
            self._remove_partial(step)
        try:
            self.manager.reload()
            good = self.manager.latest_step()
        except Exception:  # noqa: BLE001 - the save's failure is what the user must hear
            good = None
        kept = f"; the last good checkpoint, step {good}, is kept" if good is not None and good != step else ""
        return CheckpointError(f"cannot save the checkpoint{at} to {self.directory}: {short_reason(error)}{kept}")

    def _remove_partial(self, step: int) -> None:
        if jax.process_index() != 0:
            return
        try:
            for partial in epath.Path(self.directory).glob(f"{step}.orbax-checkpoint-tmp*"):
                partial.rmtree()
        except Exception:  # noqa: BLE001 - best effort: orbax skips such directories when it lists steps
            pass

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict]:
        """The state at `step`, laid out as `abstract_state` (ShapeDtypeStructs with shardings)."""
        restore_args = ocp.checkpoint_utils.construct_restore_args(abstract_state)  # each array's layout and type
        args = ocp.args.Composite(state=ocp.args.PyTreeRestore(abstract_state, restore_args=restore_args),
                                  data=ocp.args.JsonRestore())
        restored = self.manager.restore(step, args=args)
        return restored["state"], dict(restored["data"])

    def saved_meta(self, step: int) -> dict | None:
        """The JSON saved beside the state at `step` (data position, model identity); None when it cannot
        be read (then restoring decides)."""
        try:
            with failures_reported_once():
                meta = self.manager.restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))["data"]
        except Exception:  # noqa: BLE001 - a damaged checkpoint: restore_latest reports it
            return None
        return dict(meta) if isinstance(meta, dict) else None

    def restore_latest(self, abstract_state: Any, model=None) -> Restored | None:
        """The newest checkpoint that restores; None when there is none. With `model` (the ModelConfig), a
        checkpoint of the per-layer layout is read so and converted to the stacked one (trainer/stacks.py).

        A newer one that fails to restore while an older one restores is damaged (the older one proves
        that the config matches): it is renamed `STEP.unreadable-TIME`, out of the way of the step that
        training saves again. When none restores, nothing moves and `CheckpointError` lists each reason.
        """
        quiet_late_callbacks()
        unreadable: list[tuple[int, str]] = []
        for step in reversed(self.all_steps()):
            restored, reason = self._try_restore(step, abstract_state, model)
            if not _everywhere(reason is None):  # each process reads its own shards: all must succeed
                unreadable.append((step, reason or "another process could not read its part"))
                continue
            moved = self._move_aside([bad for bad, _ in unreadable]) if unreadable else []
            return Restored(step, *restored,
                            tuple((bad, why, to) for (bad, why), to in zip(unreadable, moved, strict=True)))
        if unreadable:
            reasons = "; ".join(f"step {s} ({self.step_path(s)}): {r}" for s, r in unreadable)
            raise CheckpointError(f"no checkpoint in {self.directory} can be restored (were they written with "
                                  f"another config?): {reasons}")
        return None

    @staticmethod
    def _mismatch(saved_state: Any, abstract_state: Any) -> str | None:
        """How the arrays saved (the step's metadata, `saved_state`) differ from `abstract_state` (None: they
        match): a full restore of another model's checkpoint fails read by read."""
        saved = jax.tree.leaves(saved_state)
        wanted = jax.tree.leaves(abstract_state)
        if len(saved) != len(wanted):
            return f"it holds {len(saved)} arrays, this config's state has {len(wanted)}"
        for meta, want in zip(saved, wanted, strict=True):  # dtypes may differ: restoring casts
            if tuple(meta.shape) != tuple(want.shape):
                return f"it holds {meta.name} of shape {list(meta.shape)}, this config needs {list(want.shape)}"
        return None

    def _try_restore(self, step: int, abstract_state: Any, model=None) -> tuple[tuple[Any, dict] | None, str | None]:
        """((state, data state), None) at `step`, or (None, why they cannot be read)."""
        try:
            with failures_reported_once():
                target = abstract_state
                saved = self.manager.item_metadata(step)["state"]  # read once: its layout, then its shapes
                if model is not None and holds_per_layer_layout(saved):
                    target = per_layer_layout(model, abstract_state)
                mismatch = self._mismatch(saved, target)
                if mismatch:
                    return None, mismatch
                state, data_state = self.restore(step, target)
                if target is not abstract_state:
                    state = stacked_layout(model, state, abstract_state)
                if int(state["step"]) != step:
                    return None, f"it holds step {int(state['step'])}"
                return (state, data_state), None
        except Exception as e:  # noqa: BLE001 - tensorstore, JSON and file errors alike
            return None, short_reason(e)

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
                                          f"out of the way: {short_reason(e)}; move or delete it, then run "
                                          "again") from None
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


def _chain_text(error: BaseException) -> str:
    texts = []
    while error is not None:
        texts.append(str(error))
        error = error.__cause__ or error.__context__
    return "\n".join(texts)


def _everywhere(ok: bool) -> bool:
    """Whether `ok` holds on every process (a collective with several processes)."""
    if jax.process_count() == 1:
        return ok
    return bool(np.all(multihost_utils.process_allgather(np.asarray(ok))))
