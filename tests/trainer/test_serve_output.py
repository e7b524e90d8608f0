"""The engine's output processor: text made a token at a time equals the whole output decoded at once (a
byte-level BPE splitting characters across tokens, the server's byte codec), stop strings found where they
straddle tokens, and a token's text costs the same at the 4,000th token as at the first."""

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from trainer.serve.engine import Request, SamplingParams
from trainer.serve.output import WINDOW, Detokenizer, OutputProcessor

TEXT = "Ça va? Déjà vu: naïve café, 東京 and 🦊 foxes; the end. " * 8


def byte_level_bpe() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator([TEXT], trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tokenizer


def test_text_a_token_at_a_time_is_the_whole_decode():
    bpe = byte_level_bpe()
    for decode, ids in ((bpe.decode, bpe.encode(TEXT).ids), (lambda i: bytes(i).decode("utf-8", "replace"),
                                                            list(TEXT.encode()))):
        state = Detokenizer(decode)
        pieces = [state.add(token) for token in ids]
        assert "".join(pieces) + state.flush() == decode(ids) == state.text
        assert not any("\ufffd" in p for p in pieces)  # half characters wait for the rest


def test_stop_strings_straddling_tokens_cut_the_text_and_eos_has_no_text():
    decode = lambda ids: bytes(ids).decode("utf-8", "replace")  # noqa: E731
    out = OutputProcessor(decode, eos_id=0)
    req = Request([1], SamplingParams(max_tokens=100, stop=("vu:", "zzz")))
    reasons = []
    for t in "Déjà vu: naïve".encode():  # as the engine does: until a reason
        reasons.append(out.on_token(req, t))
        if reasons[-1]:
            break
    assert reasons == [None] * (len("Déjà vu:".encode()) - 1) + ["stop"] and req.text == "Déjà "
    ended = Request([1], SamplingParams(max_tokens=100))
    assert [out.on_token(ended, t) for t in [*"é".encode(), 0]] == [None, None, "stop"]
    assert ended.eos and ended.text == "é"
    kept = Request([1], SamplingParams(max_tokens=100, ignore_eos=True))
    assert out.on_token(kept, 0) is None and not kept.eos


def test_a_tokens_text_costs_the_same_at_the_end_of_a_long_output():
    """4,000 tokens with 4 stop strings: the decoder is never given more than a window of ids, a stop string
    is looked for in a bounded tail, and the text is never joined until the end (no decode, search or copy of
    the whole output per token). benchmarks/serve_output.py measures the time."""
    seen = []

    def decode(ids):
        seen.append(len(ids))
        return bytes(ids).decode("utf-8", "replace")

    out = OutputProcessor(decode)
    stops = ("STOP", "halt!", "ÿÿ", "<end>")
    req = Request([1], SamplingParams(max_tokens=4000, stop=stops))
    text = ("a stream of words, é and 🦊, on and on " * 200).encode()[:4000]
    tails = []
    for t in text[:-1]:
        assert out.on_token(req, t) is None
        tails.append(len(req.detokenizer.tail))
        assert req.text is None  # not joined while it goes on
    assert out.on_token(req, text[-1]) == "length"
    assert max(seen) <= WINDOW + 1 and max(tails) == max(map(len, stops)) - 1
    assert req.text == text.decode("utf-8", "replace") == "".join(req.detokenizer.pieces)


def test_top_logprobs_keep_every_alternative_when_two_tokens_share_a_text():
    """Bytes 0xE2 and 0xF0 each decode alone to U+FFFD: as keys of one text they merged, and the position
    returned 2 alternatives of the 3 asked for; the later one is now named by its id."""
    from types import SimpleNamespace

    from trainer.serve.logprobs import Logprob
    from trainer.serve.responses import completion_logprobs

    decode = lambda ids: bytes(ids).decode("utf-8", errors="replace")  # noqa: E731 - the server's byte codec
    entry = Logprob(token=0xF0, logprob=-1.5, top_ids=(0xE2, 0xF0, 0x61), top_logprobs=(-1.0, -1.5, -2.0))
    req = SimpleNamespace(prompt=[0x61], prompt_logprobs=[], logprobs=[entry])
    top = completion_logprobs(decode, req, 3, echo=False)["top_logprobs"][0]
    assert top == {"\ufffd": -1.0, f"token_id:{0xF0}": -1.5, "a": -2.0}
    chosen_not_among = Logprob(token=0xE2, logprob=-3.0, top_ids=(0xF0, 0x61), top_logprobs=(-1.0, -2.0))
    req.logprobs = [chosen_not_among]
    assert completion_logprobs(decode, req, 2, echo=False)["top_logprobs"][0] == {
        "\ufffd": -1.0, "a": -2.0, f"token_id:{0xE2}": -3.0}
