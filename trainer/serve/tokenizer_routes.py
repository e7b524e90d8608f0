"""vLLM's tokenizer routes, so that a harness (lm-evaluation-harness's `tokenizer_backend="remote"`) counts and
cuts prompts with the served model's own tokenizer and downloads none:

  POST /tokenize        {"prompt": text | "messages": [...], "add_special_tokens"} ->
                        {"count", "max_model_len", "tokens", "token_strs"}
  POST /detokenize      {"tokens": [id, ...]} -> {"prompt": text}
  GET  /tokenizer_info  {"tokenizer_class", "eos_token", "eos_token_id", "bos_token", "pad_token",
                         "model_max_length", "vocab_size", "chat_template"}

The run's tokenizers add no special tokens (prepare's BPE has no template), so `add_special_tokens` changes
nothing here: it is taken for vLLM's shape. The chat template is given as the Jinja template equivalent to
this server's own (`--chat-template`), which is what vLLM's clients render.
"""

from __future__ import annotations

import json

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from trainer.serve import chat
from trainer.serve.protocol import APIError, ChatMessage


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int]


def add(app: FastAPI, state) -> None:
    app.add_api_route("/tokenize", _tokenize(state), methods=["POST"])
    app.add_api_route("/detokenize", _detokenize(state), methods=["POST"])
    app.add_api_route("/tokenizer_info", _info(state), methods=["GET"])


def _ready(state, model: str | None) -> None:
    if model and model != state.model_name:
        raise APIError(404, f"the model '{model}' does not exist; this server serves '{state.model_name}'",
                       kind="not_found_error", param="model", code="model_not_found")
    if state.encode is None or state.loop is None:
        raise APIError(503, "the model is loading", kind="service_unavailable")


# Prompts longer than this (characters) are tokenized on a worker thread: a tokenizer takes about a second a
# megabyte, which on the event loop would stall /health and every stream meanwhile. Shorter ones take less
# than a thread's hand-off.
INLINE_TEXT = 4096


async def encode(state, text: str) -> list[int]:
    """A text's token ids by the server's codec (a 400 naming the prompt when it refuses the text)."""
    import asyncio

    try:
        if len(text) <= INLINE_TEXT:
            return state.encode(text)
        return await asyncio.to_thread(state.encode, text)
    except Exception as e:  # noqa: BLE001 - the codec's own message says what it wanted
        reason = str(getattr(e, "message", None) or e).removeprefix("--prompt: ").removeprefix("--prompt ")
        raise APIError(400, f"prompt: {reason}", param="prompt") from None


def _tokenize(state):
    async def tokenize(body: TokenizeRequest):
        _ready(state, body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt (a text) or messages", param="prompt")
        text = body.prompt
        if body.messages is not None:
            try:
                text = chat.render(state.chat_template, body.messages, body.add_generation_prompt)
            except chat.ChatTemplateError as e:
                raise APIError(400, str(e), param="messages") from None
        tokens = await encode(state, text)
        strs = [state.decode([t]) for t in tokens] if body.return_token_strs and state.decode else None
        return {"count": len(tokens), "max_model_len": state.max_len, "tokens": tokens, "token_strs": strs}

    return tokenize


def _detokenize(state):
    async def detokenize(body: DetokenizeRequest):
        _ready(state, body.model)
        vocab = state.loop.engine.model.cfg.model.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise APIError(400, f"tokens: ids must be in [0, {vocab}), got {bad}", param="tokens")
        return {"prompt": state.decode(body.tokens) if state.decode else " ".join(map(str, body.tokens))}

    return detokenize


def _info(state):
    async def info():
        _ready(state, None)
        return {"tokenizer_class": state.tokenizer_class, "eos_token": state.eos_token,
                "eos_token_id": state.loop.engine.eos_id, "bos_token": None, "pad_token": None,
                "model_max_length": state.max_len, "vocab_size": state.loop.engine.model.cfg.model.vocab_size,
                "chat_template": (state.chat_template.source if isinstance(state.chat_template, chat.HubChatTemplate)
                                  else jinja_template(state.chat_template))}

    return info


def jinja_template(template: dict) -> str:
    """This server's chat template ({"message": "...{role}...{content}...", "generation": "..."}) as the Jinja
    template Hugging Face tokenizers carry: each message laid out by `message`, then `generation` when a
    generation prompt is asked for. Literal text is quoted as Jinja string literals, never as template code."""
    pieces, rest = [], template["message"]
    while rest:
        at = min((i for i in (rest.find("{role}"), rest.find("{content}")) if i >= 0), default=len(rest))
        if at:
            pieces.append("{{ " + json.dumps(rest[:at].replace("{{", "{").replace("}}", "}")) + " }}")
        if at == len(rest):
            break
        name = "role" if rest.startswith("{role}", at) else "content"
        pieces.append("{{ message['" + name + "'] }}")
        rest = rest[at + len(name) + 2:]
    generation = "{{ " + json.dumps(template["generation"]) + " }}"
    return ("{% for message in messages %}" + "".join(pieces) + "{% endfor %}"
            "{% if add_generation_prompt %}" + generation + "{% endif %}")
