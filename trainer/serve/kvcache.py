"""The serving key/value cache: every layer's keys and values for a fixed number of decode slots.

Arrays `k` and `v` are [layers, slots, max_len, kv_heads, head_size], in the compute dtype or int8. In
int8 each (position, head) vector is stored with its own float32 scale (symmetric, absmax / 127), kept
in `k_scale`/`v_scale` [layers, slots, max_len, kv_heads]: the cache is the largest buffer of a serving
chip after the weights, and int8 halves it against bfloat16.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from trainer.attention import window_mask


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: jax.Array
    v: jax.Array
    k_scale: jax.Array | None = None
    v_scale: jax.Array | None = None

    @staticmethod
    def empty(layers: int, slots: int, max_len: int, kv_heads: int, head_size: int, dtype) -> KVCache:
        shape = (layers, slots, max_len, kv_heads, head_size)
        if jnp.dtype(dtype) == jnp.int8:
            scale = jnp.zeros(shape[:-1], jnp.float32)
            return KVCache(jnp.zeros(shape, jnp.int8), jnp.zeros(shape, jnp.int8), scale, scale)
        return KVCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    @staticmethod
    def split_ways(mesh, kv_heads: int) -> int:
        """The devices one cache is split over: its KV heads over the mesh's `model` axis, as attention's
        heads are (each device keeps and reads the keys and values of its own heads); where `model` does
        not divide the KV heads (fewer KV heads than `model`: grouped-query attention), every device
        holds them all."""
        ways = dict(mesh.shape).get("model", 1)
        return ways if kv_heads % ways == 0 else 1

    @staticmethod
    def sharding(mesh, kv_heads: int, dtype) -> KVCache:
        """The cache's layout on the mesh (split_ways), as a KVCache of NamedShardings."""
        from jax.sharding import NamedSharding, PartitionSpec

        heads = "model" if KVCache.split_ways(mesh, kv_heads) > 1 else None
        values = NamedSharding(mesh, PartitionSpec(None, None, None, heads, None))
        if jnp.dtype(dtype) != jnp.int8:
            return KVCache(values, values)
        scales = NamedSharding(mesh, PartitionSpec(None, None, None, heads))
        return KVCache(values, values, scales, scales)

    @staticmethod
    def nbytes(layers: int, slots: int, max_len: int, kv_heads: int, head_size: int, dtype) -> int:
        """Bytes of a cache of this shape, without building it (the start-up memory check)."""
        per_position = kv_heads * head_size * jnp.dtype(dtype).itemsize
        if jnp.dtype(dtype) == jnp.int8:
            per_position += kv_heads * 4
        return 2 * layers * slots * max_len * per_position

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None

    def layer(self, index: int, starts_B: jax.Array, rows_B: jax.Array | None = None, span: int | None = None,
              *, window: int = 0, lengths_B: jax.Array | None = None) -> LayerCache:
        """Layer `index`'s view (LayerCache); `window` its sliding window (0: none), `lengths_B` the real
        tokens of each row (the rest padding; this cache writes padding where it falls, since a later token
        overwrites it before any reads it)."""
        del lengths_B
        return LayerCache(self, index, starts_B, rows_B, span, window)


def quantize(x_BxLxKxH: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Symmetric int8 per (row, position, head): (int8 values, float32 scales [B, L, K])."""
    x = x_BxLxKxH.astype(jnp.float32)
    scale_BxLxK = jnp.max(jnp.abs(x), axis=-1) / 127.0
    safe = jnp.where(scale_BxLxK > 0, scale_BxLxK, 1.0)[..., None]
    return jnp.clip(jnp.round(x / safe), -127, 127).astype(jnp.int8), scale_BxLxK


def read_at(index, rows_B: jax.Array | None, span: int | None, batch: int) -> tuple:
    """The index of one layer's cached positions 0..span of slots rows_B (None: the first `batch` slots, a
    slice: no gather) in a cache array [layers, slots, max_len, ...]."""
    positions = slice(None, span)
    return (index, slice(None, batch), positions) if rows_B is None else (index, rows_B, positions)


@dataclasses.dataclass
class LayerCache:
    """One layer's view of the cache for one call: batch row b holds the tokens at positions
    starts_B[b].. of slot rows_B[b] (rows_B None: row b is slot b, the first B slots in the batch). Attention reads
    the first `span` positions of each slot (None: all max_len), a static length covering every position
    the call's tokens attend to: a step then costs what its live positions need, not the whole cache. With a
    `window` a token attends to the last `window` positions only (its own included): this cache keeps every
    position, those before the window masked out (trainer/serve/ringcache.py keeps the window alone)."""

    cache: KVCache
    index: int
    starts_B: jax.Array
    rows_B: jax.Array | None
    span: int | None = None
    window: int = 0

    def append(self, k_BxLxKxH: jax.Array, v_BxLxKxH: jax.Array):
        """(the updated view, keys [B, span, K, H], values, mask [B, 1, L, span]): the new keys and
        values written at their positions, and which cached positions each new token may attend to."""
        batch, length = k_BxLxKxH.shape[:2]
        positions_BxL = self.starts_B[:, None] + jnp.arange(length, dtype=self.starts_B.dtype)
        rows_B = jnp.arange(batch) if self.rows_B is None else self.rows_B
        at = (self.index, rows_B[:, None], positions_BxL)
        c = self.cache
        # Positions past max_len (a padded last prefill chunk) are dropped, never clamped onto others.
        if c.quantized:
            kq, ks = quantize(k_BxLxKxH)
            vq, vs = quantize(v_BxLxKxH)
            c = KVCache(c.k.at[at].set(kq, mode="drop"), c.v.at[at].set(vq, mode="drop"),
                        c.k_scale.at[at].set(ks, mode="drop"), c.v_scale.at[at].set(vs, mode="drop"))
        else:
            c = KVCache(c.k.at[at].set(k_BxLxKxH.astype(c.k.dtype), mode="drop"),
                        c.v.at[at].set(v_BxLxKxH.astype(c.v.dtype), mode="drop"))
        keys, values = self._read(c, "k", batch), self._read(c, "v", batch)
        mask_Bx1xLxS = window_mask(positions_BxL, keys.shape[1], self.window)
        return dataclasses.replace(self, cache=c), keys, values, mask_Bx1xLxS

    def _read(self, c: KVCache, name: str, batch: int) -> jax.Array:
        sel = read_at(self.index, self.rows_B, self.span, batch)
        values = getattr(c, name)[sel]
        if not c.quantized:
            return values
        return values.astype(jnp.float32) * getattr(c, f"{name}_scale")[sel][..., None]
