"""Parameter counts and training FLOPs of the model, and peak FLOP/s per device for MFU.

Every count comes from the parameters the trainer itself creates (trainer.params.param_inventory),
so the MFU the trainer logs and the FLOPs `moe-tpu plan` bounds the step time with are one count.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

from trainer.params import ParamInfo, param_inventory

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


@dataclasses.dataclass(frozen=True)
class ParamCounts:
    total: int
    active: int  # all but the routed experts a token does not visit
    per_expert: int  # one routed expert of one MoE layer
    embedding: int  # embedding table and output head
    experts: int  # every routed expert of every layer
    matmul_active: int  # the weights one token multiplies by (FLOPs: 6 per weight per token)


def count_params(params: Sequence[ParamInfo], cfg: Config) -> ParamCounts:
    """Counts from the trainer's own parameter list (trainer.params.param_inventory): the one place
    both the MFU and `moe-tpu plan` take their parameter and FLOP counts from."""
    total = sum(p.size for p in params)
    experts = sum(p.size for p in params if p.is_expert)
    num_experts, top_k = cfg.moe.num_experts, cfg.moe.top_k
    n_moe = cfg.model.num_moe_layers
    unvisited = experts * (num_experts - top_k) // num_experts
    # The embedding lookup is a gather, not a matmul; tied, the table is also the head (one matmul).
    lookup = 0 if cfg.model.tie_embeddings else sum(p.size for p in params if p.name == "embed")
    dense = sum(p.size for p in params if p.is_matrix and not p.is_expert)
    return ParamCounts(
        total=total, active=total - unvisited, per_expert=experts // (num_experts * n_moe) if n_moe else 0,
        embedding=sum(p.size for p in params if p.is_vocab), experts=experts,
        matmul_active=dense - lookup + experts * top_k // num_experts,
    )


def attention_flops_per_token(cfg: Config) -> float:
    """Training FLOPs of the attention scores and their weighted sum: 12 x layers x seq_len x heads x
    head_size (the PaLM convention); with latent attention the scores take the q/k head size and the sum the
    value head size, 6 x ... x each."""
    m = cfg.model
    width = m.head_size if m.mla is None else (m.mla.qk_head_dim + m.mla.v_head_dim) / 2
    return 12.0 * m.num_layers * cfg.data.seq_len * m.num_heads * width


def model_flops_per_token(counts: ParamCounts, cfg: Config) -> float:
    """Model FLOPs per token for training: 6 per active matmul weight (forward 2, backward 4), plus attention."""
    return 6.0 * counts.matmul_active + attention_flops_per_token(cfg)


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
