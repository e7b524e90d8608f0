"""What serving needs of a device's memory: the weights' shards and the KV cache, against what the device
holds. Apart from start-up so that `sample` checks its request with the same figures without importing the
server's start-up (which imports `sample`'s checkpoint helpers)."""

from __future__ import annotations

import math

# The weight formats the engine quantizes to on load (`--weights`, trainer/serve/quant.py); `auto` keeps the
# checkpoint's float dtype. The one list: the server's flag and the planner's serve verdict read it.
QUANTIZED_WEIGHTS = ("int8",)

# Beyond weights and cache: logits, activations of a prefill chunk, XLA's scratch. A share of the device
# memory, since what it covers grows with the model.
HEADROOM = 0.10


def memory_plan(model, slots: int, max_len: int, kv_dtype, int8_weights: bool) -> dict[str, int]:
    """Bytes on the busiest device: its shard of each weight, and its part of the KV cache."""
    import jax.numpy as jnp

    from trainer.serve.kvcache import KVCache
    from trainer.serve.quant import input_axes

    weights = 0
    for name, var in model.codec.variables.items():
        value = var.get_value()
        shard = model.shardings["params"][name].shard_shape(value.shape)
        count = math.prod(shard)
        axes = input_axes(name, value.ndim) if int8_weights else None
        if axes is None:
            weights += count * jnp.dtype(value.dtype).itemsize
        else:  # int8 values and a float32 scale per output channel
            weights += count + 4 * count // math.prod(shard[a] for a in axes)
    m = model.cfg.model
    cache = KVCache.nbytes(m.num_layers, slots, max_len, m.kv_heads, m.head_size, kv_dtype)
    cache //= KVCache.split_ways(model.mesh, m.kv_heads)
    return {"weights": weights, "kv_cache": cache}


def device_memory(device) -> int | None:
    """The bytes the device can hold (TPU and GPU report it; CPU does not: no check there)."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - a backend without memory statistics
        return None
    return stats.get("bytes_limit")
