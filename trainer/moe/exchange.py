"""Moving token rows between devices over the expert mesh axis: the only collectives on data.

Capacity buffers go with one tiled all_to_all each way. Dropless rows go either
with ragged_all_to_all (only the assigned rows travel; TPU and GPU) or with a
padded all_to_all (every destination gets a full chunk; the CPU backend cannot
compile ragged_all_to_all). Both land in the same layout, chunk s of the receive
buffer holding source s's rows, so everything after the exchange is shared.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from trainer.moe import dispatch
from trainer.moe.experts import ExpertWeights, grouped_ffn


def exchange_to_experts(buf_GxExCxD: jax.Array, axis: str | None, num_shards: int) -> jax.Array:
    """[G, E, C, D] rows per expert -> [E_l, S * G * C, D] rows of the local experts from all S sources."""
    num_groups, num_experts, capacity, d_model = buf_GxExCxD.shape
    if axis is not None and num_shards > 1:
        # Split the expert dim over destinations; received chunks stack on the group dim.
        buf_GxExCxD = jax.lax.all_to_all(buf_GxExCxD, axis, split_axis=1, concat_axis=0, tiled=True)
    local = buf_GxExCxD.shape[1]
    return buf_GxExCxD.transpose(1, 0, 2, 3).reshape(local, -1, d_model)


def exchange_from_experts(out_ElxRxD: jax.Array, shape, axis: str | None, num_shards: int) -> jax.Array:
    """The inverse of exchange_to_experts: back to [G, E, C, D] on the devices the rows came from."""
    num_groups, num_experts, capacity, d_model = shape
    local = out_ElxRxD.shape[0]
    out_SGxElxCxD = out_ElxRxD.reshape(local, -1, capacity, d_model).transpose(1, 0, 2, 3)
    if axis is not None and num_shards > 1:
        out_SGxElxCxD = jax.lax.all_to_all(out_SGxElxCxD, axis, split_axis=0, concat_axis=1, tiled=True)
    return out_SGxElxCxD


def dropless_experts(x_NxD, counts_E, w: ExpertWeights, block_rows: int, topo) -> jax.Array:
    """Rows sorted by expert in, each row's expert output out, in the same order."""
    if topo.expert_axis is None or topo.num_expert_shards == 1:
        dest_1xN, block_group, num_blocks = dispatch.aligned_layout(counts_E[None], x_NxD.shape[0], block_rows)
        return _grouped_on_layout(x_NxD, dest_1xN.reshape(-1), block_group, num_blocks, w, block_rows, topo)
    return _dropless_parallel(x_NxD, counts_E, w, block_rows, topo)


def _grouped_on_layout(x_RxD, dest_R, block_group_NB, num_blocks, w, block_rows: int, topo) -> jax.Array:
    """Moves rows into the block-aligned layout, runs the grouped FFN, moves them back."""
    num_rows = block_group_NB.shape[0] * block_rows
    x_MxD = dispatch.gather_rows(x_RxD, dispatch.inverse_index(dest_R, num_rows))
    out_MxD = grouped_ffn(x_MxD, w, block_group_NB, num_blocks, impl=topo.grouped_matmul)
    return dispatch.gather_rows(out_MxD, dest_R)


