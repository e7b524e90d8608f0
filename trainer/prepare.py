"""`python -m trainer.prepare` / `moe-tpu data prepare`: a corpus in, a tokenized dataset the trainer reads out.

In: text files (one document per file, or per line with --lines), JSON lines or Parquet files with a text
column. Tokenizer: a `tokenizer.json` given by path (the `tokenizers` library's format), or a byte-level
BPE trained on the corpus itself. Out, in a directory (local or gs://): ArrayRecord shards whose records
are documents (their token ids, little-endian uint16 or uint32, no end-of-document token: the trainer
adds it when packing), the tokenizer it used, and `manifest.json`:

    {"format": "moe-tpu-dataset", "version": 1, "vocab_size": int, "eod_id": int, "eod_token": str,
     "token_dtype": "uint16"|"uint32", "documents": int, "tokens": int, "max_token_id": int,
     "tokenizer": {"file": "tokenizer.json", "fingerprint": "sha256:...", "trained": bool},
     "shards": [{"file": str, "documents": int, "tokens": int}], "inputs": [str]}

Exit codes: 0 written; 2 a usage or input error (the file or key named); 1 any other failure.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator

import click

from trainer import signals
from trainer.files import not_a_file
from trainer.status import EXIT_FAILED, EXIT_USAGE

EOD_TOKEN = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
MANIFEST = "manifest.json"
BATCH_DOCUMENTS = 512  # documents per encode_batch call
PIECE_CHARS = 1 << 16  # the longest text tokenized at once (see Corpus)
BATCH_CHARS = 1 << 20  # characters per encode_batch call, at most (about)


class PrepareError(click.UsageError):
    exit_code = EXIT_USAGE


class PrepareFailure(click.ClickException):
    """A runtime failure (a full disk, an I/O error): exit 1, with nothing half-written left behind."""

    exit_code = EXIT_FAILED


# ----------------------------------------------------------------------------- reading the corpus


def input_files(patterns: tuple[str, ...]) -> list[str]:
    """The files the patterns name. A pattern that names one thing that is no file is refused, naming what
    it is; a wildcard passes over directories but refuses a FIFO, a device or a socket it matches."""
    files: list[str] = []
    for pattern in patterns:
        if not glob.has_magic(pattern):
            kind = not_a_file(pattern)
            if kind == "a directory":
                raise PrepareError(f"input '{pattern}' is a directory: name its files, e.g. '{pattern.rstrip('/')}"
                                   f"/*.jsonl' (or '{pattern.rstrip('/')}/**/*.txt' for every subdirectory too)")
            if kind:
                raise PrepareError(f"input '{pattern}' is {kind}, not a file")
        matches = sorted(glob.glob(pattern, recursive=True))
        for match in matches:
            kind = not_a_file(match)
            if kind not in (None, "a directory"):
                raise PrepareError(f"input '{pattern}' matches {match}, which is {kind}, not a file: leave it "
                                   "out of the pattern")
        matches = [f for f in matches if os.path.isfile(f)]
        if not matches:
            raise PrepareError(f"input '{pattern}' matches no files")
        files += matches
    return files


class Corpus:
    """Every document of the input files, in order, each as a list of pieces of at most PIECE_CHARS
    characters; the format comes from each file's suffix.

    A tokenizer's work and memory grow with its longest pre-token (a run of letters, digits or spaces):
    one 50 MB line without a space would take gigabytes. So a long document is cut into pieces that are
    tokenized one by one: at a space or line break where there is one (which leaves a byte-level BPE's
    tokens as they were), else hard every PIECE_CHARS characters; `hard_cuts` counts the latter.
    """

    def __init__(self, files: list[str], *, text_key: str, lines: bool):
        self.files, self.text_key, self.lines = files, text_key, lines
        self.hard_cuts = 0

    def __iter__(self) -> Iterator[list[str]]:
        for document in self._documents():
            yield [piece for piece, _ in document]

    def texts(self) -> Iterator[str]:
        """The pieces a tokenizer is trained on: every one but those after a hard cut (a run of letters
        megabytes long is as many distinct words, which the BPE trainer would keep in memory, all of them)."""
        return (piece for document in self._documents() for piece, after_hard_cut in document if not after_hard_cut)

    def _documents(self) -> Iterator[list[tuple[str, bool]]]:
        for path in self.files:
            if path.endswith((".jsonl", ".json")):
                texts = _jsonl(path, self.text_key)
            elif path.endswith(".parquet"):
                texts = _parquet(path, self.text_key)
            else:
                texts = _text(path, self.lines)
            for text in texts:
                signals.checkpoint()  # a signal is acted on between two documents (trainer/signals.py)
                yield self._pieces(text)

    def _pieces(self, text: str) -> list[tuple[str, bool]]:
        """(piece, whether it follows a hard cut) of the text, in order."""
        if len(text) <= PIECE_CHARS:
            return [(text, False)]
        pieces, start, hard = [], 0, False
        while len(text) - start > PIECE_CHARS:
            end = start + PIECE_CHARS
            cut = max(text.rfind(" ", start + 1, end), text.rfind("\n", start + 1, end))
            pieces.append((text[start:cut if cut > start else end], hard))
            hard = cut <= start
            self.hard_cuts += hard
            start = end if hard else cut
        pieces.append((text[start:], hard))
        return pieces


def _text(path: str, lines: bool) -> Iterator[str]:
    try:
        with open(path, encoding="utf-8") as f:
            if lines:
                yield from (line.rstrip("\n") for line in f if line.strip())
            else:
                yield f.read()
    except UnicodeDecodeError:
        raise PrepareError(_not_utf8(path)) from None
    except OSError as e:
        raise PrepareError(f"cannot read {path}: {e.strerror}") from None


def _not_utf8(path: str) -> str:
    """Where the file's first byte that is not UTF-8 is, by line and column (a second pass, on failure only)."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as e:
                return (f"{path} line {number} is not UTF-8 text: byte 0x{line[e.start]:02x} at column {e.start + 1} "
                        "(convert the file to UTF-8, e.g. with iconv)")
    return f"{path} is not UTF-8 text (convert it to UTF-8, e.g. with iconv)"


