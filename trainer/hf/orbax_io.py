"""The trainer's side of a conversion: parameters written as the orbax checkpoint `train` writes, a tensor at
a time, and a run's checkpoint read back a layer at a time (each layer's slice read from its array's
tensorstore), as host numpy arrays."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import queue
import threading
from collections.abc import Iterable

import numpy as np

from trainer import stacks
from trainer.config import Config
from trainer.hf.errors import HFError, WriteError
from trainer.outputs import NoRun, RunDirectory

# Parameters named so are the MoE selection biases: state beside the parameters ("moe_bias"), as train keeps them.
BIAS_SUFFIX = ".expert_bias"


def save_params(directory: str, params: Iterable[tuple[str, np.ndarray]], cfg: Config, source: str,
                names: Iterable[str]) -> None:
    """Step 0 of a checkpoints directory holding `params` (no optimizer state: a fine-tune makes its own), whose
    names (the layers' own, `blocks.{i}.…`, or already stacked) are `names`, given before the first value.

    The checkpoint is orbax's, written as it comes: each value goes straight into its slice of its stacked
    array's tensorstore (trainer/stacks.py) and is freed, so the host holds about two tensors, never the model
    (orbax's own save takes the state whole). The values are read here, in the calling thread, where a
    recorded signal is acted on (trainer/signals.py), while orbax's save runs in a thread of its own and its
    handler for `Streamed` leaves (StreamedHandler) writes each one as it is handed over."""
    import orbax.checkpoint as ocp

    from trainer.checkpoint import quiet_orbax, short_reason
    from trainer.resume import model_identity

    feed = Feed(cfg, names)
    state = {"step": np.zeros((), np.int32), "params": {n: s for n, s in feed.streams.items()
                                                        if not n.endswith(BIAS_SUFFIX)}}
    biases = {n: s for n, s in feed.streams.items() if n.endswith(BIAS_SUFFIX)}  # DeepSeek-V3's selection bias
    if biases:
        state["moe_bias"] = biases
    meta = {"model": model_identity(cfg), "imported_from": source}
    failed: list[BaseException] = []

    def save() -> None:
        try:
            manager.save(0, args=ocp.args.Composite(state=ocp.args.PyTreeSave(state), data=ocp.args.JsonSave(meta)))
            manager.wait_until_finished()
        except BaseException as e:  # noqa: BLE001 - handed to the calling thread, which raises it
            failed.append(e)
            feed.stop()

    with quiet_orbax(), _failures_reported_here():
        ocp.type_handlers.register_type_handler(Streamed, StreamedHandler(feed), override=True)
        manager = ocp.CheckpointManager(os.path.abspath(directory), options=ocp.CheckpointManagerOptions(
            create=True, enable_async_checkpointing=False), item_handlers={
            "state": ocp.PyTreeCheckpointHandler(), "data": ocp.JsonCheckpointHandler()})
        writer = threading.Thread(target=save, name="hf-import-writer", daemon=True)
        writer.start()
        try:
            for name, value in params:
                feed.put(name, value)
            feed.finish()
        except BaseException as e:
            feed.abort()  # the writer ends its save without the values left: nothing raised in orbax's threads
            writer.join()
            manager.close()
            if isinstance(e, Stopped) and failed:  # the writer failed first: that failure is the one to report
                raise WriteError(f"cannot write the checkpoint to {directory}: {short_reason(failed[0])}") from None
            raise
        writer.join()
        manager.close()
    if failed:
        raise WriteError(f"cannot write the checkpoint to {directory}: {short_reason(failed[0])}") from None


def _logged_without_traceback(record: logging.LogRecord) -> bool:
    return record.exc_info is None


@contextlib.contextmanager
def _failures_reported_here():
    """A failed write (a full disk) is logged, traceback and all, by each of orbax's threads that hands it on,
    before manager.save raises it: save_params reports it once (WriteError), so meanwhile orbax's records that
    carry an exception are dropped."""
    log = logging.getLogger("absl")
    log.addFilter(_logged_without_traceback)
    try:
        yield
    finally:
        log.removeFilter(_logged_without_traceback)


class Stopped(Exception):
    """Raised in the reading thread when the writer failed; the failure itself is reported from `failed`."""


@dataclasses.dataclass
class Streamed:
    """A leaf of the state orbax saves whose value is handed over a layer at a time (Feed): the stacked
    parameter `name`, whose `layers` slices (or one whole value when it is no stack) arrive in any order."""

    name: str
    layers: int | None  # None: not stacked, one value


class Feed:
    """The hand-over between the thread reading the tensors and orbax's writer: one value at a time in a queue,
    one in flight (the next one is read while it is written)."""

    def __init__(self, cfg: Config, names: Iterable[str]):
        self.cfg = cfg
        self.streams: dict[str, Streamed] = {}
        for name in names:
            target, index = stacks.locate(cfg.model, name)
            layers = None if index is None else len(stacks.layer_names(cfg.model, target))
            self.streams.setdefault(target, Streamed(target, layers))
        self.left = {name: set(range(s.layers)) if s.layers else {None} for name, s in self.streams.items()}
        self.queue: queue.Queue = queue.Queue()
        self.room = threading.Semaphore(1)
        self.stopped = threading.Event()

    def put(self, name: str, value: np.ndarray) -> None:
        target, index = stacks.locate(self.cfg.model, name)
        if index not in self.left.get(target, ()):
            raise HFError(f"the parameter {name} is not one the checkpoint holds, or comes twice")
        self.left[target].discard(index)
        while not self.room.acquire(timeout=0.1):
            if self.stopped.is_set():  # the writer failed: the calling thread reports why
                raise Stopped()
        self.queue.put((target, index, value))

    def finish(self) -> None:
        missing = sorted(n for n, left in self.left.items() if left)
        if missing:
            layers = sorted(i for i in self.left[missing[0]] if i is not None)
            raise HFError(f"the parameter {missing[0]} lacks " + (f"layers {layers}" if layers else "its value"))

    def abort(self) -> None:
        self.queue.put(None)

    def stop(self) -> None:
        self.stopped.set()

    def get(self):
        """The next (name, index, value), or None once the reading side stopped (a bad tensor, a signal)."""
        return self.queue.get()


def _streamed_handler_class():
    """StreamedHandler, defined once orbax is imported (it subclasses orbax's handler of numpy arrays)."""
    import orbax.checkpoint as ocp
    import tensorstore as ts
    from orbax.checkpoint._src.serialization import ocdbt_utils
    from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils

    class Handler(ocp.type_handlers.NumpyHandler):
        """Writes the Streamed leaves as numpy arrays (restored as any other: the checkpoint is orbax's own),
        each value into its slice as the Feed hands it over. Orbax's write spec is built the way its numpy
        handler builds it (orbax offers no writer of an array in parts)."""

        def __init__(self, feed: Feed):
            super().__init__(deepcopy_host_arrays=False)
            self.feed = feed

        async def serialize(self, values, infos, args=None):
            from orbax.checkpoint._src.futures import future

            args = args or [ocp.SaveArgs()] * len(values)
            return [future.CommitFutureAwaitingContractedSignals(self._write_all(values, infos, args),
                                                                 name="hf_import_stream")]

        async def _write_all(self, values, infos, args) -> None:
            import asyncio

            where = {v.name: (v, info, arg) for v, info, arg in zip(values, infos, args, strict=True)}
            if set(where) != set(self.feed.streams):
                raise ValueError("orbax handed over part of the streamed parameters")  # one call takes them all
            for _, info, _ in where.values():
                await info.await_path_creation()
            stores, left = {}, sum(s.layers or 1 for s in self.feed.streams.values())
            while left:
                item = await asyncio.to_thread(self.feed.get)
                if item is None:
                    # The reading side stopped and reports why. The save ends here, quietly, its values left
                    # unwritten: an error raised here would be logged, traceback and all, by each of orbax's
                    # threads that waits on this one; the half-made checkpoint is removed with its directory.
                    return
                name, index, value = item
                if name not in stores:
                    stream, info, arg = where[name]
                    shape = value.shape if stream.layers is None else (stream.layers, *value.shape)
                    # A chunk a layer: a slice written into a chunk of the whole stack would keep the chunk in
                    # tensorstore's memory until its last layer came (measured: the model again).
                    chunk = value.shape if stream.layers is None else (1, *value.shape)
                    spec = ts_utils.build_array_write_spec(
                        info=info, arg=arg, global_shape=shape, local_shape=chunk, dtype=value.dtype,
                        use_ocdbt=info.is_ocdbt_checkpoint, metadata_key=self._metadata_key,
                        process_index=ocdbt_utils.get_process_index_for_subdir(use_ocdbt=info.is_ocdbt_checkpoint))
                    stores[name] = await ts.open(ts.Spec(spec.json), create=True, open=True,
                                                 context=info.ts_context)
                await (stores[name] if index is None else stores[name][index]).write(
                    value, can_reference_source_data_indefinitely=True)  # never changed after: no copy
                del value
                release_freed_memory()
                self.feed.room.release()
                left -= 1

    return Handler


def release_freed_memory() -> None:
    """Hands the memory freed since back to the system (glibc's malloc_trim; elsewhere nothing). glibc keeps what
    tensorstore's threads and the tensors read free in its per-thread heaps, for reuse that a conversion's next
    tensor, of another size, seldom makes: measured on benchmarks/hf_convert.py's 3.2 GB checkpoint, 0.5 GB was
    still held after the import (0.1 GB once trimmed), and trimming after each value took its peak from 1.0-1.2 GB
    to 0.7 GB."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    import ctypes

    try:
        return ctypes.CDLL(None).malloc_trim  # the C library the interpreter runs on
    except (OSError, AttributeError):  # not glibc: its allocator is its own business
        return None


def StreamedHandler(feed: Feed):  # noqa: N802 - builds the handler class lazily, so importing this module stays light
    return _streamed_handler_class()(feed)


@dataclasses.dataclass
class SavedRun:
    """A run's checkpoint opened for reading: its config, step, and `read(names)` of parameters by the layers'
    own names (`blocks.{i}.…`), whether it holds them stacked (trainer/stacks.py) or a layer at a time (written
    before the layers were stacked). A layer of a stacked array is read as its own slice, straight from the
    array's tensorstore (the zarr array orbax wrote, opened by the key and format its metadata names): orbax's
    restore reads whole arrays, which would hold a stack's every layer until its last one is written."""

    run: str  # the run's output directory (config.json, checkpoints/, hf/)
    cfg: Config
    step: int
    manager: object
    shapes: dict[str, tuple[int, ...]]  # as saved
    _stores: dict = dataclasses.field(default_factory=dict)  # saved name -> its opened tensorstore

    def layer_shapes(self) -> dict[str, tuple[int, ...]]:
        """The saved parameters' shapes by the layers' own names."""
        out = {}
        for name, shape in self.shapes.items():
            out.update({n: shape[1:] for n in stacks.layer_names(self.cfg.model, name)} if stacks.is_stacked(name)
                       else {name: shape})
        return out

    def read(self, wanted: set[str]) -> dict[str, np.ndarray]:
        missing = sorted(wanted - set(self.shapes) - set(self.layer_shapes()))
        if missing:
            raise HFError(f"the checkpoint at step {self.step} in {self.run} has no parameter '{missing[0]}', which "
                          "its config.json needs")
        from trainer.checkpoint import short_reason

        out = {}
        for name in wanted:
            target, index = stacks.locate(self.cfg.model, name) if name not in self.shapes else (name, None)
            store = self._store(target)
            try:
                out[name] = np.asarray((store if index is None else store[index]).read().result())
            except Exception as e:  # noqa: BLE001 - tensorstore's errors: a missing or damaged chunk
                raise HFError(f"cannot read '{target}' at step {self.step} in {self.run}: {short_reason(e)}") from None
        return out

    def _store(self, name: str):
        """The tensorstore of a saved array, opened once (its metadata only: no data is read)."""
        import tensorstore as ts

        from trainer.checkpoint import short_reason

        if name not in self._stores:
            state = os.path.join(str(self.manager.directory), str(self.step), "state")
            key = f"{'moe_bias' if name.endswith(BIAS_SUFFIX) else 'params'}.{name}"  # orbax's key: the tree path
            try:
                with open(os.path.join(state, "_METADATA"), encoding="utf-8") as f:
                    layout = json.load(f)
                kvstore = ({"driver": "ocdbt", "base": f"file://{state}/", "path": key} if layout.get("use_ocdbt")
                           else {"driver": "file", "path": os.path.join(state, key)})
                driver = "zarr3" if layout.get("use_zarr3") else "zarr"
                self._stores[name] = ts.open({"driver": driver, "kvstore": kvstore}, open=True, read=True).result()
            except Exception as e:  # noqa: BLE001 - a damaged or foreign directory, tensorstore's errors alike
                raise HFError(f"cannot read '{name}' at step {self.step} in {self.run}: {short_reason(e)}") from None
        return self._stores[name]


def open_run(run: str, step: int | None) -> SavedRun:
    """A run's output directory (or its checkpoints directory), at `step` or its latest."""
    import orbax.checkpoint as ocp

    from trainer.checkpoint import failures_reported_once, quiet_orbax, short_reason
    from trainer.hf.families import load_trainer_config

    try:
        found = RunDirectory.find(os.path.abspath(run), "--checkpoint")  # orbax takes absolute paths only
    except NoRun as e:
        raise HFError(str(e)) from None
    run, checkpoints = found.path, found.checkpoints
    cfg = load_trainer_config(found.config)
    with quiet_orbax():
        manager = ocp.CheckpointManager(checkpoints, item_handlers={"state": ocp.PyTreeCheckpointHandler()},
                                        options=ocp.CheckpointManagerOptions(read_only=True))
        # Closed once the metadata is read, also on an error: a manager left open had its threads call into
        # an event loop closed at exit (a traceback after the message). The arrays are read by tensorstore.
        try:
            steps = list(manager.all_steps())
            if not steps:
                raise HFError(f"--checkpoint {checkpoints} holds no finished checkpoint")
            if step is not None and step not in steps:
                raise HFError(f"--step {step}: {checkpoints} holds steps {sorted(steps)}")
            step = max(steps) if step is None else step
            # A damaged directory fails one of the metadata's reads, and the others, left running, fail after:
            # asyncio would log each as a traceback after the message (failures_reported_once drops them).
            with failures_reported_once():
                try:
                    state = manager.item_metadata(step)["state"]
                    saved = {**state["params"], **(state.get("moe_bias") or {})}
                except Exception as e:  # noqa: BLE001 - a damaged or foreign directory
                    raise HFError(f"cannot read the checkpoint at step {step} in {checkpoints}: "
                                  f"{short_reason(e)}") from None
        finally:
            manager.close()
    return SavedRun(run, cfg, step, manager, {n: tuple(meta.shape) for n, meta in saved.items()})
