"""The whole gated FFN over expert-sorted rows, one block of rows at a time (CPU dropless path).

Fusing the three products per block keeps the [rows, d_ff] intermediates out of
full-size elementwise passes, and the loop runs only over the blocks in use
(a dynamic trip count), so the worst-case row buffer of the dropless exchange
costs memory, not compute. The backward pass is a second loop; it reuses the
hidden activations of the blocks that usually arrive and recomputes any beyond;
weight gradients accumulate per expert.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

_MM = (((1,), (0,)), ((), ()))  # [B, K] x [K, N]
_MM_T = (((1,), (1,)), ((), ()))  # [B, N] x [K, N]^T
_T_MM = (((0,), (0,)), ((), ()))  # [B, K]^T x [B, N]


def _dot(a, b, dims):
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _zeros_like_all(shape, dtype, *arrays) -> jax.Array:
    """Zeros varying over every mesh axis any of `arrays` varies over: under shard_map a loop
    carry must keep its type, and what the loop writes into it carries its inputs' axes."""
    zeros = jnp.zeros(shape, dtype)
    for a in arrays:
        zeros = zeros + jnp.zeros_like(a, dtype=dtype, shape=())
    return zeros


def _varying_axes(a: jax.Array) -> frozenset:
    manual = getattr(jax.typeof(a), "manual_axis_type", None)
    return frozenset(getattr(manual, "varying", ()))


def _sum_to_axes_of(grad: jax.Array, primal: jax.Array) -> jax.Array:
    """A gradient varies over every axis the block products did; a primal replicated over some of
    them (expert weights over "data") takes the sum there, as shard_map's own transpose would."""
    extra = tuple(sorted(_varying_axes(grad) - _varying_axes(primal)))
    return jax.lax.psum(grad, extra) if extra else grad


def _add_expert(dw_GxKxN, e, dw_KxN):
    """dw[e] += dw_KxN as a slice update (an indexed add would lower to a scatter)."""
    old = jax.lax.dynamic_index_in_dim(dw_GxKxN, e, keepdims=True)
    return jax.lax.dynamic_update_index_in_dim(dw_GxKxN, old + dw_KxN[None], e, 0)


def _block_index(index_M, i, block_rows):
    return jax.lax.dynamic_slice_in_dim(index_M, i * block_rows, block_rows)


def _hidden(x_BxD, w_in, w_gate, e, dtype):
    h_BxF = _dot(x_BxD, w_in[e], _MM).astype(dtype)
    g_BxF = _dot(x_BxD, w_gate[e], _MM).astype(dtype)
    return h_BxF, g_BxF


def _forward(x_SxD, w_in, w_gate, w_out, src_M, dst_M, block_group_NB, num_blocks, num_out, save_blocks):
    """Block i reads rows src[i*B:(i+1)*B] of x and writes rows dst[...] of the output;
    indices past the end stand for padding (read as zeros, never written). With save_blocks
    > 0 it also returns the hidden activations of the first save_blocks blocks (plus one
    scratch block that later blocks overwrite), for the backward pass."""
    block_rows = src_M.shape[0] // block_group_NB.shape[0]
    ins = (x_SxD, w_in, w_gate, w_out, src_M, block_group_NB)

    def body(i, carry):
        out_OxD, saved = carry
        e = block_group_NB[i]
        x_BxD = x_SxD.at[_block_index(src_M, i, block_rows)].get(mode="fill", fill_value=0)
        h_BxF, g_BxF = _hidden(x_BxD, w_in, w_gate, e, x_SxD.dtype)
        y_BxD = _dot(jax.nn.silu(g_BxF) * h_BxF, w_out[e], _MM).astype(x_SxD.dtype)
        out_OxD = out_OxD.at[_block_index(dst_M, i, block_rows)].set(y_BxD, mode="drop", unique_indices=True)
        if save_blocks:
            row = jnp.minimum(i, save_blocks) * block_rows
            hidden = (h_BxF, g_BxF)
            saved = tuple(jax.lax.dynamic_update_slice_in_dim(s, a, row, 0) for s, a in zip(saved, hidden, strict=True))
        return out_OxD, saved

    out = _zeros_like_all((num_out, x_SxD.shape[1]), x_SxD.dtype, *ins)
    saved_shape = ((save_blocks + 1) * block_rows, w_in.shape[-1])
    saved = tuple(_zeros_like_all(saved_shape, x_SxD.dtype, *ins) for _ in range(2)) if save_blocks else ()
    return jax.lax.fori_loop(0, num_blocks, body, (out, saved))


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def tiled_ffn(x_SxD, w_in_GxDxF, w_gate_GxDxF, w_out_GxFxD, src_M, dst_M, block_group_NB, num_blocks, num_out,
              save_blocks=0):
    """Grouped gated FFN straight from source rows to destination rows.

    Row m of the block layout (blocks of B rows, block i of expert block_group[i], only the
    first num_blocks in use) is source row src[m] of x; its output goes to row dst[m] of the
    [num_out, D] result. Each destination row is written at most once; rows never written are 0.
    The backward pass reuses the hidden activations of the first save_blocks blocks and
    recomputes the rest: saving all would take a buffer sized (and zeroed) for the worst
    case of the dropless exchange, several times the rows that usually arrive.
    """
    args = (x_SxD, w_in_GxDxF, w_gate_GxDxF, w_out_GxFxD, src_M, dst_M, block_group_NB, num_blocks)
    return _forward(*args, num_out, 0)[0]


