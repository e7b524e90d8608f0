"""Writing: documents tokenized in batches into ArrayRecord shards, the tokenizer and the manifest beside them,
with a progress bar over the input bytes."""

from __future__ import annotations

import errno
import json
import os
import sys
import time

from trainer import signals
from trainer.prepare.errors import PrepareError
from trainer.prepare.readers import BATCH_DOCUMENTS, Corpus
from trainer.prepare.tokenizer import TOKENIZER_FILE, fingerprint

MANIFEST = "manifest.json"
BATCH_CHARS = 1 << 20  # characters per encode_batch call, at most (about)


class ShardWriter:
    """Documents into ArrayRecord shards of at most `per_shard` documents each (group size 1: random access)."""

    def __init__(self, directory: str, dtype, per_shard: int):
        self.directory, self.dtype, self.per_shard = directory, dtype, per_shard
        self.shards: list[dict] = []
        self._writer = None

    def add(self, ids) -> None:
        import numpy as np
        from array_record.python import array_record_module

        signals.checkpoint()
        if self._writer is None or self.shards[-1]["documents"] >= self.per_shard:
            self.close()
            name = f"train-{len(self.shards):05d}.array_record"
            self._writer = array_record_module.ArrayRecordWriter(os.path.join(self.directory, name), "group_size:1")
            self.shards.append({"file": name, "documents": 0, "tokens": 0})
        try:
            self._writer.write(np.asarray(ids, self.dtype).tobytes())
        except RuntimeError as e:
            raise _os_error(e) from None
        self.shards[-1]["documents"] += 1
        self.shards[-1]["tokens"] += len(ids)

    def close(self) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            try:
                writer.close()
            except RuntimeError as e:
                raise _os_error(e) from None


def _os_error(error: Exception) -> OSError:
    """ArrayRecord's and tokenizers' I/O failures are RuntimeErrors and Exceptions carrying the system's
    message: back to an OSError with its errno, so that a full disk is told apart from other failures."""
    text = str(error)
    for code in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EROFS):
        if os.strerror(code) in text:
            return OSError(code, os.strerror(code))
    return OSError(errno.EIO, text.splitlines()[0] if text else type(error).__name__)


def write_shards(corpus: Corpus, tokenizer, trained: bool, local: str, eod_token: str, per_shard: int,
           progress: bool) -> dict:
    """Shards, the tokenizer and the manifest into the directory `local`; returns the manifest."""
    import numpy as np

    eod_id = tokenizer.token_to_id(eod_token)
    if eod_id is None:
        raise PrepareError(f"the tokenizer has no end-of-document token '{eod_token}' (set --eod-token)")
    vocab = tokenizer.get_vocab_size()
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    writer = ShardWriter(local, dtype, per_shard)
    corpus.hard_cuts = corpus.check.replaced = 0  # counted again: the tokenizer was trained on a first pass
    try:
        with _Progress(sum(os.path.getsize(f) for f in corpus.files), enabled=progress) as bar:
            encoder = _Encoder(tokenizer, writer, bar)
            for document in corpus:
                encoder.add(document)
            encoder.flush()
    finally:
        writer.close()
    if encoder.count == 0:
        raise PrepareError(f"the inputs hold no documents: {', '.join(corpus.files)}")
    try:
        tokenizer.save(os.path.join(local, TOKENIZER_FILE))
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises its own Exception for I/O errors
        raise _os_error(e) from None
    manifest = {"format": "moe-tpu-dataset", "version": 1, "vocab_size": vocab, "eod_id": eod_id,
                "eod_token": eod_token, "token_dtype": np.dtype(dtype).name, "documents": encoder.count,
                "tokens": encoder.tokens, "max_token_id": encoder.max_id,
                "tokenizer": {"file": TOKENIZER_FILE, "fingerprint": fingerprint(tokenizer), "trained": trained},
                "shards": writer.shards, "inputs": corpus.files}
    with open(os.path.join(local, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


class _Encoder:
    """Documents to token ids in batches of BATCH_DOCUMENTS (or BATCH_CHARS characters), written in order; a
    document of several pieces (see Corpus) is tokenized a few pieces at a time and written as one record."""

    def __init__(self, tokenizer, writer: ShardWriter, bar):
        self.tokenizer, self.writer, self.bar = tokenizer, writer, bar
        self.batch: list[str] = []
        self.batch_chars = self.tokens = self.count = self.max_id = 0

    def add(self, document: list[str]) -> None:
        if len(document) > 1:
            self.flush()
            self._write([self._ids(document[i:i + 4]) for i in range(0, len(document), 4)], document)
            return
        self.batch.append(document[0])
        self.batch_chars += len(document[0])
        if len(self.batch) >= BATCH_DOCUMENTS or self.batch_chars >= BATCH_CHARS:
            self.flush()

    def flush(self) -> None:
        if self.batch:
            for ids in self._ids(self.batch, concatenate=False):
                self._write([ids], [])
            self.bar.advance(sum(len(t.encode("utf-8")) for t in self.batch), self.tokens)
            self.batch, self.batch_chars = [], 0

    def _ids(self, texts: list[str], concatenate: bool = True):
        import numpy as np

        encodings = self.tokenizer.encode_batch(texts, add_special_tokens=False)
        arrays = [np.asarray(e.ids, self.writer.dtype) for e in encodings]
        return np.concatenate(arrays) if concatenate else arrays

    def _write(self, parts: list, pieces: list[str]) -> None:
        import numpy as np

        ids = np.concatenate(parts) if len(parts) > 1 else parts[0]
        if len(ids):
            self.writer.add(ids)
            self.tokens += len(ids)
            self.count += 1
            self.max_id = max(self.max_id, int(ids.max()))
        if pieces:
            self.bar.advance(sum(len(t.encode("utf-8")) for t in pieces), self.tokens)


class _Progress:
    """A progress bar over the input bytes with the tokens written and tokens per second (rich, on stderr)."""

    def __init__(self, total_bytes: int, enabled: bool):
        self.total, self.enabled, self.started = total_bytes, enabled, time.perf_counter()
        self._progress = self._task = None

    def __enter__(self):
        if self.enabled:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self._progress = Progress(TextColumn("tokenizing"), BarColumn(), TextColumn("{task.percentage:>3.0f}%"),
                                      TextColumn("{task.fields[tokens]}"), TimeRemainingColumn(),
                                      console=Console(file=sys.stderr), transient=True)
            self._progress.start()
            self._task = self._progress.add_task("tokenizing", total=max(self.total, 1), tokens="")
        return self

    def advance(self, nbytes: int, tokens: int) -> None:
        if self._progress is not None:
            rate = tokens / max(time.perf_counter() - self.started, 1e-9)
            self._progress.update(self._task, advance=nbytes, tokens=f"{tokens:,} tokens  {rate:,.0f} tokens/s")

    def __exit__(self, *exc):
        if self._progress is not None:
            self._progress.stop()
