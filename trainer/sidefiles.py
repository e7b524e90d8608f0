"""A run's side files: what its model needs beside its weights to be used as text (the tokenizer, the chat
template, the special tokens, the generation defaults), in one place for every reader and writer of a run.

An imported Hugging Face model keeps the source's own in the run's HUB_DIR (`hf/`: its config.json and
tokenizer files, verbatim). A fine-tune (`train --init-from`) takes its source's with it: a Hugging Face
directory's files, or another run's HUB_DIR, copied into its own once its first state is made, so that its
`sample`, `serve` and `hf export` read them as the import's do. A run trained from scratch has none: its
tokenizer is its prepared dataset's (the manifest names it and its end-of-document token), which `hf export`
writes as a tokenizer.json with a tokenizer_config.json that transformers' AutoTokenizer loads.

Importable without jax or numpy: `data prepare` reads a model's end-of-sequence token here.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from typing import Any

from trainer.outputs import HUB_DIR, NoRun, RunDirectory, fetched, join

CONFIG = "config.json"  # the Hugging Face model's own config.json (its token ids, max_position_embeddings)
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
GENERATION_CONFIG = "generation_config.json"
# Files beside the weights that travel with the model: the tokenizer, its chat template, generation defaults.
TOKENIZER_FILES = (TOKENIZER, TOKENIZER_CONFIG, "special_tokens_map.json", "tokenizer.model", "vocab.json",
                   "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json", GENERATION_CONFIG)
MAX_JSON_BYTES = 64 << 20  # a tokenizer_config.json with its chat templates is kilobytes to a few megabytes


def present(source: str) -> list[str]:
    """The side files (TOKENIZER_FILES and config.json) there are in the local directory `source`."""
    return [name for name in TOKENIZER_FILES + (CONFIG,) if os.path.isfile(os.path.join(source, name))]


def copy_files(source: str, target: str) -> list[str]:
    """The side files there are in the directory `source`, copied into `target` (made if need be); their
    names."""
    os.makedirs(target, exist_ok=True)
    names = present(source)
    for name in names:
        shutil.copyfile(os.path.join(source, name), os.path.join(target, name))
    return names


def of_source(init_from: str) -> str | None:
    """A local directory holding the side files of what `--init-from` named (and the fine-tune read): a run's
    (an import's, a fine-tune's) HUB_DIR, or a Hugging Face directory itself, local or gs:// (fetched); None
    where there are none."""
    try:
        return RunDirectory.find(init_from, "--init-from").hub
    except NoRun:  # no run: the Hugging Face directory the fine-tune read
        if "://" in init_from:
            return fetched(init_from, TOKENIZER_FILES + (CONFIG,))
        return init_from if os.path.isfile(os.path.join(init_from, CONFIG)) else None


def carry(init_from: str, output_dir: str) -> list[str]:
    """A fine-tune's side files: those of its source (`of_source`) copied into OUTPUT_DIR/HUB_DIR, replacing
    any there (a first start that failed); their names, none when the source has none. Written beside it and
    renamed, so a reader never sees half of them; into gs:// a file at a time (read once the run has
    checkpoints)."""
    source = of_source(init_from)
    if source is None:
        return []
    if "://" in output_dir:
        return _upload(source, join(output_dir, HUB_DIR))
    target = os.path.join(output_dir, HUB_DIR)
    staging = tempfile.mkdtemp(prefix=f".{HUB_DIR}.partial-", dir=output_dir)
    try:
        copied = copy_files(source, staging)
        if os.path.isdir(target):
            shutil.rmtree(target)
        os.rename(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return copied


def _upload(source: str, target: str) -> list[str]:
    from etils import epath

    remote = epath.Path(target)
    remote.mkdir(parents=True, exist_ok=True)
    names = present(source)
    for name in names:
        with open(os.path.join(source, name), "rb") as f:
            (remote / name).write_bytes(f.read())
    return names


def read_json(path: str) -> Any:
    """A side file's JSON, or None where it is missing, too large or not JSON (a reader then goes without)."""
    try:
        if not os.path.isfile(path) or os.path.getsize(path) > MAX_JSON_BYTES:
            return None
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def tokenizer_file(run: RunDirectory) -> str | None:
    """The model's own tokenizer.json (HUB_DIR), or None: what `sample` and `serve` read text with when no
    --tokenizer is given (else the dataset's)."""
    path = os.path.join(run.hub, TOKENIZER) if run.hub else None
    return path if path and os.path.isfile(path) else None


def eos_token_id(run: RunDirectory) -> int | None:
    """The end-of-sequence token id the model stops at (its generation_config.json's, else its config.json's
    `eos_token_id`; the first of a list), or None: no side files, or none named."""
    for name in (GENERATION_CONFIG, CONFIG) if run.hub else ():
        value = token_id((read_json(os.path.join(run.hub, name)) or {}), "eos_token_id")
        if value is not None:
            return value
    return None


