"""Moving tokens into per-expert buffers and back, by gathers instead of one-hot tensors.

The fast path never builds a [tokens, experts, capacity] tensor: slot indices are
scattered as integers and rows move with gathers whose gradients are gathers too
(take_rows), since XLA:CPU runs a row scatter-add row by row. The GShard one-hot
einsum dispatch/combine at the end of the module is the baseline that tests and
the benchmark compare against.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from trainer.moe.routing import expert_counts


def gather_rows(x_MxD: jax.Array, index_R: jax.Array) -> jax.Array:
    """x[index], where index == M yields a zero row (a filled gather, not a padded copy of x)."""
    return x_MxD.at[index_R].get(mode="fill", fill_value=0)


def sum_leading(x_KxAxD: jax.Array) -> jax.Array:
    """Sum over the leading axis as a chain of adds: XLA:CPU runs a reduction over a short
    major axis as a slow generic reduce, where K - 1 elementwise adds fuse into one pass."""
    total = x_KxAxD[0]
    for i in range(1, x_KxAxD.shape[0]):
        total = total + x_KxAxD[i]
    return total


def weighted_sum(x_KxAxD: jax.Array, weights_KxA: jax.Array) -> jax.Array:
    """y[a] = sum_k weights[k, a] * x[k, a] in float32, as one contraction: its gradient for the
    weights is a batched dot too, where XLA:CPU runs the elementwise form's (a reduction over D
    of [K * A, D] products) several times slower."""
    return jnp.einsum("kad,ka->ad", x_KxAxD.astype(jnp.float32), weights_KxA.astype(jnp.float32),
                      precision=jax.lax.Precision.HIGHEST)


def inverse_index(dest_N: jax.Array, num_rows: int) -> jax.Array:
    """For rows[dest[n]] = x[n]: the source of each destination row, num_sources where none."""
    num = dest_N.shape[0]
    src_R = jnp.full((num_rows + 1,), num, jnp.int32)
    return src_R.at[dest_N].set(jnp.arange(num, dtype=jnp.int32), mode="drop")[:num_rows]


@jax.custom_vjp
def take_rows(x_AxD: jax.Array, index_B: jax.Array, inverse_KxA: jax.Array) -> jax.Array:
    """y[b] = x[index[b]] (zeros where index[b] == A), with a gather for a gradient too.

    inverse lists, for every row a of x, the up-to-K rows b that read it (B where
    fewer): the gradient dx[a] = sum_k dy[inverse[k, a]] is then another gather.
    Autodiff of a gather would scatter-add instead, which the CPU backend runs
    row by row. Every b reading a valid row must appear in inverse exactly once.
    """
    return gather_rows(x_AxD, index_B)


def _take_rows_fwd(x_AxD, index_B, inverse_KxA):
    return gather_rows(x_AxD, index_B), (index_B, inverse_KxA)


def _take_rows_bwd(res, dy_BxD):
    index_B, inverse_KxA = res
    dx_AxD = sum_leading(gather_rows(dy_BxD, inverse_KxA))
    return dx_AxD, None, None


take_rows.defvjp(_take_rows_fwd, _take_rows_bwd)


def dispatch_to_slots(x_TxD: jax.Array, slot_N: jax.Array, num_slots: int, top_k: int) -> jax.Array:
    """Buffer [num_slots, D] whose row s holds the token assigned to slot s (zeros if none).

    slot_N is choice-major (n = r * T + t); dropped assignments carry slot == num_slots.
    """
    num_tokens = x_TxD.shape[0]
    # Assignment n is token n mod T (choice-major); "no source" (n == K * T) reads the zero row past the last
    # token. Arithmetic, not a gather from a table of tokens: on a v5e chip each such gather of moe-1b's 40,960
    # slots took 0.28 ms.
    source_S = inverse_index(slot_N, num_slots)
    token_S = jnp.where(source_S < top_k * num_tokens, source_S % num_tokens, num_tokens)
    return take_rows(x_TxD, token_S, slot_N.reshape(top_k, num_tokens))


def combine_from_slots(out_SxD: jax.Array, slot_N: jax.Array, gate_N: jax.Array, top_k: int) -> jax.Array:
    """y[t] = sum_r gate[r, t] * out[slot[r, t]], in float32; dropped slots read the zero row."""
    source_1xS = inverse_index(slot_N, out_SxD.shape[0])[None]
    y_NxD = take_rows(out_SxD, slot_N, source_1xS)
    return weighted_sum(y_NxD.reshape(top_k, -1, out_SxD.shape[-1]), gate_N.reshape(top_k, -1))


def searchsorted_right(sorted_G: jax.Array, queries: jax.Array) -> jax.Array:
    """jnp.searchsorted(sorted_G, queries, side="right"): how many of the (few) sorted values are
    <= each query. Up to 64 values it compares every query with every value in one fused pass;
    the default binary search is a while loop, several thunks per step on XLA:CPU, and the MoE
    block's layouts search a handful of cumulative counts (experts, devices) each."""
    method = "compare_all" if sorted_G.shape[-1] <= 64 else "scan"
    return jnp.searchsorted(sorted_G, queries, side="right", method=method)


