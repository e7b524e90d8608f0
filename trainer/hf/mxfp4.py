"""MXFP4 expert weights (GPT-OSS on the Hub): `X_blocks` uint8 [E, R, C/32, 16] and `X_scales` uint8 [E, R, C/32]
for a weight X of R rows and C columns a matrix. Each byte holds two FP4 (e2m1) values, the low nibble first; a
block of 32 values (16 bytes) shares the power-of-two scale 2^(s - 127). Dequantised as transformers does it
(../shared/HF-FACTS.md): each FP4 value times 2^(s - 127) in float32, rounded once to bfloat16, and each expert's
[R, C] transposed to [C, R] (the Hub's MXFP4 files hold [out, in]; GPT-OSS's bfloat16 tensors are [in, out]).

`quantized` is the inverse for tests' fixtures: the nearest FP4 value of each entry over the smallest scale
that keeps its block within FP4's range (6).
"""

from __future__ import annotations

import numpy as np

from trainer.hf.errors import HFError

BLOCKS, SCALES = "_blocks", "_scales"
BLOCK = 32  # values a scale
# The sixteen FP4 (e2m1) codes' values: sign bit 8, then exponent and mantissa.
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)
SCALE_BIAS = 127


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


def quantized(w_ExCxR: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(blocks, scales) of [E, C, R] values (a test fixture's): each expert's [R, C] in blocks of 32 along C."""
    experts, cols, rows = w_ExCxR.shape
    x = np.asarray(w_ExCxR, np.float32).transpose(0, 2, 1).reshape(experts, rows, cols // BLOCK, BLOCK)
    top = np.max(np.abs(x), axis=-1)
    exponent = np.where(top > 0, np.ceil(np.log2(np.maximum(top, 1e-30) / 6.0)), 0).astype(np.int32)
    exponent = np.clip(exponent, -SCALE_BIAS, 255 - SCALE_BIAS - 1)
    scaled = x / np.ldexp(np.float32(1.0), exponent)[..., None]
    codes = np.argmin(np.abs(np.abs(scaled)[..., None] - FP4_VALUES[:8]), axis=-1).astype(np.uint8)
    codes = np.where(scaled < 0, codes | 8, codes).astype(np.uint8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return np.ascontiguousarray(blocks), np.ascontiguousarray(exponent + SCALE_BIAS, np.uint8)
