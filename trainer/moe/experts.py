"""Gated SiLU experts: batched over capacity buffers, or grouped over expert-sorted rows.

Parameters stay float32; matmuls run in the compute dtype (bfloat16 on TPU).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from trainer.moe.dispatch import BlockLayout, inverse_index, take_rows
from trainer.moe.gmm import grouped_matmul
from trainer.moe.stacked import read
from trainer.moe.tiled import tiled_ffn


class ExpertWeights(NamedTuple):
    w_in_ExDxF: jax.Array
    w_gate_ExDxF: jax.Array
    w_out_ExFxD: jax.Array

    def cast(self, dtype) -> ExpertWeights:
        return ExpertWeights(*(w.astype(dtype) for w in self))

    def read(self) -> ExpertWeights:
        """The weights as arrays (a layer of stacked weights, trainer/moe/stacked.py, read as its slice)."""
        return ExpertWeights(*(read(w) for w in self))


def batched_ffn(x_ExCxD: jax.Array, w: ExpertWeights) -> jax.Array:
    """Each expert's FFN on its own [C, D] buffer: silu(x W_gate) * (x W_in) W_out."""
    h_ExCxF = jnp.einsum("ecd,edf->ecf", x_ExCxD, w.w_in_ExDxF)
    g_ExCxF = jnp.einsum("ecd,edf->ecf", x_ExCxD, w.w_gate_ExDxF)
    return jnp.einsum("ecf,efd->ecd", jax.nn.silu(g_ExCxF) * h_ExCxF, w.w_out_ExFxD)


def grouped_ffn(x_SxD, w: ExpertWeights, layout: BlockLayout, *, impl: str) -> jax.Array:
    """The FFN over rows grouped by expert in a block layout (dispatch.BlockLayout): layout
    row m is source row src[m] of x, its output lands in row dst[m] of the [num_out, D] result.

    "tiled" moves rows inside its block loop; "ragged_dot" gathers the layout first. Either
    way the gradients are gathers or block-local updates, never a full-size scatter-add.
    """
    if impl == "tiled":
        w, b = w.read(), layout.blocks
        return tiled_ffn(x_SxD, *w, layout.src_M, layout.dst_M, b.span_start_NS, b.span_group_NS, b.span_count_C,
                         layout.num_out, layout.block_rows, layout.save_rows)
    x_MxD = take_rows(x_SxD, layout.src_M, layout.src_rows_KxS)
    group_NB, num_blocks = layout.blocks.group_NB, layout.blocks.num_blocks
    h_MxF = grouped_matmul(x_MxD, w.w_in_ExDxF, group_NB, num_blocks, impl)
    g_MxF = grouped_matmul(x_MxD, w.w_gate_ExDxF, group_NB, num_blocks, impl)
    out_MxD = grouped_matmul(jax.nn.silu(g_MxF) * h_MxF, w.w_out_ExFxD, group_NB, num_blocks, impl)
    return take_rows(out_MxD, inverse_index(layout.dst_M, layout.num_out), layout.dst_M[None])


def shared_ffn(x_TxD: jax.Array, w_in_DxF: jax.Array, w_gate_DxF: jax.Array, w_out_FxD: jax.Array) -> jax.Array:
    """A dense expert every token goes through (DeepSeekMoE's shared experts, concatenated)."""
    h_TxF = x_TxD @ w_in_DxF
    return (jax.nn.silu(x_TxD @ w_gate_DxF) * h_TxF) @ w_out_FxD