# Tokens that end an assistant's turn in a family's chat format, beside its eos_token_id (GPT-OSS's harmony:
# the answer ends at <|return|>, a tool call at <|call|>).
TURN_ENDS = {"gpt_oss": ("<|return|>", "<|call|>")}


def stop_token_ids(run: RunDirectory, tokenizer=None) -> tuple[int, ...]:
    """Every token id generation stops at besides the first eos_token_id (eos_token_id): the rest of a list
    in generation_config.json or config.json (GPT-OSS names three), and the family's turn ends (TURN_ENDS)
    that `tokenizer` (a tokenizers.Tokenizer) holds. Sorted, without duplicates."""
    found: set[int] = set()
    for name in (GENERATION_CONFIG, CONFIG) if run.hub else ():
        config = read_json(os.path.join(run.hub, name)) or {}
        value = config.get("eos_token_id") if isinstance(config, dict) else None
        found.update(v for v in (value if isinstance(value, list) else [value])
                     if isinstance(v, int) and not isinstance(v, bool) and v >= 0)
    model_type = hub_config(run).get("model_type")
    for text in TURN_ENDS.get(model_type, ()) if tokenizer is not None else ():
        token = tokenizer.token_to_id(text)
        if token is not None:
            found.add(token)
    found.discard(eos_token_id(run))
    return tuple(sorted(found))


def token_id(config: Any, key: str) -> int | None:
    """config[key] as one token id (the first of a list), or None."""
    value = config.get(key) if isinstance(config, dict) else None
    value = value[0] if isinstance(value, list) and value else value
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def eos_token(directory: str, tokenizer) -> str | None:
    """The end-of-sequence token's text that the model files in `directory` (beside its tokenizer.json) name:
    tokenizer_config.json's `eos_token` (a string, or an object with its `content`), else the token of
    generation_config.json's or config.json's `eos_token_id` in `tokenizer`; None when they name none."""
    named = (read_json(os.path.join(directory, TOKENIZER_CONFIG)) or {})
    named = named.get("eos_token") if isinstance(named, dict) else None
    named = named.get("content") if isinstance(named, dict) else named
    if isinstance(named, str) and named:
        return named
    for name in (GENERATION_CONFIG, CONFIG):
        found = token_id(read_json(os.path.join(directory, name)), "eos_token_id")
        if found is not None and tokenizer.id_to_token(found) is not None:
            return tokenizer.id_to_token(found)
    return None


def hub_config(run: RunDirectory) -> dict:
    """The Hugging Face config.json the model came with (HUB_DIR), or {}: its token ids and
    max_position_embeddings, which an export writes back."""
    found = read_json(os.path.join(run.hub, CONFIG)) if run.hub else None
    return found if isinstance(found, dict) else {}


def export(run: RunDirectory, cfg, target: str) -> dict:
    """The side files of an export, written into `target`: the model's own (HUB_DIR) as they are; where they
    hold no tokenizer and the run trained on a prepared dataset, its tokenizer.json with a tokenizer_config.json
    (PreTrainedTokenizerFast, the dataset's end-of-document token as eos) that transformers' AutoTokenizer
    loads. Returns {"files": their names, "eos_token_id": the dataset's (None for the model's own), "note": why
    there is no tokenizer}."""
    own = copy_files(run.hub, target) if run.hub else []
    if TOKENIZER in own or "tokenizer.model" in own:
        return {"files": own, "eos_token_id": None, "note": None}
    if cfg.data.source != "records":
        where = "the model's own files hold none and " if run.hub else ""
        return {"files": own, "eos_token_id": None, "note": f"{where}the run's data (data.source={cfg.data.source}) "
                                                            "has none"}
    from trainer.manifest import inside, load_manifest

    try:
        manifest = load_manifest(cfg.data.path)
        source = inside(manifest, manifest.get("tokenizer", {}).get("file", TOKENIZER), "tokenizer.file",
                        cfg.data.path)
        from etils import epath

        text = epath.Path(source).read_text()
    except Exception as e:  # noqa: BLE001 - a DataError, OSError, or a remote store's own: said, not raised
        return {"files": own, "eos_token_id": None, "note": f"its dataset's cannot be read: {e}"}
    with open(os.path.join(target, TOKENIZER), "w", encoding="utf-8") as f:
        f.write(text)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": manifest["eod_token"],
              "model_max_length": cfg.data.seq_len, "clean_up_tokenization_spaces": False}
    with open(os.path.join(target, TOKENIZER_CONFIG), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    return {"files": [*own, TOKENIZER, TOKENIZER_CONFIG], "eos_token_id": manifest["eod_id"], "note": None}
