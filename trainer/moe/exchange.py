"""Moving token rows between devices over the expert mesh axis: the only collectives on data.

Capacity buffers go with one tiled all_to_all each way. Dropless rows go either
with ragged_all_to_all (only the assigned rows travel; TPU and GPU) or with a
padded all_to_all (every destination gets a chunk of one fixed size; the CPU
backend cannot compile ragged_all_to_all). Both land in the same layout, chunk s of the receive
buffer holding source s's rows, so everything after the exchange is shared.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from trainer.moe import dispatch
from trainer.moe.experts import ExpertWeights, grouped_ffn


def exchange_to_experts(buf_GxExCxD: jax.Array, axis: str | None, num_shards: int) -> jax.Array:
    """[G, E, C, D] rows per expert -> [E_l, S * G * C, D] rows of the local experts from all S sources."""
    num_groups, num_experts, capacity, d_model = buf_GxExCxD.shape
    buf_ExRxD = buf_GxExCxD.transpose(1, 0, 2, 3).reshape(num_experts, num_groups * capacity, d_model)
    if axis is None or num_shards == 1:
        return buf_ExRxD
    # Expert chunks go to their devices; what arrives stacks source-major on the row dim.
    return jax.lax.all_to_all(buf_ExRxD, axis, split_axis=0, concat_axis=1, tiled=True)


def exchange_from_experts(out_ElxRxD: jax.Array, shape, axis: str | None, num_shards: int) -> jax.Array:
    """The inverse of exchange_to_experts: back to [G, E, C, D] on the devices the rows came from."""
    num_groups, num_experts, capacity, d_model = shape
    if axis is not None and num_shards > 1:
        # Each source's rows go home; what comes back stacks on the expert dim.
        out_ElxRxD = jax.lax.all_to_all(out_ElxRxD, axis, split_axis=1, concat_axis=0, tiled=True)
    return out_ElxRxD.reshape(num_experts, num_groups, capacity, d_model).transpose(1, 0, 2, 3)


class Assignments(NamedTuple):
    """Token choice assignments of this device's T tokens, choice-major (n = r * T + t)."""

    order_N: jax.Array  # assignments sorted by expert (stable)
    rank_N: jax.Array  # each assignment's place in that order
    experts_N: jax.Array  # each assignment's expert
    counts_E: jax.Array  # assignments per expert
    top_k: int
    # Every token shard's counts_E, [A, S, E] (core.summed_stats), or None: the plan all-gathers them.
    counts_AxSxE: jax.Array | None = None


def dropless_experts(x_TxD, a: Assignments, w: ExpertWeights, block_rows: int, topo) -> jax.Array:
    """Every assignment's expert output, [N, D] choice-major."""
    if topo.expert_axis is None or topo.num_expert_shards == 1:
        _, blocks = dispatch.aligned_layout(a.counts_E[None], a.order_N.shape[0], block_rows)
        # Each assignment's row from its expert's offset: what aligned_layout gives its place in the sorted order,
        # without a gather through the sort's permutation (1.4 ms a step, moe-1b on a v5e chip).
        offset_G = dispatch.aligned_offsets(a.counts_E[None], block_rows)[0]
        dest_KxT = (a.rank_N + dispatch.lookup(offset_G, a.experts_N)).reshape(a.top_k, -1)
        layout = dispatch.block_layout(dest_KxT, blocks, block_rows, num_out=dest_KxT.size)
        return grouped_ffn(x_TxD, w, layout, impl=topo.grouped_matmul)  # saves all: no worst case here
    if topo.exchange == "ragged":
        return _dropless_ragged(x_TxD, a, w, block_rows, topo)
    return _dropless_padded(x_TxD, a, w, block_rows, topo)


