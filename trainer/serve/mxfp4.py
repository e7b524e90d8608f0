"""MXFP4 expert weights for serving (`--weights mxfp4`): the routed experts' weights as GPT-OSS's Hub
checkpoints hold them, FP4 (e2m1) values and a power-of-two scale a block of 32 along the input axis
(trainer/hf/mxfp4.py says the format and quantizes to it); every other weight stays in the checkpoint's dtype.

A checkpoint imported from MXFP4 blocks holds experts already on MXFP4's grid, and quantizing them again gives
back the same values times scales, bit for bit: such a model is served with no rounding beyond MXFP4's own,
at 4.25 bits an expert weight (int4 would round the Hub's values again, in groups of 128).

Mxfp4Weight holds the values as jnp.float4_e2m1fn (a TPU keeps two a byte) and the scales as the Hub's bytes
(uint8, 2^(s - 127)). Every reader but the grouped matmul widens it where it reads it, as int8 and int4 weights
are (trainer/serve/quant.py); the grouped matmul takes a stacked one as a qwix QArray (trainer/moe/stacked.py).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from trainer.arith.quant import MXFP4_BLOCK, MXFP4_SCALE_BIAS, mxfp4_axis
from trainer.hf.mxfp4 import fp4_blocks
from trainer.serve.quant4 import Widened, spec_for, widen
from trainer.stacks import is_stacked


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Mxfp4Weight(Widened):
    values: jax.Array  # jnp.float4_e2m1fn, the weight's shape
    scale: jax.Array  # uint8 (2^(s - 127)), the weight's shape with its blocked axis of length blocks
    axis: int = dataclasses.field(metadata={"static": True}, default=-2)  # the blocked (input) axis, from the end
    dtype: str = dataclasses.field(metadata={"static": True}, default="float32")
    arrays = ("values", "scale")

    def factors(self) -> jax.Array:
        """The blocks' scales as float32 powers of two, the scale's shape."""
        return jnp.ldexp(jnp.float32(1.0), self.scale.astype(jnp.int32) - MXFP4_SCALE_BIAS)

    def scales(self) -> jax.Array:
        return self.factors()

    def dequantize(self) -> jax.Array:
        return widen(self.values, self.factors(), self.axis, self.dtype)

    @property
    def nbytes(self) -> int:
        """Two values a byte, as a TPU holds them (jax reports a byte a value), and a byte a block."""
        return (self.values.size + 1) // 2 + self.scale.size


def scale_shape(shape: tuple[int, ...], axis: int) -> tuple[int, ...]:
    """The scales' shape of a weight of `shape` blocked along `axis`."""
    return (*shape[:axis], shape[axis] // MXFP4_BLOCK, *shape[axis + 1:])


def quantize_weight(w: jax.Array, axis: int) -> Mxfp4Weight:
    """w in MXFP4, its blocks along `axis` (trainer/hf/mxfp4.py's fp4_blocks)."""
    values, scale = fp4_blocks(w, axis)
    return Mxfp4Weight(values, scale, axis % w.ndim - w.ndim, jnp.dtype(w.dtype).name)


def quantize_params(params: dict[str, jax.Array]) -> dict:
    """{name: Mxfp4Weight (the routed experts') or the float array}, on the arrays' devices, one at a time."""
    return {n: quantize_array(n, p) for n, p in params.items()}


def quantize_array(name: str, p: jax.Array):
    """Weight `name` in MXFP4 (a routed experts' weight) or `p` itself; ValueError where an expert's input axis
    is not a whole number of blocks. Sharded as `p` is, where the mesh divides the scales."""
    axis = mxfp4_axis(name, p.shape)
    if axis is None:
        return p
    placed = None
    if isinstance(p.sharding, NamedSharding):
        mesh, spec = p.sharding.mesh, p.sharding.spec
        placed = (p.sharding, NamedSharding(mesh, spec_for(spec, scale_shape(p.shape, axis), mesh)))
    return _quantizer(axis, placed, p.ndim, jnp.dtype(p.dtype).name, is_stacked(name))(p)


@functools.cache
def _quantizer(axis: int, placed, ndim: int, dtype: str, stacked: bool):
    """The jitted quantization of a weight of `ndim` axes blocked along `axis`; a stacked weight a layer at a
    time (its scratch: one layer's)."""
    def quantize(p):
        if stacked:
            return jax.lax.map(lambda w: quantize_weight(w, axis - 1), p)
        return quantize_weight(p, axis)

    if placed is None:
        return jax.jit(quantize)
    return jax.jit(quantize, out_shardings=Mxfp4Weight(*placed, axis - ndim, dtype))


def shard_bytes(shape: tuple[int, ...], axis: int, sharding: NamedSharding) -> int:
    """A device's bytes of a weight of `shape` held in MXFP4 (two values a byte, a scale byte a block), the
    weight sharded by `sharding`: what quantize_array places there."""
    mesh, spec = sharding.mesh, sharding.spec
    scales = scale_shape(shape, axis)
    values = math.prod(sharding.shard_shape(shape))
    return (values + 1) // 2 + math.prod(NamedSharding(mesh, spec_for(spec, scales, mesh)).shard_shape(scales))
