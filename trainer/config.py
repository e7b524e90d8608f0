"""The trainer's typed config: YAML (a named config or a path) plus `--set` overrides -> frozen pydantic models.

Nothing downstream sees raw dicts: `load_config` returns a `Config`, and every problem (an unknown key,
a wrong type, a bad value) raises `ConfigError` naming the key and, for unknown keys, the closest valid one.
`check` is the same validation for the control plane, which checks a run's `trainer:` section before it
creates anything. This module imports neither jax nor flax, so that check stays cheap.
"""

from __future__ import annotations

import difflib
import pathlib
import re
import stat
import typing
from typing import Annotated, Any, Literal, Self

import pydantic
import yaml
from pydantic import Field, field_validator, model_validator

from trainer import safeyaml
from trainer.files import kind_of
from trainer.model_config import ModelConfig
from trainer.moe.config import MoEConfig
from trainer.schema import Flag, Integer, NonNegative, Number, Positive, Section, explain, invalid

CONFIG_DIR = pathlib.Path(__file__).parent / "configs"


class ConfigError(ValueError):
    """A config that cannot be used; the message names the key and how to fix it."""


MAX_BATCH_TOKENS = 2**31 - 1  # a batch is one int32 array, indexed by int32 on the devices


# What `train` says of a config that names no data (data.source: none, as `hf import` writes it).
NO_DATA = ("data.source is none: this config names no data to train on (an imported model's config: its training "
           "data is not in its checkpoint). Give a dataset `moe-tpu data prepare` wrote with the model's tokenizer, "
           "--set data.source=records --set data.path=DIR, or ask for random tokens with --set data.source=synthetic")


class DataConfig(Section):
    # none: no data chosen yet (an import's config); `train` refuses it (NO_DATA), `sample` and `serve` need none
    source: Literal["synthetic", "text", "tokens", "records", "none"] = "synthetic"
    seq_len: Integer = Field(64, ge=2)
    global_batch_size: Positive = 16
    path: str = ""  # text: a glob of local files; tokens: a .npy or raw .bin file; records: a prepared dataset
    # directory (manifest.json + ArrayRecord shards, from `python -m trainer.prepare`); local or gs://
    eval_path: str = ""  # evaluation data of the same kind as data.path (tokens, records or text)
    # or hold out this share of data.path's records (tokens, records) for evaluation
    eval_share: Number = Field(0.0, ge=0, lt=1)
    token_dtype: Literal["uint16", "uint32"] = "uint16"  # raw .bin token files
    synthetic_vocab: Positive = 32  # states of the Markov source (token ids 0..synthetic_vocab-1)
    synthetic_branching: Positive = 4  # successors per state with non-zero probability
    # Dirichlet concentration of each state's successor weights
    synthetic_concentration: Number = Field(1.0, gt=0)

    @model_validator(mode="after")
    def _valid(self) -> Self:
        if self.source in ("text", "tokens") and not self.path:
            raise ValueError(f"data.source={self.source} needs data.path (set it with --set data.path=...)")
        if self.eval_share and self.eval_path:
            raise ValueError("set data.eval_path or data.eval_share, not both")
        if self.eval_share and self.source in ("synthetic", "text"):
            raise ValueError(f"data.source={self.source} has no records to hold out; set data.eval_path instead"
                             if self.source == "text" else "synthetic data is evaluated on fresh samples: "
                             "leave data.eval_share at 0")
        if self.global_batch_size * (self.seq_len + 1) > MAX_BATCH_TOKENS:
            raise ValueError(f"data.global_batch_size x (data.seq_len + 1) = {self.global_batch_size:,} x "
                             f"{self.seq_len + 1:,} tokens per step is more than one batch can hold "
                             f"({MAX_BATCH_TOKENS:,}, the int32 index limit)")
        if self.synthetic_branching > self.synthetic_vocab:
            raise ValueError(f"data.synthetic_branching must be between 1 and data.synthetic_vocab "
                             f"({self.synthetic_vocab}), got {self.synthetic_branching}")
        return self


# The step counter is an int32 in the train state and the learning-rate schedule: past this, jax cannot take it.
MAX_STEPS = 2**31 - 1
StepCount = Annotated[Integer, Field(ge=0, le=MAX_STEPS, description="the step counter is a 32-bit integer")]


class OptimConfig(Section):
    lr: Number = Field(3e-3, gt=0)
    warmup_steps: StepCount = 10
    decay_steps: StepCount = 0  # 0: decay over the run's --steps
    min_lr_ratio: Number = Field(0.1, ge=0, le=1)
    weight_decay: Number = Field(0.1, ge=0)
    b1: Number = Field(0.9, ge=0, lt=1)
    b2: Number = Field(0.95, ge=0, lt=1)
    eps: Number = Field(1e-8, ge=0)
    clip_norm: Number = Field(1.0, ge=0)  # 0: no clipping


