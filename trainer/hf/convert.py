"""Import a Hugging Face checkpoint as a trainer checkpoint, and export one back.

An import writes, in OUT: `config.json` (the trainer's config of the model's shape: what `sample`, `serve`
and `--init-from` rebuild it from), `checkpoints/0/` (the orbax layout `train` writes, parameters only: a
fine-tune starts its own optimizer), and `hf/` (the source's config.json, tokenizer files and generation
defaults, verbatim: the export writes them back). Everything is written to a hidden directory beside OUT
and renamed at the end, so a failure leaves nothing in OUT. An export writes the Hub's files the same way.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from trainer import sidefiles, signals
from trainer.config import Config, DataConfig
from trainer.hf import deepseek, families, fp8, gpt_oss, mxfp4, names
from trainer.hf.errors import HFError, WriteError
from trainer.hf.orbax_io import BIAS_SUFFIX, open_run, save_params
from trainer.hf.safetensors_io import CONFIG, DTYPES, INDEX, SINGLE, HubReader, ShardWriter, read_json
from trainer.outputs import CHECKPOINTS_DIR, CONFIG_FILE, HUB_DIR, RunDirectory

IGNORED = ("rotary_emb.inv_freq",)  # buffers some older saves hold; recomputed, never read


@dataclasses.dataclass(frozen=True)
class HubModel:
    """What a Hugging Face directory holds: its config.json, the trainer config, the family, each
    layer's expert layout, and the reader of its tensors."""

    directory: str
    hub: dict
    cfg: Config
    family: families.Family
    layouts: list[str]
    reader: HubReader


def open_hub(source: str) -> HubModel:
    """Reads SRC's config.json and safetensors headers (no tensor yet) and checks the tokenizer."""
    config_path = os.path.join(source, CONFIG)
    if not os.path.isdir(source):
        raise HFError(f"{source} is not a directory holding a Hugging Face checkpoint")
    if not os.path.exists(config_path):
        raise HFError(f"{source} holds no {CONFIG}: give a Hugging Face checkpoint's directory")
    hub = read_json(config_path)
    if not isinstance(hub, dict):
        raise HFError(f"{config_path} must hold a JSON object")
    fam = families.family(hub.get("model_type"), config_path)
    reader = HubReader(source)
    embed = "model.embed_tokens.weight"
    dtype = DTYPES.get(reader.dtype(embed))
    if dtype is None:
        raise HFError(f"{reader.where_is(embed)}: '{embed}' is {reader.dtype(embed)}; float32, bfloat16 and float16 "
                      "checkpoints convert")
    cfg = families.trainer_config(hub, config_path, dtype)
    fused = lambda i: f"model.layers.{i}.mlp.experts.gate_up_proj" in reader.names()  # noqa: E731
    layouts = [names.FUSED if fused(i) else names.PER_EXPERT for i in range(cfg.model.num_layers)]
    if fam.gpt_oss:  # fused on disk, its experts' matrices in bfloat16 or MXFP4
        layouts = [names.MXFP4 if mxfp4.is_mxfp4(hub) else names.FUSED] * cfg.model.num_layers
    check_tokenizer(source, cfg.model.vocab_size)
    return HubModel(source, hub, cfg, fam, layouts, reader)


def check_tokenizer(directory: str, vocab_size: int) -> None:
    """A tokenizer.json whose ids reach past the model's vocabulary is another model's."""
    path = os.path.join(directory, "tokenizer.json")
    if not os.path.exists(path):
        return
    from tokenizers import Tokenizer

    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as e:  # noqa: BLE001 - the tokenizers library raises its own Exception subclass
        raise HFError(f"{path} cannot be read as a tokenizer: {str(e).splitlines()[0]}") from None
    top = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1)
    if top >= vocab_size:
        raise HFError(f"{path} has token id {top}, outside the model's vocabulary (config.json 'vocab_size' = "
                      f"{vocab_size}): it is another model's tokenizer")


