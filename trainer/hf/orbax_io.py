"""The trainer's side of a conversion: parameters written as the orbax checkpoint `train` writes, a tensor at
a time, and a run's checkpoint read back a layer at a time (each layer's slice read from its array's
tensorstore), as host numpy arrays."""

from __future__ import annotations

import dataclasses
import functools
import json
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

    from trainer.checkpoint import _reason, quiet_orbax
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

    with quiet_orbax():
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
        except BaseException:
            feed.abort()
            writer.join()
            manager.close()
            raise
        writer.join()
        manager.close()
    if failed and not isinstance(failed[0], Stopped):
        raise WriteError(f"cannot write the checkpoint to {directory}: {_reason(failed[0])}") from None


class Stopped(Exception):
    """The writer's side of a conversion that stopped: a bad tensor, a signal, or the writer's own failure."""


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
        item = self.queue.get()
        if item is None:
            raise Stopped()
        return item


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
                name, index, value = await asyncio.to_thread(self.feed.get)
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
        from trainer.checkpoint import _reason

        out = {}
        for name in wanted:
            target, index = stacks.locate(self.cfg.model, name) if name not in self.shapes else (name, None)
            store = self._store(target)
            try:
                out[name] = np.asarray((store if index is None else store[index]).read().result())
            except Exception as e:  # noqa: BLE001 - tensorstore's errors: a missing or damaged chunk
                raise HFError(f"cannot read '{target}' at step {self.step} in {self.run}: {_reason(e)}") from None
        return out

    def _store(self, name: str):
        """The tensorstore of a saved array, opened once (its metadata only: no data is read)."""
        import tensorstore as ts

        from trainer.checkpoint import _reason

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
                raise HFError(f"cannot read '{name}' at step {self.step} in {self.run}: {_reason(e)}") from None
        return self._stores[name]


def open_run(run: str, step: int | None) -> SavedRun:
    """A run's output directory (or its checkpoints directory), at `step` or its latest."""
    import orbax.checkpoint as ocp

    from trainer.checkpoint import _reason, quiet_orbax
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
            try:
                state = manager.item_metadata(step)["state"]
                saved = {**state["params"], **(state.get("moe_bias") or {})}
            except Exception as e:  # noqa: BLE001 - a damaged or foreign directory
                raise HFError(f"cannot read the checkpoint at step {step} in {checkpoints}: {_reason(e)}") from None
        finally:
            manager.close()
    return SavedRun(run, cfg, step, manager, {n: tuple(meta.shape) for n, meta in saved.items()})


def imported_tokenizer(run: RunDirectory) -> str | None:
    """The tokenizer.json an import keeps in its side directory (HUB_DIR), or None: what `sample` and `serve`
    read an imported model's text with when no --tokenizer is given."""
    path = os.path.join(run.hub, "tokenizer.json") if run.hub else None
    return path if path and os.path.isfile(path) else None


def imported_eos(run: RunDirectory) -> int | None:
    """The end-of-sequence token id an imported model stops at (its generation_config.json's, else its
    config.json's `eos_token_id`; the first of a list), or None: not an import, or none named."""
    for name in ("generation_config.json", "config.json") if run.hub else ():
        try:
            with open(os.path.join(run.hub, name), encoding="utf-8") as f:
                value = json.load(f).get("eos_token_id")
        except (OSError, ValueError, AttributeError):
            continue
        value = value[0] if isinstance(value, list) and value else value
        if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
            return value
    return None
