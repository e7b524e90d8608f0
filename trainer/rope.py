"""YaRN's rotary frequencies and factors (arXiv 2309.00071), for multi-head attention (trainer/layers.py,
GPT-OSS) and latent attention (trainer/mla.py, DeepSeek) alike."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from trainer.model_config import YarnConfig


def mscale(scale: float, m: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def yarn_frequencies(dim: int, theta: float, yarn: YarnConfig) -> tuple[tuple[float, ...], float, float]:
    """(the dim/2 rotary frequencies, the factor on the rotary values, the factor on the softmax scale) of
    YaRN: frequencies that turn fewer than beta_slow times over the original length divided by `factor`,
    those that turn more than beta_fast times kept, a linear ramp between (in float32, as DeepSeek's)."""
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    kept = np.float32(1.0) / (np.float32(theta) ** exponents)
    stretched = np.float32(1.0) / (np.float32(yarn.factor) * np.float32(theta) ** exponents)
    at = lambda turns: dim * math.log(yarn.original_max_position_embeddings / (turns * 2 * math.pi)) / (  # noqa: E731
        2 * math.log(theta))
    low, high = at(yarn.beta_fast), at(yarn.beta_slow)
    if yarn.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    inv_freq = stretched * ramp + kept * (np.float32(1.0) - ramp)
    if yarn.mscale and yarn.mscale_all_dim:
        values = mscale(yarn.factor, yarn.mscale) / mscale(yarn.factor, yarn.mscale_all_dim)
    else:
        values = mscale(yarn.factor, 1.0)
    softmax = mscale(yarn.factor, yarn.mscale_all_dim) ** 2 if yarn.mscale_all_dim else 1.0
    return tuple(float(f) for f in inv_freq), float(values), softmax


def _swap_halves(h: int, dtype, transpose: bool = False) -> jax.Array:
    """[h, h]: x @ it is (-x2, x1) for x = (x1, x2), each value moved whole (its transpose moves them back)."""
    half, m = h // 2, np.zeros((h, h), np.float32)
    m[np.arange(half) + half, np.arange(half)] = -1.0
    m[np.arange(half), np.arange(half) + half] = 1.0
    return jnp.asarray(m.T if transpose else m, dtype)


def _turned(x: jax.Array, cos_H: jax.Array, sin_H: jax.Array, transpose: bool = False) -> jax.Array:
    # x times its cosines plus its halves swapped (one a sign) times the sines, in float32, rounded once. The swap
    # is a product with a signed permutation: exact (each output one input; in float32 at 'highest'), and
    # a matmul whose epilogue XLA fuses the rest into, so the values stay whole rows of 128 lanes on a TPU.
    precision = None if x.dtype == jnp.bfloat16 else jax.lax.Precision.HIGHEST
    swapped = jnp.einsum("...h,hk->...k", x, _swap_halves(x.shape[-1], x.dtype, transpose),
                         preferred_element_type=jnp.float32, precision=precision)
    return (x.astype(jnp.float32) * cos_H + swapped * sin_H).astype(x.dtype)


@jax.custom_vjp
def turn(x: jax.Array, cos_H: jax.Array, sin_H: jax.Array) -> jax.Array:
    """Rotates each feature pair (i, i + H/2) of x [..., H] by the angles whose cosines and sines (each of the H/2
    repeated twice, [..., H], broadcasting against x) are given: (x1 cos - x2 sin, x2 cos + x1 sin), computed in
    float32. Written with its backward pass (the same rotation, reversed) because autodiff's of the
    halves-and-concatenate form moved float32 halves of 64 lanes through memory: on a v5e chip moe-1b's
    step took 317.3 ms this way against 343.4 (`bash benchmarks/on_chip.sh levers`, 2026-12-06)."""
    return _turned(x, cos_H, sin_H)


def _turn_forward(x, cos_H, sin_H):
    return _turned(x, cos_H, sin_H), (cos_H, sin_H)


def _turn_backward(residuals, g):
    cos_H, sin_H = residuals
    return _turned(g, cos_H, sin_H, transpose=True), None, None  # the angles are no parameter


turn.defvjp(_turn_forward, _turn_backward)
