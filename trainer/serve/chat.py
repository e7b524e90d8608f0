"""A conversation as the model's prompt: the server's own format (`--chat-template FILE`: a message format
and a generation prefix), or an imported Hugging Face model's chat template (its tokenizer_config.json's
`chat_template`, or chat_template.jinja beside it), a Jinja program rendered in jinja2's immutable sandbox.

The sandbox is not optional: a template comes with a downloaded checkpoint, and an unsandboxed one could
reach Python's internals from its expressions. The names a Hugging Face template may use are those
transformers gives it: `messages`, `add_generation_prompt`, the special tokens (`bos_token`, `eos_token`,
...), `raise_exception(message)` and `strftime_now(format)` (GPT-OSS's harmony template dates its system
message), `{% break %}` and `{% continue %}`, and a `tojson` that leaves HTML characters and non-ASCII text as
they are, with blocks trimmed (trim_blocks, lstrip_blocks), as it renders them.
"""

from __future__ import annotations

import datetime
import json
import os
from typing import Any

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ChatTemplateError(ValueError):
    """A conversation the template refuses (its raise_exception), or a template that fails on it."""


class HubChatTemplate:
    """A Hugging Face chat template, compiled once."""

    def __init__(self, source: str, special: dict[str, str], where: str):
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise ChatTemplateError(str(message))

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda format: datetime.datetime.now().strftime(format)
        env.filters["tojson"] = _tojson
        try:
            self.template = env.from_string(source)
        except TemplateError as e:
            raise ValueError(f"{where}: the chat template is not valid Jinja: {e}") from None
        self.source, self.special, self.where = source, special, where

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        from jinja2.exceptions import TemplateError

        try:
            return self.template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                        **self.special)
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, ValueError, KeyError, IndexError) as e:
            raise ChatTemplateError(f"the model's chat template ({self.where}) fails on these messages: {e}") from None


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """JSON as transformers' templates get it: no HTML escaping, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def render(template, messages, add_generation_prompt: bool = True) -> str:
    """The prompt text of `messages` (objects with .role and .content) under `template`: a HubChatTemplate,
    or the server's format {"message": "...{role}...{content}...", "generation": "..."}; the generation
    prefix (the assistant's turn) follows when `add_generation_prompt`."""
    if isinstance(template, HubChatTemplate):
        return template.render([{"role": m.role, "content": m.content} for m in messages], add_generation_prompt)
    text = "".join(template["message"].format(role=m.role, content=m.content) for m in messages)
    return text + template["generation"] if add_generation_prompt else text


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def hub_chat_template(side: str | None) -> HubChatTemplate | None:
    """The chat template an import keeps in its side directory `side` (trainer.outputs.RunDirectory.hub; None:
    not an import): chat_template.jinja, or tokenizer_config.json's
    `chat_template`: a string, or a list of {"name", "template"} of which "default"), or None.
    ValueError naming the file when it is unreadable or no Jinja."""
    if side is None:
        return None
    config_path = os.path.join(side, "tokenizer_config.json")
    config: dict = {}
    if os.path.isfile(config_path):
        try:
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError) as e:
            raise ValueError(f"{config_path} cannot be read: {e}") from None
        config = config if isinstance(config, dict) else {}
    source, where = config.get("chat_template"), config_path
    if isinstance(source, list):  # named templates: the default one
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    jinja_path = os.path.join(side, "chat_template.jinja")
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            source, where = f.read(), jinja_path
    if not isinstance(source, str) or not source:
        return None
    special = {name: text for name in SPECIAL_TOKENS if (text := _token_text(config.get(name))) is not None}
    return HubChatTemplate(source, special, where)
