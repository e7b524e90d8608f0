"""A trained run read back for inference (`sample`, `python -m trainer.serve`, the serving benchmark): the
trainer config it saved beside its checkpoints, which rebuilds its model, and the codec between text and
its token ids as its data saw them. Where the run is, and what it holds, is trainer/outputs.py's
RunDirectory. Every problem a user can fix is a RunError (exit 2) naming the file or the option."""

from __future__ import annotations

import json
import os

import click

from trainer.outputs import NoRun, RunDirectory
from trainer.status import EXIT_USAGE

MAX_CONFIG_BYTES = 1 << 20  # a run's config.json is a few KiB


class RunError(click.UsageError):
    exit_code = EXIT_USAGE


def find_run(directory: str, option: str = "--checkpoint", progress=None) -> RunDirectory:
    """The run `directory` names (its output directory or its checkpoints directory), or the import of a Hugging
    Face directory (config.json and safetensors: trainer/hf/cache.py imports it once, saying so with `progress`,
    stderr by default); RunError if none."""
    if "://" not in directory:
        from trainer.hf.cache import imported, is_hub_directory

        if is_hub_directory(directory):
            from trainer.hf.errors import HFError, WriteError

            try:
                directory = imported(directory, progress or (lambda message: click.echo(message, err=True)))
            except (HFError, WriteError) as e:
                raise RunError(f"{option} {directory}: {e}") from None
    try:
        return RunDirectory.find(directory, option)
    except NoRun as e:
        hint = ", or a Hugging Face checkpoint's directory (config.json and *.safetensors)"
        raise RunError(f"{e}{hint if 'holds no checkpoint' in str(e) else ''}") from None


def load_run_config(path: str):
    import pydantic
    from etils import epath

    from trainer.config import Config, describe

    if not epath.Path(path).exists():
        raise RunError(f"{path} does not exist: the run's config is needed to rebuild its model (the trainer "
                          "writes it to OUTPUT_DIR/config.json)")
    if "://" not in path:
        from trainer.manifest import DataError, regular_file

        try:  # found without opening it: a FIFO would wait for a writer for ever, a device never end
            size = regular_file(path, "the run's config")
        except DataError as e:
            raise RunError(str(e)) from None
        if size > MAX_CONFIG_BYTES:
            raise RunError(f"{path} is {size >> 20} MiB: not a config the trainer wrote")
    try:
        return Config.model_validate(json.loads(epath.Path(path).read_text()))
    except pydantic.ValidationError as e:
        raise RunError(f"{path}: {describe(e.errors()[0])}") from None
    except ValueError as e:
        raise RunError(f"{path} is not a config: {e}") from None


def context_of(cfg, run: RunDirectory | None) -> tuple[int, str]:
    """(the positions a checkpoint's model takes, what says so), the one answer `sample` and `serve` give: an
    imported Hugging Face model's `max_position_embeddings` (its hf/config.json, which the import keeps), else
    data.seq_len, the length the run was trained on (positions past it mean nothing to the model)."""
    hub = run.hub if run is not None else None
    if hub:
        try:
            with open(os.path.join(hub, "config.json"), encoding="utf-8") as f:
                positions = json.load(f).get("max_position_embeddings")
        except (OSError, ValueError, AttributeError):
            positions = None
        if isinstance(positions, int) and not isinstance(positions, bool) and positions > 0:
            return positions, f"max_position_embeddings={positions} in {os.path.join(hub, 'config.json')}"
    return cfg.data.seq_len, f"data.seq_len={cfg.data.seq_len}, the length it was trained on"


def end_of_document(cfg, codec, run=None) -> tuple[int | None, str | None]:
    """The end-of-document token the run's data put after each document ((id, text)), at which generation
    stops: an imported Hugging Face model's own eos_token_id, else the prepared dataset's; (None, None) for
    data without documents (bytes of one text, token arrays, synthetic)."""
    from trainer.sidefiles import eos_token_id

    hub = eos_token_id(run) if run is not None else None
    if hub is not None:
        return hub, codec.decode([hub]) if codec.tokenizer is not None else None
    if cfg.data.source != "records":
        return None, None
    from trainer.manifest import DataError, load_manifest

    try:
        manifest = load_manifest(cfg.data.path)
    except DataError:  # the dataset is gone: a --tokenizer may still name the token
        manifest = {}
    eos_id, eos_token = manifest.get("eod_id"), manifest.get("eod_token")
    if eos_id is None and codec.tokenizer is not None:
        from trainer.prepare import EOD_TOKEN

        eos_token, eos_id = EOD_TOKEN, codec.tokenizer.token_to_id(EOD_TOKEN)
    return (eos_id, eos_token) if eos_id is not None else (None, None)