def read_param(model: HubModel, spec: names.Spec) -> np.ndarray:
    """One trainer parameter from its Hub tensors, each checked for shape and dtype before it is read."""
    want_dtype, bias = model.cfg.param_dtype, spec.param.endswith(BIAS_SUFFIX)  # a bias is float32 state
    block = None if model.family.gpt_oss else fp8.block_size(model.hub, os.path.join(model.directory, CONFIG))
    quantized = {name for name, shape in spec.hub.items()
                 if block and len(shape) == 2 and model.reader.dtype(name) == fp8.FP8}
    packed = {name for name in spec.hub if model.family.gpt_oss and gpt_oss.is_packed(name)}  # MXFP4, uint8
    for name, shape in spec.hub.items():
        got = model.reader.shape(name)
        if got != shape:
            raise HFError(f"{model.reader.where_is(name)}: '{name}' has shape {list(got)}; config.json makes it "
                          f"{list(shape)}")
        wrong = model.reader.dtype(name) != "U8" if name in packed else \
            DTYPES.get(model.reader.dtype(name)) != want_dtype and not bias and name not in quantized
        if wrong:
            raise HFError(f"{model.reader.where_is(name)}: '{name}' is {model.reader.dtype(name)}, the checkpoint's "
                          f"other tensors are {'uint8 (MXFP4)' if name in packed else want_dtype}")
    if (quantized or packed) and want_dtype != "bfloat16":
        raise HFError(f"{model.reader.where_is(min(quantized | packed))}: {'FP8' if quantized else 'MXFP4'} "
                      f"weights dequantise to bfloat16, but the checkpoint's other tensors are {want_dtype}")
    value = spec.to_trainer(Tensors(list(spec.hub), lambda name: fp8.dequantized(model.reader, name, block)
                                    if name in quantized else model.reader.tensor(name)))
    return value.astype(np.float32) if bias else value


class Tensors(Sequence):
    """A parameter's Hub tensors, each read when it is indexed and held by no one here: a stack of E experts
    takes them one at a time (names._experts), never all E beside the stack."""

    def __init__(self, names: list[str], read: Callable[[str], np.ndarray]):
        self.names, self.read = names, read

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, i):
        return self.read(self.names[i])


def iter_params(model: HubModel) -> Iterator[tuple[str, np.ndarray]]:
    """Every trainer parameter, a layer's at a time; then any tensor of the source no parameter used is an
    error naming it (a feature the config does not declare)."""
    used = set()
    for group in names.all_specs(model.cfg, model.family, model.layouts):
        for spec in group:
            used.update(spec.hub)
            used.update(name + fp8.SCALE_SUFFIX for name in spec.hub)  # FP8 block scales, where there are
            signals.checkpoint()  # a recorded Ctrl-C or SIGTERM is acted on between two tensors
            yield spec.param, read_param(model, spec)
    extra = sorted(n for n in model.reader.names() - used
                   if not n.endswith(IGNORED) and not deepseek.skipped(model.hub, n))
    if extra:
        raise HFError(f"{model.reader.where_is(extra[0])}: the tensor '{extra[0]}' (and {len(extra) - 1} more) is "
                      f"no part of a {model.family.model_type} model as config.json describes it")


@contextlib.contextmanager
def made_parents(output: str) -> Iterator[str]:
    """OUTPUT's directory (`-o runs/x` makes runs/), made where it is missing; the directories made are removed
    again when the block fails (nothing of the command is left). Yields the directory."""
    parent = os.path.dirname(os.path.abspath(output))
    missing = []
    at = parent
    while not os.path.isdir(at) and at != os.path.dirname(at):
        missing.append(at)
        at = os.path.dirname(at)
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        _remove_empty(missing)
        raise HFError(f"-o {output}: cannot make its directory {parent}: {e.strerror or e}") from None
    try:
        yield parent
    except BaseException:
        _remove_empty(missing)
        raise


def _remove_empty(directories: list[str]) -> None:
    """The directories made_parents made, innermost first, each where it is still empty."""
    for directory in directories:
        with contextlib.suppress(OSError):
            os.rmdir(directory)


