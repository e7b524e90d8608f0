"""What a checkpoint records of the run that wrote it, and the check that a resume continues that run
(the same model and data; a longer run's schedule said aloud)."""

from __future__ import annotations

from typing import Any

from trainer.config import Config, ConfigError
from trainer.data import DataIterator
from trainer.metrics import Reporter

# The config keys that decide a checkpoint's arrays and their meaning: a different value is another model.
MODEL_KEYS = ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "d_ff", "moe_every",
              "tie_embeddings", "tied_head_scale")


# Recorded since the model gained them: a checkpoint without the key had the default (None: no latent attention).
LATER_KEYS = {"model.mla": None}


def model_identity(cfg: Config) -> dict[str, Any]:
    """What a checkpoint records of the model it holds: its sizes, its attention and its experts."""
    mla = cfg.model.mla.model_dump() if cfg.model.mla else None
    return {**{f"model.{k}": getattr(cfg.model, k) for k in MODEL_KEYS}, "model.mla": mla,
            "moe.num_experts": cfg.moe.num_experts}


def checkpoint_meta(cfg: Config, steps: int, data: DataIterator) -> dict[str, Any]:
    """The JSON saved beside the state: the data position, and what resuming must agree with."""
    return {**data.state(), "model": model_identity(cfg), "steps": steps,
            "decay_steps": cfg.optim.decay_steps or steps}


def _content_based(fingerprint: str) -> bool:
    return fingerprint.startswith(("dataset:sha256:", "tokens:sha256:"))


def _path_based(fingerprint: str) -> bool:
    """Checkpoints written before datasets were known by their content named them by their path: a path says
    nothing of the data now there, so they are taken as they are."""
    return fingerprint.startswith(("records:", "tokens:")) and not _content_based(fingerprint)


def _dataset(fingerprint: str) -> str:
    return f"the dataset with fingerprint {fingerprint}" if _content_based(fingerprint) else fingerprint


def check_resumable(saved: dict, cfg: Config, data: DataIterator, steps: int, reporter: Reporter,
                    allow_data_change: bool = False) -> bool:
    """Refuse (ConfigError, exit 2) to resume another model's or another data source's checkpoint, naming
    what differs; say how a longer run changes the learning-rate schedule. With `allow_data_change`,
    other data is said aloud instead of refused. Returns whether the saved data position applies (False:
    the data changed, and its stream starts at the beginning of the data now configured)."""
    recorded = saved.get("model") or {}
    recorded = {**LATER_KEYS, **recorded} if recorded else {}
    differences = [f"{key} is {value} in the checkpoint, {now} now"
                   for key, value in recorded.items() if (now := model_identity(cfg).get(key, value)) != value]
    source = saved.get("source")
    data_change = None
    if source is not None and source != data.fingerprint and not _path_based(source):
        data_change = (f"the data is {_dataset(source)} in the checkpoint, {_dataset(data.fingerprint)} now "
                       f"(data.path {cfg.data.path or cfg.data.source} holds other data than the checkpoints "
                       "were trained on)" if _content_based(source) else
                       f"the data source is {source} in the checkpoint, {data.fingerprint} now")
    if data_change and not allow_data_change:
        differences.append(data_change)
    if differences:
        raise ConfigError("the checkpoints were written by a different run: " + "; ".join(differences)
                          + ". Resuming would train another model on them; use another --output-dir "
                            "(or --resume never in a fresh one), or set the config back"
                          + (" (--allow-data-change resumes the model and optimizer on the new data)"
                             if differences == [data_change] else ""))
    if data_change:
        reporter.info(f"note: {data_change}; --allow-data-change: the model and optimizer resume, the data "
                      "stream starts at the beginning of the data now configured")
    _say_schedule(saved, cfg, steps, reporter)
    return data_change is None


def _say_schedule(saved: dict, cfg: Config, steps: int, reporter: Reporter) -> None:
    old = saved.get("decay_steps")
    new = cfg.optim.decay_steps or steps
    if isinstance(old, int) and old != new:
        reporter.info(f"note: the learning-rate schedule changes: its cosine decay ends at step {new}, not at "
                      f"step {old} as in the checkpoint's run (set optim.decay_steps={old} to keep the old one)")