def _exchange_plan(a: Assignments, topo):
    """Every device's per-expert counts (E integers each), so that each side knows what it sends
    and receives without a third all_to_all. Returns (me, sizes_SxJ, recv_counts_SxEl,
    round_sizes): round_sizes, what padded_rounds reads (group_counts)."""
    num_shards = topo.num_expert_shards
    local = a.counts_E.shape[0] // num_shards
    me = jax.lax.axis_index(topo.expert_axis)
    counts_SxE, round_counts = group_counts(a.counts_E, a.counts_AxSxE, topo)
    per_device = lambda counts: counts.reshape(*counts.shape[:-1], num_shards, local).sum(axis=-1)
    recv_counts_SxEl = jax.lax.dynamic_slice_in_dim(counts_SxE, me * local, local, axis=1)
    return me, per_device(counts_SxE), recv_counts_SxEl, per_device(round_counts)


def group_counts(mine_C, every_AxSxC, topo):
    """(the [S, C] counts of this device's expert group, the counts its rounds must cover).

    every_AxSxC, every token shard's counts from the statistics' all-reduce (core.summed_stats),
    gives both: the group's row over the token axes beside the expert axis, and all of it. Without
    it (None) the group all-gathers its own, which are then both."""
    if every_AxSxC is None:
        counts_SxC = jax.lax.all_gather(mine_C, topo.expert_axis)
        return counts_SxC, counts_SxC
    others = tuple(t for t in topo.token_axes if t != topo.expert_axis)
    return (every_AxSxC[jax.lax.axis_index(others)] if others else every_AxSxC[0]), every_AxSxC


def _on_receiver(recv_SNxD, recv_counts_SxEl, w, block_rows, topo, save_rows=None):
    """Received chunks (source-major, each sorted by local expert) through the local experts;
    the backward pass reuses the hidden activations of the first save_rows layout rows (all by default)."""
    num_rows = recv_SNxD.shape[0] // recv_counts_SxEl.shape[0]
    dest_SxN, blocks = dispatch.aligned_layout(recv_counts_SxEl, num_rows, block_rows)
    layout = dispatch.block_layout(dest_SxN.reshape(1, -1), blocks, block_rows, save_rows=save_rows)
    return grouped_ffn(recv_SNxD, w, layout, impl=topo.grouped_matmul)


def _dropless_padded(x_TxD, a: Assignments, w, block_rows, topo) -> jax.Array:
    """Chunk j of the send buffer holds rows for device j, zero-padded to the round's chunk
    (`padded_chunks`: 1.25x the fair share in the first round): one round moves every row when no
    send is longer, which balanced routing keeps to. Longer sends take further, smaller rounds
    (`in_rounds`); every device of the group learns every send size from the plan, so all run the
    same rounds. Nothing is sized for the worst case, so a balanced step allocates and zeroes one
    round's buffers.
    """
    num_rows = a.order_N.shape[0]
    me, sizes_SxJ, recv_counts_SxEl, round_sizes = _exchange_plan(a, topo)
    chunks = padded_chunks(num_rows, topo.num_expert_shards)
    round_fn = functools.partial(_padded_round, block_rows=block_rows, topo=topo, top_k=a.top_k)
    aux = (a.order_N, a.rank_N, me, sizes_SxJ, recv_counts_SxEl)
    return in_rounds(round_fn, chunks, x_TxD, w, aux, padded_rounds(round_sizes, chunks, topo, num_rows))


class Chunks(NamedTuple):
    """Rows per destination of the padded exchange's rounds: `first` in round 0, `more` in each
    round after it (round r >= 1 moves rows [first + (r - 1) * more, first + r * more) of every send)."""

    first: int
    more: int

    def start(self, r):
        return 0 if isinstance(r, int) and r == 0 else self.first + (r - 1) * self.more


