"""Structured output: a request's text held to a JSON schema, any JSON object, a regular expression, a choice of
strings or a Lark grammar, through llguidance (the constrained-decoding library vLLM uses).

OpenAI's `response_format` ({"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": ...}})
and vLLM's `structured_outputs` ({"json": schema}, {"regex": ...}, {"choice": [...]}, {"grammar": lark},
{"json_object": true}) become one llguidance grammar; each generated sequence gets a matcher of it. Before each
token the matcher computes, on the host, the bit mask of the tokens that may come next (one bit a token, 32 a
word), which the engine hands the compiled step as an input (trainer.serve.runner): masked tokens get -inf before
sampling, and rows without a grammar have every bit set, so nothing compiles again. The request stops when its
grammar is complete.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np


class StructuredError(ValueError):
    """A grammar that cannot be built (a schema llguidance cannot compile, a bad regex); `param` is the request
    field it came from."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def words(vocab_size: int) -> int:
    """Mask words a row: one bit for each token of the vocabulary and one more (an end token of the grammar's
    own where the model has none)."""
    return vocab_size // 32 + 1


class _ByteTokens:
    """llguidance's view of a byte-level codec (token i < 256 is byte i), as its TokenizerWrapper wants it: the
    256 bytes and one token more, 256, the grammar's end (Constraint moves its bit to the model's end token).
    The model's ids past the bytes have no text, so no grammar allows them; left out, they cost a mask nothing:
    at a vocabulary of 32,768, given as special tokens of no text, they made each mask 7x slower (8 masks in
    the middle of a JSON document: 0.55 ms against 0.075 ms, measured)."""

    END = 256

    def __init__(self):
        self.eos_token_id, self.bos_token_id = self.END, None
        self.tokens = [bytes([i]) for i in range(256)] + [b""]
        self.special_token_ids = [self.END]

    def __call__(self, text):
        return list(text.encode("utf-8") if isinstance(text, str) else text)


class Grammars:
    """Grammars and matchers for one model's tokens: `kind` is the codec's ("tokenizer": a tokenizers.Tokenizer,
    "bytes", or "ids": no text, so nothing to constrain)."""

    def __init__(self, kind: str, vocab_size: int, eos_id: int | None, tokenizer=None):
        self.kind, self.vocab_size, self.eos_id, self.tokenizer = kind, vocab_size, eos_id, tokenizer
        self._tokens = None

    def tokens(self):
        """The llguidance tokenizer, built on first use (a large vocabulary takes about a second)."""
        if self._tokens is None:
            import llguidance

            # Without an end token of the model's, one past its vocabulary: never drawn, the mask's spare bit.
            eos = self.eos_id if self.eos_id is not None else self.vocab_size
            if self.kind == "tokenizer":
                tokenizer = self.tokenizer
                if self.eos_id is None:  # llguidance wants its end token in the tokenizer: one of its own, added
                    from tokenizers import Tokenizer

                    tokenizer = Tokenizer.from_str(tokenizer.to_str())
                    tokenizer.add_special_tokens(["<|moe-tpu-grammar-end|>"])
                    eos = tokenizer.get_vocab_size(with_added_tokens=True) - 1
                self._tokens = llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=max(self.vocab_size, eos + 1),
                                                      eos_token=eos)
            else:
                self._tokens = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokens()))
        if (self._tokens.vocab_size + 31) // 32 > words(self.vocab_size):
            raise StructuredError(f"the tokenizer's {self._tokens.vocab_size} tokens (with the grammar's end) "
                                  f"overrun the model's vocabulary of {self.vocab_size}: no grammar can be held to "
                                  "it", "response_format")
        return self._tokens

    def grammar(self, response_format, structured_outputs) -> str | None:
        """The llguidance grammar a request asks for (None: plain text). Raises StructuredError."""
        import llguidance

        if response_format is not None and structured_outputs is not None:
            raise StructuredError("give response_format or structured_outputs, not both", "structured_outputs")
        spec, param = _spec(response_format, structured_outputs)
        if spec is None:
            return None
        if self.kind == "ids":
            raise StructuredError(f"{param}: this model has no tokenizer (its prompts are token ids), so its output "
                                  "cannot be held to a text grammar", param)
        kind, value = spec
        try:
            if kind == "json":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(
                    value, defaults={"whitespace_flexible": False})
            elif kind == "regex":
                grammar = llguidance.LLMatcher.grammar_from_regex(value)
            else:
                grammar = llguidance.LLMatcher.grammar_from_lark(value)
        except (ValueError, TypeError) as e:
            raise StructuredError(f"{param}: {e}", param) from None
        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokens())
        if error:
            raise StructuredError(f"{param}: llguidance cannot compile it: {error.strip()}", param)
        return grammar

    def constraint(self, grammar: str) -> Constraint:
        import llguidance

        matcher = llguidance.LLMatcher(self.tokens(), grammar, log_level=0)
        if matcher.is_error():
            raise StructuredError(f"llguidance cannot compile the grammar: {matcher.get_error()}", "response_format")
        end = (_ByteTokens.END, self.eos_id) if self.kind == "bytes" else None
        return Constraint(matcher, self.vocab_size, self.tokens().vocab_size, end)


