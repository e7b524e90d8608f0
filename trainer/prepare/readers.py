"""Reading the corpus: the input files a prepare's patterns name, and their documents (text files, JSON lines,
Parquet), each cut into pieces a tokenizer takes in bounded memory."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
from collections.abc import Iterator

from trainer import signals
from trainer.files import not_a_file
from trainer.prepare.errors import PrepareError

BATCH_DOCUMENTS = 512  # documents per encode_batch call (and rows per Parquet batch)
PIECE_CHARS = 1 << 16  # the longest text tokenized at once (see Corpus)


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
    for path in files:  # before any is read: a file that cannot be read is named now, not after hours of work
        with _opened(path):
            pass
    return files


class Corpus:
    """Every document of the input files, in order, each as a list of pieces of at most PIECE_CHARS
    characters; the format comes from each file's suffix.

    A tokenizer's work and memory grow with its longest pre-token (a run of letters, digits or spaces):
    one 50 MB line without a space would take gigabytes. So a long document is cut into pieces that are
    tokenized one by one: at a space or line break where there is one (which leaves a byte-level BPE's
    tokens as they were), else hard every PIECE_CHARS characters; `hard_cuts` counts the latter.
    """

    def __init__(self, files: list[str], *, text_key: str, lines: bool, replace_bad_text: bool = False):
        self.files, self.text_key, self.lines = files, text_key, lines
        self.check = TextCheck(replace_bad_text)
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
                texts = _jsonl(path, self.text_key, self.check)
            elif path.endswith(".parquet"):
                texts = _parquet(path, self.text_key, self.check)
            else:
                texts = _text(path, self.lines, self.check)
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


class TextCheck:
    """What is not text in the input: a byte that is not UTF-8 (a surrogate's bytes among them), a NUL, and in
    JSON an unpaired surrogate escape. Refused by default, naming the file and the byte offset (most often the
    file is in another encoding, UTF-16 or not text at all); with `replace` (--bad-text replace) each is read
    as U+FFFD, the Unicode replacement character, and counted for the summary."""

    BAD = re.compile("[\0\ud800-\udfff]")  # NUL, and surrogates: UTF-8 has no encoding for a lone one

    def __init__(self, replace: bool = False):
        self.replace, self.replaced = replace, 0

    def decode(self, raw: bytes, path: str, offset: int, number: int | None = None) -> str:
        """The text of `raw`, the bytes at `offset` of `path` (line `number`, or the whole file)."""
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            if not self.replace:
                raise PrepareError(_not_utf8(path, raw, offset, e.start, number)) from None
            text = raw.decode("utf-8", "replace")
            self.replaced += text.count(REPLACEMENT) - raw.count(REPLACEMENT.encode())
        if "\0" in text:
            if not self.replace:
                at = raw.index(b"\0")
                line = number or raw.count(b"\n", 0, at) + 1
                raise PrepareError(f"{path} line {line} holds a NUL byte at byte offset {offset + at}, which is not "
                                   f"text (a UTF-16 file, or no text file?): {_REMEDY}")
            self.replaced += text.count("\0")
            text = text.replace("\0", REPLACEMENT)
        return text

    def clean(self, text: str, where: str) -> str:
        """`text` from JSON or Parquet, where NULs and lone surrogates arrive as escapes."""
        bad = self.BAD.search(text)
        if bad is None:
            return text
        if not self.replace:
            what = "a NUL" if bad.group() == "\0" else f"an unpaired surrogate (\\u{ord(bad.group()):04x})"
            raise PrepareError(f"{where} holds {what}, which is not text: {_REMEDY}")
        self.replaced += len(self.BAD.findall(text))
        return self.BAD.sub(REPLACEMENT, text)


REPLACEMENT = "\ufffd"
_REMEDY = "convert the file to UTF-8 text (e.g. with iconv), or read each such byte as U+FFFD with --bad-text replace"


def _lines(text: str) -> list[str]:
    """Lines as Python's universal newlines cut them: at \\n, \\r\\n and \\r."""
    return text.replace("\r\n", "\n").replace("\r", "\n").split("\n")


def _text(path: str, lines: bool, check: TextCheck) -> Iterator[str]:
    """The file's documents: the whole file, or each line that is not blank. Read as bytes and decoded here,
    so that a byte that is not text is named by its offset in the file."""
    with _opened(path) as f:
        if not lines:
            yield "\n".join(_lines(check.decode(f.read(), path, 0)))
            return
        offset = 0
        for number, raw in enumerate(f, 1):
            for line in _lines(check.decode(raw, path, offset, number)):
                if line.strip():
                    yield line
            offset += len(raw)


@contextlib.contextmanager
def _opened(path: str):
    try:
        with open(path, "rb") as f:
            yield f
    except OSError as e:
        raise PrepareError(f"cannot read {path}: {e.strerror}") from None


def _not_utf8(path: str, raw: bytes, offset: int, at: int, number: int | None) -> str:
    """Where the first byte that is not UTF-8 is: by line and column, and by its offset in the file."""
    line = number or raw.count(b"\n", 0, at) + 1
    column = at - (raw.rfind(b"\n", 0, at) + 1) + 1
    return (f"{path} line {line} is not UTF-8 text: byte 0x{raw[at]:02x} at column {column} (byte offset "
            f"{offset + at} in the file); {_REMEDY}")


def _jsonl(path: str, text_key: str, check: TextCheck) -> Iterator[str]:
    with _opened(path) as f:
        offset = 0
        for number, raw in enumerate(f, 1):
            line = check.decode(raw, path, offset, number)
            if line.strip():
                yield check.clean(_json_text(path, number, line, text_key),
                                  f"{path} line {number} (byte offset {offset}): the field '{text_key}'")
            offset += len(raw)


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
    return text


def _json_kind(value) -> str:
    return {bool: "true or false", int: "a number", float: "a number", list: "a list", dict: "an object",
            type(None): "null"}.get(type(value), type(value).__name__)


def _parquet(path: str, text_key: str, check: TextCheck) -> Iterator[str]:
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
            for number, text in enumerate(batch.column(0).to_pylist(), row + 1):
                if text is not None:
                    yield check.clean(text, f"{path} row {number}: the column '{text_key}'")
            row += batch.num_rows
    except UnicodeDecodeError:  # Parquet's strings are UTF-8 by the format, unchecked by the reader
        raise PrepareError(f"{path}: the column '{text_key}' holds bytes that are not UTF-8 text in rows {row + 1} "
                           f"to {row + BATCH_DOCUMENTS}; convert the file to UTF-8 text") from None
    except (OSError, pa.ArrowException) as e:
        raise PrepareError(f"cannot read {path} as Parquet after row {row}: {str(e).splitlines()[0]}") from None
