"""The trainer's and the server's compiled programs kept by what they are made from, so that a restarted run or
server loads them without tracing and lowering them first (trainer/step.py, trainer/serve/runner.py).

jax's persistent compilation cache keys a program by its lowered form, so a warm start still traces and lowers
the train step and the initial state's program before it can look them up: on one v5e chip 3.2 s and about 3 s
of moe-1b's 14.2 s to the first step (docs/performance.md). This keeps each compiled program in that cache's
directory (`moe-tpu-programs/`) under a key of everything the program is made from: the run's config and the
steps it runs (the learning-rate schedule is in the program), the mesh and its devices, this process's index,
the versions of jax, jaxlib, flax, optax and the backend, the JAX_*, XLA_*, LIBTPU* and TPU_* variables and
jax's own settings, and the trainer's source files. A change to any of them is another key, so an entry is
never used for a program it was not compiled as; an entry that fails to load is a miss, and the program is
traced and compiled as before (then kept again).

Written by hand: jax keys compiled programs by their lowered text only; the (de)serialisation is jax's own
(jax.experimental.serialize_executable). Entries are pickles, read only from the user's own cache directory,
as jax's own cache is.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import pickle
import re
import threading
import time
from pathlib import Path
from typing import Any

SUBDIR = "moe-tpu-programs"
ENV_PREFIXES = ("JAX_", "XLA_", "LIBTPU", "TPU_")
ENV_IGNORED = ("JAX_COMPILATION_CACHE_DIR",)  # where the programs are kept is not what they are made from
TRACED_THROUGH = ("jaxlib", "flax", "optax")  # whose code is in the programs, beside jax's and the trainer's own
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"  # jax records it on the thread whose compile its cache served
_heard = threading.local()
LOADED_EVENT = "/moe_tpu/program_cache/loaded"  # a program loaded (its seconds), where XLA would have compiled one


def enabled(cfg) -> bool:
    """train.program_cache (on unless set false), where jax's persistent cache is a local directory."""
    return cfg.train.program_cache is not False and directory() is not None


def directory() -> Path | None:
    import jax

    base = jax.config.jax_compilation_cache_dir
    return None if not base or "://" in base else Path(base) / SUBDIR


@functools.cache
def _sources() -> str:
    """A digest of the trainer's Python files (the code every program is traced from)."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


@functools.cache
def _library_versions() -> tuple[str, ...]:
    """The versions of the libraries the programs are made through besides jax (its compiler, the model's, the
    optimiser's); read from their metadata, so that nothing more is imported."""
    from importlib import metadata

    def version(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:  # installed under another name: its absence is part of the key
            return f"{name}: no metadata"

    return tuple(version(name) for name in TRACED_THROUGH)


def _jax_settings() -> str:
    """The settings jax keys its own traces by, without the objects' addresses (one process's alone)."""
    try:
        from jax._src.config import trace_context

        text = repr(trace_context())
    except Exception:  # noqa: BLE001 - a jax without it: its public settings instead
        import jax

        text = repr(sorted((k, repr(v)) for k, v in jax.config.values.items()))
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)


def key(kind: str, cfg, mesh, **extra: Any) -> str:
    """The key of program `kind` of a run of `cfg` on `mesh` (`extra`: whatever else it is made from)."""
    import jax

    client = mesh.devices.flat[0].client
    parts = {
        "kind": kind, "config": cfg.model_dump(mode="json"), "mesh": dict(mesh.shape),
        "devices": [(d.id, d.process_index, d.device_kind) for d in mesh.devices.flat],
        "process": jax.process_index(), "backend": [client.platform, client.platform_version],
        "versions": [jax.__version__, *_library_versions()],
        "env": sorted((k, v) for k, v in os.environ.items() if k.startswith(ENV_PREFIXES) and k not in ENV_IGNORED),
        "jax": _jax_settings(), "sources": _sources(), **extra}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=repr).encode()).hexdigest()


def kept(program_key: str | None) -> bool:
    """Whether a program is kept under `program_key` (None: none is looked for)."""
    folder = directory()
    return program_key is not None and folder is not None and (folder / program_key).is_file()


def load(program_key: str, mesh):
    """The program kept under `program_key`, loaded onto `mesh`'s devices; None where there is none or it does
    not load (then it is removed, and compiled again by the caller)."""
    from jax.experimental import serialize_executable

    folder = directory()
    path = None if folder is None else folder / program_key
    if path is None or not path.is_file():
        return None
    started = time.perf_counter()
    try:
        serialized, in_tree, out_tree = pickle.loads(path.read_bytes())
        loaded = serialize_executable.deserialize_and_load(serialized, in_tree, out_tree,
                                                           execution_devices=list(mesh.devices.flat))
    except Exception:  # noqa: BLE001 - a damaged or foreign entry is a miss
        path.unlink(missing_ok=True)
        return None
    import jax.monitoring

    jax.monitoring.record_event_duration_secs(LOADED_EVENT, time.perf_counter() - started)
    return loaded


@functools.cache
def _count_cache_hits() -> None:
    import jax.monitoring

    def heard(event: str, **_) -> None:
        if event == CACHE_HIT_EVENT:
            _heard.hits = getattr(_heard, "hits", 0) + 1

    jax.monitoring.register_event_listener(heard)


def compile_to_keep(lowered, **options) -> tuple[Any, bool]:
    """`lowered.compile(**options)`, and whether the program it gives may be kept: not where jax's persistent
    cache served it. An executable loaded from that cache serializes without its code on a CPU; kept, it failed
    when called ("NOT_FOUND: Function broadcast_reduce_fusion not found"). A program compiled here is kept the
    first time; one jax's cache serves is traced again on the next start, as before this cache."""
    _count_cache_hits()
    before = getattr(_heard, "hits", 0)
    compiled = lowered.compile(**options)
    return compiled, getattr(_heard, "hits", 0) == before


def compile_and_keep(program_key: str | None, lowered, wait: bool = True, **options):
    """`lowered` compiled with `options`, and kept under `program_key` where it may be (compile_to_keep; None:
    not kept), written here or, unless `wait`, on a thread of its own that the process waits for at exit."""
    compiled, keepable = compile_to_keep(lowered, **options)
    if keepable and program_key is not None:
        if wait:
            store(program_key, compiled)
        else:
            threading.Thread(target=store, args=(program_key, compiled), name=f"keep-{program_key[:12]}").start()
    return compiled


def store(program_key: str, compiled) -> bool:
    """Keep `compiled` under `program_key` (written whole or not at all); False where it cannot be kept."""
    from jax.experimental import serialize_executable

    folder = directory()
    if folder is None:
        return False
    try:
        blob = pickle.dumps(serialize_executable.serialize(compiled))
        folder.mkdir(parents=True, exist_ok=True)
        partial = folder / f".{program_key}.{os.getpid()}.partial"
        partial.write_bytes(blob)
        os.replace(partial, folder / program_key)
        return True
    except Exception:  # noqa: BLE001 - a program that cannot be serialized (or a full disk) is compiled next time
        return False