# Seeds become 32-bit PRNG keys and numpy generators: past this, jax cannot take them.
MAX_SEED = 2**31 - 1


class TrainConfig(Section):
    steps: StepCount = 200
    seed: Integer = Field(0, ge=0, le=MAX_SEED, description="it becomes a 32-bit PRNG key")
    log_every: Positive = 1
    checkpoint_every: Positive = 100
    # Checkpoint arrays compressed with zstd (orbax's default). Weights compress little: without it bfloat16
    # weights took 1.28x the disk and saved 1.6-1.8x as fast; restoring was 1.6-1.7x as fast on 2 CPU cores,
    # 1.07x on a v5e host's 13 (benchmarks/checkpoint_codec.py). Either is read back whatever this says.
    checkpoint_compression: Flag = True
    keep_checkpoints: Positive = 3
    fsdp: Flag = False  # shard the non-expert weights' embed axis over the data axis
    # split the vocabulary (embedding rows, the head's columns, the logits) over the mesh's model axis
    shard_vocab: Flag = False
    # Positions per chunk of the loss (a divisor of data.seq_len): the float32 logits are made a chunk at a
    # time and again in the backward pass, never all at once; 0: all at once.
    loss_chunk: NonNegative = 0
    # On an accelerator, the first steps run on a program XLA compiles quickly (optimisation level O1) until
    # the optimised one, compiled after it, is ready (trainer/step.py TieredStep); false: every step waits for
    # the optimised one.
    quick_compile: Flag = True
    # The compiled train step and initial state's program (and a server's step programs, for the run it serves)
    # kept under a key of what they are made from, so that a restart skips tracing and lowering them
    # (trainer/program_cache.py).
    program_cache: Flag = True
    eval_every: NonNegative = 0  # evaluate every N steps (and at the last step); 0: never
    eval_batches: Positive = 4  # global batches per evaluation (the same ones every time)
    profile_steps: tuple[Integer, Integer] | None = None  # [A, B]: a jax profiler trace of steps A..B (1-based)
    # in OUTPUT_DIR/profile, as --profile-steps A:B does
    tensorboard: Flag = True  # event files in OUTPUT_DIR/tensorboard (or $AIP_TENSORBOARD_LOG_DIR)
    # A run's output (or checkpoints) directory whose latest parameters a fresh run starts from (a
    # fine-tune: a new optimizer and data stream; trainer/init_from.py); --init-from sets it.
    init_from: Annotated[str, Field(min_length=1)] | None = None

    @field_validator("profile_steps", mode="before")
    @classmethod
    def _steps_range(cls, value: Any) -> Any:
        # (errors of our own kind: describe() words them "train.profile_steps: ...")
        if isinstance(value, str):
            try:
                return parse_steps_range(value)
            except ValueError as e:
                raise invalid(str(e)) from None
        if isinstance(value, int) and not isinstance(value, bool):  # YAML 1.1 reads 3:5 as 185
            raise invalid(f"expected [A, B] (YAML reads A:B unquoted as a number), got {value}")
        return value

    @model_validator(mode="after")
    def _valid(self) -> Self:
        if self.profile_steps is not None and not 1 <= self.profile_steps[0] <= self.profile_steps[1]:
            raise ValueError(f"train.profile_steps must be [A, B] with 1 <= A <= B, got {list(self.profile_steps)}")
        return self


class Config(Section):
    name: str = "custom"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # compute dtype
    param_dtype: Literal["float32", "bfloat16", "float16"] = "float32"  # master weights
    model: ModelConfig = ModelConfig()
    moe: MoEConfig = MoEConfig()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()

    @field_validator("model", "moe", "data", "optim", "train", mode="before")
    @classmethod
    def _empty_section(cls, value: Any) -> Any:
        return {} if value is None else value  # a YAML section with no keys under it

    @model_validator(mode="after")
    def _valid(self) -> Self:
        if self.data.source == "synthetic" and self.data.synthetic_vocab > self.model.vocab_size:
            raise ValueError(f"data.synthetic_vocab ({self.data.synthetic_vocab}) exceeds model.vocab_size "
                             f"({self.model.vocab_size})")
        if self.train.eval_every and self.data.source != "synthetic" and not (self.data.eval_path
                                                                              or self.data.eval_share):
            raise ValueError(f"train.eval_every needs evaluation data: set data.eval_path"
                             f"{'' if self.data.source == 'text' else ' or data.eval_share'}")
        if self.data.source == "text" and self.model.vocab_size < 256:
            raise ValueError(f"byte-level text needs model.vocab_size >= 256, got {self.model.vocab_size}")
        seq_len, chunk = self.data.seq_len, self.train.loss_chunk
        if chunk and (chunk > seq_len or seq_len % chunk):
            raise ValueError(f"train.loss_chunk ({chunk}) must divide data.seq_len ({seq_len}); 0 computes the "
                             "loss at once")
        if self.model.attention == "splash" and seq_len % 128:
            raise ValueError(f"model.attention=splash needs data.seq_len a multiple of 128, got {seq_len}: set "
                             "model.attention=auto (XLA's attention for such lengths) or another data.seq_len")
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump()


