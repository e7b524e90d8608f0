"""Datasets at scale through Grain: prepared ArrayRecord shards of documents, and flat token arrays.

Both are random-access sources of records that no host reads whole: ArrayRecord's own reader fetches
one document per read, and a flat `.npy`/`.bin` array (local: memory-mapped; gs:// or any fsspec URL:
ranged reads) is cut into rows of seq_len + 1 tokens that overlap by one, so every token is a target.
The pipeline is Grain's: a global shuffle by seed (reshuffled every epoch), then host h of P takes the
records at positions h, h + P, ... (disjoint, together every record), documents are decoded with an
end-of-document token appended and packed into rows (concat-then-split), and rows are batched per host.
The iterator's state is Grain's (a record index and a split offset, tens of bytes per host); it goes
into every checkpoint, one entry per host, and a restored iterator yields exactly the next batch.

A prepared dataset is a directory (local or gs://) holding `manifest.json` (trainer/prepare.py writes it)
and the shards it names; `load_manifest` reads it and `check_manifest` refuses one that the model's
vocabulary cannot hold.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from trainer.config import Config, DataConfig


class DataError(ValueError):
    """Data that cannot be read or does not fit the model; the message says which and why."""


MANIFEST = "manifest.json"
MANIFEST_FORMAT = "moe-tpu-dataset"
STATE_LIMIT = 1024  # bytes of one host's iterator state (JSON), gathered from every host at a checkpoint


def is_remote(path: str) -> bool:
    return "://" in path


def join(base: str, name: str) -> str:
    return f"{base.rstrip('/')}/{name}" if is_remote(base) else os.path.join(base, name)


# ----------------------------------------------------------------------------- the manifest


def load_manifest(path: str) -> dict[str, Any]:
    """The manifest of the dataset directory `path` (or of the manifest file itself)."""
    import fsspec

    url = path if path.endswith(".json") else join(path, MANIFEST)
    try:
        with fsspec.open(url, "rt") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise DataError(f"data.path '{path}' holds no {MANIFEST} (write one with `python -m trainer.prepare`)") \
            from None
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read the dataset manifest {url}: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise DataError(f"{url} is not a moe-tpu dataset manifest (no \"format\": \"{MANIFEST_FORMAT}\")")
    for key in ("vocab_size", "eod_id", "token_dtype", "shards"):
        if key not in manifest:
            raise DataError(f"the dataset manifest {url} lacks '{key}'")
    manifest["directory"] = url.rpartition("/")[0] if is_remote(url) else os.path.dirname(os.path.abspath(url))
    return manifest


def check_manifest(manifest: dict[str, Any], vocab_size: int, key: str = "data.path") -> None:
    """Refuses a dataset whose tokens the model's vocabulary cannot hold."""
    if manifest["vocab_size"] > vocab_size:
        raise DataError(f"{key}: the dataset's tokenizer has a vocabulary of {manifest['vocab_size']} tokens, "
                        f"more than model.vocab_size={vocab_size}; set --set model.vocab_size="
                        f"{manifest['vocab_size']} (or more), or prepare the data with a smaller vocabulary")


def shard_paths(manifest: dict[str, Any], split: str = "train") -> list[str]:
    shards = [s for s in manifest["shards"] if s.get("split", "train") == split]
    return [join(manifest["directory"], s["file"]) for s in shards]


# ----------------------------------------------------------------------------- sources