class Codec:
    """Text <-> token ids as the run's data saw them: with no --tokenizer, the tokenizer of the run's dataset,
    checked (with `checkpoints`) to be the one the run trained with."""

    def __init__(self, cfg, tokenizer_path: str | None, any_tokenizer: bool = False, checkpoints: str | None = None):
        self.kind, self.tokenizer = "ids", None
        manifest = _manifest(cfg, needed=tokenizer_path is None)
        # The manifest whose own tokenizer decodes (no --tokenizer): check_trained_on compares it with the run's.
        self.dataset = manifest if tokenizer_path is None else None
        if self.dataset is not None and checkpoints is not None and not any_tokenizer:
            check_trained_on(cfg, checkpoints, self.dataset)
        if tokenizer_path is None and manifest is not None:
            from trainer.manifest import join

            tokenizer_path = join(manifest["directory"], manifest.get("tokenizer", {}).get("file", "tokenizer.json"))
        if tokenizer_path is not None:
            from trainer.prepare import PrepareError, fingerprint, load_tokenizer

            try:
                self.tokenizer, self.kind = load_tokenizer(tokenizer_path), "tokenizer"
            except PrepareError as e:
                raise RunError(e.message) from None
            theirs = (manifest or {}).get("tokenizer", {}).get("fingerprint", "")
            if theirs and fingerprint(self.tokenizer) != theirs and not any_tokenizer:
                raise RunError(f"--tokenizer {tokenizer_path} (fingerprint {fingerprint(self.tokenizer)}) is not "
                                  f"the tokenizer the run's dataset '{cfg.data.path}' was prepared with ({theirs}): "
                                  "its ids would mean other text; leave --tokenizer out, or add --any-tokenizer to "
                                  "read and write the ids with it all the same")
        elif cfg.data.source == "text":
            self.kind = "bytes"

    def encode(self, text: str) -> list[int]:
        if self.kind == "bytes":  # the bytes as given, valid UTF-8 or not (the terminal's bytes come back)
            return list(text.encode("utf-8", "surrogateescape"))
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # undecodable argv bytes arrive as lone surrogates
            shown = text.encode("utf-8", "surrogateescape")
            raise RunError(f"--prompt {shown!r} is not UTF-8 text") from None
        if self.kind == "tokenizer":
            return self.tokenizer.encode(text, add_special_tokens=False).ids
        words = text.split()
        try:
            return [int(t) for t in words]
        except ValueError:  # names the first word that is not an id, not the whole (maybe huge) prompt
            word = next(w for w in words if not _is_int(w))
            raise RunError(f"--prompt: this run's data has no tokenizer; give token ids separated by spaces, "
                              f"got {_brief(word)} (word {words.index(word) + 1} of {len(words)})") from None

    def decode(self, ids: list[int]) -> str:
        if self.kind == "tokenizer":
            return self.tokenizer.decode(ids)
        if self.kind == "bytes":
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return " ".join(map(str, ids))


def check_trained_on(cfg, checkpoints: str, manifest: dict) -> None:
    """The dataset whose tokenizer decodes is the one the run trained on: one prepared again at data.path
    since (another tokenizer, say) would give the model's ids other text, silently. Its fingerprint
    (trainer/datasets.py: the tokenizer's among its content) against the latest checkpoint's."""
    from trainer.manifest import dataset_fingerprint

    trained = _trained_on(checkpoints)
    if trained is None or not trained.startswith("dataset:sha256:"):
        return  # a checkpoint that named its data by path, or none readable: restoring the weights says so
    now = dataset_fingerprint(manifest)
    if not trained.startswith(now):
        raise RunError(f"the dataset at data.path '{cfg.data.path}' is not the one the run trained on (fingerprint "
                       f"{now}, the run's {trained.split(':heldout')[0]}): prepared again since? Its tokenizer's "
                       "ids may mean other text; "
                       "give the run's tokenizer with --tokenizer FILE, or add --any-tokenizer to use the "
                       "dataset's all the same")


def _trained_on(checkpoints: str) -> str | None:
    """The data fingerprint saved with the latest checkpoint (None where it cannot be read)."""
    import orbax.checkpoint as ocp

    from trainer.checkpoint import quiet_orbax

    path = checkpoints if "://" in checkpoints else os.path.abspath(checkpoints)
    try:
        with quiet_orbax():
            manager = ocp.CheckpointManager(path, options=ocp.CheckpointManagerOptions(read_only=True))
            step = manager.latest_step()
            meta = None if step is None else manager.restore(
                step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))["data"]
    except Exception:  # noqa: BLE001 - a damaged checkpoint: restoring the weights reports it, naming it
        return None
    source = meta.get("source") if isinstance(meta, dict) else None
    return source if isinstance(source, str) else None


def _manifest(cfg, needed: bool):
    """The run's dataset manifest (records data), or None. A missing dataset is an error only when its
    tokenizer is `needed` (no --tokenizer given)."""
    if cfg.data.source != "records":
        return None
    from trainer.manifest import DataError, load_manifest

    try:
        return load_manifest(cfg.data.path)
    except DataError as e:
        if needed:
            raise RunError(f"{e}; or give the dataset's tokenizer with --tokenizer FILE") from None
        return None


def _is_int(word: str) -> bool:
    try:
        int(word)
    except ValueError:
        return False
    return True


def _brief(text: str, width: int = 40) -> str:
    """repr() of a piece of the user's input, cut short: a message names it, it does not print it all."""
    shown = repr(text)
    return shown if len(shown) <= width else shown[:width - 4] + "...'"