def _jsonl(path: str, text_key: str) -> Iterator[str]:
    try:
        with open(path, encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    yield _json_text(path, number, line, text_key)
    except UnicodeDecodeError:
        raise PrepareError(_not_utf8(path)) from None
    except OSError as e:
        raise PrepareError(f"cannot read {path}: {e.strerror}") from None


def _json_text(path: str, number: int, line: str, text_key: str) -> str:
    where = f"{path} line {number}"
    try:
        record = json.loads(line)
    except RecursionError:
        raise PrepareError(f"{where} nests too deep to read (lists or objects inside each other); "
                           "each line must be one object with a text field") from None
    except ValueError as e:
        raise PrepareError(f"{where} is not JSON: {e}") from None
    if not isinstance(record, dict):
        raise PrepareError(f"{where} is {_json_kind(record)}, not an object: each line must be one object with "
                           f"a text field '{text_key}'")
    if text_key not in record:
        raise PrepareError(f"{where} has no text field '{text_key}' (set --text-key)")
    text = record[text_key]
    if not isinstance(text, str):
        raise PrepareError(f"{where}: the field '{text_key}' holds {_json_kind(text)}, not text")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PrepareError(f"{where}: the field '{text_key}' holds an unpaired surrogate "
                           f"(\\u{ord(text[e.start]):04x}), which is not text") from None
    return text


def _json_kind(value) -> str:
    return {bool: "true or false", int: "a number", float: "a number", list: "a list", dict: "an object",
            type(None): "null"}.get(type(value), type(value).__name__)


def _parquet(path: str, text_key: str) -> Iterator[str]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise PrepareError("Parquet input needs pyarrow (pip install 'moe-tpu[data]')") from None
    try:
        file = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow's errors: one message naming the file
        raise PrepareError(f"cannot read {path} as Parquet: {e}") from None
    if text_key not in file.schema_arrow.names:
        raise PrepareError(f"{path} has no column '{text_key}' (columns: {', '.join(file.schema_arrow.names)}; "
                           "set --text-key)")
    kind = file.schema_arrow.field(text_key).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)):
        raise PrepareError(f"{path}: the column '{text_key}' holds {kind}, not text (set --text-key)")
    row = 0
    try:
        for batch in file.iter_batches(columns=[text_key], batch_size=BATCH_DOCUMENTS):
            yield from (text for text in batch.column(0).to_pylist() if text is not None)
            row += batch.num_rows
    except (OSError, pa.ArrowException) as e:
        raise PrepareError(f"cannot read {path} as Parquet after row {row}: {str(e).splitlines()[0]}") from None


# ----------------------------------------------------------------------------- the tokenizer


def load_tokenizer(path: str):
    from tokenizers import Tokenizer

    kind = not_a_file(path)
    if kind:
        raise PrepareError(f"the tokenizer file {path} is {kind}, not a file (give a tokenizer.json)")
    if not os.path.isfile(path):
        raise PrepareError(f"the tokenizer file {path} does not exist")
    try:
        return Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises its own Exception subclass
        raise PrepareError(f"the tokenizer file {path} cannot be read: {str(e).splitlines()[0]}") from None


