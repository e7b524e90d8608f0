"""The trainer's parameter inventory and shard counts (trainer.params), kept on disk between commands.

`validate`, `plan`, `run` and `serve` each ask trainer.params for the model's parameters and for how the
mesh splits each of them. Both answers come from the trainer's own code under jax (the model built
abstractly, the sharding rules on an abstract mesh), and starting jax to ask costs a command some 1.7 s
of CPU before it does anything. The answers depend only on the trainer's source, the jax and flax
versions and the question, so they are kept in $XDG_CACHE_HOME/moe-tpu/plan (~/.cache by default), in
one file per trainer source: a command whose questions were all asked before starts no jax at all.

A file that cannot be read or does not hold what this writes is ignored (and replaced); two commands
writing at once each write a whole file (the last one stays), and at worst an answer is computed again.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import os
import threading
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING

from provision.statefiles import user_cache_dir, write_atomic
from trainer.params import ParamInfo

if TYPE_CHECKING:
    from trainer.config import Config

CACHE = ("moe-tpu", "plan")
CACHE_ENV = "MOE_TPU_PLAN_CACHE"  # a directory instead of the default; "off" keeps nothing
FORMAT = 1
# Bounds on what one file keeps (a cache, not a record): the inventories of the last MAX_MODELS model
# configs asked about, MAX_WAYS shard counts, and a file over MAX_BYTES is not read.
MAX_MODELS = 64
MAX_WAYS = 50_000
MAX_BYTES = 32 * 1024 * 1024


def cache_dir(env: dict[str, str] | os._Environ = os.environ) -> Path | None:
    if env.get(CACHE_ENV) == "off":
        return None
    if env.get(CACHE_ENV):
        return Path(env[CACHE_ENV])
    return user_cache_dir(env, *CACHE)


@functools.cache
def source_digest() -> str:
    """What the answers depend on besides the question: every source file of the trainer package and
    the versions of jax and flax."""
    import trainer

    digest = hashlib.sha256()
    root = Path(trainer.__file__).parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    for package in ("jax", "flax"):
        try:
            digest.update(f"{package}={metadata.version(package)}\0".encode())
        except metadata.PackageNotFoundError:
            digest.update(f"{package}=none\0".encode())
    return digest.hexdigest()[:24]


class _Store:
    """This trainer source's answers: read once, written back (merged with what another command wrote
    meanwhile) when this command has added any."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.added = False
        self.models, self.ways = self._read()
        # shard_ways' answers by the question itself: the planner asks the same ones many thousand times a
        # plan, and writing each as its file key costs more than the rest of the estimate.
        self.answered: dict[tuple, int] = {}
        if path is not None:
            atexit.register(self.save)

    def _read(self) -> tuple[dict[str, list], dict[str, int]]:
        if self.path is None:
            return {}, {}
        try:
            if not self.path.is_file() or self.path.stat().st_size > MAX_BYTES:
                return {}, {}
            doc = json.loads(self.path.read_text())
            models, ways = doc["models"], doc["ways"]
            if doc.get("format") != FORMAT or not isinstance(models, dict) or not isinstance(ways, dict):
                return {}, {}
            return ({k: v for k, v in models.items() if isinstance(v, list)},
                    {k: v for k, v in ways.items() if type(v) is int and v > 0})
        except (OSError, ValueError, KeyError, TypeError):
            return {}, {}

    def save(self) -> None:
        with self.lock:
            if self.path is None or not self.added:
                return
            models, ways = self._read()
            models.update(self.models)
            ways.update(self.ways)
            models = dict(list(models.items())[-MAX_MODELS:])
            ways = dict(list(ways.items())[-MAX_WAYS:])
            try:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(self.path, json.dumps({"format": FORMAT, "models": models, "ways": ways}),
                             "plan cache")
                self.added = False
            except Exception:  # noqa: BLE001 - a cache that cannot be written is only slower next time
                pass


@functools.cache
def _store() -> _Store:
    where = cache_dir()
    return _Store(None if where is None else where / f"params-{source_digest()}.json")


def param_inventory(cfg: Config) -> tuple[ParamInfo, ...]:
    """trainer.params.param_inventory(cfg), from the cache where it was asked before."""
    store = _store()
    key = hashlib.sha256(cfg.model_dump_json().encode()).hexdigest()
    rows = store.models.get(key)
    if rows is not None:
        try:
            return tuple(ParamInfo(name=str(name), shape=tuple(int(d) for d in shape), dtype=str(dtype),
                                   axes=tuple(None if a is None else str(a) for a in axes))
                         for name, shape, dtype, axes in rows)
        except (TypeError, ValueError):
            pass  # not what this writes: asked again below
    from trainer import params

    found = params.param_inventory(cfg)
    with store.lock:
        store.models[key] = [[p.name, list(p.shape), p.dtype, list(p.axes)] for p in found]
        store.added = True
    return found


def shard_ways(axes: tuple[str | None, ...], shape: tuple[int, ...], mesh_shape: tuple[tuple[str, int], ...],
               fsdp: bool) -> int:
    """trainer.params.shard_ways(...), from the cache where it was asked before."""
    store = _store()
    asked = (tuple(axes), tuple(shape), tuple(mesh_shape), fsdp)
    known = store.answered.get(asked)  # asked before in this process: no key to write out
    if known is not None:
        return known
    key = json.dumps([axes, shape, mesh_shape, fsdp])
    ways = store.ways.get(key)
    if ways is None:
        from trainer import params

        ways = params.shard_ways(tuple(axes), tuple(shape), tuple(mesh_shape), fsdp)
        with store.lock:
            store.ways[key] = ways
            store.added = True
    store.answered[asked] = ways
    return ways
