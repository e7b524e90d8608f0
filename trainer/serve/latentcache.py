"""The serving cache of multi-head latent attention (trainer/mla.py): one latent per token and layer, not
every head's keys and values.

Arrays `latent` [layers, slots, max_len, kv_lora_rank] (the RMS-normalised compressed keys and values) and
`rope` [layers, slots, max_len, qk_rope_head_dim] (the rotated key every head shares), in the compute dtype
or int8. In int8 each position's latent and its rotary key are stored with a float32 scale each
(symmetric, absmax / 127, as trainer/serve/kvcache.py's), in `latent_scale`/`rope_scale`
[layers, slots, max_len]: the two differ in magnitude (one normalised, one not). Decoding absorbs the
heads' up-projections into the query and the output (MLAttention), so attention reads the latents as they
are: DeepSeek-V3 keeps 576 values a token and layer, against its 128 heads' 40,960 keys and values. The
latent serves every head, so it is whole on every device (not split over `model`).

`CacheLayout.of(model config)` is the one place that chooses between this cache, KVCache and (a model with
sliding-window layers) trainer/serve/ringcache.py's WindowedCache.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from trainer.serve.kvcache import KVCache, quantize, read_at
from trainer.serve.ringcache import WindowedCache


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LatentCache:
    latent: jax.Array
    rope: jax.Array
    latent_scale: jax.Array | None = None
    rope_scale: jax.Array | None = None

    @staticmethod
    def empty(layers: int, slots: int, max_len: int, latent: int, rope: int, dtype) -> LatentCache:
        shape = (layers, slots, max_len)
        if jnp.dtype(dtype) == jnp.int8:
            scale = jnp.zeros(shape, jnp.float32)
            return LatentCache(jnp.zeros((*shape, latent), jnp.int8), jnp.zeros((*shape, rope), jnp.int8),
                               scale, scale)
        return LatentCache(jnp.zeros((*shape, latent), dtype), jnp.zeros((*shape, rope), dtype))

    @staticmethod
    def sharding(mesh, dtype) -> LatentCache:
        """Whole on every device, as a LatentCache of NamedShardings: every head reads every latent."""
        from jax.sharding import NamedSharding, PartitionSpec

        whole = NamedSharding(mesh, PartitionSpec())
        return LatentCache(whole, whole, whole, whole) if jnp.dtype(dtype) == jnp.int8 else LatentCache(whole, whole)

    @staticmethod
    def nbytes(layers: int, slots: int, max_len: int, latent: int, rope: int, dtype) -> int:
        """Bytes of a cache of this shape, without building it (the start-up memory check, the planner)."""
        per_position = (latent + rope) * jnp.dtype(dtype).itemsize
        if jnp.dtype(dtype) == jnp.int8:
            per_position += 2 * 4  # a float32 scale for the latent, one for the rotary key
        return layers * slots * max_len * per_position

    @property
    def quantized(self) -> bool:
        return self.latent_scale is not None

    def layer(self, index: int, starts_B: jax.Array, rows_B: jax.Array | None = None, span: int | None = None,
              *, window: int = 0, lengths_B: jax.Array | None = None) -> LatentLayerCache:
        """Layer `index`'s view, as KVCache.layer's (latent attention has no sliding window: `window` is 0)."""
        if window:
            raise ValueError("latent attention has no sliding window")
        del lengths_B
        return LatentLayerCache(self, index, starts_B, rows_B, span)


@dataclasses.dataclass
class LatentLayerCache:
    """One layer's view of the latent cache for one call, as kvcache.LayerCache's: batch row b holds the
    tokens at positions starts_B[b].. of slot rows_B[b] (rows_B None: row b is slot b), reading the first
    `span` positions of each slot (None: all)."""

    cache: LatentCache
    index: int
    starts_B: jax.Array
    rows_B: jax.Array | None
    span: int | None = None

    def append(self, latent_BxLxC: jax.Array, rope_BxLxR: jax.Array):
        """(the updated view, latents [B, span, C], rotary keys [B, span, R], mask [B, 1, L, span]):
        the new tokens' latents written at their positions, and which cached positions each may attend to."""
        batch, length = latent_BxLxC.shape[:2]
        positions_BxL = self.starts_B[:, None] + jnp.arange(length, dtype=self.starts_B.dtype)
        rows_B = jnp.arange(batch) if self.rows_B is None else self.rows_B
        at = (self.index, rows_B[:, None], positions_BxL)
        c, new = self.cache, {}
        # Positions past max_len (a padded last prefill chunk) are dropped, never clamped onto others.
        for name, x in (("latent", latent_BxLxC), ("rope", rope_BxLxR)):
            if c.quantized:
                x, scale = quantize(x)
                new[f"{name}_scale"] = getattr(c, f"{name}_scale").at[at].set(scale, mode="drop")
            new[name] = getattr(c, name).at[at].set(x.astype(getattr(c, name).dtype), mode="drop")
        c = dataclasses.replace(c, **new)
        latents = self._read(c, "latent", batch)
        mask_Bx1xLxS = jnp.arange(latents.shape[1])[None, None, None, :] <= positions_BxL[:, None, :, None]
        view = LatentLayerCache(c, self.index, self.starts_B, self.rows_B, self.span)
        return view, latents, self._read(c, "rope", batch), mask_Bx1xLxS

    def _read(self, c: LatentCache, name: str, batch: int) -> jax.Array:
        sel = read_at(self.index, self.rows_B, self.span, batch)
        values = getattr(c, name)[sel]
        if not c.quantized:
            return values
        return values.astype(jnp.float32) * getattr(c, f"{name}_scale")[sel][..., None]


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """A model's serving cache, chosen from its config: latent attention's LatentCache (`latent` and `rope`
    values a position and layer), every other attention's KVCache (`kv_heads` x `head_size` keys and as
    many values), or with sliding-window layers (`windows`: each layer's, 0 for a full one) a WindowedCache,
    the sliding layers holding their window's positions alone."""

    layers: int
    kv_heads: int = 0
    head_size: int = 0
    latent: int = 0
    rope: int = 0
    windows: tuple[int, ...] = ()

    @staticmethod
    def of(m) -> CacheLayout:
        """The layout of a trainer.config.ModelConfig's cache."""
        if m.mla is not None:
            return CacheLayout(m.num_layers, latent=m.mla.kv_lora_rank, rope=m.mla.qk_rope_head_dim)
        windows = tuple(m.window(i) for i in range(m.num_layers))
        return CacheLayout(m.num_layers, kv_heads=m.kv_heads, head_size=m.head_size,
                           windows=windows if any(windows) else ())

    @property
    def is_latent(self) -> bool:
        return self.latent > 0

    @property
    def is_windowed(self) -> bool:
        """Whether sliding layers keep their window alone (WindowedCache)."""
        return bool(self.windows)

    def empty(self, slots: int, max_len: int, dtype) -> KVCache | LatentCache | WindowedCache:
        if self.is_latent:
            return LatentCache.empty(self.layers, slots, max_len, self.latent, self.rope, dtype)
        if self.is_windowed:
            return WindowedCache.empty(self.windows, slots, max_len, self.kv_heads, self.head_size, dtype)
        return KVCache.empty(self.layers, slots, max_len, self.kv_heads, self.head_size, dtype)

    def sharding(self, mesh, dtype) -> KVCache | LatentCache | WindowedCache:
        if self.is_latent:
            return LatentCache.sharding(mesh, dtype)
        if self.is_windowed:
            return WindowedCache.sharding(mesh, self.windows, self.kv_heads, dtype)
        return KVCache.sharding(mesh, self.kv_heads, dtype)

    def nbytes(self, slots: int, max_len: int, dtype) -> int:
        """Bytes of the whole cache (every device's part together)."""
        if self.is_latent:
            return LatentCache.nbytes(self.layers, slots, max_len, self.latent, self.rope, dtype)
        if self.is_windowed:
            return WindowedCache.nbytes(self.windows, slots, max_len, self.kv_heads, self.head_size, dtype)
        return KVCache.nbytes(self.layers, slots, max_len, self.kv_heads, self.head_size, dtype)

    def split_ways(self, mesh) -> int:
        """The devices the cache is split over (the latent: none, every device holds it whole)."""
        return 1 if self.is_latent else KVCache.split_ways(mesh, self.kv_heads)

    def device_bytes(self, mesh, slots: int, max_len: int, dtype) -> int:
        """Bytes of the cache on one device."""
        return self.nbytes(slots, max_len, dtype) // self.split_ways(mesh)
