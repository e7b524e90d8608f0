"""Datasets at scale through Grain: prepared ArrayRecord shards of documents, and flat token arrays.

Both are random-access sources of records that no host reads whole: ArrayRecord's own reader fetches
one document per read, and a flat `.npy`/`.bin` array (local: memory-mapped; gs:// or any fsspec URL:
ranged reads) is cut into rows of seq_len + 1 tokens that overlap by one, so every token is a target.
The pipeline is Grain's: a global shuffle by seed (reshuffled every epoch), then host h of P takes the
records at positions h, h + P, ... (disjoint, together every record), documents are decoded with an
end-of-document token appended and packed into rows (concat-then-split), and rows are batched per host.
The iterator's state is Grain's (a record index and a split offset, tens of bytes per host); it goes
into every checkpoint, one entry per host, and a restored iterator yields exactly the next batch.

A prepared dataset is a directory (local or gs://) holding `manifest.json` and the shards it names
(trainer/manifest.py reads and checks it).
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from trainer.config import Config, DataConfig
from trainer.manifest import (
    INT32_MAX,
    MANIFEST,
    DataError,
    check_manifest,
    dataset_fingerprint,
    is_remote,
    join,
    load_manifest,
    regular_file,
    resolve_eval_path,
    shard_paths,
)

STATE_LIMIT = 1024  # bytes of one host's iterator state (JSON), gathered from every host at a checkpoint


def tokens_fingerprint(path: str, rows: TokenRows) -> str:
    """What a token array is, not where: dtype and length, and locally a hash of its first and last 64 KiB,
    remotely the object store's checksum of it (no extra read)."""
    import hashlib

    import fsspec

    digest = hashlib.sha256(f"{rows.dtype.str}:{rows.num_tokens}".encode())
    fs, target = fsspec.core.url_to_fs(path)
    if is_remote(path):
        info = fs.info(target)
        digest.update(str(info.get("crc32c") or info.get("md5Hash") or info.get("ETag") or "").encode())
        return f"tokens:sha256:{digest.hexdigest()[:16]}"
    span = 1 << 16
    end = rows.offset + rows.num_tokens * rows.dtype.itemsize
    with open(path, "rb") as f:
        for start in sorted({rows.offset, max(rows.offset, end - span)}):
            f.seek(start)
            digest.update(f.read(min(span, end - start)))
    return f"tokens:sha256:{digest.hexdigest()[:16]}"


# ----------------------------------------------------------------------------- sources


class TokenRows:
    """Rows of seq_len + 1 tokens (overlapping by one) of a flat token array, read by range on demand.

    Grain's random-access source protocol (`__len__`, `__getitem__`). Locally the array is memory-mapped;
    a remote object is never fetched whole: each row is one ranged read through fsspec (gcsfs for gs://).
    """

    def __init__(self, path: str, dtype: str, seq_len: int, key: str = "data.path"):
        self.path, self.seq_len, self.key = path, seq_len, key
        self.dtype, self.offset, n = self._layout(path, np.dtype(dtype), key)
        if n < seq_len + 1:
            raise DataError(f"{key} '{path}' holds {n} tokens, fewer than one row of data.seq_len + 1 = "
                            f"{seq_len + 1}")
        self.num_tokens = n
        self._rows = (n - 1) // seq_len
        self._remote = None  # (fsspec file system, path in it), made at the first remote read
        self._local = None if is_remote(path) else np.memmap(path, dtype=self.dtype, mode="r",
                                                              offset=self.offset, shape=(n,))

    @staticmethod
    def _layout(path: str, dtype: np.dtype, key: str) -> tuple[np.dtype, int, int]:
        """(dtype, byte offset of the first token, token count), from the .npy header or the file size."""
        import fsspec

        if not is_remote(path):
            regular_file(path, key)
        try:
            fs, target = fsspec.core.url_to_fs(path)
            size = fs.size(target)
            if not path.endswith(".npy"):
                return dtype, 0, size // dtype.itemsize
            with fs.open(target, "rb") as f:
                version = np.lib.format.read_magic(f)
                read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                    np.lib.format.read_array_header_2_0
                shape, _, dtype = read_header(f)
                offset = f.tell()
        except FileNotFoundError:
            raise DataError(f"{key} '{path}' does not exist") from None
        except (OSError, ValueError) as e:
            raise DataError(f"cannot read tokens from {key} '{path}': {e}") from None
        return _checked_npy(path, np.dtype(dtype), offset, int(math.prod(shape)), size, key)

    def __len__(self) -> int:
        return self._rows

    def __getitem__(self, row: int) -> np.ndarray:
        start = int(row) * self.seq_len
        if self._local is not None:
            return self._ids(self._local[start:start + self.seq_len + 1], row)
        if self._remote is None:
            import fsspec

            self._remote = fsspec.core.url_to_fs(self.path)
        fs, target = self._remote
        size = self.dtype.itemsize
        raw = fs.cat_file(target, start=self.offset + start * size,
                          end=self.offset + (start + self.seq_len + 1) * size)
        return self._ids(np.frombuffer(raw, self.dtype), row)

    def _ids(self, tokens: np.ndarray, row: int) -> np.ndarray:
        """int32 ids; a value that int32 cannot hold would wrap into the vocabulary unseen, so it is refused."""
        if self.dtype.itemsize >= 4 and tokens.size and (tokens.max() > INT32_MAX or tokens.min() < 0):
            bad = tokens.max() if tokens.max() > INT32_MAX else tokens.min()
            raise DataError(f"{self.key} '{self.path}' holds token id {int(bad)} (row {row}): no vocabulary holds it")
        return np.asarray(tokens, np.int32)

    def __getstate__(self):  # memory maps and file-system clients are reopened, not pickled
        return {**self.__dict__, "_local": None, "_remote": None}

    def __setstate__(self, state):
        self.__dict__.update(state)
        if not is_remote(self.path):
            self._local = np.memmap(self.path, dtype=self.dtype, mode="r", offset=self.offset,
                                    shape=(self.num_tokens,))


