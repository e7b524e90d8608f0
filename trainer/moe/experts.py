"""Gated experts: batched over capacity buffers, or grouped over expert-sorted rows.

Parameters stay float32; matmuls run in the compute dtype (bfloat16 on TPU). An expert is
act(x W_gate + b_gate, x W_in + b_in) W_out + b_out, the biases optional (GPT-OSS has them) and act
the SwiGLU silu(gate) * up or GPT-OSS's clamped one (Activation).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from trainer.moe.dispatch import BlockLayout, inverse_index, take_rows
from trainer.moe.gmm import grouped_matmul
from trainer.moe.tiled import tiled_ffn
from trainer.moe.weights import SWIGLU, Activation, ExpertWeights  # noqa: F401 - the experts' weights, re-exported


def batched_ffn(x_ExCxD: jax.Array, w: ExpertWeights) -> jax.Array:
    """Each expert's FFN on its own [C, D] buffer: act(x W_gate, x W_in) W_out (with the biases, where there are)."""
    h_ExCxF = jnp.einsum("ecd,edf->ecf", x_ExCxD, w.w_in_ExDxF)
    g_ExCxF = jnp.einsum("ecd,edf->ecf", x_ExCxD, w.w_gate_ExDxF)
    if w.biased:
        h_ExCxF, g_ExCxF = h_ExCxF + w.b_in_ExF[:, None], g_ExCxF + w.b_gate_ExF[:, None]
    out_ExCxD = jnp.einsum("ecf,efd->ecd", w.activation(g_ExCxF, h_ExCxF), w.w_out_ExFxD)
    return out_ExCxD + w.b_out_ExD[:, None] if w.biased else out_ExCxD


def grouped_ffn(x_SxD, w: ExpertWeights, layout: BlockLayout, *, impl: str) -> jax.Array:
    """The FFN over rows grouped by expert in a block layout (dispatch.BlockLayout): layout
    row m is source row src[m] of x, its output lands in row dst[m] of the [num_out, D] result.

    "tiled" moves rows inside its block loop; "ragged_dot" gathers the layout first. Either
    way the gradients are gathers or block-local updates, never a full-size scatter-add.
    """
    if impl == "tiled":
        w, b = w.read(), layout.blocks
        return tiled_ffn(x_SxD, w, layout.src_M, layout.dst_M, b.span_start_NS, b.span_group_NS, b.span_count_C,
                         layout.num_out, layout.block_rows, layout.save_rows)
    x_MxD = take_rows(x_SxD, layout.src_M, layout.src_rows_KxS)
    group_NB, num_blocks = layout.blocks.group_NB, layout.blocks.num_blocks
    h_MxF = grouped_matmul(x_MxD, w.w_in_ExDxF, group_NB, num_blocks, impl)
    g_MxF = grouped_matmul(x_MxD, w.w_gate_ExDxF, group_NB, num_blocks, impl)
    if w.biased:  # each row's expert's (rows past the blocks in use are never read back)
        group_M = jnp.repeat(group_NB, layout.block_rows, total_repeat_length=x_MxD.shape[0])
        h_MxF, g_MxF = h_MxF + w.b_in_ExF[group_M], g_MxF + w.b_gate_ExF[group_M]
    out_MxD = grouped_matmul(w.activation(g_MxF, h_MxF), w.w_out_ExFxD, group_NB, num_blocks, impl)
    if w.biased:
        out_MxD = out_MxD + w.b_out_ExD[group_M]
    return take_rows(out_MxD, inverse_index(layout.dst_M, layout.num_out), layout.dst_M[None])


def shared_ffn(x_TxD: jax.Array, w_in_DxF: jax.Array, w_gate_DxF: jax.Array, w_out_FxD: jax.Array) -> jax.Array:
    """A dense expert every token goes through (DeepSeekMoE's shared experts, concatenated)."""
    h_TxF = x_TxD @ w_in_DxF
    return (jax.nn.silu(x_TxD @ w_gate_DxF) * h_TxF) @ w_out_FxD
