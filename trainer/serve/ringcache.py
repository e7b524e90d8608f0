"""The serving key/value cache of a model with sliding-window layers (GPT-OSS: sliding and full attention
alternating): the full layers keep every position of a slot, as KVCache does, and the sliding layers a ring
of their window's positions only, position p at index p % ring.

`full` is a KVCache [full layers, slots, max_len, kv_heads, head_size] and `ring` one [sliding layers, slots,
ring, kv_heads, head_size] (ring = min(window, max_len)), both in the compute dtype or int8 with their scales
(trainer/serve/kvcache.py). GPT-OSS-120b's sliding layers attend to 128 positions: at a context of 32,768 the
cache holds half its layers' 128 positions, not 32,768, and is near half the size.

A call's tokens (a prefill chunk, one decode token a row) attend over the ring as it was before the call (the
last `ring` positions before the row's first token) and the call's own keys and values, then the last `ring`
of the call's real tokens are written into it: a chunk longer than the window is exact too. A row's padding
(the tail of a prompt's last chunk) and positions at max_len or past (an idle decode slot) are never written:
in a ring they would land on positions still in the window.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from trainer.serve.kvcache import KVCache, LayerCache, quantize, read_at


def ring_length(window: int, max_len: int) -> int:
    """The positions a slot's ring holds: the window, or max_len where a slot holds fewer."""
    return min(window, max_len)


def ranks(windows: tuple[int, ...]) -> tuple[int, ...]:
    """Each layer's index among the layers of its kind (full: window 0, or sliding)."""
    seen = {False: 0, True: 0}
    out = []
    for w in windows:
        out.append(seen[bool(w)])
        seen[bool(w)] += 1
    return tuple(out)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class WindowedCache:
    full: KVCache  # the full layers': [full layers, slots, max_len, ...]
    ring: KVCache  # the sliding layers': [sliding layers, slots, ring, ...]
    # Each layer's index in `full` or `ring` (which of the two: the window its view is asked for); static.
    ranks: tuple[int, ...] = dataclasses.field(metadata=dict(static=True), default=())

    @staticmethod
    def empty(windows: tuple[int, ...], slots: int, max_len: int, kv_heads: int, head_size: int,
              dtype) -> WindowedCache:
        """The cache of layers with these windows (0: full attention), every sliding one the same window."""
        sliding, window = sum(map(bool, windows)), max(windows)
        full = KVCache.empty(len(windows) - sliding, slots, max_len, kv_heads, head_size, dtype)
        ring = KVCache.empty(sliding, slots, ring_length(window, max_len), kv_heads, head_size, dtype)
        return WindowedCache(full, ring, ranks(windows))

    @staticmethod
    def sharding(mesh, windows: tuple[int, ...], kv_heads: int, dtype) -> WindowedCache:
        """Both parts laid out as KVCache.sharding lays a cache out."""
        parts = KVCache.sharding(mesh, kv_heads, dtype)
        return WindowedCache(parts, parts, ranks(windows))

    @staticmethod
    def nbytes(windows: tuple[int, ...], slots: int, max_len: int, kv_heads: int, head_size: int, dtype) -> int:
        """Bytes of the cache, without building it: the full layers' max_len positions a slot, the sliding
        layers' ring."""
        sliding, ring = sum(map(bool, windows)), ring_length(max(windows), max_len)
        return (KVCache.nbytes(len(windows) - sliding, slots, max_len, kv_heads, head_size, dtype)
                + KVCache.nbytes(sliding, slots, ring, kv_heads, head_size, dtype))

    @property
    def quantized(self) -> bool:
        return self.full.quantized

    def layer(self, index, starts_B: jax.Array, rows_B: jax.Array | None = None, span: int | None = None,
              *, window: int = 0, lengths_B: jax.Array | None = None) -> PartView:
        """Layer `index`'s view (index a layer of the model, traced or not): a full layer's (window 0) over
        `full`, a sliding one's over `ring`, as KVCache.layer's."""
        rank = jnp.asarray(self.ranks, jnp.int32)[index]
        if not window:
            return PartView(self, "full", LayerCache(self.full, rank, starts_B, rows_B, span))
        max_len = self.full.k.shape[2]  # kept with no full layer too: the array is [0, slots, max_len, ...]
        ring = RingLayerCache(self.ring, rank, starts_B, rows_B, span, window, max_len, lengths_B)
        return PartView(self, "ring", ring)


@dataclasses.dataclass
class PartView:
    """A layer's view of one part of a WindowedCache (`part`: "full" or "ring"), whose `cache` is the whole
    WindowedCache with that part updated, as the model carries it from layer to layer."""

    whole: WindowedCache
    part: str
    view: LayerCache | RingLayerCache

    @property
    def starts_B(self) -> jax.Array:
        return self.view.starts_B

    @property
    def cache(self) -> WindowedCache:
        return dataclasses.replace(self.whole, **{self.part: self.view.cache})

    def append(self, k_BxLxKxH: jax.Array, v_BxLxKxH: jax.Array):
        view, keys, values, mask = self.view.append(k_BxLxKxH, v_BxLxKxH)
        return PartView(self.whole, self.part, view), keys, values, mask


