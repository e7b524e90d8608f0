"""int4 weights for serving: grouped and symmetric, two values a byte.

Each output channel's input axis is cut into groups of GROUP values, each group with its own float32 scale
(absmax / 7, values in -7..7; absmax clipped a little where that rounds the group closer: group_scales).
One scale per whole input row, as int8 keeps, is too coarse for sixteen levels: a row's largest weight
sets the step for all of it, and most of a row's weights round to zero.
GROUP = 128 is the usual choice (it divides every width of the named configs, and a head of 128): its
scales add 4 / 128 bytes a weight to the packed half byte, 0.27x of bfloat16 in all. An input axis
shorter than GROUP, or one it does not divide, takes groups of the largest power of two dividing both
(`tiny`'s 64 wide rows: 64).

Two storages of the values (storage_for picks by backend; quantize_params takes either):
  - "nibbles" (Int4Weight): packed two a byte (uint8, the group's values 2i and 2i+1 in the low and the
    high nibble), along the same axis, so a weight keeps its rank and its sharding: what the CPU wants, where
    jax's own int4 arrays take a whole byte a value (measured: a 1024 x 1024 jnp.int4 array holds 1,048,576
    bytes).
  - "native" (Int4Native): a jnp.int4 array of the weight's shape, which XLA packs two a byte on a TPU and
    widens inside the dot.
Either travels into the layer scan as integers and scales and is widened a layer at a time where the
layer reads it (trainer/serve/quant.py says how), as int8 weights are. Each keeps its grouped axis counted
from the end, so a layer's slice of a stacked weight keeps it. The router and the norms stay in float.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from trainer.arith.quant import GROUP, group_axis, group_size, layout  # noqa: F401 - int4's layout, one place
from trainer.serve.quant import SUBLANES, take_padded
from trainer.stacks import is_stacked

LEVELS = 7  # symmetric: -7..7 (the 16th code, -8, is never written)
CLIPS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)  # a group's scale: absmax / 7 times the best of these


STORAGES = ("nibbles", "native")


def storage_for(platform: str) -> str:
    """The int4 storage a backend wants: "native" (jnp.int4) on a TPU, where XLA packs it two a byte and
    converts it inside the matmul; "nibbles" elsewhere (on CPU jnp.int4 takes a byte a value, twice the
    packed nibbles)."""
    return "native" if platform == "tpu" else "nibbles"


def widen(q: jax.Array, scale: jax.Array, axis: int, dtype: str) -> jax.Array:
    """q (integers, the weight's shape) times its groups' scales along `axis` (< 0), in `dtype`."""
    a = axis % q.ndim
    shape, groups = q.shape, scale.shape[a]
    x = q.reshape(*shape[:a], groups, shape[a] // groups, *shape[a + 1:]).astype(jnp.float32)
    return (x * jnp.expand_dims(scale, a + 1)).reshape(shape).astype(dtype)


class Widened:
    """What a layer reads of a weight scaled by groups along an axis (int4 here, MXFP4 in mxfp4.py): `self.w[...]`,
    and the embedding's rows by take."""

    def __getitem__(self, index) -> jax.Array:
        return self.dequantize()[index]

    def arrays_of(self) -> tuple[jax.Array, jax.Array]:
        return tuple(getattr(self, f) for f in self.arrays)

    def contract(self, x: jax.Array, dtype) -> jax.Array:
        """x's last axis contracted with a 2-D weight's grouped (input) axis, in float32: a product of x's
        slice and the integer values a group (widened to `dtype` inside the matmul), times the group's
        scales, summed over the groups; for more rows than a group has values (a long prefill chunk), whose
        partial products would outgrow the weight, the widened weight's product. The widened weight
        (`self[...]`) broadcasts the scales to the weight's size in float32 first: on a v5e chip moe-1b's int4
        head wrote 128 MB a decode step that way, 0.41 ms against int8's 0.05 (benchmarks/serve_weights.py
        --profile, 2026-12-06)."""
        from trainer.sharding import current_platform

        if current_platform() == "cpu":  # XLA's CPU runtime has no bfloat16 batched product into float32
            dtype = jnp.float32
        q, scale = self.codes(), self.scales().astype(jnp.float32)
        if self.axis % 2 == 1:  # [out, in]: the tied embedding read as the head
            q, scale = q.T, scale.T
        groups, inputs = scale.shape[0], q.shape[0]
        if math.prod(x.shape[:-1]) * groups > inputs:  # the partial products would outgrow the widened weight
            w = (self.dequantize() if self.axis % 2 == 0 else self.dequantize().T).astype(dtype)
            return jnp.einsum("...k,kn->...n", x.astype(dtype), w, preferred_element_type=jnp.float32)
        rows = math.prod(x.shape[:-1])
        # At fewer rows than a vector register's sublanes (a decode step of one slot), XLA turns the product
        # into a multiply and a sum and widens the whole weight into float32 first (on a v5e chip, 2026-12-06:
        # 0.41 ms of a 1.48 ms step); padded to 8 rows it stays a matmul that widens tile by tile (the step 1.20).
        x_g = jnp.pad(x.reshape(rows, groups, inputs // groups), ((0, max(0, SUBLANES - rows)), (0, 0), (0, 0)))
        partial = jnp.einsum("rgk,gkn->rgn", x_g.astype(dtype), q.reshape(groups, inputs // groups, -1).astype(dtype),
                             preferred_element_type=jnp.float32)
        return jnp.einsum("rgn,gn->rn", partial[:rows], scale).reshape(*x.shape[:-1], -1)

    def contract_leading(self, x: jax.Array, n: int, dtype) -> jax.Array:
        """x's last `n` axes contracted with the weight's first `n` (its input axes, the grouped one among
        them: an attention projection's [D, N, H], or its output's [N, H, D]), in float32: as contract, a
        product of each group's slice (the values widened to `dtype` inside the matmul) times the group's
        scales, summed over the groups, never the widened weight's product at a decode step's few rows. At
        one decode row the widened weight's product made XLA broadcast each int4 projection's scales to the
        weight's size in float32 and read it whole (on a v5e chip, 2026-12-07: moe-1b's int4 q, k and v
        products at 275 GB/s, their broadcasts 25 us of a 0.55 ms step; benchmarks/serve_weights.py
        --profile)."""
        from trainer.sharding import current_platform

        q, scale = self.codes(), self.scales().astype(jnp.float32)
        a = self.axis % q.ndim
        inputs, outputs = q.shape[:n], q.shape[n:]
        if a >= n or x.shape[-n:] != inputs:
            raise ValueError(f"contract over {n} axes of a weight {q.shape} grouped along axis {a}")
        groups = scale.shape[a]
        rows = math.prod(x.shape[:-n])
        if rows > q.shape[a] // groups:  # the partial products would outgrow the widened weight
            w = self.dequantize().astype(dtype)
            return jnp.tensordot(x.astype(dtype), w, n, preferred_element_type=jnp.float32)
        if current_platform() == "cpu":  # XLA's CPU runtime has no bfloat16 batched product into float32
            dtype = jnp.float32
        split = (*inputs[:a], groups, inputs[a] // groups, *inputs[a + 1:])
        x_r = jnp.pad(x.reshape(rows, *split), ((0, max(0, SUBLANES - rows)),) + ((0, 0),) * len(split))
        letters = "abcdefghijklmnopq"[:len(split) + len(outputs)]
        ins, outs = letters[:len(split)], letters[len(split):]
        kept = ins[:a + 1] + ins[a + 2:]  # every input axis but the group's own values: the scale's axes
        partial = jnp.einsum(f"z{ins},{ins}{outs}->z{kept}{outs}", x_r.astype(dtype),
                             q.reshape(*split, *outputs).astype(dtype), preferred_element_type=jnp.float32)
        out = jnp.einsum(f"z{kept}{outs},{kept}{outs}->z{outs}", partial[:rows], scale)
        return out.reshape(*x.shape[:-n], *outputs)

    def codes(self) -> jax.Array:
        """The values, the weight's shape (integers, or MXFP4's FP4 values)."""
        return self.values

    def scales(self) -> jax.Array:
        """Each group's scale as a number, the scale's shape."""
        return self.scale

    def take(self, indices: jax.Array, axis: int = 0) -> jax.Array:
        """jnp.take of the widened weight along an axis other than the grouped one, widening only those."""
        if axis % self.scale.ndim == self.axis % self.scale.ndim:
            raise ValueError(f"take along axis {axis}: the weight's groups run along it")
        return dataclasses.replace(self, **{f: take_padded(getattr(self, f), indices, axis)
                                            for f in self.arrays}).dequantize()


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Int4Weight(Widened):
    """The "nibbles" storage."""

    packed: jax.Array  # uint8, the weight's shape with its grouped axis halved
    scale: jax.Array  # float32, the weight's shape with its grouped axis of length groups
    axis: int = dataclasses.field(metadata={"static": True}, default=-1)  # the grouped (input) axis, from the end
    dtype: str = dataclasses.field(metadata={"static": True}, default="float32")
    arrays = ("packed", "scale")

    def codes(self) -> jax.Array:
        """The integers, the weight's shape (int8, sign-extended from the nibbles)."""
        a, shape = self.axis % self.packed.ndim, self.packed.shape
        byte = jax.lax.bitcast_convert_type(self.packed, jnp.int8)
        low, high = jnp.right_shift(jnp.left_shift(byte, 4), 4), jnp.right_shift(byte, 4)  # sign-extended
        return jnp.stack([low, high], axis=a + 1).reshape(*shape[:a], 2 * shape[a], *shape[a + 1:])

    def dequantize(self) -> jax.Array:
        return widen(self.codes(), self.scale, self.axis, self.dtype)

    @property
    def nbytes(self) -> int:
        return self.packed.size + self.scale.size * 4


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Int4Native(Widened):
    """The "native" storage."""

    values: jax.Array  # jnp.int4, the weight's shape
    scale: jax.Array  # float32, the weight's shape with its grouped axis of length groups
    axis: int = dataclasses.field(metadata={"static": True}, default=-1)  # the grouped (input) axis, from the end
    dtype: str = dataclasses.field(metadata={"static": True}, default="float32")
    arrays = ("values", "scale")

    def dequantize(self) -> jax.Array:
        return widen(self.values, self.scale, self.axis, self.dtype)

    @property
    def nbytes(self) -> int:
        """Two values a byte, as a TPU holds them (jax reports a byte a value)."""
        return (self.values.size + 1) // 2 + self.scale.size * 4


def spec_for(spec: PartitionSpec, shape: tuple[int, ...], mesh) -> PartitionSpec:
    """The weight's partition spec for an array of `shape` (its packed values or its scales): an axis the
    mesh does not divide evenly any more is kept whole on every device."""
    entries = list(spec) + [None] * (len(shape) - len(spec))
    out = []
    for size, entry in zip(shape, entries, strict=False):
        names = entry if isinstance(entry, tuple) else (entry,) if entry else ()
        ways = math.prod(mesh.shape[n] for n in names)
        out.append(entry if ways and size % ways == 0 else None)
    while out and out[-1] is None:  # trailing whole axes left out: P(None, "expert"), not P(None, "expert", None)
        out.pop()
    return PartitionSpec(*out)


def group_scales(x: jax.Array, axis: int) -> jax.Array:
    """Each group's scale (x: the weight with its groups on `axis` + 1): of absmax / 7 clipped to each of
    CLIPS, the one whose rounding errs least in squares. The largest weight of a group rounded a little
    short buys a finer step for the rest: on `tiny` trained on a prepared corpus, greedy agreement with
    float over 32 held-out rows went from 83% to 94% (KL 0.0029 to 0.0018) at the same bytes."""
    absmax = jnp.max(jnp.abs(x), axis=axis + 1, keepdims=True)
    best = best_err = None
    for clip in CLIPS:
        scale = jnp.where(absmax > 0, absmax * clip / LEVELS, 1.0)
        err = jnp.sum(jnp.square(jnp.clip(jnp.round(x / scale), -LEVELS, LEVELS) * scale - x), axis=axis + 1,
                      keepdims=True)
        if best is None:
            best, best_err = scale, err
        else:
            best, best_err = jnp.where(err < best_err, scale, best), jnp.minimum(err, best_err)
    return best


def shard_bytes(shape: tuple[int, ...], axis: int, sharding: NamedSharding) -> int:
    """A device's bytes of a weight of `shape` held in int4 (its packed values and its float32 scales), the
    weight sharded by `sharding`: what quantize_params places there."""
    mesh, spec = sharding.mesh, sharding.spec
    packed, scale = layout(shape, axis)
    held = [math.prod(NamedSharding(mesh, spec_for(spec, s, mesh)).shard_shape(s)) for s in (packed, scale)]
    return held[0] + 4 * held[1]


def quantize_weight(w: jax.Array, axis: int, storage: str = "nibbles") -> Int4Weight | Int4Native:
    shape = w.shape
    axis %= w.ndim
    length = shape[axis]
    group = group_size(length)
    x = w.astype(jnp.float32).reshape(*shape[:axis], length // group, group, *shape[axis + 1:])
    scale = group_scales(x, axis)
    q = jnp.clip(jnp.round(x / scale), -LEVELS, LEVELS).astype(jnp.int8)
    scale, dtype, from_end = jnp.squeeze(scale, axis + 1), jnp.dtype(w.dtype).name, axis - w.ndim
    if storage == "native":
        return Int4Native(q.reshape(shape).astype(jnp.int4), scale, from_end, dtype)
    pairs = q.reshape(*shape[:axis], length // 2, 2, *shape[axis + 1:])
    low, high = jnp.take(pairs, 0, axis=axis + 1), jnp.take(pairs, 1, axis=axis + 1)
    byte = jnp.bitwise_or(jnp.bitwise_and(low, 0x0F), jnp.left_shift(high, 4))
    return Int4Weight(jax.lax.bitcast_convert_type(byte, jnp.uint8), scale, from_end, dtype)


def _shardings(p: jax.Array, axis: int, storage: str) -> tuple[NamedSharding, NamedSharding] | None:
    """Where the values and the scales go: the weight's own spec where the mesh divides them."""
    if not isinstance(p.sharding, NamedSharding):
        return None
    mesh, spec = p.sharding.mesh, p.sharding.spec
    packed, scale = layout(p.shape, axis)
    values = p.shape if storage == "native" else packed
    return NamedSharding(mesh, spec_for(spec, values, mesh)), NamedSharding(mesh, spec_for(spec, scale, mesh))


def quantize_params(params: dict[str, jax.Array], storage: str | None = None) -> dict:
    """{name: Int4Weight or Int4Native (`storage`, None: storage_for the arrays' backend) or the float array},
    computed on the arrays' devices and sharded as they are, one array at a time."""
    return {n: quantize_array(n, p, storage) for n, p in params.items()}


def quantize_array(name: str, p: jax.Array, storage: str | None = None):
    """Weight `name` in int4 (Int4Weight or Int4Native, as quantize_params), or `p` itself where it stays float."""
    axis = group_axis(name, p.shape)
    if axis is None:
        return p
    storage = storage or storage_for(next(iter(p.devices())).platform)
    if storage not in STORAGES:
        raise ValueError(f"int4 storage {storage!r}: one of {', '.join(STORAGES)}")
    return _quantizer(axis, storage, _shardings(p, axis, storage), p.ndim, jnp.dtype(p.dtype).name,
                      is_stacked(name))(p)


@functools.cache
def _quantizer(axis: int, storage: str, placed, ndim: int, dtype: str, stacked: bool):
    """The jitted quantization of a weight of `ndim` axes and `dtype` grouped along `axis`, its values and
    scales placed by `placed` (two shardings, or None); a stacked weight a layer at a time (its scratch: one
    layer's)."""
    def quantize(p):
        if stacked:
            return jax.lax.map(lambda w: quantize_weight(w, axis - 1, storage), p)
        return quantize_weight(p, axis, storage)

    if placed is None:
        return jax.jit(quantize)
    kind = Int4Native if storage == "native" else Int4Weight
    return jax.jit(quantize, out_shardings=kind(*placed, axis - ndim, dtype))  # the output's tree, static fields too