def train_bpe(texts: Iterator[str], vocab_size: int):
    """A byte-level BPE trained on `texts`: every byte is in its alphabet, so it encodes any text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOD_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def fingerprint(tokenizer) -> str:
    return "sha256:" + hashlib.sha256(tokenizer.to_str().encode()).hexdigest()


# ----------------------------------------------------------------------------- writing


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


class OutputDir:
    """The local dataset directory, held by one `data prepare` at a time (an flock on the directory) and
    written whole or not at all: every file goes to a `.partial-*` directory inside it first and is moved
    in when all are written, the manifest last, so no reader ever sees a manifest before its shards."""

    def __init__(self, output: str):
        if not output.strip():
            raise PrepareError("--output is empty: name the dataset directory")
        self.output, self.path = output, os.path.abspath(output)
        if os.path.lexists(self.path) and not os.path.isdir(self.path):
            what = "a link to nothing" if not os.path.exists(self.path) else not_a_file(self.path) or "a file"
            raise PrepareError(f"--output {output} is {what}, not a directory")
        self.created = not os.path.exists(self.path)
        self._fd: int | None = None
        self.partial: str | None = None

    def __enter__(self) -> OutputDir:
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as e:
            raise _write_error(e, f"cannot create the output directory {self.output}") from None
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise PrepareError(f"--output {self.output} is not writable (permission denied)")
        self._lock()
        if os.path.lexists(os.path.join(self.path, "manifest.json")):
            raise PrepareError(f"{self.output} already holds a dataset (manifest.json); choose another --output")
        for stale in glob.glob(os.path.join(self.path, ".partial-*")):  # a killed prepare's: we hold the lock
            shutil.rmtree(stale, ignore_errors=True)
        try:
            self.partial = tempfile.mkdtemp(prefix=".partial-", dir=self.path)
        except OSError as e:
            raise _write_error(e, f"cannot write in {self.output}") from None
        return self

    def _lock(self) -> None:
        import fcntl

        self._fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PrepareError(f"another `data prepare` is writing to {self.output}; wait for it to finish, or "
                               "choose another --output") from None

    def publish(self, names: list[str]) -> None:
        """Moves the finished files in (a rename each, never following a link that is there), the manifest last."""
        for name in sorted(names, key=lambda n: n == MANIFEST):
            os.replace(os.path.join(self.partial, name), os.path.join(self.path, name))

    def __exit__(self, *exc) -> None:
        if self.partial is not None:
            shutil.rmtree(self.partial, ignore_errors=True)
        if exc[0] is not None and self.created:
            with contextlib.suppress(OSError):
                os.rmdir(self.path)  # only if empty: what we created and left nothing in
        if self._fd is not None:
            os.close(self._fd)


def _write_error(error: OSError, what: str) -> click.ClickException:
    """A full disk is a runtime failure (exit 1); a path that cannot be written is the user's to fix (exit 2)."""
    if error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return PrepareFailure(f"{what}: {os.strerror(error.errno)}; nothing was written (free some space, or "
                              "choose another --output)")
    hint = " (a part of the path is a file)" if error.errno == errno.ENOTDIR else ""
    return PrepareError(f"{what}: {error.strerror or error}{hint}")