def with_absolute_paths(cfg: Config, base: str | None = None) -> Config:
    """`cfg` with its local paths (data.path, data.eval_path, train.init_from) made absolute from `base` (the
    working directory): a run keeps them so, and its config.json then means the same files from any
    directory, for `sample`, `serve`, a resumed run and a deploy alike. URLs (gs://) are left as they are."""
    import os

    def absolute(path: str | None) -> str | None:
        if not path or "://" in path or os.path.isabs(path):
            return path
        return os.path.normpath(os.path.join(base or os.getcwd(), path))

    data = {k: absolute(getattr(cfg.data, k)) for k in ("path", "eval_path")}
    train = {"init_from": absolute(cfg.train.init_from)}
    return cfg.model_copy(update={"data": cfg.data.model_copy(update=data),
                                  "train": cfg.train.model_copy(update=train)})


def printable(text: str) -> str:
    """`text` with its control characters (terminal escapes above all) written as escapes: a value from a
    config is echoed in messages, and must not drive the user's terminal."""
    return "".join(c if c.isprintable() or c in "\n\t" else repr(c)[1:-1] for c in text)


def parse_steps_range(text: str) -> tuple[int, int]:
    """"A:B" with 1 <= A <= B (steps to trace) -> (A, B)."""
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text)
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise ValueError(f"expected A:B with 1 <= A <= B (steps to trace), got '{text}'")
    return int(m.group(1)), int(m.group(2))


def named_configs() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


NAMED_CONFIGS: tuple[str, ...] = tuple(named_configs())


def check(config: str, overrides: list[str], steps: int | None = None) -> None:
    """Raises `ConfigError` for anything `load_config` rejects, and for fewer than one step to train.

    `config` is a named config or a YAML path (relative paths from the working directory), `overrides`
    are `--set` items (`key.sub=value`), `steps` is the run's `--steps` (None: the config's train.steps).
    Imports neither jax nor flax: the control plane calls it before it creates anything.
    """
    cfg = load_config(config, list(overrides))
    if cfg.data.source == "none":
        raise ConfigError(NO_DATA)
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int)):
        raise ConfigError(f"steps must be an integer, got {steps!r}")
    if steps is None and cfg.train.steps < 1:
        raise ConfigError(f"train.steps must be at least 1 for a run, got {cfg.train.steps}")
    if steps is not None and steps < 1:
        raise ConfigError(f"steps must be at least 1, got {steps}")
    if steps is not None and steps > MAX_STEPS:
        raise ConfigError(f"steps must be at most {MAX_STEPS:,} (the step counter is a 32-bit integer), got {steps}")


def load_config(name_or_path: str, overrides: typing.Sequence[str] = ()) -> Config:
    """Reads a named config (e.g. `tiny`) or a YAML path, applies `key.sub=value` overrides, validates."""
    raw = _read_yaml(name_or_path, seen=())
    for item in overrides:
        key, value = _parse_override(item)
        _set_path(raw, key, value)
    name = raw.pop("name", None) or pathlib.Path(name_or_path).stem
    try:
        return Config.model_validate({**raw, "name": name})
    except pydantic.ValidationError as e:
        raise ConfigError(describe(e.errors()[0])) from None


