"""The tokenizer: a tokenizer.json read from a file, or a byte-level BPE trained on the corpus, and its
fingerprint (what the manifest records, and sample and the server compare)."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator

from trainer.files import not_a_file
from trainer.prepare.errors import PrepareError

EOD_TOKEN = "<|endoftext|>"
TOKENIZER_FILE = "tokenizer.json"


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