class RemoteOutput:
    """A dataset under gs:// (or another fsspec URL), held by one `data prepare` at a time and published
    whole. An object store has no flock and no rename, so: the lock is an object created only where none is
    (Cloud Storage's ifGenerationMatch=0: of two writers exactly one succeeds), removed at the end; files a
    stopped prepare left there are overwritten under the lock. The files are written locally, then uploaded
    with the manifest last, itself created only where none is, so a reader who finds a manifest finds its
    shards and no writer replaces a manifest another one published. A prepare that fails or is stopped
    removes what it uploaded and its lock."""

    LOCK = ".prepare-lock"

    def __init__(self, output: str):
        import fsspec

        self.output = output.rstrip("/")
        try:
            self.fs, self.prefix = fsspec.core.url_to_fs(self.output)
        except (ImportError, ValueError) as e:
            raise PrepareError(f"--output {output}: {e}") from None
        self.exclusive = "gs" in _protocols(self.fs)  # the only store here whose writes take a precondition
        self.partial: str | None = None
        self.locked, self.uploaded, self.published = False, [], False

    def _path(self, name: str) -> str:
        return f"{self.prefix.rstrip('/')}/{name}"

    def _create(self, name: str, data: bytes | None = None, local: str | None = None) -> None:
        """Writes the object only if none is there (FileExistsError if one is)."""
        if not self.exclusive and self.fs.exists(self._path(name)):  # elsewhere: checked, then written
            raise FileExistsError(self._path(name))
        kw = {"mode": "create"} if self.exclusive else {}
        if local is None:
            self.fs.pipe_file(self._path(name), data, **kw)
        else:
            self.fs.put_file(local, self._path(name), **kw)

    def __enter__(self) -> RemoteOutput:
        import socket

        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": started}
        try:
            self._create(self.LOCK, json.dumps(holder).encode())
        except FileExistsError:
            raise PrepareError(f"another `data prepare` is writing to {self.output} ({self._holder()}); wait for it "
                               f"to finish, or, if that prepare no longer runs, delete {self.output}/{self.LOCK}") \
                from None
        except OSError as e:
            raise _write_error(e, f"cannot write to {self.output}") from None
        self.locked = True
        try:
            if self.fs.exists(self._path(MANIFEST)):
                raise PrepareError(f"{self.output} already holds a dataset (manifest.json); choose another --output")
            self.partial = tempfile.mkdtemp(prefix="moe-tpu-prepare-")
        except BaseException:
            self.__exit__(*sys.exc_info())
            raise
        return self

    def _holder(self) -> str:
        """Who holds the lock, as its object says (best effort: it may be gone by now)."""
        try:
            held = json.loads(self.fs.cat_file(self._path(self.LOCK))[:4096])
            return f"its lock says host {held['host']}, process {held['pid']}, since {held['started']}"
        except Exception:  # noqa: BLE001 - only a detail of the message
            return f"it holds {self.output}/{self.LOCK}"

    def publish(self, names: list[str]) -> None:
        """Uploads the finished files, the manifest last and only where no manifest is."""
        for name in sorted(names, key=lambda n: (n == MANIFEST, n)):
            local = os.path.join(self.partial, name)
            if name == MANIFEST:
                try:
                    self._create(name, local=local)
                except FileExistsError:  # only where the lock was deleted under a running prepare
                    self.uploaded = []  # under another's manifest now: not ours to remove
                    raise PrepareFailure(f"another prepare published a dataset in {self.output} while this one "
                                         f"wrote (its lock {self.LOCK} was deleted while it ran), and this one's "
                                         "shards replaced some of its shards: prepare it again into a new --output") \
                        from None
                self.published = True
            else:
                self.fs.put_file(local, self._path(name))
                self.uploaded.append(name)

    def __exit__(self, *exc) -> None:
        if self.partial is not None:
            shutil.rmtree(self.partial, ignore_errors=True)
        if not self.published:
            for name in self.uploaded:
                with contextlib.suppress(Exception):
                    self.fs.rm_file(self._path(name))
        if self.locked:
            with contextlib.suppress(Exception):
                self.fs.rm_file(self._path(self.LOCK))
            self.locked = False


def _protocols(fs) -> set[str]:
    protocol = fs.protocol
    return {protocol} if isinstance(protocol, str) else set(protocol)


def prepare(inputs: tuple[str, ...], output: str, *, tokenizer_path: str | None, vocab_size: int,
            text_key: str = "text", lines: bool = False, documents_per_shard: int = 100_000,
            eod_token: str = EOD_TOKEN, progress: bool = True, say=print) -> dict:
    """Tokenizes the corpus into `output`; returns the manifest."""
    files = input_files(inputs)
    corpus = Corpus(files, text_key=text_key, lines=lines)
    with RemoteOutput(output) if "://" in output else OutputDir(output) as target:
        tokenizer, trained = _tokenizer(corpus, tokenizer_path, vocab_size, say)
        try:
            started = time.perf_counter()
            manifest = _write(corpus, tokenizer, trained, target.partial, eod_token, documents_per_shard, progress)
            target.publish(os.listdir(target.partial))
        except OSError as e:
            raise _write_error(e, f"cannot write the dataset to {output}") from None
    seconds = max(time.perf_counter() - started, 1e-9)
    tokens = manifest["tokens"]
    say(f"wrote {manifest['documents']:,} documents, {tokens:,} tokens in {len(manifest['shards'])} shard(s) to "
        f"{output} in {seconds:.1f}s ({tokens / seconds:,.0f} tokens/s)")
    if corpus.hard_cuts:
        say(f"note: {corpus.hard_cuts:,} run(s) of {PIECE_CHARS:,} characters without a space or line break were "
            f"cut there and tokenized as separate pieces (a tokenizer's memory grows with its longest word)")
    return manifest