def _tiled_ffn_fwd(x_SxD, w_in, w_gate, w_out, src_M, dst_M, block_group_NB, num_blocks, num_out, save_blocks):
    args = (x_SxD, w_in, w_gate, w_out, src_M, dst_M, block_group_NB, num_blocks)
    out_OxD, saved = _forward(*args, num_out, save_blocks)
    return out_OxD, args + (saved,)


def _tiled_ffn_bwd(num_out, save_blocks, res, dout_OxD):
    x_SxD, w_in, w_gate, w_out, src_M, dst_M, block_group_NB, num_blocks, saved = res
    block_rows = src_M.shape[0] // block_group_NB.shape[0]
    dout_OxD = dout_OxD.astype(x_SxD.dtype)

    def hidden(i, x_BxD, e):
        recompute = lambda: _hidden(x_BxD, w_in, w_gate, e, x_SxD.dtype)
        if not save_blocks:
            return recompute()
        load = lambda: tuple(jax.lax.dynamic_slice_in_dim(s, i * block_rows, block_rows) for s in saved)
        return jax.lax.cond(i < save_blocks, load, recompute)

    def body(i, carry):
        dx_SxD, dw_in, dw_gate, dw_out = carry
        e = block_group_NB[i]
        src_B = _block_index(src_M, i, block_rows)
        x_BxD = x_SxD.at[src_B].get(mode="fill", fill_value=0)
        dy_BxD = dout_OxD.at[_block_index(dst_M, i, block_rows)].get(mode="fill", fill_value=0)
        h_BxF, g_BxF = (a.astype(jnp.float32) for a in hidden(i, x_BxD, e))
        sig_BxF = jax.nn.sigmoid(g_BxF)
        silu_BxF = g_BxF * sig_BxF
        dw_out = _add_expert(dw_out, e, _dot((silu_BxF * h_BxF).astype(x_SxD.dtype), dy_BxD, _T_MM))
        da_BxF = _dot(dy_BxD, w_out[e], _MM_T)
        dh_BxF = (da_BxF * silu_BxF).astype(x_SxD.dtype)
        dg_BxF = (da_BxF * h_BxF * sig_BxF * (1.0 + g_BxF * (1.0 - sig_BxF))).astype(x_SxD.dtype)
        dx_BxD = (_dot(dh_BxF, w_in[e], _MM_T) + _dot(dg_BxF, w_gate[e], _MM_T)).astype(x_SxD.dtype)
        # A source row may feed several blocks (a token's k experts): accumulate.
        dx_SxD = dx_SxD.at[src_B].add(dx_BxD, mode="drop")
        dw_in = _add_expert(dw_in, e, _dot(x_BxD, dh_BxF, _T_MM))
        dw_gate = _add_expert(dw_gate, e, _dot(x_BxD, dg_BxF, _T_MM))
        return dx_SxD, dw_in, dw_gate, dw_out

    ins = (x_SxD, dout_OxD, src_M, block_group_NB)
    init = (_zeros_like_all(x_SxD.shape, x_SxD.dtype, *ins),) + tuple(
        _zeros_like_all(w.shape, jnp.float32, *ins) for w in (w_in, w_gate, w_out)
    )
    dx_SxD, *dws = jax.lax.fori_loop(0, num_blocks, body, init)
    dws = [_sum_to_axes_of(dw.astype(w.dtype), w) for dw, w in zip(dws, (w_in, w_gate, w_out), strict=True)]
    return (_sum_to_axes_of(dx_SxD, x_SxD), *dws, None, None, None, None)


tiled_ffn.defvjp(_tiled_ffn_fwd, _tiled_ffn_bwd)
