"""Per-row sampling inside the jitted steps: greedy, temperature, top-k and top-p, each row its own.

A row's randomness is its request's seed folded with the position it generates, so a request draws
the same tokens alone or in any batch, and on a retry with the same seed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def sample_tokens(logits_BxV: jax.Array, temperature_B: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array,
                  seed_B: jax.Array, position_B: jax.Array) -> jax.Array:
    """The next token of each row, int32 [B]: argmax where temperature is 0, else a draw from the softmax
    at that temperature restricted to the top_k best (0: all) and to the smallest set of best tokens whose
    probability reaches top_p."""
    vocab = logits_BxV.shape[-1]
    greedy_B = jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    scaled_BxV = logits_BxV / jnp.maximum(temperature_B, 1e-6)[:, None]
    sorted_BxV = jnp.sort(scaled_BxV, axis=-1)[:, ::-1]
    k_B = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, vocab), vocab)
    kth_B = jnp.take_along_axis(sorted_BxV, (k_B - 1)[:, None], axis=-1)[:, 0]
    ranked_BxV = jnp.where(jnp.arange(vocab)[None, :] < k_B[:, None], sorted_BxV, -jnp.inf)
    probs_BxV = jax.nn.softmax(ranked_BxV, axis=-1)
    before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV  # probability of the better tokens
    keep_BxV = (before_BxV < top_p_B[:, None]) & (ranked_BxV > -jnp.inf)
    floor_B = jnp.min(jnp.where(keep_BxV, sorted_BxV, jnp.inf), axis=-1)
    floor_B = jnp.maximum(floor_B, kth_B)
    masked_BxV = jnp.where(scaled_BxV >= floor_B[:, None], scaled_BxV, -jnp.inf)

    def draw(seed, position, row_V):
        key = jax.random.fold_in(jax.random.key(seed.astype(jnp.uint32)), position)
        return jax.random.categorical(key, row_V)

    drawn_B = jax.vmap(draw)(seed_B, position_B, masked_BxV).astype(jnp.int32)
    return jnp.where(temperature_B > 0, drawn_B, greedy_B)
