"""The whole gated FFN over expert-sorted rows, one span of blocks at a time (CPU dropless path).

Fusing the three products per span of blocks keeps the [rows, d_ff] intermediates
out of full-size elementwise passes, and one loop per span size runs only over the
spans in use (a dynamic trip count), so the worst-case row buffer of the dropless
exchange costs memory, not compute. The backward pass is a second loop; it reuses the
hidden activations of the spans that usually arrive and recomputes any beyond;
weight gradients accumulate per expert. The experts' biases and gating are ExpertWeights'.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from trainer.moe.dispatch import span_sizes, span_slots
from trainer.moe.weights import ExpertWeights

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


def _spans_of_size(span_count_C, block_rows, total_blocks, num_groups):
    """(rows, first, count) per span size: its spans are span_start[first:first + count]."""
    sizes, slots = span_sizes(), span_slots(total_blocks, num_groups)
    firsts = [sum(slots[:c]) for c in range(len(sizes))]
    # A span longer than all the blocks never runs, and could not be sliced (decoding: a few rows a device).
    return [(size * block_rows, first, span_count_C[c])
            for c, (size, first, n) in enumerate(zip(sizes, firsts, slots, strict=True)) if n and size <= total_blocks]


def _hidden(x_BxD, w: ExpertWeights, e, dtype):
    h_BxF = _dot(x_BxD, w.w_in_ExDxF[e], _MM).astype(dtype)
    g_BxF = _dot(x_BxD, w.w_gate_ExDxF[e], _MM).astype(dtype)
    if w.biased:
        h_BxF, g_BxF = h_BxF + w.b_in_ExF[e], g_BxF + w.b_gate_ExF[e]
    return h_BxF, g_BxF


def _output(a_BxF, w: ExpertWeights, e, dtype):
    y_BxD = _dot(a_BxF, w.w_out_ExFxD[e], _MM).astype(dtype)
    return y_BxD + w.b_out_ExD[e] if w.biased else y_BxD


def _forward(x_SxD, w: ExpertWeights, src_M, dst_M, span_start_NS, span_group_NS, span_count_C, num_out,
             block_rows, save_rows, keep_hidden):
    """Span i of rows R reads rows src[start:start+R] of x (start = span_start[i] * B) and writes
    rows dst[...] of the output; indices past the end stand for padding (read as zeros, never
    written). With keep_hidden it also returns the hidden activations of the spans within the
    first save_rows rows (plus a scratch span that the others overwrite), for the backward pass."""
    ins = (x_SxD, *jax.tree.leaves(w), src_M, span_group_NS)
    # Spans past save_rows write their activations to a scratch span at its end (none when all fit).
    max_rows = min(span_sizes()[0] * block_rows, src_M.shape[0]) if save_rows < src_M.shape[0] else 0

    def body(rows):
        def run(i, carry):
            out_OxD, saved = carry
            e, start = span_group_NS[i], span_start_NS[i] * block_rows
            x_BxD = x_SxD.at[jax.lax.dynamic_slice_in_dim(src_M, start, rows)].get(mode="fill", fill_value=0)
            h_BxF, g_BxF = _hidden(x_BxD, w, e, x_SxD.dtype)
            y_BxD = _output(w.activation(g_BxF, h_BxF), w, e, x_SxD.dtype)
            dst_B = jax.lax.dynamic_slice_in_dim(dst_M, start, rows)
            out_OxD = out_OxD.at[dst_B].set(y_BxD, mode="drop", unique_indices=True)
            if keep_hidden:
                row = jnp.where(start + rows <= save_rows, start, save_rows)
                saved = tuple(jax.lax.dynamic_update_slice_in_dim(s, a, row, 0)
                              for s, a in zip(saved, (h_BxF, g_BxF), strict=True))
            return out_OxD, saved
        return run

    out = _zeros_like_all((num_out, x_SxD.shape[1]), x_SxD.dtype, *ins)
    saved_shape = (save_rows + max_rows, w.w_in_ExDxF.shape[-1])
    saved = tuple(_zeros_like_all(saved_shape, x_SxD.dtype, *ins) for _ in range(2)) if keep_hidden else ()
    carry = (out, saved)
    for rows, first, count in _spans_of_size(span_count_C, block_rows, src_M.shape[0] // block_rows,
                                             w.w_in_ExDxF.shape[0]):
        carry = jax.lax.fori_loop(first, first + count, body(rows), carry)
    return carry


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def tiled_ffn(x_SxD, w: ExpertWeights, src_M, dst_M, span_start_NS, span_group_NS, span_count_C, num_out,
              block_rows, save_rows=0):
    """Grouped gated FFN straight from source rows to destination rows.

    Row m of the block layout (blocks of B rows, grouped by expert into spans of up to
    SPAN_BLOCKS blocks: dispatch.Blocks) is source row src[m] of x; its output goes to row
    dst[m] of the [num_out, D] result. Each span is one matmul per weight; only the spans in
    use run. Each destination row is written at most once; rows never written are 0.
    The backward pass reuses the hidden activations of the spans within the first save_rows
    rows and recomputes the rest: saving all would take a buffer sized (and zeroed) for the
    worst case of the dropless exchange, several times the rows that usually arrive.
    """
    args = (x_SxD, w, src_M, dst_M, span_start_NS, span_group_NS, span_count_C)
    return _forward(*args, num_out, block_rows, save_rows, False)[0]


def _tiled_ffn_fwd(x_SxD, w, src_M, dst_M, span_start_NS, span_group_NS, span_count_C, num_out, block_rows,
                   save_rows):
    args = (x_SxD, w, src_M, dst_M, span_start_NS, span_group_NS, span_count_C)
    out_OxD, saved = _forward(*args, num_out, block_rows, save_rows, save_rows > 0)
    return out_OxD, args + (saved,)


def _gated_grads(g_BxF, h_BxF, da_BxF, act):
    """(act(g, h), its gradient in h, in g) for the output's gradient da, in float32: silu's written out,
    another gating's by autodiff."""
    if not act.clamped:
        sig_BxF = jax.nn.sigmoid(g_BxF)
        silu_BxF = g_BxF * sig_BxF
        return silu_BxF * h_BxF, da_BxF * silu_BxF, da_BxF * h_BxF * sig_BxF * (1.0 + g_BxF * (1.0 - sig_BxF))
    a_BxF, pull = jax.vjp(act, g_BxF, h_BxF)
    dg_BxF, dh_BxF = pull(da_BxF)
    return a_BxF, dh_BxF, dg_BxF