@dataclasses.dataclass
class RingLayerCache:
    """One sliding layer's view of the ring for one call: batch row b holds the tokens at positions
    starts_B[b].. of slot rows_B[b] (None: row b is slot b), its first lengths_B[b] real (None: all). `span`,
    as LayerCache's, bounds the positions the call reaches: below the ring's length only the ring's first
    `span` indices hold anything."""

    cache: KVCache
    index: jax.Array
    starts_B: jax.Array
    rows_B: jax.Array | None
    span: int | None
    window: int
    max_len: int
    lengths_B: jax.Array | None = None

    def append(self, k_BxLxKxH: jax.Array, v_BxLxKxH: jax.Array):
        """(the updated view, keys [B, S + L, K, H], values, mask [B, 1, L, S + L]): the keys and values of
        the ring before the call (its first S indices) then the call's own, and which of them each new token
        attends to (those of the last `window` positions up to its own)."""
        batch, length = k_BxLxKxH.shape[:2]
        ring = self.cache.k.shape[2]
        read = min(self.span or ring, ring)
        positions_BxL = self.starts_B[:, None] + jnp.arange(length, dtype=self.starts_B.dtype)
        sel = read_at(self.index, self.rows_B, read, batch)
        before_k, before_v = (self._stored(self.cache, name, sel) for name in ("k", "v"))
        c, own_k, own_v = self._write(k_BxLxKxH, v_BxLxKxH, positions_BxL)
        # Index s of the ring holds the last position before the call that is s modulo the ring (none: < 0).
        first_Bx1 = self.starts_B[:, None]
        held_BxS = first_Bx1 - 1 - (first_Bx1 - 1 - jnp.arange(read, dtype=first_Bx1.dtype)) % ring
        keys_BxT = jnp.concatenate([held_BxS, positions_BxL], axis=1)
        queries_Bx1xLx1 = positions_BxL[:, None, :, None]
        keys_Bx1x1xT = keys_BxT[:, None, None, :]
        mask_Bx1xLxT = (keys_Bx1x1xT >= 0) & (keys_Bx1x1xT <= queries_Bx1xLx1) & (
            keys_Bx1x1xT > queries_Bx1xLx1 - self.window)
        keys = jnp.concatenate([before_k, own_k], axis=1)
        values = jnp.concatenate([before_v, own_v], axis=1)
        return dataclasses.replace(self, cache=c), keys, values, mask_Bx1xLxT

    def _write(self, k_BxLxKxH: jax.Array, v_BxLxKxH: jax.Array, positions_BxL: jax.Array):
        """(the ring with the last `ring` real tokens of each row written at position % ring, the call's keys
        and values as the cache holds them: in its dtype, or int8 read back as float32)."""
        c = self.cache
        batch, length = k_BxLxKxH.shape[:2]
        ring = c.k.shape[2]
        offsets_1xL = jnp.arange(length, dtype=positions_BxL.dtype)[None]
        lengths_Bx1 = (jnp.full((batch, 1), length, positions_BxL.dtype) if self.lengths_B is None
                       else self.lengths_B.astype(positions_BxL.dtype)[:, None])
        kept_BxL = (offsets_1xL < lengths_Bx1) & (offsets_1xL >= lengths_Bx1 - ring) & (positions_BxL < self.max_len)
        rows_B = jnp.arange(batch) if self.rows_B is None else self.rows_B
        at = (self.index, rows_B[:, None], jnp.where(kept_BxL, positions_BxL % ring, ring))  # ring: dropped
        if not c.quantized:
            k, v = k_BxLxKxH.astype(c.k.dtype), v_BxLxKxH.astype(c.v.dtype)
            return KVCache(c.k.at[at].set(k, mode="drop"), c.v.at[at].set(v, mode="drop")), k, v
        (kq, ks), (vq, vs) = quantize(k_BxLxKxH), quantize(v_BxLxKxH)
        c = KVCache(c.k.at[at].set(kq, mode="drop"), c.v.at[at].set(vq, mode="drop"),
                    c.k_scale.at[at].set(ks, mode="drop"), c.v_scale.at[at].set(vs, mode="drop"))
        return c, kq.astype(jnp.float32) * ks[..., None], vq.astype(jnp.float32) * vs[..., None]

    @staticmethod
    def _stored(c: KVCache, name: str, sel: tuple) -> jax.Array:
        values = getattr(c, name)[sel]
        if not c.quantized:
            return values
        return values.astype(jnp.float32) * getattr(c, f"{name}_scale")[sel][..., None]
