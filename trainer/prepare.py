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

from trainer.status import EXIT_USAGE

EOD_TOKEN = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"
BATCH_DOCUMENTS = 512  # documents per encode_batch call


class PrepareError(click.UsageError):
    exit_code = EXIT_USAGE


# ----------------------------------------------------------------------------- reading the corpus


def input_files(patterns: tuple[str, ...]) -> list[str]:
    files: list[str] = []
    for pattern in patterns:
        matches = sorted(f for f in glob.glob(pattern, recursive=True) if os.path.isfile(f))
        if not matches:
            raise PrepareError(f"input '{pattern}' matches no files")
        files += matches
    return files


def documents(files: list[str], *, text_key: str, lines: bool) -> Iterator[str]:
    """Every document of every input file, in order; the format comes from the file's suffix."""
    for path in files:
        if path.endswith((".jsonl", ".json")):
            yield from _jsonl(path, text_key)
        elif path.endswith(".parquet"):
            yield from _parquet(path, text_key)
        else:
            try:
                with open(path, encoding="utf-8", errors="replace") as f:
                    if lines:
                        yield from (line.rstrip("\n") for line in f if line.strip())
                    else:
                        yield f.read()
            except OSError as e:
                raise PrepareError(f"cannot read {path}: {e.strerror}") from None


def _jsonl(path: str, text_key: str) -> Iterator[str]:
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError as e:
                raise PrepareError(f"{path} line {number} is not JSON: {e}") from None
            if not isinstance(record, dict) or not isinstance(record.get(text_key), str):
                raise PrepareError(f"{path} line {number} has no text field '{text_key}' (set --text-key)")
            yield record[text_key]


def _parquet(path: str, text_key: str) -> Iterator[str]:
    try:
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
    for batch in file.iter_batches(columns=[text_key], batch_size=BATCH_DOCUMENTS):
        yield from (text for text in batch.column(0).to_pylist() if text is not None)


# ----------------------------------------------------------------------------- the tokenizer


def load_tokenizer(path: str):
    from tokenizers import Tokenizer

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

    def add(self, ids: list[int]) -> None:
        import numpy as np
        from array_record.python import array_record_module

        if self._writer is None or self.shards[-1]["documents"] >= self.per_shard:
            self.close()
            name = f"train-{len(self.shards):05d}.array_record"
            self._writer = array_record_module.ArrayRecordWriter(os.path.join(self.directory, name), "group_size:1")
            self.shards.append({"file": name, "documents": 0, "tokens": 0})
        self._writer.write(np.asarray(ids, self.dtype).tobytes())
        self.shards[-1]["documents"] += 1
        self.shards[-1]["tokens"] += len(ids)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _upload(local: str, remote: str) -> None:
    import fsspec

    fs, target = fsspec.core.url_to_fs(remote)
    for name in sorted(os.listdir(local)):
        fs.put_file(os.path.join(local, name), f"{target.rstrip('/')}/{name}")


def prepare(inputs: tuple[str, ...], output: str, *, tokenizer_path: str | None, vocab_size: int,
            text_key: str = "text", lines: bool = False, documents_per_shard: int = 100_000,
            eod_token: str = EOD_TOKEN, progress: bool = True, say=print) -> dict:
    """Tokenizes the corpus into `output`; returns the manifest."""
    import numpy as np

    files = input_files(inputs)
    if tokenizer_path:
        tokenizer, trained = load_tokenizer(tokenizer_path), False
    else:
        started = time.perf_counter()
        tokenizer, trained = train_bpe(documents(files, text_key=text_key, lines=lines), vocab_size), True
        say(f"trained a byte-level BPE of {tokenizer.get_vocab_size()} tokens in "
            f"{time.perf_counter() - started:.1f}s")
    eod_id = tokenizer.token_to_id(eod_token)
    if eod_id is None:
        raise PrepareError(f"the tokenizer has no end-of-document token '{eod_token}' (set --eod-token)")
    vocab = tokenizer.get_vocab_size()
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    remote = "://" in output
    local = tempfile.mkdtemp(prefix="moe-tpu-prepare-") if remote else os.path.abspath(output)
    if not remote:
        if os.path.exists(os.path.join(local, "manifest.json")):
            raise PrepareError(f"{output} already holds a dataset (manifest.json); choose another --output")
        os.makedirs(local, exist_ok=True)
    writer = ShardWriter(local, dtype, documents_per_shard)
    total_bytes = sum(os.path.getsize(f) for f in files)
    tokens = count = max_id = 0
    started = time.perf_counter()
    try:
        with _Progress(total_bytes, enabled=progress) as bar:
            batch: list[str] = []
            for text in documents(files, text_key=text_key, lines=lines):
                batch.append(text)
                if len(batch) == BATCH_DOCUMENTS:
                    tokens, count, max_id = _encode(tokenizer, batch, writer, tokens, count, max_id, bar)
                    batch = []
            if batch:
                tokens, count, max_id = _encode(tokenizer, batch, writer, tokens, count, max_id, bar)
        writer.close()
        if count == 0:
            raise PrepareError(f"the inputs hold no documents: {', '.join(inputs)}")
        tokenizer.save(os.path.join(local, TOKENIZER_FILE))
        manifest = {"format": "moe-tpu-dataset", "version": 1, "vocab_size": vocab, "eod_id": eod_id,
                    "eod_token": eod_token, "token_dtype": np.dtype(dtype).name, "documents": count,
                    "tokens": tokens, "max_token_id": max_id,
                    "tokenizer": {"file": TOKENIZER_FILE, "fingerprint": fingerprint(tokenizer), "trained": trained},
                    "shards": writer.shards, "inputs": files}
        with open(os.path.join(local, "manifest.json"), "w") as f:
            json.dump(manifest, f, indent=1)
        if remote:
            _upload(local, output)
    finally:
        writer.close()
        if remote:
            shutil.rmtree(local, ignore_errors=True)
    seconds = max(time.perf_counter() - started, 1e-9)
    say(f"wrote {count:,} documents, {tokens:,} tokens in {len(writer.shards)} shard(s) to {output} in "
        f"{seconds:.1f}s ({tokens / seconds:,.0f} tokens/s)")
    return manifest


def _encode(tokenizer, batch, writer, tokens, count, max_id, bar):
    for encoding in tokenizer.encode_batch(batch, add_special_tokens=False):
        ids = encoding.ids
        if ids:
            writer.add(ids)
            tokens += len(ids)
            count += 1
            max_id = max(max_id, max(ids))
    bar.advance(sum(len(t.encode("utf-8", errors="replace")) for t in batch), tokens)
    return tokens, count, max_id


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


def main(args: list[str] | None = None, prog_name: str | None = None) -> None:
    prepare_command.main(args=args, prog_name=prog_name or "python -m trainer.prepare")


if __name__ == "__main__":
    main()
