"""The output processor's cost per token along a long generation: a 4,000-token output with 4 stop strings
(none of which occurs), through a byte-level BPE trained here, the time per token over the first and the last
500 tokens, with the engine's incremental text (trainer.serve.output) and with what the engine did before
(the whole output decoded again and searched at every token), in one run.

    PYTHONPATH=. python benchmarks/serve_output.py

Prints one JSON object: microseconds per token at the start and at the end for each, and end/start ratios.
"""

from __future__ import annotations

import json
import time

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from trainer.serve.engine import Request, SamplingParams
from trainer.serve.output import OutputProcessor

STOPS = ("<|im_end|>", "\n\nUser:", "###", "STOP")
TEXT = "The quick brown fox jumps over the lazy dog; déjà vu, naïve café, 東京 and 🦊. " * 400


def tokenizer() -> Tokenizer:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([TEXT[:4000]], trainers.BpeTrainer(
        vocab_size=400, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return bpe


def incremental(decode, ids) -> list[float]:
    out = OutputProcessor(decode)
    req = Request([1], SamplingParams(max_tokens=len(ids) + 1, stop=STOPS))
    times = []
    for token in ids:
        started = time.perf_counter()
        assert out.on_token(req, token) is None
        times.append(time.perf_counter() - started)
    return times


def whole(decode, ids) -> list[float]:
    """The former engine's: decode the output so far, search each stop string in all of it."""
    output, times = [], []
    for token in ids:
        started = time.perf_counter()
        output.append(token)
        text = decode(output)
        assert min((i for i in (text.find(s) for s in STOPS) if i >= 0), default=-1) < 0
        times.append(time.perf_counter() - started)
    return times


def main() -> None:
    bpe = tokenizer()
    ids = bpe.encode(TEXT).ids[:4000]
    row = {"tokens": len(ids), "stop_strings": len(STOPS)}
    for name, run in (("incremental", incremental), ("whole", whole)):
        times = run(bpe.decode, ids)
        start, end = (sum(t) / len(t) * 1e6 for t in (times[:500], times[-500:]))
        row[f"{name}_start_us"], row[f"{name}_end_us"] = round(start, 2), round(end, 2)
        row[f"{name}_end_over_start"] = round(end / start, 3)
    print(json.dumps(row))


if __name__ == "__main__":
    main()