def _read_yaml(name_or_path: str, seen: tuple[str, ...], via: str = "") -> dict[str, Any]:
    path = pathlib.Path(name_or_path)
    if not (path.suffix in (".yaml", ".yml") or path.exists()):
        path = CONFIG_DIR / f"{name_or_path}.yaml"
        if not path.exists():
            close = difflib.get_close_matches(name_or_path, named_configs(), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(f"unknown config '{name_or_path}'{hint}; named configs: "
                              f"{', '.join(named_configs())}, or give a path to a YAML file")
    _check_file(path, via)
    if str(path.resolve()) in seen:
        raise ConfigError(f"config {path} inherits from itself via 'base'")
    try:
        root = safeyaml.compose(path.read_text(encoding="utf-8"))
        twice = _duplicate_key(root)
        if twice:
            raise ConfigError(f"config {path}: the key '{twice[0]}' appears twice (lines {twice[1]} and {twice[2]}); "
                              "keep one")
        raw = safeyaml.construct(root) or {}
    except safeyaml.Unbounded as e:
        raise ConfigError(f"config {path} is not a config: {e}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"config {path} is not valid YAML: {safeyaml.describe(e)}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config {path}: {getattr(e, 'strerror', None) or e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config {path} must be a mapping of keys to values")
    base = raw.pop("base", None)
    if base is None:
        return raw
    if not isinstance(base, str) or not base:
        raise ConfigError(f"config {path}: base must be the path of a config file or a config's name, got {base!r:.80}")
    merged = _read_yaml(base, seen + (str(path.resolve()),), via=f"base of {path}")
    merged.pop("name", None)
    _deep_update(merged, raw)
    return merged


MAX_CONFIG_BYTES = 64 << 20  # a config is a few kilobytes; this only keeps a huge file from filling memory


def _check_file(path: pathlib.Path, via: str) -> None:
    """A config file that exists and is a regular file of sensible size, found without opening it: a FIFO
    would block, /dev/zero never end, a directory is no config."""
    what = f"the {via}, {path}," if via else f"config file {path}"
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ConfigError(f"{what} does not exist") from None
    except OSError as e:
        raise ConfigError(f"cannot read {what}: {e.strerror}") from None
    if stat.S_ISDIR(st.st_mode) and not via:
        raise ConfigError(f"cannot read config {path}: Is a directory")
    kind = kind_of(st.st_mode)
    if kind:
        raise ConfigError(f"{what} is {kind}, not a config file")
    if st.st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{what} is {st.st_size:,} bytes: no config (they are a few kilobytes)")


def _duplicate_key(root: yaml.Node | None) -> tuple[str, int, int] | None:
    """(dotted key, first line, second line) of the first key given twice in a mapping, or None: YAML
    keeps the last silently, and a user who wrote both meant one of them."""
    stack: list[tuple[yaml.Node | None, str]] = [(root, "")]
    while stack:
        node, prefix = stack.pop()
        if isinstance(node, yaml.MappingNode):
            lines: dict[str, int] = {}
            for key_node, value_node in node.value:
                key = f"{prefix}{key_node.value}"
                if key in lines:
                    return key, lines[key], key_node.start_mark.line + 1
                lines[key] = key_node.start_mark.line + 1
                stack.append((value_node, f"{key}."))
    return None


def _deep_update(dst: dict, src: dict) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _deep_update(dst[k], v)
        else:
            dst[k] = v


def _parse_override(item: str) -> tuple[str, Any]:
    key, sep, text = item.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set expects key.sub=value, got '{item}'")
    try:
        value = safeyaml.load(text) if text.strip() else ""
    except safeyaml.Unbounded as e:
        raise ConfigError(f"--set {key.strip()}: the value is not a config value: {e}") from None
    except yaml.YAMLError:
        value = text
    return key.strip(), value


def _set_path(raw: dict, key: str, value: Any) -> None:
    node = raw
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: '{part}' is not a section")
    node[parts[-1]] = value


def describe(error: Any) -> str:
    """One pydantic error in the project's words (trainer.schema.explain), naming the dotted key first."""
    loc = tuple(str(part) for part in error["loc"])
    key = ".".join(loc)
    if error["type"] == "value_error":
        return f"invalid config: {_qualify(str(error['ctx']['error']), loc)}"
    text = explain(error, _section_or_none, dotted=True)
    if error["type"] == "extra_forbidden":
        return text
    if text.startswith("must be "):
        return f"{key or 'the config'} {text}"
    return f"{key}: {text}"


def _section_or_none(loc: tuple[str, ...]) -> type[Section] | None:
    try:
        cls = _section(tuple(str(part) for part in loc))
    except (KeyError, AttributeError):
        return None
    return cls if isinstance(cls, type) and issubclass(cls, Section) else None


def _section(loc: tuple[str, ...]) -> type[Section]:
    cls: type[Section] = Config
    for part in loc:
        cls = cls.model_fields[part].annotation
        # an optional section (model.mla: MLAConfig | None): the section
        cls = next((a for a in typing.get_args(cls) if isinstance(a, type) and issubclass(a, Section)), cls)
    return cls


def _qualify(message: str, loc: tuple[str, ...]) -> str:
    """A section's own check may name its field bare ('top_k must be ...'): name it in full ('moe.top_k')."""
    cls = _section(loc)
    message = message.removeprefix(f"{cls.__name__}: ")
    prefix = "".join(f"{part}." for part in loc)
    if prefix and message.split(" ", 1)[0] in cls.model_fields:
        return prefix + message
    return message if not prefix or message.startswith(prefix) else f"{prefix.rstrip('.')}: {message}"
