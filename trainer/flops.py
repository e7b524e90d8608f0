"""Parameter counts and training FLOPs of the model, and peak FLOP/s per device for MFU.

Every count comes from the parameters the trainer itself creates (trainer.params.param_inventory), counted
by trainer/arith/counts.py, so the MFU the trainer logs and the FLOPs `moe-tpu plan` bounds the step time
with are one count.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from trainer.arith.counts import (  # noqa: F401 - the counts and FLOPs, one place (jax-free for the planner)
    ParamCounts,
    attention_flops_per_token,
    count_params,
    model_flops_per_token,
)
from trainer.params import param_inventory

if TYPE_CHECKING:  # the control plane imports this module without the trainer's config loader
    from trainer.config import Config

# Dense bf16 peak FLOP/s per chip, by the start of jax's device_kind. Longest matching prefix wins.
PEAK_FLOPS_PER_DEVICE: dict[str, float] = {
    "TPU v5 lite": 197e12,  # v5e
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v5": 459e12,
    "TPU v6 lite": 918e12,  # v6e (Trillium)
    "TPU v6e": 918e12,
    "TPU v4": 275e12,
    "TPU v3": 123e12,
    "NVIDIA H200": 989e12,
    "NVIDIA H100": 989e12,
    "NVIDIA GH200": 989e12,
    "NVIDIA B200": 2250e12,
    "NVIDIA A100": 312e12,
    "NVIDIA L4": 121e12,
    "NVIDIA A10G": 70e12,
}


def device_peak_flops(device_kind: str) -> float | None:
    """Peak bf16 FLOP/s of one device, or None where unknown (CPUs)."""
    matches = [k for k in PEAK_FLOPS_PER_DEVICE if device_kind.startswith(k)]
    return PEAK_FLOPS_PER_DEVICE[max(matches, key=len)] if matches else None


@functools.lru_cache(maxsize=8)
def counts_of(cfg: Config) -> ParamCounts:
    """The counts of the model `cfg` builds (its parameters listed abstractly, once per config)."""
    return count_params(param_inventory(cfg), cfg)


def flops_per_token(cfg: Config) -> float:
    """Training FLOPs per token of the model `cfg` builds."""
    return model_flops_per_token(counts_of(cfg), cfg)


def flops_per_step(cfg: Config) -> float:
    return flops_per_token(cfg) * cfg.data.global_batch_size * cfg.data.seq_len


def mfu(cfg: Config, step_time_s: float, num_devices: int, device_kind: str) -> float | None:
    peak = device_peak_flops(device_kind)
    if peak is None or step_time_s <= 0:
        return None
    return flops_per_step(cfg) / step_time_s / (peak * num_devices)
