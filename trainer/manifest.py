"""A prepared dataset's manifest: `manifest.json` (trainer/prepare/ writes it) and the shards it names, local or
gs://. `load_manifest` reads it, refusing what is not a manifest of this format, and `check_manifest` refuses
one that the model's vocabulary cannot hold; the records themselves are read by trainer/datasets.py."""

from __future__ import annotations

import json
import os
from typing import Any

from trainer.files import kind_of


class DataError(ValueError):
    """Data that cannot be read or does not fit the model; the message says which and why."""


MANIFEST = "manifest.json"
MANIFEST_FORMAT = "moe-tpu-dataset"
MANIFEST_VERSION = 1  # what trainer.prepare writes and this trainer reads
INT32_MAX = 2**31 - 1


def is_remote(path: str) -> bool:
    return "://" in path


def join(base: str, name: str) -> str:
    return f"{base.rstrip('/')}/{name}" if is_remote(base) else os.path.join(base, name)


# ----------------------------------------------------------------------------- the manifest

MANIFEST_MAX_BYTES = 64 << 20  # a manifest lists shards: megabytes at most, never a file to read without end


def regular_file(path: str, key: str) -> int:
    """The size of the local file `path`; anything else that would block or never end (a FIFO, a device,
    a socket) or is no file is a DataError naming `key`, found without opening it."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise DataError(f"{key} '{path}' does not exist") from None
    except OSError as e:
        raise DataError(f"{key} '{path}' cannot be read: {e.strerror}") from None
    kind = kind_of(st.st_mode)
    if kind:
        raise DataError(f"{key} '{path}' is {kind}, not a file")
    return st.st_size


def load_manifest(path: str, key: str = "data.path") -> dict[str, Any]:
    """The manifest of the dataset directory `path` (or of the manifest file itself), every field checked:
    a manifest is input like any other, and its paths must stay inside the dataset's directory."""
    import fsspec

    url = path if path.endswith(".json") else join(path, MANIFEST)
    if not is_remote(path) and url != path and os.path.exists(path) and not os.path.isdir(path):
        raise DataError(f"{key} '{path}' is not a dataset directory (data.source=records reads the directory "
                        "that `moe-tpu data prepare` wrote)")
    try:
        if not is_remote(url) and regular_file(url, key) > MANIFEST_MAX_BYTES:
            raise DataError(f"{url} is over {MANIFEST_MAX_BYTES >> 20} MiB: no dataset manifest")
        with fsspec.open(url, "rt", encoding="utf-8") as f:
            manifest = json.loads(f.read(MANIFEST_MAX_BYTES + 1))
    except (FileNotFoundError, DataError) as e:
        if isinstance(e, DataError) and "does not exist" not in str(e):
            raise
        raise DataError(f"{key} '{path}' holds no {MANIFEST} (write one with `python -m trainer.prepare`)") \
            from None
    except (OSError, ValueError, RecursionError) as e:
        raise DataError(f"cannot read the dataset manifest {url}: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise DataError(f"{url} is not a moe-tpu dataset manifest (no \"format\": \"{MANIFEST_FORMAT}\")")
    manifest["directory"] = url.rpartition("/")[0] if is_remote(url) else os.path.dirname(os.path.abspath(url))
    _check_fields(manifest, url)
    return manifest


def _field(manifest: dict, key: str, url: str, kind: type, low: int = 0, high: int | None = None):
    value = manifest.get(key)
    if value is None:
        raise DataError(f"the dataset manifest {url} lacks '{key}'")
    if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value < low
                        or (high is not None and value > high)):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise DataError(f"the dataset manifest {url}: '{key}' must be an integer {bound}, got {value!r:.80}")
    if kind is not int and not isinstance(value, kind):
        raise DataError(f"the dataset manifest {url}: '{key}' must be {kind.__name__}, got {value!r:.80}")
    return value