class TokenRows:
    """Rows of seq_len + 1 tokens (overlapping by one) of a flat token array, read by range on demand.

    Grain's random-access source protocol (`__len__`, `__getitem__`). Locally the array is memory-mapped;
    a remote object is never fetched whole: each row is one ranged read through fsspec (gcsfs for gs://).
    """

    def __init__(self, path: str, dtype: str, seq_len: int):
        self.path, self.seq_len = path, seq_len
        self.dtype, self.offset, n = self._layout(path, np.dtype(dtype))
        if n < seq_len + 1:
            raise DataError(f"data.path '{path}' holds {n} tokens, fewer than one row of data.seq_len + 1 = "
                            f"{seq_len + 1}")
        self.num_tokens = n
        self._rows = (n - 1) // seq_len
        self._remote = None  # (fsspec file system, path in it), made at the first remote read
        self._local = None if is_remote(path) else np.memmap(path, dtype=self.dtype, mode="r",
                                                              offset=self.offset, shape=(n,))

    @staticmethod
    def _layout(path: str, dtype: np.dtype) -> tuple[np.dtype, int, int]:
        """(dtype, byte offset of the first token, token count), from the .npy header or the file size."""
        import fsspec

        try:
            fs, target = fsspec.core.url_to_fs(path)
            size = fs.size(target)
            if path.endswith(".npy"):
                with fs.open(target, "rb") as f:
                    version = np.lib.format.read_magic(f)
                    read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                        np.lib.format.read_array_header_2_0
                    shape, _, dtype = read_header(f)
                    offset = f.tell()
                return np.dtype(dtype), offset, int(math.prod(shape))
        except FileNotFoundError:
            raise DataError(f"data.path '{path}' does not exist") from None
        except (OSError, ValueError) as e:
            raise DataError(f"cannot read tokens from data.path '{path}': {e}") from None
        return dtype, 0, size // dtype.itemsize

    def __len__(self) -> int:
        return self._rows

    def __getitem__(self, row: int) -> np.ndarray:
        start = int(row) * self.seq_len
        if self._local is not None:
            return np.asarray(self._local[start:start + self.seq_len + 1], np.int32)
        if self._remote is None:
            import fsspec

            self._remote = fsspec.core.url_to_fs(self.path)
        fs, target = self._remote
        size = self.dtype.itemsize
        raw = fs.cat_file(target, start=self.offset + start * size,
                          end=self.offset + (start + self.seq_len + 1) * size)
        return np.frombuffer(raw, self.dtype).astype(np.int32)

    def __getstate__(self):  # memory maps and file-system clients are reopened, not pickled
        return {**self.__dict__, "_local": None, "_remote": None}

    def __setstate__(self, state):
        self.__dict__.update(state)
        if not is_remote(self.path):
            self._local = np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.offset,
                                    shape=(self.num_tokens,))


def document_source(paths: Sequence[str]):
    """Grain's ArrayRecord source over the shards `paths`; a shard with no records is an error."""
    from array_record.python import array_record_data_source, array_record_module

    for path in paths:
        if not is_remote(path) and not os.path.exists(path):
            raise DataError(f"the dataset shard {path} does not exist")
        if not is_remote(path):
            reader = array_record_module.ArrayRecordReader(path)
            count = reader.num_records()
            reader.close()
            if count == 0:
                raise DataError(f"the dataset shard {path} holds no documents")
    return array_record_data_source.ArrayRecordDataSource(list(paths))


# ----------------------------------------------------------------------------- the pipeline


def _seed(seed: int) -> int:
    return seed % (2**32)


def host_records(dataset, *, seed: int | None, process_index: int, process_count: int):
    """The records host `process_index` reads, endlessly: globally shuffled each epoch (seed None: in
    order), then every process_count-th from this host's offset."""
    if len(dataset) < process_count:
        raise DataError(f"the data has {len(dataset)} records, fewer than the {process_count} hosts that "
                        "read it: some host would get no rows")
    if seed is not None:
        dataset = dataset.shuffle(seed=_seed(seed))
    return dataset.repeat(None)[process_index::process_count]


def _decoder(dtype: np.dtype, eod_id: int):
    def decode(record: bytes) -> dict[str, np.ndarray]:
        tokens = np.frombuffer(record, dtype).astype(np.int32)
        return {"tokens": np.concatenate([tokens, np.asarray([eod_id], np.int32)])}

    return decode


def read_options(remote: bool):
    """Reader threads that prefetch records: many for object stores (each read waits on the network), few
    for local files (Grain's default of 16 threads and 500 records costs more than it saves on a small host)."""
    import grain

    return grain.ReadOptions(num_threads=16, prefetch_buffer_size=256) if remote else \
        grain.ReadOptions(num_threads=2, prefetch_buffer_size=64)


def row_pipeline(records, *, documents: dict[str, Any] | None, seq_len: int, per_host: int, remote: bool = False):
    """Batches of int32 [per_host, seq_len + 1] rows: records are rows already, or documents to pack."""
    import grain

    options = read_options(remote)
    if documents is None:
        return records.to_iter_dataset(options).batch(per_host, drop_remainder=True)
    docs = records.map(_decoder(np.dtype(documents["token_dtype"]), documents["eod_id"])).to_iter_dataset(options)
    packed = grain.experimental.ConcatThenSplitIterDataset(docs, length_struct={"tokens": seq_len + 1})
    return packed.map(lambda row: row["tokens"]).batch(per_host, drop_remainder=True)