@contextlib.contextmanager
def staged(output: str) -> Iterator[str]:
    """A temporary directory beside OUTPUT that becomes OUTPUT when the block succeeds, and is removed
    when it fails. OUTPUT must not exist, or be an empty directory; its directory is made where missing."""
    output = os.path.abspath(output)
    if os.path.lexists(output) and not (os.path.isdir(output) and not os.listdir(output)):
        raise HFError(f"-o {output} exists and is not an empty directory: give a new one")
    with made_parents(output) as parent, _staged(output, parent) as tmp:
        yield tmp


@contextlib.contextmanager
def _staged(output: str, parent: str) -> Iterator[str]:
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(output)}.partial-", dir=parent)
    try:
        yield tmp
        if os.path.isdir(output):
            os.rmdir(output)
        os.rename(tmp, output)
    except OSError as e:  # a full disk, a file-system error: exit 1 (WriteError), nothing left of the output
        shutil.rmtree(tmp, ignore_errors=True)
        raise WriteError(f"cannot write {output}: {e.filename or ''}{': ' if e.filename else ''}"
                         f"{e.strerror or e}") from None
    except WriteError as e:  # the checkpoint writer's: said of OUTPUT, not of the staging directory removed
        _remove(tmp, settle=1.0)
        raise WriteError(str(e).replace(tmp, output)) from None
    except BaseException:  # bad input or a signal: the checkpoint writer, if any, ended its save (orbax_io)
        _remove(tmp, settle=0.0)
        raise


def _remove(tmp: str, settle: float) -> None:
    """Removes the staging directory and sees that it stays gone for `settle` seconds. A checkpoint writer that
    failed may still be closing files in it (tensorstore finishes its writes on threads of its own, and its
    OCDBT store writes a manifest once the context that holds it is collected), so a removal racing those can
    leave a directory behind: the context is collected first, then the directory removed until it has stayed
    absent that long (bounded: 10 s). A writer stopped by the reading side has ended its save before this, and
    needs no wait."""
    gc.collect()
    absent_since = None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        shutil.rmtree(tmp, ignore_errors=True)
        now = time.monotonic()
        if os.path.lexists(tmp):
            absent_since = None
        elif absent_since is None:
            absent_since = now
        if absent_since is not None and now - absent_since >= settle:
            return
        time.sleep(0.1)


def fetched(source: str, into: str) -> str:
    """A gs:// (or other remote) Hugging Face prefix copied into the local directory `into`, a file at a time:
    config.json, the index and the shards it names (or model.safetensors), and the tokenizer files there are.
    Returns `into`; a local SOURCE is returned as it is."""
    if "://" not in source:
        return source
    from etils import epath

    remote = epath.Path(source)

    def copy(name: str, needed: bool) -> bool:
        path = remote / name
        try:
            if not path.exists():
                if needed:
                    raise HFError(f"{source.rstrip('/')}/{name} does not exist")
                return False
            path.copy(epath.Path(into) / name)
        except OSError as e:
            raise HFError(f"cannot read {source.rstrip('/')}/{name}: {e}") from None
        return True

    copy(CONFIG, True)
    if copy(INDEX, False):
        index = read_json(os.path.join(into, INDEX))
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        for shard in sorted(set(weight_map.values()) if isinstance(weight_map, dict) else ()):
            if not isinstance(shard, str) or os.path.basename(shard) != shard:
                raise HFError(f"{source.rstrip('/')}/{INDEX} names the shard {shard!r}, which is no file name")
            if not copy(shard, False):
                raise HFError(f"{source.rstrip('/')}/{INDEX} names the shard '{shard}', which is missing from "
                              f"{source}")
    else:
        copy(SINGLE, True)
    for name in sidefiles.TOKENIZER_FILES:
        copy(name, False)
    return into


