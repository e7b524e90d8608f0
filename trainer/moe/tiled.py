"""The whole gated FFN over expert-sorted rows, one block of rows at a time (CPU dropless path).

Fusing the three products per block keeps the [rows, d_ff] intermediates out of
full-size elementwise passes, and the loop runs only over the blocks in use
(a dynamic trip count), so the worst-case row buffer of the dropless exchange
costs memory, not compute. The backward pass is a second loop with the saved
hidden activations; weight gradients accumulate per expert.
"""

from __future__ import annotations

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


def _rows(a, i, block_rows):
    return jax.lax.dynamic_slice_in_dim(a, i * block_rows, block_rows)


def _put_rows(a, rows, i, block_rows):
    return jax.lax.dynamic_update_slice_in_dim(a, rows.astype(a.dtype), i * block_rows, 0)


def _add_expert(dw_GxKxN, e, dw_KxN):
    """dw[e] += dw_KxN as a slice update (an indexed add would lower to a scatter)."""
    old = jax.lax.dynamic_index_in_dim(dw_GxKxN, e, keepdims=True)
    return jax.lax.dynamic_update_index_in_dim(dw_GxKxN, old + dw_KxN[None], e, 0)


def _forward(x_MxD, w_in, w_gate, w_out, block_group_NB, num_blocks):
    block_rows = x_MxD.shape[0] // block_group_NB.shape[0]
    d_ff = w_in.shape[-1]
    ins = (x_MxD, w_in, w_gate, w_out, block_group_NB)

    def body(i, carry):
        out_MxD, h_MxF, g_MxF = carry
        e = block_group_NB[i]
        x_BxD = _rows(x_MxD, i, block_rows)
        h_BxF = _dot(x_BxD, w_in[e], _MM).astype(x_MxD.dtype)
        g_BxF = _dot(x_BxD, w_gate[e], _MM).astype(x_MxD.dtype)
        y_BxD = _dot(jax.nn.silu(g_BxF) * h_BxF, w_out[e], _MM)
        return (_put_rows(out_MxD, y_BxD, i, block_rows), _put_rows(h_MxF, h_BxF, i, block_rows),
                _put_rows(g_MxF, g_BxF, i, block_rows))

    init = tuple(_zeros_like_all((x_MxD.shape[0], n), x_MxD.dtype, *ins) for n in (x_MxD.shape[1], d_ff, d_ff))
    return jax.lax.fori_loop(0, num_blocks, body, init)


@jax.custom_vjp
def tiled_ffn(x_MxD, w_in_GxDxF, w_gate_GxDxF, w_out_GxFxD, block_group_NB, num_blocks):
    """silu(x W_gate[g]) * (x W_in[g]) W_out[g] for each row block of group g; zero rows after
    the first num_blocks blocks."""
    return _forward(x_MxD, w_in_GxDxF, w_gate_GxDxF, w_out_GxFxD, block_group_NB, num_blocks)[0]


def _tiled_ffn_fwd(x_MxD, w_in, w_gate, w_out, block_group_NB, num_blocks):
    out_MxD, h_MxF, g_MxF = _forward(x_MxD, w_in, w_gate, w_out, block_group_NB, num_blocks)
    return out_MxD, (x_MxD, w_in, w_gate, w_out, block_group_NB, num_blocks, h_MxF, g_MxF)


def _tiled_ffn_bwd(res, dout_MxD):
    x_MxD, w_in, w_gate, w_out, block_group_NB, num_blocks, h_MxF, g_MxF = res
    block_rows = x_MxD.shape[0] // block_group_NB.shape[0]
    dout_MxD = dout_MxD.astype(x_MxD.dtype)

    def body(i, carry):
        dx_MxD, dw_in, dw_gate, dw_out = carry
        e = block_group_NB[i]
        x_BxD, dy_BxD = _rows(x_MxD, i, block_rows), _rows(dout_MxD, i, block_rows)
        h_BxF = _rows(h_MxF, i, block_rows).astype(jnp.float32)
        g_BxF = _rows(g_MxF, i, block_rows).astype(jnp.float32)
        sig_BxF = jax.nn.sigmoid(g_BxF)
        silu_BxF = g_BxF * sig_BxF
        dw_out = _add_expert(dw_out, e, _dot((silu_BxF * h_BxF).astype(x_MxD.dtype), dy_BxD, _T_MM))
        da_BxF = _dot(dy_BxD, w_out[e], _MM_T)
        dh_BxF = (da_BxF * silu_BxF).astype(x_MxD.dtype)
        dg_BxF = (da_BxF * h_BxF * sig_BxF * (1.0 + g_BxF * (1.0 - sig_BxF))).astype(x_MxD.dtype)
        dx_BxD = _dot(dh_BxF, w_in[e], _MM_T) + _dot(dg_BxF, w_gate[e], _MM_T)
        dw_in = _add_expert(dw_in, e, _dot(x_BxD, dh_BxF, _T_MM))
        dw_gate = _add_expert(dw_gate, e, _dot(x_BxD, dg_BxF, _T_MM))
        return _put_rows(dx_MxD, dx_BxD, i, block_rows), dw_in, dw_gate, dw_out

    ins = (x_MxD, dout_MxD, block_group_NB)
    init = (_zeros_like_all(x_MxD.shape, x_MxD.dtype, *ins),) + tuple(
        _zeros_like_all(w.shape, jnp.float32, *ins) for w in (w_in, w_gate, w_out)
    )
    dx_MxD, *dws = jax.lax.fori_loop(0, num_blocks, body, init)
    dws = [_sum_to_axes_of(dw.astype(w.dtype), w) for dw, w in zip(dws, (w_in, w_gate, w_out))]
    return (_sum_to_axes_of(dx_MxD, x_MxD), *dws, None, None)


tiled_ffn.defvjp(_tiled_ffn_fwd, _tiled_ffn_bwd)
