"""Parameter counts and training FLOPs from the model config, and peak FLOP/s per device for MFU."""

from __future__ import annotations

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


def _layer_params(cfg: Config) -> tuple[int, int, int]:
    """(attention, dense FFN, one expert) matmul parameters of one layer."""
    m = cfg.model
    attn = m.d_model * m.head_size * (2 * m.num_heads + 2 * m.kv_heads)
    return attn, 3 * m.d_model * m.d_ff, 3 * m.d_model * cfg.moe.d_ff


def param_counts(cfg: Config) -> dict[str, int]:
    """Total parameters and the matmul parameters one token passes through ("active")."""
    m, e = cfg.model, cfg.moe
    attn, dense, expert = _layer_params(cfg)
    shared = getattr(e, "num_shared_experts", 0)
    n_moe = m.num_moe_layers
    n_dense = m.num_layers - n_moe
    embed = m.vocab_size * m.d_model
    head = 0 if m.tie_embeddings else m.vocab_size * m.d_model
    norms = (2 * m.num_layers + 1) * m.d_model
    router = m.d_model * e.num_experts
    total = (embed + head + norms + m.num_layers * attn + n_dense * dense
             + n_moe * (router + (e.num_experts + shared) * expert))
    active = (m.vocab_size * m.d_model + m.num_layers * attn + n_dense * dense
              + n_moe * (router + (e.top_k + shared) * expert))
    return {"total": total, "active": active}


def flops_per_token(cfg: Config) -> float:
    """Training FLOPs per token: 6 x active matmul params + 12 x layers x seq x attention width (PaLM)."""
    m = cfg.model
    attention = 12 * m.num_layers * cfg.data.seq_len * m.num_heads * m.head_size
    return 6.0 * param_counts(cfg)["active"] + attention


def flops_per_step(cfg: Config) -> float:
    return flops_per_token(cfg) * cfg.data.global_batch_size * cfg.data.seq_len


def mfu(cfg: Config, step_time_s: float, num_devices: int, device_kind: str) -> float | None:
    peak = device_peak_flops(device_kind)
    if peak is None or step_time_s <= 0:
        return None
    return flops_per_step(cfg) / step_time_s / (peak * num_devices)