def _checked_npy(path: str, dtype: np.dtype, offset: int, count: int, size: int,
                 key: str = "data.path") -> tuple[np.dtype, int, int]:
    """A .npy header's claims against the file: integer tokens, and as many bytes as the header says."""
    if dtype.kind not in "ui":
        raise DataError(f"{key} '{path}' holds {dtype.name} values; token ids must be integers (uint16, uint32, "
                        "int32, ...)")
    if offset + count * dtype.itemsize > size:
        raise DataError(f"{key} '{path}' is truncated: its header says {count:,} tokens "
                        f"({count * dtype.itemsize:,} bytes), the file holds {max(size - offset, 0):,} bytes of them")
    return dtype, offset, count


def document_source(paths: Sequence[str], documents: Sequence[int | None] | None = None):
    """Grain's ArrayRecord source over the shards `paths`; a shard that is no file, cannot be read, holds no
    records or not the `documents` its manifest lists is an error naming it."""
    from array_record.python import array_record_data_source, array_record_module

    for number, path in enumerate(paths):
        if is_remote(path):
            continue
        regular_file(path, "the dataset shard")
        count = None
        try:
            reader = array_record_module.ArrayRecordReader(path)
            count = reader.num_records()
            reader.close()
        except RuntimeError as e:  # ArrayRecord's errors: one line naming the shard (some have no words)
            said = (str(e).strip().splitlines() or ["ArrayRecord's reader gives no reason"])[0]
            raise DataError(f"the dataset shard {path} cannot be read (truncated or corrupt?): {said}; "
                            "prepare the dataset again") from None
        if count == 0:
            raise DataError(f"the dataset shard {path} holds no documents")
        if documents is not None and documents[number] is not None and documents[number] != count:
            raise DataError(f"the dataset shard {path} holds {count} documents, its manifest says "
                            f"{documents[number]}: it was truncated or replaced; prepare the dataset again")
    try:
        return array_record_data_source.ArrayRecordDataSource(list(paths))
    except RuntimeError as e:
        raise DataError(f"the dataset shards of {os.path.dirname(paths[0])} cannot be read: "
                        f"{str(e).splitlines()[0]}") from None


class CheckedDocuments:
    """The shards' records as Grain reads them, each checked against the manifest before it is decoded: a
    whole number of `token_dtype` tokens, every id below `vocab_size`. A hand-edited manifest that lies about
    either is named by its key and the shard that shows it: at start-up (`check_first`: the first record of
    every shard) or at the record that shows it, never as token ids the model takes for other text."""

    def __init__(self, source, paths: Sequence[str], documents: Sequence[int | None], manifest: dict, key: str):
        self.source, self.paths, self.key = source, list(paths), key
        self.dtype, self.vocab = np.dtype(manifest["token_dtype"]), manifest["vocab_size"]
        self.url = join(manifest["directory"], MANIFEST)
        known = all(isinstance(n, int) for n in documents) and sum(documents) == len(source)
        self.starts = list(itertools.accumulate([0, *documents[:-1]])) if known else None

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> bytes:
        record = self.source[index]
        self._check(record, index)
        return record

    def __getitems__(self, indices: Sequence[int]) -> list[bytes]:
        records = self.source.__getitems__(indices)
        for index, record in zip(indices, records, strict=True):
            self._check(record, index)
        return records

    def check_first(self) -> None:
        for start in self.starts or [0]:
            self[start]

    def _shard(self, index: int) -> str:
        if self.starts is None:
            return f"of {self.url.rpartition('/')[0]}"
        return self.paths[bisect.bisect_right(self.starts, index) - 1]

    def _check(self, record: bytes, index: int) -> None:
        if len(record) % self.dtype.itemsize:
            raise DataError(f"{self.key}: the dataset shard {self._shard(index)} holds a document of {len(record)} "
                            f"bytes, not a whole number of {self.dtype.name} tokens ({self.dtype.itemsize} bytes "
                            f"each): the manifest's 'token_dtype' ({self.dtype.name}) does not match its shards "
                            f"({self.url}); prepare the dataset again")
        ids = np.frombuffer(record, self.dtype)
        if ids.size and int(ids.max()) >= self.vocab:
            raise DataError(f"{self.key}: the dataset shard {self._shard(index)} holds token id {int(ids.max())}, "
                            f"past the manifest's 'vocab_size' ({self.vocab}): its 'vocab_size' or 'token_dtype' "
                            f"({self.dtype.name}) does not match its shards ({self.url}); prepare the dataset again")


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


