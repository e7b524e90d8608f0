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

import os
import sys
import time

import click

from trainer import signals
from trainer.prepare.errors import PrepareError, PrepareFailure
from trainer.prepare.publishing import OutputDir, RemoteOutput, write_error
from trainer.prepare.readers import PIECE_CHARS, Corpus, input_files
from trainer.prepare.shards import MANIFEST, write_shards
from trainer.prepare.tokenizer import EOD_TOKEN, TOKENIZER_FILE, fingerprint, load_tokenizer, train_bpe

__all__ = ["EOD_TOKEN", "MANIFEST", "PIECE_CHARS", "TOKENIZER_FILE", "OutputDir", "PrepareError", "PrepareFailure",
           "RemoteOutput", "fingerprint", "load_tokenizer", "main", "prepare", "prepare_command", "train_bpe"]


def prepare(inputs: tuple[str, ...], output: str, *, tokenizer_path: str | None, vocab_size: int,
            text_key: str = "text", lines: bool = False, documents_per_shard: int = 100_000,
            eod_token: str | None = None, progress: bool = True, say=print, bad_text: str = "refuse") -> dict:
    """Tokenizes the corpus into `output`; returns the manifest. The end-of-document token is `eod_token`, else
    the model's end-of-sequence token that the files beside `tokenizer_path` name (an imported model's
    tokenizer_config.json), else EOD_TOKEN."""
    files = input_files(inputs)
    corpus = Corpus(files, text_key=text_key, lines=lines, replace_bad_text=bad_text == "replace")
    with RemoteOutput(output) if "://" in output else OutputDir(output) as target:
        tokenizer, trained = _tokenizer(corpus, tokenizer_path, vocab_size, say)
        if eod_token is None and tokenizer_path:
            from trainer.sidefiles import eos_token

            eod_token = eos_token(os.path.dirname(os.path.abspath(tokenizer_path)), tokenizer)
        try:
            started = time.perf_counter()
            manifest = write_shards(corpus, tokenizer, trained, target.partial, eod_token or EOD_TOKEN,
                                    documents_per_shard, progress)
            target.publish(os.listdir(target.partial))
        except OSError as e:
            raise write_error(e, f"cannot write the dataset to {output}") from None
    seconds = max(time.perf_counter() - started, 1e-9)
    tokens = manifest["tokens"]
    say(f"wrote {manifest['documents']:,} documents, {tokens:,} tokens in {len(manifest['shards'])} shard(s) to "
        f"{output} in {seconds:.1f}s ({tokens / seconds:,.0f} tokens/s)")
    if corpus.check.replaced:
        say(f"note: {corpus.check.replaced:,} byte(s) or character(s) that are not text (not UTF-8, NUL, unpaired "
            "surrogates) were read as U+FFFD (--bad-text replace)")
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
@click.option("--eod-token", default=None, metavar="TOKEN",
              help=f"The tokenizer's end-of-document token [the model's eos_token that the tokenizer_config.json "
                   f"beside --tokenizer names, else {EOD_TOKEN}].")
@click.option("--bad-text", type=click.Choice(["refuse", "replace"]), default="refuse", show_default=True,
              help="A byte that is not UTF-8, a NUL or an unpaired surrogate: refuse it (naming the file and byte "
                   "offset), or read each as U+FFFD and count them.")
@click.option("--quiet", "-q", is_flag=True, help="No progress bar.")
def prepare_command(inputs, output, tokenizer_path, vocab_size, text_key, lines, documents_per_shard, eod_token,
                    bad_text, quiet):
    """Tokenize text, JSON lines or Parquet files into ArrayRecord shards and a manifest for the trainer.

    \b
    Examples:
      python -m trainer.prepare 'corpus/*.txt' -o data/corpus --vocab-size 8192
      python -m trainer.prepare docs.jsonl --tokenizer tokenizer.json -o gs://BUCKET/datasets/docs
    Then train with --set data.source=records --set data.path=DIR.
    """
    prepare(tuple(inputs), output, tokenizer_path=tokenizer_path, vocab_size=vocab_size, text_key=text_key,
            lines=lines, documents_per_shard=documents_per_shard, eod_token=eod_token, progress=not quiet,
            say=lambda message: click.echo(message, err=True), bad_text=bad_text)


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