def import_checkpoint(source: str, output: str, seq_len: int | None = None) -> dict:
    """SRC (a Hugging Face directory, local or gs://) -> OUTPUT, a trainer checkpoint; returns what was done.
    The run's config names no data (data.source none: `train` asks for it) and the model's context,
    max_position_embeddings, or `seq_len` where that is less. A gs:// source is first copied beside OUTPUT
    (and removed after)."""
    if "://" in source:
        with made_parents(output) as parent:
            download = tempfile.mkdtemp(prefix=f".{os.path.basename(output)}.download-", dir=parent)
            try:
                return import_checkpoint(fetched(source, download), output, seq_len)
            finally:
                shutil.rmtree(download, ignore_errors=True)
    model = open_hub(source)
    context = min(max_positions(model.hub), seq_len or MAX_CONTEXT)
    cfg = model.cfg.model_copy(update={"data": DataConfig(source="none", seq_len=context)})
    with staged(output) as tmp:
        save_params(os.path.join(tmp, CHECKPOINTS_DIR), iter_params(model), model.cfg,
                    source=f"hf:{model.family.model_type}:{os.path.abspath(source)}",
                    names=[spec.param for group in names.all_specs(model.cfg, model.family, model.layouts)
                           for spec in group])
        with open(os.path.join(tmp, CONFIG_FILE), "w", encoding="utf-8") as f:
            f.write(cfg.model_dump_json(indent=2) + "\n")
        side = sidefiles.copy_files(source, os.path.join(tmp, HUB_DIR))
    skipped = sorted(n for n in model.reader.names() if deepseek.skipped(model.hub, n))
    return {"family": model.family.model_type, "output": os.path.abspath(output), "dtype": model.cfg.param_dtype,
            "layouts": sorted(set(model.layouts)), "files": side, "skipped": skipped, "seq_len": context}


DEFAULT_POSITIONS = 4096  # a config.json without max_position_embeddings (transformers' default for most)
MAX_CONTEXT = 2**31 - 1


def max_positions(hub: dict) -> int:
    """The model's context: config.json's max_position_embeddings (DEFAULT_POSITIONS where it names none)."""
    value = hub.get("max_position_embeddings")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 2 else DEFAULT_POSITIONS


def export_checkpoint(run: str, output: str, step: int | None = None, max_shard_bytes: int = 5 * 10**9) -> dict:
    """A trainer run's (or an imported) checkpoint -> OUTPUT in the Hub's layout; returns what was done."""
    saved = open_run(run, step)
    found = RunDirectory.at(saved.run)
    carried = sidefiles.hub_config(found)  # the imported model's own config.json (its ids, its context)
    fam = families.family_of(saved.cfg, carried.get("model_type"))
    hub = families.hub_config(saved.cfg, fam, carried)
    with staged(output) as tmp:
        writer = ShardWriter(tmp, max_shard_bytes)
        for group in names.all_specs(saved.cfg, fam):
            values = saved.read({spec.param for spec in group} | {n for spec in group for n in spec.needs})
            for spec in group:
                signals.checkpoint()  # a recorded Ctrl-C or SIGTERM is acted on between two tensors
                tensors = spec.to_hub(values[spec.param], *(values[n] for n in spec.needs))
                for name, tensor in zip(spec.writes, tensors, strict=True):
                    writer.add(name, tensor)
        shards = writer.finish()
        side = sidefiles.export(found, saved.cfg, tmp)
        if side["eos_token_id"] is not None:  # the dataset's end-of-document token: where generation stops
            hub.setdefault("eos_token_id", side["eos_token_id"])
        _write_json(os.path.join(tmp, CONFIG), hub)
        if sidefiles.GENERATION_CONFIG not in side["files"]:
            _write_json(os.path.join(tmp, sidefiles.GENERATION_CONFIG), _generation_config(hub))
    return {"family": fam.model_type, "step": saved.step, "output": os.path.abspath(output), "shards": len(shards),
            "tokenizer": sidefiles.TOKENIZER in side["files"] or "tokenizer.model" in side["files"],
            "note": side["note"]}


def _generation_config(hub: dict) -> dict:
    out = {"_from_model_config": True}
    out.update({k: hub[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if hub.get(k) is not None})
    return out


def _write_json(path: str, value: dict) -> None:
    import json

    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=2)
        f.write("\n")
