"""Around the train step: a logged row per report (throughput, MFU from the one FLOP inventory in
trainer.flops) and a profiler trace of chosen steps."""

from __future__ import annotations

import os
import time

import jax
import numpy as np

from trainer import flops
from trainer.config import Config


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