class GrainIterator:
    """Yields this host's rows of consecutive global batches from a Grain pipeline; resumable exactly."""

    def __init__(self, dataset, fingerprint: str, vocab_size: int, *, process_index: int = 0,
                 process_count: int = 1, name: str = "data.path"):
        self.fingerprint, self.vocab_size, self.name = fingerprint, vocab_size, name
        self.process_index, self.process_count = process_index, process_count
        self.entropy_floor = None
        self._iterator = iter(dataset)

    def __iter__(self):
        return self

    def __next__(self) -> np.ndarray:
        rows_BxT = np.asarray(next(self._iterator), np.int32)
        if rows_BxT.size and (rows_BxT.max() >= self.vocab_size or rows_BxT.min() < 0):
            raise DataError(f"{self.name}: token id {int(rows_BxT.max())} is outside the model's vocabulary "
                            f"(model.vocab_size={self.vocab_size})")
        return rows_BxT

    def close(self) -> None:
        """Stops the reader threads (they prefetch until then)."""
        self._iterator.close()

    def host_state(self) -> dict:
        return self._iterator.get_state()

    def state(self) -> dict:
        """Every host's position (gathered to all with several processes), for the checkpoint."""
        text = json.dumps(self.host_state())
        if len(text.encode()) > STATE_LIMIT:
            raise DataError(f"the data iterator's state is {len(text.encode())} bytes, over {STATE_LIMIT}")
        hosts = [text] if self.process_count == 1 else _gather_texts(text)
        return {"source": self.fingerprint, "process_count": self.process_count,
                "hosts": [json.loads(t) for t in hosts]}

    def restore(self, state: dict) -> None:
        hosts = state.get("hosts")
        if not isinstance(hosts, list) or len(hosts) != self.process_count:
            raise DataError(f"the checkpoint's data position is for {state.get('process_count')} hosts, this run "
                            f"has {self.process_count}: the data order cannot be continued exactly")
        self._iterator.set_state(hosts[self.process_index])


def _gather_texts(text: str) -> list[str]:
    import jax
    from jax.experimental import multihost_utils

    buf = np.zeros(STATE_LIMIT, np.uint8)
    raw = text.encode()
    buf[:len(raw)] = np.frombuffer(raw, np.uint8)
    gathered = np.asarray(multihost_utils.process_allgather(buf))
    assert gathered.shape[0] == jax.process_count()
    return [bytes(row).rstrip(b"\0").decode() for row in gathered]


# ----------------------------------------------------------------------------- from the config


def _records(d: DataConfig, vocab_size: int, path: str, key: str):
    """(grain MapDataset of records, documents settings or None, fingerprint) for `path`."""
    import grain

    if d.source == "tokens":
        rows = TokenRows(path, d.token_dtype, d.seq_len)
        return grain.MapDataset.source(rows), None, f"tokens:{path}:{rows.num_tokens}:l{d.seq_len}"
    manifest = load_manifest(path)
    check_manifest(manifest, vocab_size, key)
    paths = shard_paths(manifest)
    if not paths:
        raise DataError(f"{key}: the dataset {path} lists no shards")
    source = document_source(paths)
    fingerprint = f"records:{path}:{len(source)}:{manifest.get('tokenizer', {}).get('fingerprint', '')}"
    return grain.MapDataset.source(source), manifest, fingerprint


def _held_out(records, share: float):
    """(train, eval) split of the records, in their stored order: the last `share` of them are held out."""
    n = len(records)
    held = max(1, round(n * share))
    if held >= n:
        raise DataError(f"data.eval_share={share} leaves no training records (of {n})")
    return records[: n - held], records[n - held:]


def open_datasets(cfg: Config, seed: int, *, process_index: int = 0, process_count: int = 1,
                  with_eval: bool = False) -> tuple[GrainIterator, Any]:
    """The training iterator and, when asked, a factory of fresh evaluation iterators (or None)."""
    d = cfg.data
    per_host = _per_host(d.global_batch_size, process_count)
    records, documents, fingerprint = _records(d, cfg.model.vocab_size, d.path, "data.path")
    eval_records = eval_documents = None
    if with_eval and d.eval_path:
        eval_records, eval_documents, _ = _records(d, cfg.model.vocab_size, resolve_eval_path(d.eval_path),
                                                   "data.eval_path")
    elif with_eval and d.eval_share > 0:
        records, eval_records = _held_out(records, d.eval_share)
        eval_documents = documents
        fingerprint += f":heldout{d.eval_share}"

    def pipeline(recs, docs, shuffle_seed):
        hosts = host_records(recs, seed=shuffle_seed, process_index=process_index, process_count=process_count)
        return row_pipeline(hosts, documents=docs, seq_len=d.seq_len, per_host=per_host, remote=is_remote(d.path))

    train = GrainIterator(pipeline(records, documents, seed), fingerprint, cfg.model.vocab_size,
                          process_index=process_index, process_count=process_count)
    if eval_records is None:
        return train, None
    key = "data.eval_path" if d.eval_path else "data.path"
    return train, lambda: GrainIterator(pipeline(eval_records, eval_documents, None), fingerprint,
                                        cfg.model.vocab_size, process_index=process_index,
                                        process_count=process_count, name=key)


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


def _per_host(global_batch: int, process_count: int) -> int:
    if global_batch % process_count:
        raise DataError(f"data.global_batch_size ({global_batch}) must be divisible by the number of hosts "
                        f"({process_count})")
    return global_batch // process_count
