"""MXFP4 expert weights (GPT-OSS on the Hub): `X_blocks` uint8 [E, R, C/32, 16] and `X_scales` uint8 [E, R, C/32]
for a weight X of R rows and C columns a matrix. Each byte holds two FP4 (e2m1) values, the low nibble first; a
block of 32 values (16 bytes) shares the power-of-two scale 2^(s - 127). Dequantised as transformers does it
(../shared/HF-FACTS.md): each FP4 value times 2^(s - 127) in float32, rounded once to bfloat16, and each expert's
[R, C] transposed to [C, R] (the Hub's MXFP4 files hold [out, in]; GPT-OSS's bfloat16 tensors are [in, out]).

`fp4_blocks` quantizes to MXFP4, the one implementation: each block's scale the smallest power of two that keeps
it within FP4's range (6), each value the nearest FP4 value (ties to even). A weight already on MXFP4's grid (a
checkpoint imported from MXFP4 blocks) comes back exactly: a block's FP4 values times a power of two up to 6
are FP4 values again. Serving's `--weights mxfp4` (trainer/serve/mxfp4.py) runs it on the device inside jit;
`quantized` lays its result out as the Hub's bytes (tests' fixtures).
"""

from __future__ import annotations

import numpy as np

from trainer.arith.quant import MXFP4_BLOCK as BLOCK  # values a scale
from trainer.arith.quant import MXFP4_SCALE_BIAS as SCALE_BIAS
from trainer.hf.errors import HFError

BLOCKS, SCALES = "_blocks", "_scales"
# The sixteen FP4 (e2m1) codes' values: sign bit 8, then exponent and mantissa.
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)
FP4_MAX = 6.0


def is_mxfp4(hub: dict) -> bool:
    """Whether config.json says the experts are MXFP4; HFError for any other quantization."""
    quant = hub.get("quantization_config")
    if quant is None:
        return False
    if not isinstance(quant, dict) or quant.get("quant_method") != "mxfp4":
        raise HFError(f"'quantization_config' = {quant!r:.80} is not supported (GPT-OSS's MXFP4 experts only)")
    return True


def packed_shapes(experts: int, rows: int, cols: int) -> dict[str, tuple[int, ...]]:
    """{suffix: shape} of the blocks and scales of an [experts, cols, rows] weight stored as MXFP4."""
    if cols % BLOCK:
        raise HFError(f"an MXFP4 weight's rows must be a multiple of {BLOCK} values, got {cols}")
    return {BLOCKS: (experts, rows, cols // BLOCK, BLOCK // 2), SCALES: (experts, rows, cols // BLOCK)}


def dequantized(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """bfloat16 [E, C, R] from blocks [E, R, C/32, 16] and scales [E, R, C/32]."""
    import ml_dtypes

    if blocks.dtype != np.uint8 or scales.dtype != np.uint8 or blocks.shape[:-1] != scales.shape:
        raise HFError(f"MXFP4 blocks {list(blocks.shape)} ({blocks.dtype}) and scales {list(scales.shape)} "
                      f"({scales.dtype}) do not match: uint8 [..., C/32, 16] and uint8 [..., C/32]")
    experts, rows, groups, half = blocks.shape
    out = np.empty((experts, rows, groups, 2 * half), np.float32)
    out[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    out[..., 1::2] = FP4_VALUES[blocks >> 4]
    # 2^(s - 127) in float32 (s = 255 gives inf, as transformers' ldexp does); the products are exact.
    factor = np.ldexp(np.float32(1.0), scales.astype(np.int32) - SCALE_BIAS).astype(np.float32)
    out *= factor[..., None]
    values = out.astype(ml_dtypes.bfloat16).reshape(experts, rows, groups * 2 * half)
    return np.ascontiguousarray(values.transpose(0, 2, 1))


def fp4_blocks(x, axis: int):
    """(the FP4 values, jnp.float4_e2m1fn of x's shape; the blocks' scale bytes, uint8 of x's shape with `axis`
    cut to one a block) of x, its blocks of 32 running along `axis`. A jax computation (jit and lax.map trace it);
    ValueError where `axis` is not a whole number of blocks."""
    import jax.numpy as jnp

    axis %= x.ndim
    shape, length = x.shape, x.shape[axis]
    if length % BLOCK:
        raise ValueError(f"MXFP4 blocks of {BLOCK} along axis {axis} of {list(shape)}: {length} is not a multiple")
    x = x.astype(jnp.float32).reshape(*shape[:axis], length // BLOCK, BLOCK, *shape[axis + 1:])
    top = jnp.max(jnp.abs(x), axis=axis + 1, keepdims=True)
    # The smallest e with top <= 6 * 2^e, from top's binary exponent (top = m * 2^k, m in [0.5, 1), and
    # 6 * 2^(k - 3) = 0.75 * 2^k): exact, where a logarithm's rounding could pick the next power of two.
    mantissa, k = jnp.frexp(top)
    e = jnp.where(top > 0, k - jnp.where(mantissa <= FP4_MAX / 8, 3, 2), 0)
    e = jnp.clip(e, -SCALE_BIAS, SCALE_BIAS)
    values = jnp.ldexp(x, -e).astype(jnp.float4_e2m1fn)  # x / 2^e is exact; the cast rounds to nearest, ties even
    return values.reshape(shape), jnp.squeeze(e + SCALE_BIAS, axis + 1).astype(jnp.uint8)


def quantized(w_ExCxR: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(blocks, scales) as the Hub lays them out of [E, C, R] values (a test fixture's): fp4_blocks of each
    expert's [R, C] in blocks of 32 along C, two FP4 codes a byte, the low nibble first."""
    import jax
    import jax.numpy as jnp

    values, scales = jax.jit(fp4_blocks, static_argnums=1)(jnp.asarray(w_ExCxR, jnp.float32), 1)
    codes = np.asarray(values).view(np.uint8).transpose(0, 2, 1)  # a code a byte (ml_dtypes), [E, R, C]
    experts, rows, cols = codes.shape
    codes = codes.reshape(experts, rows, cols // BLOCK, BLOCK)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return np.ascontiguousarray(blocks), np.asarray(scales).transpose(0, 2, 1).copy()