class Constraint:
    """One sequence's matcher. `row` [words(vocab)] int32 is the mask of its first token (drawn by the prompt's
    last prefill chunk); the engine has each later mask written straight into its slot's row of the decode
    step's input (`fill`), after the matcher took the token before it (`accept`)."""

    def __init__(self, matcher, vocab_size: int, grammar_vocab: int, end: tuple[int, int | None] | None = None):
        """`end`: (the grammar's end token, the model's end token or None) where they differ: the mask's bit
        moves from the one to the other."""
        self.matcher, self.vocab_size, self.end = matcher, vocab_size, end
        self.size = (grammar_vocab + 31) // 32  # the words llguidance writes
        self.row = np.zeros(words(vocab_size), np.int32)
        self.fill(self.row)

    def accept(self, token: int) -> bool:
        """Takes the drawn token; whether the grammar is complete (nothing may follow but its end)."""
        if not self.matcher.consume_token(token):
            raise ValueError(f"the grammar refused token {token}: {self.matcher.get_error()}")
        return self.matcher.is_stopped()

    def fill(self, row_W: np.ndarray) -> bool:
        """Writes the mask of the next token into `row_W` (a C-contiguous int32 row of words(vocab): a row of the
        engine's masks, written in place, not copied there); whether it allows any of the model's tokens (when
        not, only the grammar's end token may follow and the model has none: the grammar is complete).

        Through the matcher's pointer call rather than llguidance.numpy's fill_next_token_bitmask, whose checks
        of the array's shape and layout cost some 10 us a call (a sixth of a mask in the middle of a JSON
        document, at every token of every constrained slot); `row_W` is checked here once instead."""
        if row_W.dtype != np.int32 or not row_W.flags.c_contiguous or row_W.size < self.size:
            raise ValueError(f"a mask row must be {self.size} or more contiguous int32 words")
        self.matcher.unsafe_compute_mask_ptr(row_W.ctypes.data, self.size * 4)
        row_W[self.size:] = 0  # tokens past the tokenizer's: no text, never drawn
        if self.end is not None:
            (at, to), bits_W = self.end, row_W.view(np.uint32)
            on = bits_W[at // 32] >> np.uint32(at % 32) & 1
            bits_W[at // 32] &= ~np.uint32(1 << at % 32)
            if on and to is not None:
                bits_W[to // 32] |= np.uint32(1 << to % 32)
        whole, rest = divmod(self.vocab_size, 32)  # the model's tokens: whole words, then a word's low bits
        return bool(row_W[:whole].any()) or bool(int(row_W[whole]) & ((1 << rest) - 1))


def _spec(response_format, structured_outputs) -> tuple[tuple[str, str] | None, str]:
    """((kind, grammar source), the field) from the request's fields: kind json, regex or lark."""
    if response_format is not None:
        if not isinstance(response_format, dict) or "type" not in response_format:
            raise StructuredError('response_format: want {"type": "text" | "json_object" | "json_schema", ...}',
                                  "response_format")
        kind = response_format["type"]
        if kind == "text":
            return None, "response_format"
        if kind == "json_object":
            return ("json", json.dumps({"type": "object"})), "response_format"
        if kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise StructuredError('response_format.json_schema: want {"name": ..., "schema": {...}}',
                                      "response_format")
            return ("json", json.dumps(spec.get("schema", {}))), "response_format"
        raise StructuredError(f"response_format.type: want text, json_object or json_schema, got {kind!r}",
                              "response_format")
    if structured_outputs is None:
        return None, "structured_outputs"
    param = "structured_outputs"
    keys = {k: v for k, v in structured_outputs.items() if v is not None} if isinstance(structured_outputs, dict) \
        else None
    if keys is None or len(keys) != 1 or next(iter(keys)) not in _OPTIONS:
        raise StructuredError(f"{param}: want exactly one of {', '.join(_OPTIONS)}", param)
    key, value = next(iter(keys.items()))
    return _OPTIONS[key](value, f"{param}.{key}"), f"{param}.{key}"


def _json(value, param):
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise StructuredError(f"{param}: not JSON: {e}", param) from None
    if not isinstance(value, dict):
        raise StructuredError(f"{param}: want a JSON schema (an object)", param)
    return "json", json.dumps(value)


def _text(kind: str) -> Callable:
    def check(value, param):
        if not isinstance(value, str) or not value:
            raise StructuredError(f"{param}: want a non-empty string", param)
        return kind, value

    return check


def _choice(value, param):
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise StructuredError(f"{param}: want a non-empty list of strings", param)
    return "lark", "start: " + " | ".join(json.dumps(v) for v in value)


def _json_object(value, param):
    if value is not True:
        raise StructuredError(f"{param}: want true", param)
    return "json", json.dumps({"type": "object"})


_OPTIONS = {"json": _json, "regex": _text("regex"), "choice": _choice, "grammar": _text("lark"),
            "json_object": _json_object}
