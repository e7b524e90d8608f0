"""The serving cache of multi-head latent attention (trainer/mla.py): one latent per token and layer, not
every head's keys and values.

Arrays `latent` [layers, slots, max_len, kv_lora_rank] (the RMS-normalised compressed keys and values) and
`rope` [layers, slots, max_len, qk_rope_head_dim] (the rotated key every head shares), in the compute dtype
or int8. In int8 each position's latent and its rotary key are stored with a float32 scale each
(symmetric, absmax / 127, as trainer/serve/kvcache.py's), in `latent_scale`/`rope_scale`
[layers, slots, max_len]: the two differ in magnitude (one normalised, one not). Decoding absorbs the
heads' up-projections into the query and the output (MLAttention), so attention reads the latents as they
are: DeepSeek-V3 keeps 576 values a token and layer, against its 128 heads' 40,960 keys and values.

The latent serves every head, so it cannot be split by head as KVCache is; it is split by position instead:
over the mesh's `model` axis (tensor parallelism's, where the heads are split), each device holding max_len / n
consecutive positions of every slot (split_ways). A call writes each new token's latent on the device that
holds its position. The absorbed attention (`attend`) runs on every device over its own positions for every
head, each device's softmax left unnormalised (its highest score, the sum of its exponentials, the latents
they weigh), and the parts are merged exactly: the highest score over the devices, each part rescaled to it
and summed (a log-sum-exp merge), so a step reads no device's latents but its own. What crosses devices is
small beside the cache: each layer gathers the queries of every head (the heads are split over `model`) and
reduce-scatters the weighted latents back to each device's heads. A step over a span of S positions reads
min(S, max_len / n) of them on each device (a short span's positions lie on the first devices; the others'
are masked). Expanding keys and values (a long prefill chunk: `read`) gathers the row's span of the layer
onto every device first.

`CacheLayout.of(model config)` is the one place that chooses between this cache, KVCache and (a model with
sliding-window layers) trainer/serve/ringcache.py's WindowedCache.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from trainer import sharding
from trainer.arith.kv import latent_split_ways
from trainer.serve.kvcache import KVCache, quantize, read_at
from trainer.serve.ringcache import WindowedCache

AXIS = "model"  # the mesh axis the positions are split over: the one attention's heads are split over


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
    def split_ways(mesh, max_len: int) -> int:
        """The devices one cache's positions are split over: the mesh's `model` axis where it divides max_len
        and the prefix cache's block, else none (trainer/arith/kv.py's latent_split_ways says why)."""
        return latent_split_ways(1 if mesh is None else dict(mesh.shape).get(AXIS, 1), max_len)

    @staticmethod
    def sharding(mesh, dtype, max_len: int) -> LatentCache:
        """The cache's layout on the mesh (split_ways), as a LatentCache of NamedShardings."""
        from jax.sharding import NamedSharding

        axis = AXIS if LatentCache.split_ways(mesh, max_len) > 1 else None
        values = NamedSharding(mesh, position_spec(4, axis))
        if jnp.dtype(dtype) != jnp.int8:
            return LatentCache(values, values)
        scales = NamedSharding(mesh, position_spec(3, axis))
        return LatentCache(values, values, scales, scales)

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