def lookup(table_G: jax.Array, index_N: jax.Array) -> jax.Array:
    """table[index] for a small table (an entry per expert or device): each index compared with every entry
    and the match summed, one fused pass. A gather from such a table costs a TPU a slow element-wise gather:
    on a v5e chip each of moe-1b's dropless layouts' three 32,768-row lookups into a 16-entry table took
    0.25 ms (benchmarks/train_levers.py --profile, 2026-12-06). Indices past the table's end read 0."""
    if table_G.shape[0] > 64:
        return table_G.at[index_N].get(mode="fill", fill_value=0)
    hit_NxG = index_N[..., None] == jnp.arange(table_G.shape[0], dtype=index_N.dtype)
    return jnp.sum(jnp.where(hit_NxG, table_G, jnp.zeros((), table_G.dtype)), axis=-1, dtype=table_G.dtype)


def sort_by_expert(experts_N: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """(order_N, group_sizes_E): assignments in expert order, and how many per expert."""
    order_N = jnp.argsort(experts_N, stable=True).astype(jnp.int32)
    return order_N, expert_counts(experts_N, num_experts)


# Blocks of one expert are run as spans of up to SPAN_BLOCKS blocks (one matmul each): full
# spans, then the rest of the expert's blocks as spans of power-of-two sizes, largest first. Rows
# are padded to a multiple of the (small) block only, while the matmuls stay large.
SPAN_BLOCKS = 8


def span_sizes(span_blocks: int = SPAN_BLOCKS) -> tuple[int, ...]:
    """The span sizes, in blocks, largest first: span_blocks, then its lower powers of two."""
    sizes = [span_blocks]
    while sizes[-1] > 1:
        sizes.append(sizes[-1] // 2)
    return tuple(sizes)


class Blocks(NamedTuple):
    """Which expert each block of an aligned layout holds, and the spans the blocks form.

    group_NB: each block's expert; num_blocks: how many leading blocks hold rows; span_start_NS:
    the first block of each span, span_group_NS its expert, grouped by span size (the sizes of
    span_sizes(), each size's spans from a static offset on), span_count_C: how many spans of
    each size are in use.
    """

    group_NB: jax.Array
    num_blocks: jax.Array
    span_start_NS: jax.Array
    span_group_NS: jax.Array
    span_count_C: jax.Array


def span_slots(total_blocks: int, num_groups: int, span_blocks: int = SPAN_BLOCKS) -> tuple[int, ...]:
    """The most spans of each size a layout of total_blocks blocks over num_groups groups holds:
    full spans fill at most total_blocks / span_blocks, a smaller size at most one per group."""
    return tuple(total_blocks // span_blocks if size == span_blocks else num_groups
                 for size in span_sizes(span_blocks))


def _spans(blocks_G: jax.Array, block_start_G: jax.Array, total_blocks: int, span_blocks: int):
    """Cuts group g's blocks_G[g] blocks (from block_start_G[g]) into spans: full ones, then the
    rest by its binary digits, largest first."""
    full_G = blocks_G // span_blocks
    rest_G = blocks_G % span_blocks
    starts, groups, counts = [], [], []
    for size, slots in zip(span_sizes(span_blocks), span_slots(total_blocks, blocks_G.shape[0], span_blocks),
                           strict=True):
        if size == span_blocks:
            count_G, offset_G = full_G, jnp.zeros_like(full_G)
        else:
            count_G = (rest_G // size) % 2
            offset_G = full_G * span_blocks + rest_G // (2 * size) * (2 * size)  # after the larger digits
        ends_G = jnp.cumsum(count_G)
        i_N = jnp.arange(slots, dtype=jnp.int32)
        group_N = jnp.minimum(searchsorted_right(ends_G, i_N), blocks_G.shape[0] - 1).astype(jnp.int32)
        # span i of this size starts at block_start + offset + (i - the spans before its group's) * size
        first_G = block_start_G + offset_G - (ends_G - count_G) * size
        starts.append(lookup(first_G, group_N) + i_N * size)
        groups.append(group_N)
        counts.append(ends_G[-1])
    return (jnp.concatenate(starts).astype(jnp.int32), jnp.concatenate(groups),
            jnp.stack(counts).astype(jnp.int32))


class BlockLayout(NamedTuple):
    """Rows grouped by expert, each expert's rows starting a block of B rows (M rows in all).

    src_M: the source row each layout row reads (num_src where padding); dst_M: the output
    row it writes (num_out where padding); src_rows_KxS: for each source row the up-to-K
    layout rows reading it (M where fewer); blocks: each block's expert and the spans
    (Blocks); block_rows: B; save_rows: the leading rows whose hidden activations the tiled
    backward pass reuses.
    """

    src_M: jax.Array
    dst_M: jax.Array
    src_rows_KxS: jax.Array
    blocks: Blocks
    num_out: int
    block_rows: int
    save_rows: int


def block_layout(
    dest_KxS, blocks: Blocks, block_rows: int, num_out: int | None = None, save_rows: int | None = None
) -> BlockLayout:
    """The layout where source row s is read by layout rows dest[:, s] (M where not).

    Output rows: with num_out None, one per source row (dst = src); otherwise one per
    (k, s) reading, numbered k * S + s (the choice-major assignment index). save_rows
    (default: all) bounds the rows whose hidden activations the backward pass reuses.
    """
    num_src = dest_KxS.shape[1]
    num_rows = blocks.group_NB.shape[0] * block_rows
    reader_M = inverse_index(dest_KxS.reshape(-1), num_rows)
    src_M = jnp.where(reader_M < dest_KxS.size, reader_M % num_src, num_src)
    dst_M = src_M if num_out is None else reader_M
    save = num_rows if save_rows is None else min(num_rows, -(-save_rows // block_rows) * block_rows)
    return BlockLayout(src_M, dst_M, dest_KxS, blocks, num_out or num_src, block_rows, save)


def aligned_offsets(counts_SxG: jax.Array, block_rows: int) -> jax.Array:
    """[S, G]: what to add to the place of a row of group g in chunk s (its index in that chunk, whose rows
    are sorted by group) for its row in aligned_layout's buffer: group g's first block, times block_rows,
    plus the rows of g in chunks before s, less the rows of chunk s before group g."""
    blocks_G = -(-jnp.sum(counts_SxG, axis=0) // block_rows)
    block_start_G = jnp.cumsum(blocks_G) - blocks_G
    before_SxG = jnp.cumsum(counts_SxG, axis=0) - counts_SxG
    chunk_start_SxG = jnp.cumsum(counts_SxG, axis=1) - counts_SxG
    return (block_start_G * block_rows + before_SxG - chunk_start_SxG).astype(jnp.int32)


def aligned_layout(counts_SxG: jax.Array, chunk_rows: int, block_rows: int) -> tuple[jax.Array, Blocks]:
    """Regroups S chunks of expert-sorted rows into one buffer, grouped by expert, each group
    starting on a multiple of block_rows (so a block of rows belongs to one expert).

    Chunk s holds counts[s, g] rows of group g, in group order, then padding, chunk_rows in all.
    Returns (dest_SxR, blocks): the buffer row of every chunk row (num_rows for padding), and
    the blocks (each one's group, how many are in use, their spans).
    The buffer has num_rows = (ceil(S * R / B) + G) * B rows, enough for any counts.
    """
    num_chunks, num_groups = counts_SxG.shape
    total_blocks = -(-num_chunks * chunk_rows // block_rows) + num_groups
    blocks_G = -(-jnp.sum(counts_SxG, axis=0) // block_rows)
    block_start_G = jnp.cumsum(blocks_G) - blocks_G
    offset_SxG = aligned_offsets(counts_SxG, block_rows)
    rows_R = jnp.arange(chunk_rows, dtype=jnp.int32)

    def dest_of_chunk(counts_G, offset_G):
        group_R = searchsorted_right(jnp.cumsum(counts_G), rows_R).astype(jnp.int32)
        dest_R = lookup(offset_G, group_R) + rows_R
        return jnp.where(group_R < num_groups, dest_R, total_blocks * block_rows)

    dest_SxR = jax.vmap(dest_of_chunk)(counts_SxG, offset_SxG)
    block_ids = jnp.arange(total_blocks, dtype=jnp.int32)
    block_group_NB = searchsorted_right(jnp.cumsum(blocks_G), block_ids)
    block_group_NB = jnp.minimum(block_group_NB, num_groups - 1).astype(jnp.int32)
    spans = _spans(blocks_G.astype(jnp.int32), block_start_G.astype(jnp.int32), total_blocks, SPAN_BLOCKS)
    blocks = Blocks(block_group_NB, jnp.sum(blocks_G).astype(jnp.int32), *spans)
    return dest_SxR.astype(jnp.int32), blocks


# --- GShard baseline: one-hot [T, E, C] dispatch and combine tensors (tests and benchmark only).


def einsum_dispatch_combine_tensors(
    slot_N: jax.Array, gate_N: jax.Array, num_tokens: int, num_experts: int, capacity: int, top_k: int
) -> tuple[jax.Array, jax.Array]:
    """GShard's dispatch mask and combine weights, [T, E, C] each, from the same slots."""
    one_hot_NxS = jax.nn.one_hot(slot_N, num_experts * capacity + 1, dtype=jnp.float32)[:, :-1]
    dispatch_TxS = sum_leading(one_hot_NxS.reshape(top_k, num_tokens, -1))
    combine_TxS = sum_leading((one_hot_NxS * gate_N[:, None]).reshape(top_k, num_tokens, -1))
    shape = (num_tokens, num_experts, capacity)
    return dispatch_TxS.reshape(shape), combine_TxS.reshape(shape)


def einsum_dispatch(x_TxD: jax.Array, dispatch_TxExC: jax.Array) -> jax.Array:
    return jnp.einsum("td,tec->ecd", x_TxD, dispatch_TxExC.astype(x_TxD.dtype))


def einsum_combine(out_ExCxD: jax.Array, combine_TxExC: jax.Array) -> jax.Array:
    return jnp.einsum("ecd,tec->td", out_ExCxD.astype(jnp.float32), combine_TxExC)
