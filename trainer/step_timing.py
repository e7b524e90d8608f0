"""Around the train step: the next batch on the device before the step that needs it (Feed), the steps'
metrics read together at the steps that need them (Pending), a logged row per report (throughput, MFU from
the one FLOP inventory in trainer.flops) and a profiler trace of chosen steps."""

from __future__ import annotations

import os
import time

import jax
import numpy as np

from trainer import flops
from trainer.config import Config
from trainer.sharding import global_batch


class Feed:
    """The next batch, placed on the devices while the step before it runs (a prefetch of one).

    state() is the data position of the batches handed to steps, not counting the one waiting: what a
    checkpoint records, so that a resumed run takes the waiting batch next, as an unbroken one does."""

    def __init__(self, trainer, data):
        self.trainer, self.data = trainer, data
        self.waiting: jax.Array | None = None
        self.before: dict | None = None  # the data's state before the waiting batch was pulled

    def fill(self) -> None:
        if self.waiting is None:
            self.before = self.data.state()
            self.waiting = global_batch(self.trainer, next(self.data))

    def take(self) -> jax.Array:
        self.fill()
        batch, self.waiting = self.waiting, None
        return batch

    def state(self) -> dict:
        return self.before if self.waiting is not None else self.data.state()


class Pending:
    """The metrics of the steps dispatched since the last read, still on the devices. The loop reads them
    together (one device-to-host transfer) only where it needs them: a logged row, a checkpoint, an
    evaluation, the end. Between those the host never waits for a step, so it dispatches the next one while
    the last runs."""

    def __init__(self):
        self.steps: list[int] = []
        self.metrics: list[dict] = []

    def add(self, step: int, metrics: dict) -> None:
        self.steps.append(step)
        self.metrics.append(metrics)

    def read(self) -> list[tuple[int, dict]]:
        """(step, its metrics on the host) for every step since the last read, in step order."""
        host = jax.device_get(self.metrics) if self.metrics else []
        read = list(zip(self.steps, host, strict=True))
        self.steps, self.metrics = [], []
        return read


class StepTimer:
    """Turns the train step's device metrics into a logged row with throughput and MFU."""

    def __init__(self, cfg: Config, num_devices: int, device_kind: str, start_step: int = 0):
        self.cfg, self.num_devices, self.device_kind = cfg, num_devices, device_kind
        self.tokens_per_step = cfg.data.global_batch_size * cfg.data.seq_len
        self.last_time, self.last_step = time.perf_counter(), start_step

    def restart(self) -> None:
        self.last_time = time.perf_counter()

    def row(self, step: int, metrics: dict, entropy_floor: float | None) -> dict:
        now = time.perf_counter()
        steps = step - self.last_step
        step_time = (now - self.last_time) / max(steps, 1)
        self.last_time, self.last_step = now, step
        row = {"step": step, **{k: float(v) for k, v in metrics.items() if k not in ("expert_load", "finite")},
               "expert_load": np.asarray(metrics["expert_load"]).tolist(),
               "tokens_per_s": self.tokens_per_step / step_time, "step_time_s": step_time,
               "mfu": flops.mfu(self.cfg, step_time, self.num_devices, self.device_kind)}
        if entropy_floor is not None:
            row["entropy_floor"] = entropy_floor
        return row


class Profiler:
    """Writes a jax profiler trace of steps A..B (1-based, inclusive) to OUTPUT_DIR/profile, on process 0."""

    def __init__(self, steps: tuple[int, int] | None, output_dir: str | None):
        self.steps, self.active = steps, False
        self.directory = os.path.join(output_dir or ".", "profile")

    def before(self, step: int) -> None:
        if self.steps and not self.active and step + 1 == self.steps[0] and jax.process_index() == 0:
            jax.profiler.start_trace(self.directory)
            self.active = True

    def after(self, step: int) -> None:
        if self.active and step >= self.steps[1]:
            self.close()

    def close(self) -> None:
        if self.active:
            jax.profiler.stop_trace()
            self.active = False