def padded_chunks(fair_total: int, num_shards: int, cap: int | None = None) -> Chunks:
    """The rounds' chunks for sends of fair_total rows in all (fair share fair_total / S per
    destination): the first round 1.25x the fair share, each further round 0.75x, in multiples of 8.

    XLA:CPU's all_to_all costs about in proportion to the rows it moves, padding included, so
    the first chunk is what a balanced router needs (the benchmark's random router sends at most
    1.13-1.23x the fair share to any device) and the rest comes in smaller rounds: two rounds move
    twice the fair share, which trained routers on small shards often reach. At most `cap` rows
    (a send's most; fair_total by default): one round then always does.
    """
    cap = fair_total if cap is None else cap
    of_fair = lambda num, den: 8 * -(-num * fair_total // (8 * den * num_shards))
    return Chunks(min(cap, of_fair(5, 4)), min(cap, of_fair(3, 4)))


def padded_rounds(sizes_SxJ, chunks: Chunks, topo=None, longest: int | None = None):
    """Rounds that move the longest send of the expert group (rows from source S to device J):
    1 while every send fits the first chunk, and always when no send can be longer than `longest`
    <= that chunk. Every expert group of the mesh runs as many (the most any needs), since the
    weight gradients of each round are summed over the groups (the axes other than the expert
    axis): a max all-reduce over them, unless sizes are given for every group, [A, S, J]."""
    if longest is not None and longest <= chunks.first:
        return 1
    beyond = jnp.maximum(jnp.max(sizes_SxJ) - chunks.first, 0)
    rounds = (1 + -(-beyond // chunks.more)).astype(jnp.int32)
    if sizes_SxJ.ndim == 3:
        return rounds
    others = tuple(a for a in (topo.token_axes if topo else ()) if a != topo.expert_axis)
    return jax.lax.pmax(rounds, others) if others else rounds


def _window(counts_SxG, start, size):
    """How many of each chunk's rows (counts[s, g] of group g, in group order) lie in rows
    [start, start + size) of that chunk."""
    before_SxG = jnp.cumsum(counts_SxG, axis=1) - counts_SxG
    upto = lambda end: jnp.clip(end - before_SxG, 0, counts_SxG)
    return upto(start + size) - upto(start)


def _padded_round(x_TxD, w, aux, start, chunk, *, block_rows, topo, top_k):
    """One round of the padded exchange: rows [start, start + chunk) of each send go to their
    devices, through the experts and back; [N, D] outputs, zeros for the other rounds' rows."""
    axis, num_shards = topo.expert_axis, topo.num_expert_shards
    order_N, rank_N, me, sizes_SxJ, recv_counts_SxEl = aux
    num_rows = order_N.shape[0]
    send_J = sizes_SxJ[me]
    # Where each sorted row sits in the [J, chunk] send buffer this round (J * chunk: not this round),
    # and each assignment's send row.
    dest_device_N = dispatch.searchsorted_right(jnp.cumsum(send_J), jnp.arange(num_rows)).astype(jnp.int32)
    place_N = jnp.arange(num_rows, dtype=jnp.int32) - _starts(send_J)[dest_device_N] - start
    this_round_N = (place_N >= 0) & (place_N < chunk)
    send_row_N = jnp.where(this_round_N, dest_device_N * chunk + place_N, num_shards * chunk)[rank_N]
    send_JCxD = _take_tokens(x_TxD, send_row_N, num_shards * chunk, top_k)
    recv_SCxD = jax.lax.all_to_all(send_JCxD, axis, split_axis=0, concat_axis=0, tiled=True)
    out_SCxD = _on_receiver(recv_SCxD, _window(recv_counts_SxEl, start, chunk), w, block_rows, topo)
    back_JCxD = jax.lax.all_to_all(out_SCxD, axis, split_axis=0, concat_axis=0, tiled=True)
    source_JC = dispatch.inverse_index(send_row_N, num_shards * chunk)
    return dispatch.take_rows(back_JCxD, send_row_N, source_JC[None])


# Scope of the rounds past the first: they run only when a send is longer than a round's chunk.
EXTRA_ROUNDS = "extra_rounds"


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def in_rounds(round_fn, chunks: Chunks, x, w, aux, num_rounds):
    """The sum over rounds r < num_rounds (at least 1) of round_fn(x, w, aux, start, chunk): round 0
    moves rows [0, chunks.first) of every send, round r >= 1 the next chunks.more (Chunks.start).

    The first round is differentiated as usual and keeps its activations; the others run in a
    loop of a dynamic trip count (the same on every device of the group) and are recomputed in
    the backward pass, which autodiff cannot do through such a loop, hence the custom_vjp.
    aux holds what gets no gradient: indices, counts, expert ids.
    """
    return _more_rounds(round_fn, chunks, x, w, aux, num_rounds, round_fn(x, w, aux, 0, chunks.first))


def _more_rounds(round_fn, chunks, x, w, aux, num_rounds, y):
    more = lambda r, y: y + round_fn(x, w, aux, chunks.start(r), chunks.more)
    with jax.named_scope(EXTRA_ROUNDS):
        return jax.lax.fori_loop(1, num_rounds, more, y)


def _in_rounds_fwd(round_fn, chunks, x, w, aux, num_rounds):
    y, first_vjp = jax.vjp(lambda x, w: round_fn(x, w, aux, 0, chunks.first), x, w)
    return _more_rounds(round_fn, chunks, x, w, aux, num_rounds, y), (x, w, aux, num_rounds, first_vjp)


def _in_rounds_bwd(round_fn, chunks, res, ct):
    x, w, aux, num_rounds, first_vjp = res

    def more(r, grads):
        _, vjp = jax.vjp(lambda x, w: round_fn(x, w, aux, chunks.start(r), chunks.more), x, w)
        return jax.tree.map(jnp.add, grads, vjp(ct))

    with jax.named_scope(EXTRA_ROUNDS):
        dx, dw = jax.lax.fori_loop(1, num_rounds, more, first_vjp(ct))
    return dx, dw, jax.tree.map(lambda _: None, aux), None


in_rounds.defvjp(_in_rounds_fwd, _in_rounds_bwd)


def _take_tokens(x_TxD, row_N, num_out_rows, top_k):
    """[num_out_rows, D] with assignment n's token at row_N[n], zeros elsewhere."""
    num_tokens = x_TxD.shape[0]
    source = dispatch.inverse_index(row_N, num_out_rows)
    token = jnp.where(source < row_N.shape[0], source % num_tokens, num_tokens)
    return dispatch.take_rows(x_TxD, token, row_N.reshape(top_k, num_tokens))


def _dropless_ragged(x_TxD, a: Assignments, w, block_rows, topo) -> jax.Array:
    """Only the assigned rows travel: source s's rows land in chunk s (offset s * N) of the
    receiver, the same layout as the padded exchange, and come back to where they left."""
    axis, num_shards = topo.expert_axis, topo.num_expert_shards
    num_rows = a.order_N.shape[0]
    me, sizes_SxJ, recv_counts_SxEl, _ = _exchange_plan(a, topo)
    x_sorted_NxD = _take_tokens(x_TxD, a.rank_N, num_rows, a.top_k)
    recv_SNxD = jax.lax.ragged_all_to_all(
        x_sorted_NxD, jnp.zeros((num_shards * num_rows, x_TxD.shape[1]), x_TxD.dtype),
        _starts(sizes_SxJ[me]), sizes_SxJ[me], jnp.full((num_shards,), me * num_rows, jnp.int32),
        sizes_SxJ[:, me], axis_name=axis,
    )
    # The buffer holds every row that may arrive; balanced routing brings N (as many as each device
    # sends). Activations are kept for 1.5x that, padding included; spans past it are recomputed.
    save_rows = 3 * num_rows // 2 + recv_counts_SxEl.shape[1] * block_rows
    out_SNxD = _on_receiver(recv_SNxD, recv_counts_SxEl, w, block_rows, topo, save_rows)
    out_sorted_NxD = jax.lax.ragged_all_to_all(
        out_SNxD, jnp.zeros((num_rows, x_TxD.shape[1]), out_SNxD.dtype),
        jnp.arange(num_shards, dtype=jnp.int32) * num_rows, sizes_SxJ[:, me],
        _starts(sizes_SxJ)[:, me], sizes_SxJ[me], axis_name=axis,
    )
    return dispatch.take_rows(out_sorted_NxD, a.rank_N, a.order_N[None])


def _starts(sizes):
    return (jnp.cumsum(sizes, axis=-1) - sizes).astype(jnp.int32)


# --- Once per device: a token travels at most once to each device that holds one of its experts.
#
# Pairs (slot s, token t), p = s * T + t: slot s of token t is the s-th distinct device its experts
# lie on (of at most d). The sender lays out one row per pair that holds a device, grouped by
# device; beside the rows travel the pair's gates and local expert ids ([rows, 2K] float32: gate
# of choice r, or 0, then its local expert, or E_l when choice r is on another device). The
# receiver expands each row to its experts, runs them, and sums their gated outputs into one row
# per pair, which goes back; the sender adds each token's rows from its devices. Both gradients
# run the same exchanges transposed.


def max_devices_per_token(top_k: int, num_shards: int, expert_groups: int, groups_limit: int) -> int:
    """The most devices one token's experts can sit on: k, the devices, and with group-limited
    routing over groups that tile the devices, the devices that groups_limit groups cover."""
    most = min(top_k, num_shards)
    if groups_limit and expert_groups % num_shards == 0:
        most = min(most, groups_limit)  # a group lies on one device
    elif groups_limit and num_shards % expert_groups == 0:
        most = min(most, groups_limit * num_shards // expert_groups)  # a group spans S / G devices
    return most


def once_per_device_chunks(num_tokens: int, num_shards: int, devices_per_token: int) -> Chunks:
    """The rounds' chunks of the padded once-per-device exchange (padded_chunks), for a device's
    T * devices_per_token pair rows, at most T (which always fits)."""
    return padded_chunks(num_tokens * devices_per_token, num_shards, cap=num_tokens)


class Pairs(NamedTuple):
    """A token's (slot, device) pairs, p = slot * T + t, d * T in all (d: devices_per_token)."""

    device_P: jax.Array  # the pair's device; num_shards where the slot is empty
    place_P: jax.Array  # the pair's place among the pairs for its device
    gates_PxK: jax.Array  # the gate of each of the token's k choices on that device, 0 elsewhere
    ids_PxK: jax.Array  # their local expert ids (float32, no gradient), E_l for choices elsewhere
    send_J: jax.Array  # pairs for each device


def device_pairs(experts_TxK, gate_TxK, local: int, num_shards: int, devices_per_token: int) -> Pairs:
    """The pairs of the once-per-device exchange: a token's devices fill its first slots of d."""
    num_tokens = experts_TxK.shape[0]
    slots = devices_per_token
    device_TxK = experts_TxK // local
    sorted_TxK = jnp.sort(device_TxK, axis=-1)
    first_TxK = jnp.concatenate([jnp.ones((num_tokens, 1), bool), sorted_TxK[:, 1:] != sorted_TxK[:, :-1]], axis=1)
    slot_TxK = jnp.where(first_TxK, jnp.cumsum(first_TxK, axis=1) - 1, slots)
    device_TxD = jnp.full((num_tokens, slots), num_shards, jnp.int32).at[
        jnp.arange(num_tokens)[:, None], slot_TxK].set(sorted_TxK.astype(jnp.int32), mode="drop")
    device_P = device_TxD.T.reshape(-1)  # num_shards: the slot is empty
    on_PxK = jnp.tile(device_TxK, (slots, 1)) == device_P[:, None]
    gates_PxK = jnp.where(on_PxK, jnp.tile(gate_TxK, (slots, 1)), 0.0)
    ids_PxK = jax.lax.stop_gradient(jnp.where(on_PxK, jnp.tile(experts_TxK % local, (slots, 1)), local)
                                    .astype(jnp.float32))
    to_PxS = device_P[:, None] == jnp.arange(num_shards, dtype=jnp.int32)
    send_J = jnp.sum(to_PxS, axis=0, dtype=jnp.int32)
    place_P = jnp.sum(jnp.where(to_PxS, jnp.cumsum(to_PxS, axis=0, dtype=jnp.int32) - 1, 0), axis=1)
    return Pairs(device_P, place_P, gates_PxK, ids_PxK, send_J)


def dropless_once_per_device(x_TxD, pairs: Pairs, w: ExpertWeights, block_rows: int, topo, devices_per_token: int,
                             sizes_AxSxJ=None) -> jax.Array:
    """The routed output [T, D] (float32) of every assignment, each token sent at most once per device.

    devices_per_token (d) bounds the distinct devices of a token's experts (max_devices_per_token).
    sizes_AxSxJ: every token shard's pairs per device (core.summed_stats), or None: the expert
    group all-gathers its own.
    """
    axis, num_shards = topo.expert_axis, topo.num_expert_shards
    num_tokens = x_TxD.shape[0]
    sizes_SxJ, round_sizes = group_counts(pairs.send_J, sizes_AxSxJ, topo)
    me = jax.lax.axis_index(axis)
    if topo.exchange == "ragged":
        meta_PxK2 = jnp.concatenate([pairs.gates_PxK, pairs.ids_PxK], axis=1)
        return _once_ragged(x_TxD, meta_PxK2, pairs.device_P, pairs.place_P, sizes_SxJ, me, w, block_rows, topo)
    chunks = once_per_device_chunks(num_tokens, num_shards, devices_per_token)
    round_fn = functools.partial(_once_padded_round, block_rows=block_rows, topo=topo)
    # The gates are differentiated (they carry the router's gradient): they travel as part of x.
    return in_rounds(round_fn, chunks, (x_TxD, pairs.gates_PxK), w, (pairs.ids_PxK, pairs.device_P, pairs.place_P),
                     padded_rounds(round_sizes, chunks, topo, num_tokens))


def _pair_rows(x_TxD, meta_PxK2, send_row_P, num_rows, local):
    """The send buffers, pair p at row send_row[p] (num_rows where the pair holds nothing):
    [num_rows, D] token rows and [num_rows, 2K] their metadata, where rows that hold no pair
    carry zero gates and expert `local` (none), so that the receiver runs nothing for them."""
    num_tokens, k = x_TxD.shape[0], meta_PxK2.shape[1] // 2
    pair_R = dispatch.inverse_index(send_row_P, num_rows)
    token_R = jnp.where(pair_R < send_row_P.shape[0], pair_R % num_tokens, num_tokens)
    x_RxD = dispatch.take_rows(x_TxD, token_R, send_row_P.reshape(-1, num_tokens))
    meta_RxK2 = dispatch.take_rows(meta_PxK2, pair_R, send_row_P[None])
    valid_Rx1 = (pair_R < send_row_P.shape[0])[:, None]
    ids_RxK = jnp.where(valid_Rx1, jax.lax.stop_gradient(meta_RxK2[:, k:]), jnp.float32(local))
    return x_RxD, jnp.concatenate([meta_RxK2[:, :k], ids_RxK], axis=1)


def _expand_on_receiver(recv_RxD, meta_RxK2, w, block_rows, topo, expected_rows):
    """Each received row through each of its local experts; one row per received row back, the sum
    of its experts' gated outputs (float32)."""
    num_rows, k2 = meta_RxK2.shape
    k, local = k2 // 2, w.w_in_ExDxF.shape[0]
    gates_KxR = meta_RxK2[:, :k].T
    ids_N = jax.lax.stop_gradient(meta_RxK2[:, k:]).T.reshape(-1).astype(jnp.int32)
    order_N, counts = dispatch.sort_by_expert(ids_N, local + 1)
    rank_N = dispatch.inverse_index(order_N, order_N.shape[0])
    dest_1xN, blocks = dispatch.aligned_layout(counts[None, :local], order_N.shape[0], block_rows)
    dest_KxR = dest_1xN[0][rank_N].reshape(k, num_rows)
    save_rows = 3 * expected_rows // 2 + local * block_rows
    layout = dispatch.block_layout(dest_KxR, blocks, block_rows, num_out=dest_KxR.size, save_rows=save_rows)
    out_NxD = grouped_ffn(recv_RxD, w, layout, impl=topo.grouped_matmul)
    return dispatch.weighted_sum(out_NxD.reshape(k, num_rows, -1), gates_KxR)


def _combine_pairs(back_RxD, send_row_P, num_tokens):
    """y[t] = the sum over devices j of the row that came back for pair (j, t)."""
    num_rows = back_RxD.shape[0]
    source_R = dispatch.inverse_index(send_row_P, num_rows)
    y_PxD = dispatch.take_rows(back_RxD, send_row_P, source_R[None]).astype(jnp.float32)
    return dispatch.sum_leading(y_PxD.reshape(-1, num_tokens, back_RxD.shape[1]))


def _once_padded_round(x_and_gates, w, aux, start, chunk, *, block_rows, topo):
    """One round of the padded once-per-device exchange: pair rows [start, start + chunk) of each
    device's pairs; [T, D] float32, the sum of those pairs' rows."""
    axis, num_shards = topo.expert_axis, topo.num_expert_shards
    (x_TxD, gates_PxK), (ids_PxK, device_P, place_P) = x_and_gates, aux
    num_tokens = x_TxD.shape[0]
    place_P = place_P - start
    this_round_P = (device_P < num_shards) & (place_P >= 0) & (place_P < chunk)
    send_row_P = jnp.where(this_round_P, device_P * chunk + place_P, num_shards * chunk)
    meta_PxK2 = jnp.concatenate([gates_PxK, ids_PxK], axis=1)
    send_RxD, meta_RxK2 = _pair_rows(x_TxD, meta_PxK2, send_row_P, num_shards * chunk, w.w_in_ExDxF.shape[0])
    recv_RxD = jax.lax.all_to_all(send_RxD, axis, split_axis=0, concat_axis=0, tiled=True)
    recv_meta = jax.lax.all_to_all(meta_RxK2, axis, split_axis=0, concat_axis=0, tiled=True)
    y_RxD = _expand_on_receiver(recv_RxD, recv_meta, w, block_rows, topo, num_tokens * gates_PxK.shape[1])
    back_RxD = jax.lax.all_to_all(y_RxD.astype(x_TxD.dtype), axis, split_axis=0, concat_axis=0, tiled=True)
    return _combine_pairs(back_RxD, send_row_P, num_tokens)


def _once_ragged(x_TxD, meta_PxK2, device_P, place_P, sizes_SxJ, me, w, block_rows, topo):
    """Only the pair rows travel; source s's rows land at offset s * T of the receiver."""
    axis, num_shards = topo.expert_axis, topo.num_expert_shards
    num_tokens, d_model, k = x_TxD.shape[0], x_TxD.shape[1], meta_PxK2.shape[1] // 2
    send_J, recv_S = sizes_SxJ[me], sizes_SxJ[:, me]
    start_J = _starts(send_J)
    total, num_pairs = num_shards * num_tokens, device_P.shape[0]
    present_P = device_P < num_shards
    send_row_P = jnp.where(present_P, start_J[jnp.minimum(device_P, num_shards - 1)] + place_P, num_pairs)
    local = w.w_in_ExDxF.shape[0]
    send_RxD, meta_RxK2 = _pair_rows(x_TxD, meta_PxK2, send_row_P, num_pairs, local)
    offsets_J = jnp.full((num_shards,), me * num_tokens, jnp.int32)
    to_experts = lambda rows, init: jax.lax.ragged_all_to_all(
        rows, init, start_J, send_J, offsets_J, recv_S, axis_name=axis)
    recv_RxD = to_experts(send_RxD, jnp.zeros((total, d_model), x_TxD.dtype))
    empty_meta = jnp.concatenate([jnp.zeros((total, k)), jnp.full((total, k), float(local))], axis=1)
    recv_meta = to_experts(meta_RxK2, empty_meta.astype(meta_RxK2.dtype))
    y_RxD = _expand_on_receiver(recv_RxD, recv_meta, w, block_rows, topo, num_tokens * k)
    back_RxD = jax.lax.ragged_all_to_all(
        y_RxD.astype(x_TxD.dtype), jnp.zeros((num_pairs, d_model), x_TxD.dtype),
        jnp.arange(num_shards, dtype=jnp.int32) * num_tokens, recv_S, _starts(sizes_SxJ)[:, me], send_J,
        axis_name=axis,
    )
    return _combine_pairs(back_RxD, send_row_P, num_tokens)