def _dropless_parallel(x_NxD, counts_E, w: ExpertWeights, block_rows: int, topo) -> jax.Array:
    """Each device's sorted rows go to the owners of their experts and come back processed.

    The per-expert counts of every device are all-gathered first (E integers a
    device), so each side knows what it sends and receives without a third all_to_all.
    """
    axis, num_shards = topo.expert_axis, topo.num_expert_shards
    num_rows, d_model = x_NxD.shape
    local = counts_E.shape[0] // num_shards
    me = jax.lax.axis_index(axis)
    counts_SxE = jax.lax.all_gather(counts_E, axis)
    sizes_SxJ = counts_SxE.reshape(num_shards, num_shards, local).sum(axis=2)
    recv_counts_SxEl = jax.lax.dynamic_slice_in_dim(counts_SxE, me * local, local, axis=1)
    if topo.exchange == "ragged":
        recv_SNxD = _ragged_there(x_NxD, sizes_SxJ, me, axis)
    else:
        recv_SNxD = _padded_there(x_NxD, sizes_SxJ[me], axis)
    dest_SxN, block_group, num_blocks = dispatch.aligned_layout(recv_counts_SxEl, num_rows, block_rows)
    out_SNxD = _grouped_on_layout(recv_SNxD, dest_SxN.reshape(-1), block_group, num_blocks, w, block_rows, topo)
    if topo.exchange == "ragged":
        return _ragged_back(out_SNxD, sizes_SxJ, me, axis)
    return _padded_back(out_SNxD.reshape(num_shards, num_rows, d_model), sizes_SxJ[me], axis)


def _starts(sizes):
    return (jnp.cumsum(sizes, axis=-1) - sizes).astype(jnp.int32)


def _padded_there(x_NxD, send_J, axis):
    """Chunk j of the send buffer holds the rows for device j, zero-padded to N rows."""
    num_rows = x_NxD.shape[0]
    rows_N = jnp.arange(num_rows, dtype=jnp.int32)
    index_JxN = jnp.where(rows_N < send_J[:, None], _starts(send_J)[:, None] + rows_N, num_rows)
    send_JxNxD = dispatch.gather_rows(x_NxD, index_JxN)
    recv_SxNxD = jax.lax.all_to_all(send_JxNxD, axis, split_axis=0, concat_axis=0, tiled=True)
    return recv_SxNxD.reshape(-1, x_NxD.shape[1])


def _padded_back(out_SxNxD, send_J, axis):
    """Returns every chunk to its source, then puts each row back where it was sent from."""
    num_rows = out_SxNxD.shape[1]
    back_JxNxD = jax.lax.all_to_all(out_SxNxD, axis, split_axis=0, concat_axis=0, tiled=True)
    rows_N = jnp.arange(num_rows, dtype=jnp.int32)
    dest_N = jnp.searchsorted(jnp.cumsum(send_J), rows_N, side="right").astype(jnp.int32)
    index_N = dest_N * num_rows + rows_N - _starts(send_J)[dest_N]
    return back_JxNxD.reshape(-1, out_SxNxD.shape[2])[index_N]


def _ragged_there(x_NxD, sizes_SxJ, me, axis):
    """Only the assigned rows travel; source s's rows land at chunk s (offset s * N)."""
    num_rows = x_NxD.shape[0]
    num_shards = sizes_SxJ.shape[0]
    out_SNxD = jnp.zeros((num_shards * num_rows, x_NxD.shape[1]), x_NxD.dtype)
    return jax.lax.ragged_all_to_all(
        x_NxD, out_SNxD, _starts(sizes_SxJ[me]), sizes_SxJ[me].astype(jnp.int32),
        jnp.full((num_shards,), me * num_rows, jnp.int32), sizes_SxJ[:, me].astype(jnp.int32),
        axis_name=axis,
    )


def _ragged_back(out_SNxD, sizes_SxJ, me, axis):
    """Chunk s goes back to source s, to the offset its rows for this device started at."""
    num_shards = sizes_SxJ.shape[0]
    num_rows = out_SNxD.shape[0] // num_shards
    back_NxD = jnp.zeros((num_rows, out_SNxD.shape[1]), out_SNxD.dtype)
    return jax.lax.ragged_all_to_all(
        out_SNxD, back_NxD, jnp.arange(num_shards, dtype=jnp.int32) * num_rows,
        sizes_SxJ[:, me].astype(jnp.int32), _starts(sizes_SxJ)[:, me], sizes_SxJ[me].astype(jnp.int32),
        axis_name=axis,
    )