def _check_fields(manifest: dict, url: str) -> None:
    version = _field(manifest, "version", url, int, 1)
    if version != MANIFEST_VERSION:
        raise DataError(f"the dataset manifest {url} is of format version {version}; this trainer reads version "
                        f"{MANIFEST_VERSION}: prepare the dataset with this moe-tpu (`moe-tpu data prepare`), or "
                        "train with the moe-tpu that prepared it")
    vocab = _field(manifest, "vocab_size", url, int, 2, 1 << 32)
    _field(manifest, "eod_id", url, int, 0, vocab - 1)
    dtype = _field(manifest, "token_dtype", url, str)
    if dtype not in ("uint16", "uint32") or (dtype == "uint16" and vocab > 1 << 16):
        raise DataError(f"the dataset manifest {url}: 'token_dtype' must be uint16 (a vocabulary of at most 65536) "
                        f"or uint32, got {dtype!r:.40} for a vocabulary of {vocab}")
    for key in ("documents", "tokens"):  # totals a prepare writes; a hand-made manifest may leave them out
        if key in manifest:
            _field(manifest, key, url, int, 0)
    if "max_token_id" in manifest:
        _field(manifest, "max_token_id", url, int, 0, vocab - 1)
    shards = _field(manifest, "shards", url, list)
    for number, shard in enumerate(shards):
        if not isinstance(shard, dict):
            raise DataError(f"the dataset manifest {url}: shards[{number}] must be an object, got {shard!r:.80}")
        inside(manifest, shard.get("file"), f"shards[{number}].file", url)
        for key in ("documents", "tokens"):
            if key in shard:
                _field(shard, key, f"{url} shards[{number}]", int, 0)
        if not isinstance(shard.get("split", "train"), str):
            raise DataError(f"the dataset manifest {url}: shards[{number}].split must be text")
    tokenizer = manifest.get("tokenizer", {})
    if not isinstance(tokenizer, dict) or not isinstance(tokenizer.get("fingerprint", ""), str):
        raise DataError(f"the dataset manifest {url}: 'tokenizer' must be an object with a text 'fingerprint'")
    if "file" in tokenizer:
        inside(manifest, tokenizer["file"], "tokenizer.file", url)


def inside(manifest: dict, name: Any, key: str, url: str) -> str:
    """The path of the file `name` of the dataset: a relative path that stays in the dataset's directory
    (no '..', not absolute, no link that leads out of it), else a DataError naming the manifest's key."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise DataError(f"the dataset manifest {url}: {key} must be a file name, got {name!r:.80}")
    parts = name.replace("\\", "/").split("/")
    if name.startswith("/") or os.path.isabs(name) or ".." in parts or "://" in name:
        raise DataError(f"the dataset manifest {url}: {key} '{name}' leads out of the dataset's directory; "
                        "its files must be named relative to it")
    path = join(manifest["directory"], name)
    if not is_remote(path):
        root = os.path.realpath(manifest["directory"])
        if os.path.commonpath([root, os.path.realpath(path)]) != root:
            raise DataError(f"the dataset manifest {url}: {key} '{name}' is a link out of the dataset's directory")
    return path


def check_manifest(manifest: dict[str, Any], vocab_size: int, key: str = "data.path") -> None:
    """Refuses a dataset whose tokens the model's vocabulary cannot hold."""
    if manifest["vocab_size"] > vocab_size:
        raise DataError(f"{key}: the dataset's tokenizer has a vocabulary of {manifest['vocab_size']} tokens, "
                        f"more than model.vocab_size={vocab_size}; set --set model.vocab_size="
                        f"{manifest['vocab_size']} (or more), or prepare the data with a smaller vocabulary")


def shard_paths(manifest: dict[str, Any], split: str = "train") -> list[str]:
    shards = [s for s in manifest["shards"] if s.get("split", "train") == split]
    return [join(manifest["directory"], s["file"]) for s in shards]


def dataset_fingerprint(manifest: dict[str, Any], split: str = "train") -> str:
    """What the dataset is, not where: its manifest's content (vocabulary, end-of-document id, dtype, the
    tokenizer's fingerprint, each shard's name, documents and tokens) and, locally, each shard's size in
    bytes. A copy elsewhere has the same one; another corpus under the same path has another."""
    import hashlib

    identity = {key: manifest.get(key) for key in ("vocab_size", "eod_id", "token_dtype", "documents", "tokens")}
    identity["tokenizer"] = manifest.get("tokenizer", {}).get("fingerprint", "")
    identity["shards"] = [[s["file"], s.get("documents"), s.get("tokens"), _size(manifest, s["file"])]
                          for s in manifest["shards"] if s.get("split", "train") == split]
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()
    return f"dataset:sha256:{digest[:16]}"


def _size(manifest: dict[str, Any], name: str) -> int | None:
    path = join(manifest["directory"], name)
    return None if is_remote(path) else os.path.getsize(path)


def resolve_eval_path(pattern: str) -> str:
    """The eval path itself, or the one path a local glob matches; none matching is an error."""
    if is_remote(pattern) or not any(c in pattern for c in "*?["):
        if not is_remote(pattern) and not os.path.exists(pattern):
            raise DataError(f"data.eval_path '{pattern}' matches nothing")
        return pattern
    import glob

    matches = sorted(glob.glob(pattern))
    if len(matches) != 1:
        raise DataError(f"data.eval_path '{pattern}' matches {len(matches)} paths; it must name one dataset")
    return matches[0]
