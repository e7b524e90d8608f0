"""What serving needs of a device's memory: the weights' shards and the KV cache, against what the device
holds. Apart from start-up so that `sample` checks its request with the same figures without importing the
server's start-up (which imports `sample`'s checkpoint helpers)."""

from __future__ import annotations

import math
import os

# The weight formats the engine quantizes to on load (QUANTIZED_WEIGHTS) and the share of memory beyond
# weights and cache (HEADROOM): jax-free, for the planner too.
from trainer.arith.quant import HEADROOM, QUANTIZED_WEIGHTS  # noqa: F401


def memory_plan(model, slots: int, max_len: int, kv_dtype, quantized) -> dict[str, int]:
    """Bytes on the busiest device: its shard of each weight, and its part of the KV cache (latent attention's
    latents: the positions it holds, trainer/serve/latentcache.py; a sliding layer's: its window's positions a
    slot, trainer/serve/ringcache.py).
    `quantized`: "int8", "int4" or "mxfp4" (True: int8), or None (False): the checkpoint's own dtype."""
    from trainer.serve.latentcache import CacheLayout

    quantized = "int8" if quantized is True else quantized or None
    held = {name: (weight_shard_bytes(name, var.get_value(), model.shardings["params"][name], quantized),
                   weight_shard_bytes(name, var.get_value(), model.shardings["params"][name], None))
            for name, var in model.codec.variables.items()}
    cache = CacheLayout.of(model.cfg.model).device_bytes(model.mesh, slots, max_len, kv_dtype)
    plan = {"weights": sum(q for q, _ in held.values()), "kv_cache": cache}
    if quantized:  # a quantized load reads one float array at a time beside the quantized ones (restore_weights)
        plan["loading"] = max((f for q, f in held.values() if q != f), default=0)
    return plan


def load_peak(plan: dict[str, int]) -> int:
    """The most bytes a device holds: while loading (the weights and one float array being quantized) or
    while serving (the weights, the KV cache and the prefix cache, allocated after loading)."""
    return plan["weights"] + max(plan["kv_cache"] + plan.get("prefix_cache", 0), plan.get("loading", 0))


def weight_shard_bytes(name: str, value, sharding, quantized: str | None) -> int:
    """A device's bytes of one weight: its shard in its own dtype, or quantized as trainer/serve/quant.py
    (int8: a float32 scale per output channel), quant4.py (int4: packed, a float32 scale per group) or mxfp4.py
    (the routed experts: FP4 values, a scale byte a block of 32)."""
    import jax.numpy as jnp

    from trainer.serve import mxfp4, quant, quant4

    shard = sharding.shard_shape(value.shape)
    count = math.prod(shard)
    if quantized == "int4" and quant4.group_axis(name, value.shape) is not None:
        return quant4.shard_bytes(value.shape, quant4.group_axis(name, value.shape), sharding)
    if quantized == "mxfp4" and mxfp4.mxfp4_axis(name, value.shape) is not None:
        return mxfp4.shard_bytes(value.shape, mxfp4.mxfp4_axis(name, value.shape), sharding)
    axes = quant.input_axes(name, value.ndim) if quantized == "int8" else None
    if axes is None:
        return count * jnp.dtype(value.dtype).itemsize
    return count + 4 * count // math.prod(shard[a] for a in axes)  # int8 values, a float32 scale a channel


def device_memory(device) -> int | None:
    """The bytes the device can hold (TPU and GPU report it; CPU does not: no check there)."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - a backend without memory statistics
        return None
    return stats.get("bytes_limit")


def host_memory() -> int | None:
    """The host's physical memory in bytes, what a CPU's (fake) devices share; None where the platform does
    not say."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