def position_spec(ndim: int, axis: str | None) -> PartitionSpec:
    """A cache array's [layers, slots, max_len, ...] positions over `axis` (None: whole)."""
    return PartitionSpec(None, None, axis, *(None,) * (ndim - 3))


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

    @property
    def positions(self) -> int:
        """The positions a call reads: the span's."""
        max_len = self.cache.latent.shape[2]
        return min(self.span or max_len, max_len)

    def write(self, latent_BxLxC: jax.Array, rope_BxLxR: jax.Array) -> LatentLayerCache:
        """The view with the new tokens' latents and rotary keys written at their positions, each on the
        device that holds it (every device of the other axes, which hold every slot, writing every row)."""
        batch, length = latent_BxLxC.shape[:2]
        positions_BxL = self.starts_B[:, None] + jnp.arange(length, dtype=self.starts_B.dtype)
        rows_B = jnp.arange(batch) if self.rows_B is None else self.rows_B
        new = {}
        for name, x in (("latent", latent_BxLxC), ("rope", rope_BxLxR)):
            if self.cache.quantized:
                x, new[f"{name}_scale"] = quantize(x)
            new[name] = x
        arrays = {name: getattr(self.cache, name) for name in new}
        whole = PartitionSpec()
        written = self._on_shards(_write, arrays, positions_spec(arrays), (whole,) * 4, new, self.index, rows_B,
                                  positions_BxL)
        return dataclasses.replace(self, cache=dataclasses.replace(self.cache, **written))

    def read(self, length: int):
        """(latents [B, S, C], rotary keys [B, S, R], mask [B, 1, L, S]) of the span's S positions, on every
        device, and which of them each of `length` new tokens may attend to."""
        batch, count = self.starts_B.shape[0], self._held_read()

        def gathered(first, arrays, index, rows_B):
            del first
            part = _read(arrays, index, rows_B, count, batch)
            if self._ways() == 1:
                return part
            # Device k's first `count` positions from k max_len / n: the span's positions in order either way
            # (count < max_len / n: the span is all on device 0).
            return {name: jax.lax.all_gather(a, AXIS, axis=1, tiled=True) for name, a in part.items()}

        whole = PartitionSpec()
        raw = self._on_shards(gathered, self._arrays(), whole, (whole,) * 2, self.index, self.rows_B)
        raw = {name: a[:, :self.positions] for name, a in raw.items()}
        mask_Bx1xLxS = _mask(self.starts_B, length, 0, self.positions, self.positions)
        return _values(raw, "latent"), _values(raw, "rope"), mask_Bx1xLxS

    def attend(self, parts, q_BxLxNxC: jax.Array, q_rope_BxLxNxR: jax.Array) -> jax.Array:
        """Each query's softmax-weighted sum of the span's latents [B, L, N, C] (float32): `parts(q, q_rope,
        latents, rotary keys, mask)`, softmax's parts over some positions (trainer/mla.py's
        latent_softmax_parts), runs on each device over the positions it holds, for the batch rows it
        attends for (the data and expert axes split them where they divide them), and the parts are merged."""
        count, span, ways = self._held_read(), self.positions, self._ways()
        rows = _batch_axes(q_BxLxNxC.shape[0]) if ways > 1 else None
        heads = AXIS if ways > 1 and q_BxLxNxC.shape[2] % ways == 0 else None

        def local(first, arrays, index, rows_B, starts_B, q, q_rope):
            batch, length = q.shape[:2]
            # Rows split over the batch axes and no rows_B: this device's rows are the slots from its shard's first.
            first_row = jax.lax.axis_index(rows) * batch if self.rows_B is None and rows is not None else None
            raw = _read(arrays, index, rows_B, count, batch, first_row)
            max_BxNxL, sum_BxNxL, weighted_BxLxNxC = parts(q, q_rope, _values(raw, "latent"), _values(raw, "rope"),
                                                           _mask(starts_B, length, first, count, span))
            if ways > 1:
                sum_BxNxL, weighted_BxLxNxC = merge(max_BxNxL, sum_BxNxL, weighted_BxLxNxC, heads)
            return weighted_BxLxNxC / jnp.swapaxes(sum_BxNxL, 1, 2)[..., None]

        by_row = PartitionSpec(rows)
        return self._on_shards(local, self._arrays(), PartitionSpec(rows, None, heads),
                               (PartitionSpec(), by_row, by_row, by_row, by_row), self.index, self.rows_B,
                               self.starts_B, q_BxLxNxC, q_rope_BxLxNxR)

    def _arrays(self) -> dict[str, jax.Array]:
        names = ("latent", "rope", "latent_scale", "rope_scale") if self.cache.quantized else ("latent", "rope")
        return {name: getattr(self.cache, name) for name in names}

    def _ways(self) -> int:
        """The devices the cache's positions are split over, on the mesh the model is traced on."""
        return LatentCache.split_ways(sharding.current_mesh(), self.cache.latent.shape[2])

    def _held_read(self) -> int:
        """The positions each device reads: the span's, or all it holds where the span is longer."""
        return min(self.positions, self.cache.latent.shape[2] // self._ways())

    def _on_shards(self, fn, arrays: dict, out_specs, arg_specs: tuple, *args):
        """fn(the first position a device holds, its part of `arrays`, *args) on every device (args laid out
        as arg_specs say; out_specs lays the results out), or on the whole arrays where they are not split."""
        if self._ways() == 1:
            return fn(0, arrays, *args)

        def on_device(arrays, *args):
            held = next(iter(arrays.values())).shape[2]
            return fn(jax.lax.axis_index(AXIS) * held, arrays, *args)

        args = tuple(jnp.asarray(a) if isinstance(a, int) else a for a in args)
        # Unchecked: `read`'s all_gather returns the same latents on every device, which the check cannot infer.
        return jax.shard_map(on_device, mesh=sharding.current_mesh(), in_specs=(positions_spec(arrays), *arg_specs),
                             out_specs=out_specs, check_vma=False)(arrays, *args)


def _batch_axes(batch: int) -> tuple[str, ...] | None:
    """The axes a call's batch rows split over on the current mesh (the data and expert axes, as the
    activations), or None where they do not divide the rows (a prefill's one row: every device attends for it)."""
    shape = dict(sharding.current_mesh().shape)
    shards = 1
    for axis in sharding.BATCH_AXES:
        shards *= shape.get(axis, 1)
    return sharding.BATCH_AXES if shards > 1 and batch % shards == 0 else None


def positions_spec(arrays: dict) -> dict[str, PartitionSpec]:
    return {name: position_spec(a.ndim, AXIS) for name, a in arrays.items()}


def merge(max_BxNxL: jax.Array, sum_BxNxL: jax.Array, weighted_BxLxNxC: jax.Array, heads: str | None):
    """Softmax's parts over each device's positions merged into the whole's (sum of exponentials [B, N, L],
    weighted latents [B, L, N, C]): each part rescaled to the highest score of all and summed over `model`,
    the sums kept for the device's own heads where `heads` (the axis) splits them, else for all."""
    top_BxNxL = jax.lax.pmax(max_BxNxL, AXIS)
    rescale_BxNxL = jnp.exp(max_BxNxL - top_BxNxL)
    sum_BxNxL = sum_BxNxL * rescale_BxNxL
    weighted_BxLxNxC = weighted_BxLxNxC * jnp.swapaxes(rescale_BxNxL, 1, 2)[..., None]
    if heads is None:
        return jax.lax.psum(sum_BxNxL, AXIS), jax.lax.psum(weighted_BxLxNxC, AXIS)
    return (jax.lax.psum_scatter(sum_BxNxL, AXIS, scatter_dimension=1, tiled=True),
            jax.lax.psum_scatter(weighted_BxLxNxC, AXIS, scatter_dimension=2, tiled=True))


def _write(first, arrays: dict, new: dict, index, rows_B, positions_BxL) -> dict:
    """`arrays` (a device's part, holding positions first..) with `new` written at positions_BxL of slots
    rows_B in layer `index`. Positions the part does not hold (another device's; past max_len: a padded last
    prefill chunk's, an idle slot's) are dropped, never clamped onto others."""
    held = arrays["latent"].shape[2]
    local_BxL = positions_BxL - first
    local_BxL = jnp.where((local_BxL >= 0) & (local_BxL < held), local_BxL, held)  # a negative index would wrap
    at = (index, rows_B[:, None], local_BxL)
    return {name: a.at[at].set(new[name].astype(a.dtype), mode="drop") for name, a in arrays.items()}


def _read(arrays: dict, index, rows_B, count: int, batch: int, first_row=None) -> dict:
    """Layer `index`'s first `count` positions of slots rows_B (None: the `batch` slots from first_row, 0 where
    None), each array [B, count, ...]."""
    if first_row is None:
        sel = read_at(index, rows_B, count, batch)
        return {name: a[sel] for name, a in arrays.items()}
    return {name: jax.lax.dynamic_slice(a, (index, first_row, 0) + (0,) * (a.ndim - 3),
                                        (1, batch, count, *a.shape[3:]))[0] for name, a in arrays.items()}


def _values(raw: dict, name: str) -> jax.Array:
    if f"{name}_scale" not in raw:
        return raw[name]
    return raw[name].astype(jnp.float32) * raw[f"{name}_scale"][..., None]


def _mask(starts_B: jax.Array, length: int, first, count: int, span: int) -> jax.Array:
    """[B, 1, L, count]: which of the positions first..first + count (a device's) each of the L tokens from
    starts_B may attend to: those in the span, up to its own."""
    s_S = first + jnp.arange(count)
    positions_BxL = starts_B[:, None] + jnp.arange(length, dtype=starts_B.dtype)
    return (s_S < span)[None, None, None, :] & (s_S[None, None, None, :] <= positions_BxL[:, None, :, None])


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

    def sharding(self, mesh, dtype, max_len: int) -> KVCache | LatentCache | WindowedCache:
        if self.is_latent:
            return LatentCache.sharding(mesh, dtype, max_len)
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

    def split_ways(self, mesh, max_len: int) -> int:
        """The devices the cache is split over: the latent's positions, or the KV heads."""
        if self.is_latent:
            return LatentCache.split_ways(mesh, max_len)
        return KVCache.split_ways(mesh, self.kv_heads)

    def device_bytes(self, mesh, slots: int, max_len: int, dtype) -> int:
        """Bytes of the cache on one device."""
        return self.nbytes(slots, max_len, dtype) // self.split_ways(mesh, max_len)
