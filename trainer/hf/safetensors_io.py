"""A Hugging Face checkpoint's files: config.json, safetensors shards (with their index) read a tensor at a
time, and shards written back with the Hub's names and index.

Only the headers are read up front (names, shapes, dtypes: safetensors' safe_open checks them); a tensor's
bytes are read when it is asked for, into an array of its own with plain reads of its byte range, so a
conversion holds about one layer at a time, never the model. Every problem is an HFError naming the file and
the tensor.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import numpy as np

from trainer.hf.errors import HFError

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
MAX_JSON_BYTES = 64 << 20  # config.json and the index are kilobytes to a few megabytes


def read_json(path: str) -> Any:
    if not os.path.exists(path):
        raise HFError(f"{path} does not exist")
    if not os.path.isfile(path):
        raise HFError(f"{path} is not a regular file")
    if os.path.getsize(path) > MAX_JSON_BYTES:
        raise HFError(f"{path} is over {MAX_JSON_BYTES >> 20} MiB: not a Hugging Face JSON file")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise HFError(f"{path} is not valid JSON: {e}") from None
    except OSError as e:
        raise HFError(f"cannot read {path}: {e.strerror}") from None


def header(path: str) -> tuple[int, dict]:
    """(the offset of a safetensors file's data, its JSON header): an 8-byte little-endian length, then the
    header, whose `data_offsets` count from the end of it."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return 8 + length, json.loads(f.read(length))


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a safetensors dtype name (bfloat16 and float8 through ml_dtypes, as jax has them)."""
    import ml_dtypes

    extra = {"BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2}
    plain = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
             "U8": "u1", "BOOL": "?"}
    return np.dtype(extra[name] if name in extra else plain[name])


def is_hub_directory(path: str) -> bool:
    """Whether `path` is a local directory holding config.json and safetensors weights."""
    return (os.path.isdir(path) and os.path.isfile(os.path.join(path, CONFIG))
            and any(os.path.isfile(os.path.join(path, name)) for name in (INDEX, SINGLE)))


class HubReader:
    """The tensors of a local Hugging Face directory: `shape`, `dtype` from the headers, `tensor` reads one."""

    def __init__(self, directory: str):
        if not os.path.isdir(directory):
            raise HFError(f"{directory} is not a directory (a Hugging Face checkpoint is one, with config.json, "
                          "*.safetensors and the tokenizer)")
        self.directory = directory
        self.where: dict[str, str] = {}  # tensor name -> shard file name
        index = os.path.join(directory, INDEX)
        if os.path.exists(index):
            weight_map = read_json(index).get("weight_map") if isinstance(read_json(index), dict) else None
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise HFError(f"{index}: 'weight_map' must map tensor names to shard files")
            self.where = dict(weight_map)
        elif os.path.exists(os.path.join(directory, SINGLE)):
            self.where = {name: SINGLE for name in self._open(SINGLE).keys()}
        else:
            raise HFError(f"{directory} holds neither {INDEX} nor {SINGLE}: no safetensors weights")
        self._files: dict[str, Any] = {}
        self._headers: dict[str, tuple[int, dict]] = {}  # shard -> header(), read when a tensor of it is
        self._last: tuple[str, np.ndarray] | None = None  # gate_up_proj is asked for twice in a row (its halves)

    def _open(self, shard: str):
        from safetensors import SafetensorError, safe_open

        path = os.path.join(self.directory, shard)
        if os.path.basename(shard) != shard or not os.path.isfile(path):
            raise HFError(f"{os.path.join(self.directory, INDEX)} names the shard '{shard}', which is missing "
                          f"from {self.directory}")
        try:
            return safe_open(path, framework="flax")
        except (SafetensorError, OSError) as e:
            raise HFError(f"{path} is not a readable safetensors file: {e}") from None

    def _file(self, name: str):
        if name not in self.where:
            raise HFError(f"the tensor '{name}' is missing from {self.directory} (no shard holds it)")
        shard = self.where[name]
        if shard not in self._files:
            # One shard open at a time (safe_open maps the file; its headers are all that is read through it).
            self._files.clear()
            self._headers.clear()
            self._files[shard] = self._open(shard)
            missing = sorted(n for n, s in self.where.items() if s == shard and n not in set(self._files[shard].keys()))
            if missing:
                raise HFError(f"{os.path.join(self.directory, INDEX)} places '{missing[0]}' in {shard}, which does "
                              "not hold it")
        return self._files[shard]

    def names(self) -> set[str]:
        return set(self.where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._file(name).get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The tensor's dtype as safetensors names it (F32, BF16, ...)."""
        return self._file(name).get_slice(name).get_dtype()

    def tensor(self, name: str) -> np.ndarray:
        """The tensor `name`, read from its byte range into an array of its own.

        Not through safe_open's get_tensor: that reads from the shard's memory map, whose pages stay resident
        (and counted in the process's memory) until the shard is closed, and copies each tensor twice more on
        its way to numpy. A plain read leaves the bytes in the page cache only (which the kernel reclaims)."""
        if self._last is not None and self._last[0] == name:
            return self._last[1]
        self._last = None
        part = self._file(name).get_slice(name)  # the shard's header checked by safe_open: offsets in the file
        shape, dtype = tuple(part.get_shape()), part.get_dtype()
        shard = self.where[name]
        where = os.path.join(self.directory, shard)
        try:
            if shard not in self._headers:
                self._headers[shard] = header(where)
            start, entries = self._headers[shard]
            begin, end = entries[name]["data_offsets"]
            value = np.empty(shape, numpy_dtype(dtype))
            if value.nbytes != end - begin:
                raise HFError(f"{where}: '{name}' has {end - begin} bytes, its shape {list(shape)} and {dtype} make "
                              f"{value.nbytes}")
            with open(where, "rb") as f:
                f.seek(start + begin)
                got = f.readinto(memoryview(value.reshape(-1).view(np.uint8)))
        except (OSError, KeyError, ValueError) as e:
            raise HFError(f"{where}: cannot read '{name}': {e}") from None
        if got != value.nbytes:
            raise HFError(f"{where}: cannot read '{name}': the file ends after {got} of its {value.nbytes} bytes")
        self._last = (name, value)
        return value

    def where_is(self, name: str) -> str:
        return os.path.join(self.directory, self.where.get(name, INDEX))


DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


class ShardWriter:
    """Writes tensors into shards of at most `max_bytes` (a tensor larger than that gets one of its own)
    as they come, then names them model-0000N-of-0000M.safetensors and writes the index."""

    def __init__(self, directory: str, max_bytes: int):
        self.directory, self.max_bytes = directory, max_bytes
        self.pending: dict[str, np.ndarray] = {}
        self.pending_bytes = 0
        self.shards: list[list[str]] = []
        self.total = 0

    def add(self, name: str, value: np.ndarray) -> None:
        if self.pending and self.pending_bytes + value.nbytes > self.max_bytes:
            self._flush()
        self.pending[name] = np.ascontiguousarray(value)
        self.pending_bytes += value.nbytes
        self.total += value.nbytes

    def _flush(self) -> None:
        from safetensors.numpy import save_file

        save_file(self.pending, os.path.join(self.directory, f"shard-{len(self.shards)}.tmp"),
                  metadata={"format": "pt"})
        self.shards.append(list(self.pending))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> list[str]:
        """Renames the shards, writes the index; returns the shard file names."""
        if self.pending:
            self._flush()
        count, weight_map, names = len(self.shards), {}, []
        for i, tensors in enumerate(self.shards):
            name = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
            os.replace(os.path.join(self.directory, f"shard-{i}.tmp"), os.path.join(self.directory, name))
            weight_map.update({t: name for t in tensors})
            names.append(name)
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(self.directory, INDEX), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
        return names