def _whole_tokens(record: bytes, dtype: np.dtype, where: str) -> None:
    """A record is a whole number of tokens of the manifest's dtype; else the manifest lies about its shards."""
    if len(record) % dtype.itemsize:
        raise DataError(f"{where} holds a document of {len(record)} bytes, not a whole number of {dtype.name} "
                        f"tokens ({dtype.itemsize} bytes each): the manifest's token_dtype does not match its "
                        "shards; prepare the dataset again")


def _decoder(dtype: np.dtype, eod_id: int):
    def decode(record: bytes) -> dict[str, np.ndarray]:
        _whole_tokens(record, dtype, "the dataset")
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
    """(grain MapDataset of records, the manifest or None, fingerprint) for `path`."""
    import grain

    if d.source == "tokens":
        rows = TokenRows(path, d.token_dtype, d.seq_len, key)
        return grain.MapDataset.source(rows), None, f"{tokens_fingerprint(path, rows)}:l{d.seq_len}"
    manifest = load_manifest(path, key)
    check_manifest(manifest, vocab_size, key)
    paths = shard_paths(manifest)
    if not paths:
        raise DataError(f"{key}: the dataset {path} lists no shards")
    documents = [s.get("documents") for s in manifest["shards"] if s.get("split", "train") == "train"]
    source = CheckedDocuments(document_source(paths, documents), paths, documents, manifest, key)
    source.check_first()
    tokens = sum(s.get("tokens") or 0 for s in manifest["shards"] if s.get("split", "train") == "train")
    if all(s.get("tokens") is not None for s in manifest["shards"]) and tokens + len(source) < d.seq_len + 1:
        raise DataError(f"{key}: the dataset {path} holds {tokens + len(source)} tokens with its end-of-document "
                        f"tokens, fewer than one row of data.seq_len + 1 = {d.seq_len + 1}")
    return grain.MapDataset.source(source), manifest, dataset_fingerprint(manifest)


def _same_tokenizer(train: dict | None, held: dict | None, path: str, eval_path: str) -> None:
    """An evaluation set must be tokenized as the training data was: the same ids mean the same text."""
    if train is None or held is None:
        return
    ours, theirs = (m.get("tokenizer", {}).get("fingerprint", "") for m in (train, held))
    tokenizer = join(train["directory"], train.get("tokenizer", {}).get("file", "tokenizer.json"))
    if ours != theirs or train["eod_id"] != held["eod_id"]:
        raise DataError(f"data.eval_path '{eval_path}' was prepared with another tokenizer ({theirs or 'unknown'}, "
                        f"end-of-document id {held['eod_id']}) than data.path '{path}' ({ours or 'unknown'}, "
                        f"end-of-document id {train['eod_id']}): its loss would not be comparable; prepare it "
                        f"with --tokenizer {tokenizer}")


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
        eval_path = resolve_eval_path(d.eval_path)
        eval_records, eval_documents, _ = _records(d, cfg.model.vocab_size, eval_path, "data.eval_path")
        _same_tokenizer(documents, eval_documents, d.path, eval_path)
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

    def evaluation() -> GrainIterator:
        return GrainIterator(pipeline(eval_records, eval_documents, None), fingerprint, cfg.model.vocab_size,
                             process_index=process_index, process_count=process_count, name=key)

    _read_once(evaluation(), cfg.train.eval_batches)
    return train, evaluation


def _read_once(batches: GrainIterator, count: int) -> None:
    """Every evaluation reads the same `count` batches: read (and checked) here, at start-up, so that what
    would refuse them (a token past the vocabulary, say) stops the run before its first step, not at its
    first evaluation, steps into the training."""
    try:
        for _ in range(count):
            next(batches)
    finally:
        batches.close()


def _per_host(global_batch: int, process_count: int) -> int:
    if global_batch % process_count:
        raise DataError(f"data.global_batch_size ({global_batch}) must be divisible by the number of hosts "
                        f"({process_count})")
    return global_batch // process_count
