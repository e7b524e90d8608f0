"""The engine's output processor: each request's new token becomes text incrementally, is checked against its
stop strings, the end-of-document token and max_tokens, and its log-probability record is kept.

Text per token costs O(1), not O(output): a token's text is the decode of a short window of the last tokens
(the window's text after the part already emitted), as the tokenizer may join a token to the ones before it
(byte-level pieces of one character, a space merged into a word); and a stop string is looked for only in
the new text and the few characters before it that a stop string could straddle. Hand-written because the
engine's codecs are plain functions of ids (a `tokenizers` Tokenizer's decode, the bytes of a text run, ids
as numbers), which `tokenizers`' own streaming decoder, made for its Tokenizer objects, does not cover.
"""

from __future__ import annotations

from collections.abc import Callable

# Past this many tokens without text that is complete (a window still ending in half a character), the
# window's text is emitted as it is: a model emitting invalid UTF-8 for ever must not make each token cost more.
WINDOW = 16


class Detokenizer:
    """The text of a growing list of token ids, a token at a time, kept as its pieces (a string grown by += is
    copied whole at each step while another reference to it is alive)."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode, self.ids, self.pieces, self.length = decode, [], [], 0
        self.prefix = self.read = 0  # ids[prefix:read] is the context already emitted; ids[read:] waits
        self.tail = ""  # the last characters, where a stop string may have begun

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def add(self, token: int) -> str:
        """Appends `token`; returns the text it completes (possibly empty, while a character is half made)."""
        self.ids.append(token)
        before = self.decode(self.ids[self.prefix:self.read])
        after = self.decode(self.ids[self.prefix:])
        pending = len(self.ids) - self.read
        if len(after) > len(before) and (not after.endswith("\ufffd") or pending >= WINDOW):
            self.prefix, self.read = self.read, len(self.ids)
            return self._emit(after[len(before):])
        return ""

    def flush(self) -> str:
        """The text of the tokens still waiting (half a character at the end stays as decoded)."""
        if self.read == len(self.ids):
            return ""
        before = self.decode(self.ids[self.prefix:self.read])
        new = self.decode(self.ids[self.prefix:])[len(before):]
        self.prefix = self.read = len(self.ids)
        return self._emit(new)

    def _emit(self, new: str) -> str:
        if new:
            self.pieces.append(new)
            self.length += len(new)
        return new


class OutputProcessor:
    """Decides when a request is done. With a detokenize its text grows in `req.detokenizer.pieces` as it is
    made, and `req.text` is set once it is done (cut before a stop string)."""

    def __init__(self, detokenize: Callable[[list[int]], str] | None = None, eos_id: int | None = None,
                 stop_ids: tuple[int, ...] = ()):
        """`stop_ids`: tokens that end generation as eos_id does (a family's other end tokens, e.g. GPT-OSS's
        <|call|>)."""
        self.detokenize, self.eos_id, self.stop_ids = detokenize, eos_id, frozenset(stop_ids)

    def on_token(self, req, token: int, record=None) -> str | None:
        """Records `token` as the request's next; returns its finish reason, or None while it goes on."""
        req.output.append(token)
        if record is not None:
            req.logprobs.append(record)
        s = req.sampling
        if (token == self.eos_id or token in self.stop_ids) and not s.ignore_eos:  # the token has no text
            req.eos = True
            self._finish_text(req)
            return "stop"
        if self.detokenize is not None:
            if req.detokenizer is None:
                req.detokenizer = Detokenizer(self.detokenize)
            if self._stopped(req, req.detokenizer.add(token)):
                return "stop"
        if req.constraint is not None and req.constraint.accept(token):  # its grammar is complete
            self._finish_text(req)
            return "stop"
        if len(req.output) >= s.max_tokens:
            return "stop" if self._finish_text(req) else "length"
        return None

    def complete(self, req) -> str:
        """The finish reason of a request whose grammar is complete, its text finished."""
        self._finish_text(req)
        return "stop"

    @staticmethod
    def _stopped(req, new: str) -> bool:
        """Whether a stop string ends in the new text: looked for in it and the characters before it that a
        stop string could straddle (never in the whole text). If so the text is cut before it."""
        stops, state = req.sampling.stop, req.detokenizer
        if not new or not stops:
            return False
        reach = max(len(stop) for stop in stops) - 1
        window = state.tail + new
        found = [at for at in (window.find(stop) for stop in stops) if at >= 0]
        state.tail = window[max(len(window) - reach, 0):] if reach else ""
        if not found:
            return False
        req.text = state.text[:state.length - len(window) + min(found)]
        return True

    def _finish_text(self, req) -> bool:
        """Sets the finished request's text, with that of the last tokens, which may have waited to complete
        a character; whether a stop string turned up in it (then the text is cut there)."""
        state = req.detokenizer
        if state is None:
            return False
        if self._stopped(req, state.flush()):
            return True
        req.text = state.text
        return False
