"""int8 weights for serving: per output channel, symmetric (scale = absmax / 127 over the input axes).

A v5e chip has 16 GB of HBM; int8 halves the weights against bfloat16. The router and the norms stay
in float: they are tiny, and the router's top-k is what a rounding error would flip.

A quantized weight stands where the float one stood in the model's parameters (an nnx.Param's value) and
travels as integers and scales into the layer scan, which slices one layer's of each; a layer reading its
weight (`self.w[...]`) widens that layer's slice right before its matmul, where XLA fuses the convert
into the dot's operand on a TPU. No float copy of the whole stack is ever made (benchmarks/serve_weights.py
shows the decode program's scratch).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from trainer.arith.quant import FLOAT_LEAVES, input_axes  # noqa: F401 - which weights stay float, one place
from trainer.stacks import is_stacked

SUBLANES = 8  # a TPU vector register's rows of 32-bit values
LANES = 128  # and its columns
# A take of at most this many rows of a 2-D int8 table reads their memory tiles (take_tiles): a decode step's.
TILED_TAKE = 32


def take_padded(a: jax.Array, indices: jax.Array, axis: int) -> jax.Array:
    """jnp.take(a, indices, axis), at least SUBLANES indices at a time: for fewer (a decode step of one slot)
    XLA on a TPU relays the whole table out before taking from an int8 or int4 one (on a v5e chip, 2026-12-06:
    moe-1b's embedding, 0.05 ms of a 1.1 ms step), for SUBLANES or more it reads only the rows (its compiled
    program, benchmarks/serve_aot.py)."""
    from trainer.sharding import current_platform

    axis, flat = axis % a.ndim, indices.reshape(-1)
    if a.ndim == 2 and axis == 0 and 1 < a.shape[1] < LANES and flat.size <= SUBLANES and current_platform() == "tpu":
        # A table narrower than a lane tile (int4's embedding scales, [vocab, 8]) XLA holds with its rows as
        # the lanes, and a gather from it (of its rows, or of its transpose's columns) laid the whole table out
        # again first, every step (on a v5e chip, 2026-12-07: moe-1b's, 12.6 us of a 0.53 ms decode step at one
        # slot). A decode step's few rows are sliced one by one where they lie (benchmarks/serve_aot.py).
        rows = jnp.stack([jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False) for i in flat])
        return rows.reshape(*indices.shape, a.shape[1])
    rows = jnp.take(a, jnp.pad(flat, (0, max(0, SUBLANES - flat.size))), axis=axis)
    rows = jax.lax.slice_in_dim(rows, 0, flat.size, axis=axis)
    return rows.reshape(*a.shape[:axis], *indices.shape, *a.shape[axis + 1:])


def tile_rows(a: jax.Array) -> int:
    """The rows of a TPU memory tile of `a`'s dtype: 8 of 32-bit values, 16 of 16-bit, 32 of 8-bit."""
    return SUBLANES * 4 // a.dtype.itemsize


