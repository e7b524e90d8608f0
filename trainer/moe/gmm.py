"""Grouped matmul over expert-sorted rows: jax.lax.ragged_dot, or a tiled loop for CPU.

Rows come in an aligned layout (dispatch.aligned_layout): groups start on
multiples of B rows, so every block of B rows belongs to one expert, and the
blocks in use come first. On CPU ragged_dot lowers to a masked dense product
costing rows * experts; the tiled loop does one [B, K] x [K, N] product per
block in use, and skips the rest with a dynamic trip count.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def grouped_matmul(
    x_MxK: jax.Array, w_GxKxN: jax.Array, block_group_NB: jax.Array, num_blocks: jax.Array, *, impl: str
) -> jax.Array:
    """out[m] = x[m] @ w[group of m] for rows in the used blocks, zeros elsewhere."""
    block_rows = x_MxK.shape[0] // block_group_NB.shape[0]
    if impl == "tiled":
        return _tiled_gmm(x_MxK, w_GxKxN, block_group_NB, num_blocks)
    num_groups = w_GxKxN.shape[0]
    sizes_G = jnp.zeros((num_groups,), jnp.int32).at[block_group_NB].add(
        jnp.where(jnp.arange(block_group_NB.shape[0]) < num_blocks, block_rows, 0)
    )
    # Rows past the used blocks are zeros; give them to the last group so every row is in one.
    sizes_G = sizes_G.at[-1].add(x_MxK.shape[0] - jnp.sum(sizes_G))
    out = jax.lax.ragged_dot(x_MxK, w_GxKxN, sizes_G, preferred_element_type=jnp.float32)
    return out.astype(x_MxK.dtype)


def _block_loop(num_blocks: jax.Array, body, init):
    return jax.lax.fori_loop(0, num_blocks, body, init)


def _zeros_like_all(shape, dtype, *arrays) -> jax.Array:
    """Zeros that vary over every mesh axis any of `arrays` varies over: under shard_map a
    loop carry must keep its type, and the blocks written into it carry their inputs' axes."""
    zeros = jnp.zeros(shape, dtype)
    for a in arrays:
        zeros = zeros + jnp.zeros_like(a, dtype=dtype, shape=())
    return zeros


@jax.custom_vjp
def _tiled_gmm(x_MxK, w_GxKxN, block_group_NB, num_blocks):
    return _tiled_forward(x_MxK, w_GxKxN, block_group_NB, num_blocks)


def _tiled_forward(x_MxK, w_GxKxN, block_group_NB, num_blocks, transpose_w=False):
    block_rows = x_MxK.shape[0] // block_group_NB.shape[0]
    out_cols = w_GxKxN.shape[1] if transpose_w else w_GxKxN.shape[2]
    dims = (((1,), (1,)), ((), ())) if transpose_w else (((1,), (0,)), ((), ()))

    def body(i, out_MxN):
        x_BxK = jax.lax.dynamic_slice_in_dim(x_MxK, i * block_rows, block_rows)
        w_KxN = w_GxKxN[block_group_NB[i]]
        y_BxN = jax.lax.dot_general(x_BxK, w_KxN, dims, preferred_element_type=jnp.float32)
        return jax.lax.dynamic_update_slice_in_dim(out_MxN, y_BxN.astype(out_MxN.dtype), i * block_rows, 0)

    init = _zeros_like_all((x_MxK.shape[0], out_cols), x_MxK.dtype, x_MxK, w_GxKxN, block_group_NB)
    return _block_loop(num_blocks, body, init)


def _tiled_fwd(x_MxK, w_GxKxN, block_group_NB, num_blocks):
    out = _tiled_forward(x_MxK, w_GxKxN, block_group_NB, num_blocks)
    return out, (x_MxK, w_GxKxN, block_group_NB, num_blocks)


def _tiled_bwd(res, dout_MxN):
    x_MxK, w_GxKxN, block_group_NB, num_blocks = res
    block_rows = x_MxK.shape[0] // block_group_NB.shape[0]
    dx_MxK = _tiled_forward(dout_MxN.astype(x_MxK.dtype), w_GxKxN, block_group_NB, num_blocks, transpose_w=True)

    def body(i, dw_GxKxN):
        x_BxK = jax.lax.dynamic_slice_in_dim(x_MxK, i * block_rows, block_rows)
        dy_BxN = jax.lax.dynamic_slice_in_dim(dout_MxN, i * block_rows, block_rows).astype(x_MxK.dtype)
        dw_KxN = jax.lax.dot_general(x_BxK, dy_BxN, (((0,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        group = block_group_NB[i]
        return dw_GxKxN.at[group].add(dw_KxN)

    init = _zeros_like_all(w_GxKxN.shape, jnp.float32, x_MxK, dout_MxN, block_group_NB)
    dw_GxKxN = _block_loop(num_blocks, body, init)
    return _sum_to_axes_of(dx_MxK, x_MxK), _sum_to_axes_of(dw_GxKxN.astype(w_GxKxN.dtype), w_GxKxN), None, None


def _varying_axes(a: jax.Array) -> frozenset:
    manual = getattr(jax.typeof(a), "manual_axis_type", None)
    return frozenset(getattr(manual, "varying", ()))


def _sum_to_axes_of(grad: jax.Array, primal: jax.Array) -> jax.Array:
    """A gradient varies over every axis its block products did; a primal replicated over some
    of them (expert weights over "data") takes the sum there, as shard_map's own transpose would."""
    extra = tuple(sorted(_varying_axes(grad) - _varying_axes(primal)))
    return jax.lax.psum(grad, extra) if extra else grad


_tiled_gmm.defvjp(_tiled_fwd, _tiled_bwd)


@functools.cache
def default_impl(platform: str) -> str:
    """ragged_dot where it is a real grouped kernel (TPU, GPU); tiled on CPU."""
    return "tiled" if platform == "cpu" else "ragged_dot"