def _tokenizer(corpus: Corpus, tokenizer_path: str | None, vocab_size: int, say):
    if tokenizer_path:
        return load_tokenizer(tokenizer_path), False
    started = time.perf_counter()
    tokenizer = train_bpe(corpus.texts(), vocab_size)
    say(f"trained a byte-level BPE of {tokenizer.get_vocab_size()} tokens in {time.perf_counter() - started:.1f}s")
    return tokenizer, True


def _write(corpus: Corpus, tokenizer, trained: bool, local: str, eod_token: str, per_shard: int,
           progress: bool) -> dict:
    """Shards, the tokenizer and the manifest into the directory `local`; returns the manifest."""
    import numpy as np

    eod_id = tokenizer.token_to_id(eod_token)
    if eod_id is None:
        raise PrepareError(f"the tokenizer has no end-of-document token '{eod_token}' (set --eod-token)")
    vocab = tokenizer.get_vocab_size()
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    writer = ShardWriter(local, dtype, per_shard)
    corpus.hard_cuts = 0
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


@click.command("prepare", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("inputs", nargs=-1, required=True, metavar="INPUT...")
@click.option("--output", "-o", required=True, metavar="DIR", help="The dataset directory: a local path or gs://.")
@click.option("--tokenizer", "tokenizer_path", default=None, metavar="FILE",
              help="A tokenizer.json file [train a byte-level BPE on the corpus].")
@click.option("--vocab-size", type=click.IntRange(min=257, max=1 << 20), default=8192, show_default=True,
              help="The trained BPE's vocabulary (with --tokenizer: ignored).")
@click.option("--text-key", default="text", show_default=True, help="The text field of JSON lines and Parquet.")
@click.option("--lines", is_flag=True, help="Text files hold one document per line [one per file].")
@click.option("--documents-per-shard", type=click.IntRange(min=1), default=100_000, show_default=True)
@click.option("--eod-token", default=EOD_TOKEN, show_default=True, help="The tokenizer's end-of-document token.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def prepare_command(inputs, output, tokenizer_path, vocab_size, text_key, lines, documents_per_shard, eod_token,
                    quiet):
    """Tokenize text, JSON lines or Parquet files into ArrayRecord shards and a manifest for the trainer.

    \b
    Examples:
      python -m trainer.prepare 'corpus/*.txt' -o data/corpus --vocab-size 8192
      python -m trainer.prepare docs.jsonl --tokenizer tokenizer.json -o gs://BUCKET/datasets/docs
    Then train with --set data.source=records --set data.path=DIR.
    """
    prepare(tuple(inputs), output, tokenizer_path=tokenizer_path, vocab_size=vocab_size, text_key=text_key,
            lines=lines, documents_per_shard=documents_per_shard, eod_token=eod_token, progress=not quiet,
            say=lambda message: click.echo(message, err=True))


class Stopped(BaseException):
    """SIGTERM or SIGHUP arrived: raised at the prepare's next checkpoint so that what it made is removed on
    the way out, as Ctrl-C's KeyboardInterrupt is (a BaseException: no `except Exception` swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _raised_for(signum: int) -> BaseException:
    """What a checkpoint raises for a signal (again at every checkpoint, should a library swallow it); the
    way out, which removes what the prepare made, has no checkpoint: a second signal cannot cut it short."""
    import signal

    return KeyboardInterrupt() if signum == signal.SIGINT else Stopped(signum)


def _stopped_by_signals():
    """Ctrl-C, SIGTERM and SIGHUP recorded while the prepare runs (trainer/signals.py: a handler that raised
    could be dropped where it landed, a garbage collection among them); the prepare raises them between
    documents and shards. The previous handlers come back after."""
    return signals.latch(raise_for=_raised_for)


def main(args: list[str] | None = None, prog_name: str | None = None) -> None:
    """The command, with Ctrl-C exiting 130, SIGTERM 143 and SIGHUP 129 (what it left half-written, and a
    gs:// lock, are gone by then)."""
    import signal

    try:
        with _stopped_by_signals():
            prepare_command.main(args=args, prog_name=prog_name or "python -m trainer.prepare",
                                 standalone_mode=False)
    except click.ClickException as e:
        e.show()
        sys.exit(e.exit_code)
    except (click.exceptions.Abort, KeyboardInterrupt):
        click.echo("interrupted: nothing was written", err=True)
        sys.exit(130)
    except Stopped as e:
        click.echo(f"stopped by {signal.Signals(e.signum).name}: nothing was written", err=True)
        sys.exit(128 + e.signum)


if __name__ == "__main__":
    main()