def take_tiles(table: jax.Array, indices: jax.Array, interpret: bool | None = None) -> jax.Array:
    """table[indices] of a 2-D table's rows, each read from the memory tile that holds it (a few rows' tiles
    copied into a [n, tile, width] block by a Pallas kernel, the rows picked out of that). Why by hand: an int8
    table small enough for the chip's vector memory (moe-1b's embedding, 32 MB) XLA prefetches whole into it at
    every program's start for the few rows a decode step takes (on a v5e chip, 2026-12-07: 30 us of a 0.59 ms
    step at one slot); a kernel's operand it leaves where it lies, and the kernel reads 32 KB a row. `interpret`:
    through Pallas' interpreter (None: where the model is not on a TPU)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    from trainer.sharding import current_platform

    rows, width = table.shape
    tile, flat = tile_rows(table), indices.reshape(-1).astype(jnp.int32)
    flat = jnp.clip(flat, 0, rows - 1)  # the kernel never reads past the table (jnp.take would fill the row)

    def copy(indices_ref, tile_ref, out_ref):
        out_ref[...] = tile_ref[...]

    tiles = pl.pallas_call(
        copy,
        out_shape=jax.ShapeDtypeStruct((flat.size, tile, width), table.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1, grid=(flat.size,),
            in_specs=[pl.BlockSpec((tile, width), lambda i, indices: (indices[i] // tile, 0))],
            out_specs=pl.BlockSpec((None, tile, width), lambda i, indices: (i, 0, 0))),
        interpret=current_platform() != "tpu" if interpret is None else interpret,
        name="take_tiles",
    )(flat, table)
    picked = jnp.take_along_axis(tiles, (flat % tile)[:, None, None], axis=1)[:, 0]
    return picked.reshape(*indices.shape, width)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Int8Weight:
    values: jax.Array  # int8, the weight's shape
    scale: jax.Array  # float32, the weight's shape with the input axes of size 1
    dtype: str = dataclasses.field(metadata={"static": True}, default="float32")

    def dequantize(self) -> jax.Array:
        return (self.values.astype(jnp.float32) * self.scale).astype(self.dtype)

    def __getitem__(self, index) -> jax.Array:
        """What a layer reads (`self.w[...]`): the weight widened where the layer uses it."""
        return self.dequantize()[index]

    def contract_leading(self, x: jax.Array, n: int, dtype) -> jax.Array:
        """x's last `n` axes contracted with the weight's first `n` (trainer.layers.times_leading), float32: the
        integers (exact in bfloat16) through the product, accumulated in float32, each output channel then
        scaled. The scales multiply the product, not the weight: the product reads int8 and nothing else, and
        the per-channel scales go to the op that consumes it (on a v5e chip XLA had sliced each layer's q, k
        and v scales out of their stack in ops of their own, 17 us of a 0.64 ms decode step at one slot).
        Where the scales are not per output channel, the widened weight's product."""
        if any(size != 1 for size in self.scale.shape[:n]):
            return jnp.tensordot(x.astype(dtype), self.dequantize().astype(dtype), n,
                                 preferred_element_type=jnp.float32)
        product = jnp.tensordot(x.astype(dtype), self.values.astype(dtype), n, preferred_element_type=jnp.float32)
        return product * self.scale.reshape(self.scale.shape[n:])

    def contract(self, x: jax.Array, dtype) -> jax.Array:
        """x's last axis contracted with a 2-D weight's input axis, float32, as contract_leading: axis 0 of an
        [in, out] weight, or axis 1 of the embedding [vocab, d_model] read as the tied head (its scales a row's:
        input_axes)."""
        if self.values.ndim == 2 and self.scale.shape[1] == 1 and self.scale.shape[0] == self.values.shape[0] > 1:
            product = jnp.einsum("...k,nk->...n", x.astype(dtype), self.values.astype(dtype),
                                 preferred_element_type=jnp.float32)
            return product * self.scale[:, 0]
        return self.contract_leading(x, 1, dtype)

    def take(self, indices: jax.Array, axis: int = 0) -> jax.Array:
        """jnp.take of the widened weight along an output axis (the embedding's rows), widening only those."""
        if self.scale.shape[axis] != self.values.shape[axis]:
            raise ValueError(f"take along axis {axis}: the weight's scales are reduced over it")
        from trainer.sharding import current_platform, on_one_device

        values = self.values
        # On one device only (a vocabulary split over `model` would be gathered whole for the kernel)
        if (values.ndim == 2 and axis == 0 and indices.size <= TILED_TAKE and current_platform() == "tpu"
                and on_one_device()):
            rows = take_tiles(values, indices)
        else:
            rows = take_padded(values, indices, axis)
        return Int8Weight(rows, take_padded(self.scale, indices, axis), self.dtype).dequantize()

    @property
    def nbytes(self) -> int:
        return self.values.size + self.scale.size * 4


def quantize_weight(w: jax.Array, axes: tuple[int, ...]) -> Int8Weight:
    x = w.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=axes, keepdims=True) / 127.0
    scale = jnp.where(scale > 0, scale, 1.0)
    values = jnp.clip(jnp.round(x / scale), -127, 127).astype(jnp.int8)
    return Int8Weight(values, scale, jnp.dtype(w.dtype).name)


def quantize_params(params: dict[str, jax.Array]) -> dict:
    """{name: Int8Weight or the float array}, computed on the arrays' devices, one array at a time."""
    return {n: quantize_array(n, p) for n, p in params.items()}


def quantize_array(name: str, p: jax.Array):
    """Weight `name` as int8 (an Int8Weight), or `p` itself where it stays float (input_axes). A stacked
    weight is quantized a layer at a time (its scratch: one layer's)."""
    axes = input_axes(name, p.ndim)
    return p if axes is None else _quantize(p, axes, is_stacked(name))


@functools.partial(jax.jit, static_argnums=(1, 2))  # one compilation per shape and axes
def _quantize(p: jax.Array, axes: tuple[int, ...], stacked: bool) -> Int8Weight:
    if not stacked:
        return quantize_weight(p, axes)
    return jax.lax.map(lambda w: quantize_weight(w, tuple(a - 1 for a in axes)), p)


def weight_bytes(params: dict) -> int:
    return sum(p.nbytes for p in params.values())
