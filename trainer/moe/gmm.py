"""Grouped matmul over expert-sorted rows with jax.lax.ragged_dot (the TPU/GPU dropless path).

Rows come in the block layout of dispatch.aligned_layout: groups start on
multiples of B rows and the blocks in use come first. On CPU ragged_dot lowers
to a masked dense product costing rows * experts, so there the whole FFN runs
as a loop over the blocks in use instead (tiled.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def grouped_matmul(x_MxK: jax.Array, w_GxKxN: jax.Array, block_group_NB: jax.Array, num_blocks: jax.Array) -> jax.Array:
    """out[m] = x[m] @ w[group of m] for rows in the used blocks, zeros elsewhere."""
    block_rows = x_MxK.shape[0] // block_group_NB.shape[0]
    num_groups = w_GxKxN.shape[0]
    sizes_G = jnp.zeros((num_groups,), jnp.int32).at[block_group_NB].add(
        jnp.where(jnp.arange(block_group_NB.shape[0]) < num_blocks, block_rows, 0)
    )
    # Rows past the used blocks are zeros; give them to the last group so every row is in one.
    sizes_G = sizes_G.at[-1].add(x_MxK.shape[0] - jnp.sum(sizes_G))
    # bfloat16 operands' products are exact in float32 at any precision, so one pass is stated for them: under
    # jax.default_matmul_precision('highest') the TPU's grouped-matmul kernel (Mosaic) refuses float32 contract
    # precision on bfloat16 operands. float32 operands keep the context's precision.
    bf16 = x_MxK.dtype == jnp.bfloat16 and w_GxKxN.dtype == jnp.bfloat16
    precision = jax.lax.Precision.DEFAULT if bf16 else None
    out = jax.lax.ragged_dot(x_MxK, w_GxKxN, sizes_G, precision=precision, preferred_element_type=jnp.float32)
    return out.astype(x_MxK.dtype)


@functools.cache
def default_impl(platform: str) -> str:
    """ragged_dot where it is a real grouped kernel (TPU, GPU); tiled on CPU."""
    return "tiled" if platform == "cpu" else "ragged_dot"