def _span_grads(dw: ExpertWeights, w: ExpertWeights, e, x_BxD, dy_BxD, h_BxF, g_BxF, dtype):
    """(this span's input gradient, the weights' gradients with its expert's share added)."""
    da_BxF = _dot(dy_BxD, w.w_out_ExFxD[e], _MM_T)
    a_BxF, dh_BxF, dg_BxF = _gated_grads(h_BxF=h_BxF, g_BxF=g_BxF, da_BxF=da_BxF, act=w.activation)
    dh_BxF, dg_BxF = dh_BxF.astype(dtype), dg_BxF.astype(dtype)
    dx_BxD = (_dot(dh_BxF, w.w_in_ExDxF[e], _MM_T) + _dot(dg_BxF, w.w_gate_ExDxF[e], _MM_T)).astype(dtype)
    new = dict(w_out_ExFxD=_add_expert(dw.w_out_ExFxD, e, _dot(a_BxF.astype(dtype), dy_BxD, _T_MM)),
               w_in_ExDxF=_add_expert(dw.w_in_ExDxF, e, _dot(x_BxD, dh_BxF, _T_MM)),
               w_gate_ExDxF=_add_expert(dw.w_gate_ExDxF, e, _dot(x_BxD, dg_BxF, _T_MM)))
    if w.biased:  # padding rows have no gradient (dy reads zeros there)
        column = lambda a: jnp.sum(a.astype(jnp.float32), axis=0)  # noqa: E731
        new.update(b_in_ExF=_add_expert(dw.b_in_ExF, e, column(dh_BxF)),
                   b_gate_ExF=_add_expert(dw.b_gate_ExF, e, column(dg_BxF)),
                   b_out_ExD=_add_expert(dw.b_out_ExD, e, column(dy_BxD)))
    return dx_BxD, dataclasses.replace(dw, **new)


def _tiled_ffn_bwd(num_out, block_rows, save_rows, res, dout_OxD):
    x_SxD, w, src_M, dst_M, span_start_NS, span_group_NS, span_count_C, saved = res
    dout_OxD = dout_OxD.astype(x_SxD.dtype)

    def body(rows):
        def hidden(start, x_BxD, e):
            recompute = lambda: _hidden(x_BxD, w, e, x_SxD.dtype)
            if not save_rows:
                return recompute()
            load = lambda: tuple(jax.lax.dynamic_slice_in_dim(s, start, rows) for s in saved)
            if save_rows >= src_M.shape[0]:
                return load()  # every span was saved
            return jax.lax.cond(start + rows <= save_rows, load, recompute)

        def run(i, carry):
            dx_SxD, dw = carry
            e, start = span_group_NS[i], span_start_NS[i] * block_rows
            src_B = jax.lax.dynamic_slice_in_dim(src_M, start, rows)
            x_BxD = x_SxD.at[src_B].get(mode="fill", fill_value=0)
            dy_BxD = dout_OxD.at[jax.lax.dynamic_slice_in_dim(dst_M, start, rows)].get(mode="fill", fill_value=0)
            h_BxF, g_BxF = (a.astype(jnp.float32) for a in hidden(start, x_BxD, e))
            dx_BxD, dw = _span_grads(dw, w, e, x_BxD, dy_BxD, h_BxF, g_BxF, x_SxD.dtype)
            # A source row may feed several spans (a token's k experts): accumulate.
            return dx_SxD.at[src_B].add(dx_BxD, mode="drop"), dw
        return run

    ins = (x_SxD, dout_OxD, src_M, span_group_NS)
    carry = (_zeros_like_all(x_SxD.shape, x_SxD.dtype, *ins),
             jax.tree.map(lambda a: _zeros_like_all(a.shape, jnp.float32, *ins), w))
    for rows, first, count in _spans_of_size(span_count_C, block_rows, src_M.shape[0] // block_rows,
                                             w.w_in_ExDxF.shape[0]):
        carry = jax.lax.fori_loop(first, first + count, body(rows), carry)
    dx_SxD, dw = carry
    dw = jax.tree.map(lambda d, p: _sum_to_axes_of(d.astype(p.dtype), p), dw, w)
    return (_sum_to_axes_of(dx_SxD, x_SxD), dw, None, None, None, None, None)


tiled_ffn.defvjp(_tiled_ffn_fwd, _tiled_ffn_bwd)
