"""YaRN's rotary frequencies and factors (arXiv 2309.00071), for multi-head attention (trainer/layers.py,
GPT-OSS) and latent attention (trainer/mla.py, DeepSeek) alike."""

from __future__ import annotations

import math

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
