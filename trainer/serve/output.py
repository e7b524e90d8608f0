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
    """The text of a growing list of token ids, a token at a time."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self.decode, self.ids, self.text = decode, [], ""
        self.prefix = self.read = 0  # ids[prefix:read] is the context already emitted; ids[read:] waits

    def add(self, token: int) -> str:
        """Appends `token`; returns the text it completes (possibly empty, while a character is half made)."""
        self.ids.append(token)
        before = self.decode(self.ids[self.prefix:self.read])
        after = self.decode(self.ids[self.prefix:])
        pending = len(self.ids) - self.read
        if len(after) > len(before) and (not after.endswith("\ufffd") or pending >= WINDOW):
            new = after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
            self.text += new
            return new
        return ""

    def flush(self) -> str:
        """The text of the tokens still waiting (half a character at the end stays as decoded)."""
        if self.read == len(self.ids):
            return ""
        before = self.decode(self.ids[self.prefix:self.read])
        new = self.decode(self.ids[self.prefix:])[len(before):]
        self.prefix = self.read = len(self.ids)
        self.text += new
        return new


class OutputProcessor:
    """Decides when a request is done, and keeps its text (`req.text`, with a detokenize) up to date."""

    def __init__(self, detokenize: Callable[[list[int]], str] | None = None, eos_id: int | None = None):
        self.detokenize, self.eos_id = detokenize, eos_id

    def on_token(self, req, token: int, record=None) -> str | None:
        """Records `token` as the request's next; returns its finish reason, or None while it goes on."""
        req.output.append(token)
        if record is not None:
            req.logprobs.append(record)
        s = req.sampling
        if token == self.eos_id and not s.ignore_eos:  # the token has no text
            req.eos = True
            self._finish_text(req)
            return "stop"
        if self.detokenize is not None:
            reason = self._add_text(req, token)
            if reason is not None:
                return reason
        if len(req.output) >= s.max_tokens:
            return "stop" if self._finish_text(req) else "length"
        return None

    def _add_text(self, req, token: int) -> str | None:
        state = req.detokenizer
        if state is None:
            state = req.detokenizer = Detokenizer(self.detokenize)
        start = len(state.text)
        if not state.add(token) or not req.sampling.stop:
            req.text = state.text
            return None
        return self._cut_at_stop(req, state.text, start)

    def _cut_at_stop(self, req, text: str, start: int) -> str | None:
        """Cuts the text before the first stop string that ends in its new part (from `start`)."""
        reach = max(len(stop) for stop in req.sampling.stop) - 1
        window = max(start - reach, 0)
        found = [at for at in (text.find(stop, window) for stop in req.sampling.stop) if at >= 0]
        if found:
            req.text = text[:min(found)]
            return "stop"
        req.text = text
        return None

    def _finish_text(self, req) -> bool:
        """The text of the last tokens, which may have waited to complete a character; whether a stop string
        turned up in it."""
        state = req.detokenizer
        if state is None:
            return False
        start = len(state.text)
        if state.flush() and req.sampling.stop and self._cut_at_stop(req, state.text, start) == "stop":
            return True
        req.text = state.text
        return False
