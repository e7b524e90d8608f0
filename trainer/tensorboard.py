"""TensorBoard event files of the metrics rows, from process 0 only (tensorboardX).

metrics.jsonl stays the record; this writes the same numbers under TensorBoard's usual tags into
`OUTPUT_DIR/tensorboard`, or where Vertex AI says (`AIP_TENSORBOARD_LOG_DIR`, set when the job names a
Vertex TensorBoard). tensorboardX buffers events and flushes them every `flush_secs`, never per step.
Object stores (gs://) are written through fsspec (gcsfs): tensorboardX's own gs:// writer needs the
google-cloud-storage client, which the trainer does not install.
"""

from __future__ import annotations

import io
import math
import os
import re
from typing import Any

TAGS = {
    "loss": "learning/loss", "total_loss": "learning/total_loss", "grad_norm": "learning/grad_norm",
    "lr": "learning/learning_rate", "aux_loss": "learning/aux_loss", "z_loss": "learning/z_loss",
    "entropy_floor": "learning/entropy_floor", "step_time_s": "perf/step_time_seconds",
    "tokens_per_s": "perf/tokens_per_sec", "mfu": "perf/mfu", "drop_fraction": "moe/drop_fraction",
    "eval_loss": "eval/loss", "eval_perplexity": "eval/perplexity", "eval_drop_fraction": "eval/drop_fraction",
}
FLUSH_SECS = 5


def log_dir(output_dir: str | None, env=os.environ) -> str | None:
    """Where the events go: Vertex AI's TensorBoard directory when given, else OUTPUT_DIR/tensorboard."""
    if env.get("AIP_TENSORBOARD_LOG_DIR"):
        return env["AIP_TENSORBOARD_LOG_DIR"]
    if not output_dir:
        return None
    return f"{output_dir.rstrip('/')}/tensorboard" if "://" in output_dir else os.path.join(output_dir, "tensorboard")


# "moe.{layer}.{name}": one MoE layer's balance metric in a metrics row.
_LAYER_KEY = re.compile(r"^moe\.(?P<layer>[0-9]+)\.(?P<name>[a-z_]+)$")


def scalars(row: dict[str, Any]) -> dict[str, float]:
    """A metrics row as TensorBoard tags: the scalars, the expert load's max over mean, and each MoE
    layer's balance (`moe/layer<i>/load_max_over_mean`, ...)."""
    out = {TAGS[k]: float(v) for k, v in row.items() if k in TAGS and isinstance(v, (int, float))
           and math.isfinite(v)}
    load = row.get("expert_load")
    if isinstance(load, list) and load and sum(load) > 0:
        out["moe/load_max_over_mean"] = max(load) / (sum(load) / len(load))
    for key, value in row.items():  # each MoE layer's balance (trainer/model.py LAYER_METRICS)
        if (match := _LAYER_KEY.match(key)) and isinstance(value, (int, float)) and math.isfinite(value):
            out[f"moe/layer{match['layer']}/{match['name']}"] = float(value)
    return out


class _FsspecRecordWriter:
    """One event file on an object store: the buffer is rewritten whole at each flush (objects cannot be
    appended to; event files of scalars stay small)."""

    def __init__(self, path: str):
        self.path, self.buffer = path, io.BytesIO()

    def write(self, data: bytes) -> None:
        self.buffer.write(data)

    def flush(self) -> None:
        import fsspec

        with fsspec.open(self.path, "wb") as f:
            f.write(self.buffer.getvalue())

    def close(self) -> None:
        self.flush()


class _FsspecFactory:
    def open(self, path: str):
        return _FsspecRecordWriter(path)

    def directory_check(self, path: str) -> None:  # object stores have no directories to create
        pass


# What tensorboardX imports where installed and this writer never uses: torch, to accept torch tensors, and
# google-cloud-storage, for its own gs:// writer (object stores go through _FsspecFactory here). Together
# they cost every trainer start about 1.5 s of CPU (1.1 s and 0.45 s of tensorboardX's 1.7 s, measured on
# 2 cores).
UNUSED_BY_TENSORBOARDX = ("torch", "google.cloud.storage")


def _tensorboardx():
    """tensorboardX, imported with UNUSED_BY_TENSORBOARDX left out where nothing imported them yet: a None in
    sys.modules makes an optional import fail as where the package is absent. They are taken out again at
    once, so a later import of either works."""
    import sys

    masked = [name for name in UNUSED_BY_TENSORBOARDX if name not in sys.modules]
    if "tensorboardX" not in sys.modules:
        for name in masked:
            sys.modules[name] = None
    try:
        import tensorboardX
    finally:
        for name in masked:
            if name in sys.modules and sys.modules[name] is None:
                del sys.modules[name]
    return tensorboardX


class TensorBoardWriter:
    def __init__(self, directory: str, flush_secs: int = FLUSH_SECS):
        tensorboardx = _tensorboardx()
        SummaryWriter, record_writer = tensorboardx.SummaryWriter, tensorboardx.record_writer

        if directory.startswith("gs://"):
            record_writer.register_writer_factory("gs", _FsspecFactory())
        self.directory = directory
        self._writer = SummaryWriter(directory, flush_secs=flush_secs)

    def write(self, row: dict[str, Any]) -> None:
        """One event per row holding every scalar (an add_scalar per tag costs an event each)."""
        from tensorboardX.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=tag, simple_value=value) for tag, value in scalars(row).items()]
        self._writer._get_file_writer().add_summary(Summary(value=values), int(row["step"]))

    def close(self) -> None:
        self._writer.close()


def open_writer(output_dir: str | None, enabled: bool, warn) -> TensorBoardWriter | None:
    """The writer for process 0 (None elsewhere, when disabled or without a directory, or when it cannot be
    made: a warning, and training goes on)."""
    import jax

    directory = log_dir(output_dir) if enabled else None
    if directory is None or jax.process_index() != 0:
        return None
    try:
        return TensorBoardWriter(directory)
    except Exception as e:  # noqa: BLE001 - TensorBoard is a copy of metrics.jsonl: training goes on
        warn(f"warning: no TensorBoard events in {directory}: {e}")
        return None
