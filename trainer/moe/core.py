"""The MoE computation on one device's tokens, written once for both layouts.

`Topology` says whether the experts are spread over a mesh axis. Without one the
exchange steps are the identity and the statistics are local; inside shard_map
the same code exchanges tokens with all_to_all over the expert axis and sums
the statistics over every token axis. Shapes: G routing groups of T tokens, D
model width, E experts (E_l = E / n_ep held here), K = top_k, C capacity.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from trainer.moe import capacity as cap
from trainer.moe import dispatch, routing
from trainer.moe.config import MoEConfig
from trainer.moe.direct import direct_ffn, direct_fits
from trainer.moe.exchange import (
    Assignments,
    device_pairs,
    dropless_experts,
    dropless_once_per_device,
    exchange_from_experts,
    exchange_to_experts,
    max_devices_per_token,
)
from trainer.moe.experts import ExpertWeights, batched_ffn


@dataclasses.dataclass(frozen=True)
class Topology:
    """Where the experts live. expert_axis None: all experts are local, nothing moves."""

    expert_axis: str | None = None
    num_expert_shards: int = 1
    token_axes: tuple[str, ...] = ()
    exchange: str = "padded"
    grouped_matmul: str = "tiled"
    # Each expert's hidden dimension split over this axis (tensor parallelism; parallel.py), or None.
    model_axis: str | None = None


class Stats(NamedTuple):
    """Sums over tokens, so that shards add them before the ratios are formed."""

    counts_E: jax.Array
    prob_sums_E: jax.Array
    num_tokens: jax.Array
    z_sum: jax.Array
    num_assignments: jax.Array
    num_dropped: jax.Array
    group_sum: jax.Array  # distinct expert groups per token, summed over tokens (token choice)


def route_tokens(x_GxTxD, router_DxE, cfg: MoEConfig, train: bool, key, router_bias_E=None):
    """Router logits per group (float32), with multiplicative jitter when training."""
    if train and cfg.jitter > 0 and key is not None:
        x_GxTxD = routing.multiplicative_jitter(x_GxTxD, key, cfg.jitter)
    return jax.vmap(routing.router_logits, in_axes=(0, None, None))(x_GxTxD, router_DxE, router_bias_E)


def token_choice(logits_GxTxE, cfg: MoEConfig, bias_E=None):
    fn = lambda logits: routing.top_k_routing(
        logits, cfg.top_k, softmax_before_topk=cfg.softmax_before_topk, renormalize=cfg.renormalize,
        score=cfg.score, bias_E=bias_E, expert_groups=cfg.expert_groups, groups_limit=cfg.routing_groups_limit,
        route_scale=cfg.route_scale, group_score=cfg.group_score,
    )
    return jax.vmap(fn)(logits_GxTxE)


def experts_per_group(cfg: MoEConfig) -> int:
    """The groups that "distinct groups per token" counts: expert_groups (all experts one group
    without), whatever the layout, so that one config reports the same on one device and on eight."""
    return cfg.num_experts // (cfg.expert_groups or 1)


# The capacity path's arrays the remat policy "attention_moe" keeps (trainer/model.py REMAT_POLICIES).
SAVED = ("moe_slots", "moe_keep", "moe_gates", "moe_dispatched", "moe_out")


def capacity_moe(x_GxTxD, logits_GxTxE, w: ExpertWeights, cfg: MoEConfig, capacity: int, topo: Topology,
                 bias_E=None):
    """Token choice with C slots per expert and group; overflow assignments are dropped."""
    num_groups, num_tokens, d_model = x_GxTxD.shape
    k, num_experts = cfg.top_k, cfg.num_experts
    experts_GxTxK, weights_GxTxK, priority_GxTxK, probs_GxTxE = token_choice(logits_GxTxE, cfg, bias_E)
    assign = lambda e, p: cap.assign_slots(e, p, num_experts, capacity, cfg.drop_priority)
    slot_GxN, keep_GxN = jax.vmap(assign)(experts_GxTxK, priority_GxTxK)
    # Named for the remat policy "attention_moe" (trainer/model.py), which keeps them: the backward pass then
    # neither sorts nor gathers the tokens into their slots again, nor runs the experts' down projection.
    slot_GxN, keep_GxN = checkpoint_name(slot_GxN, "moe_slots"), checkpoint_name(keep_GxN, "moe_keep")
    gate_GxN = checkpoint_name(jax.vmap(cap.flatten_choices)(weights_GxTxK) * keep_GxN, "moe_gates")
    if cfg.dispatch == "einsum":
        tensors = lambda s, g: dispatch.einsum_dispatch_combine_tensors(s, g, num_tokens, num_experts, capacity, k)
        dispatch_GxTxExC, combine_GxTxExC = jax.vmap(tensors)(slot_GxN, gate_GxN)
        buf_GxExCxD = jax.vmap(dispatch.einsum_dispatch)(x_GxTxD, dispatch_GxTxExC)
    else:
        to_slots = lambda x, s: dispatch.dispatch_to_slots(x, s, num_experts * capacity, k)
        buf_GxExCxD = jax.vmap(to_slots)(x_GxTxD, slot_GxN).reshape(num_groups, num_experts, capacity, d_model)
    buf_GxExCxD = checkpoint_name(buf_GxExCxD, "moe_dispatched")
    out_GxExCxD = checkpoint_name(experts_on_buffers(buf_GxExCxD, w, topo), "moe_out")
    if cfg.dispatch == "einsum":
        y_GxTxD = jax.vmap(dispatch.einsum_combine)(out_GxExCxD, combine_GxTxExC)
    else:
        out_GxSxD = out_GxExCxD.reshape(num_groups, num_experts * capacity, d_model)
        combine = lambda o, s, g: dispatch.combine_from_slots(o, s, g, k)
        y_GxTxD = jax.vmap(combine)(out_GxSxD, slot_GxN, gate_GxN)
    stats = token_choice_stats(experts_GxTxK, probs_GxTxE, logits_GxTxE, keep_GxN, experts_per_group(cfg))
    return y_GxTxD, summed_stats(stats, topo)[0]


def experts_on_buffers(buf_GxExCxD, w: ExpertWeights, topo: Topology):
    """Sends each expert its [G, C] rows, runs the local experts, brings the rows back."""
    num_groups, num_experts, capacity, d_model = buf_GxExCxD.shape
    recv_ElxRxD = exchange_to_experts(buf_GxExCxD, topo.expert_axis, topo.num_expert_shards)
    out_ElxRxD = batched_ffn(recv_ElxRxD, w)
    return exchange_from_experts(out_ElxRxD, buf_GxExCxD.shape, topo.expert_axis, topo.num_expert_shards)


def dropless_moe(x_GxTxD, logits_GxTxE, w: ExpertWeights, cfg: MoEConfig, topo: Topology, bias_E=None,
                 train: bool = True):
    """Token choice that computes every assignment: rows grouped by expert, grouped matmul; in serving, a step of
    a few assignments through their experts' weights directly (direct.py)."""
    num_groups, num_tokens, d_model = x_GxTxD.shape
    k = cfg.top_k
    experts_GxTxK, weights_GxTxK, _, probs_GxTxE = token_choice(logits_GxTxE, cfg, bias_E)
    x_TxD = x_GxTxD.reshape(num_groups * num_tokens, d_model)
    keep_GxN = jnp.ones((num_groups, num_tokens * k), bool)
    stats = token_choice_stats(experts_GxTxK, probs_GxTxE, logits_GxTxE, keep_GxN, experts_per_group(cfg))
    num_rows = num_groups * num_tokens * k
    if direct_fits(num_rows, cfg.direct_assignments, train,
                   topo.expert_axis is not None or topo.model_axis is not None):
        y_TxD = direct_ffn(x_TxD, experts_GxTxK.reshape(-1, k), weights_GxTxK.reshape(-1, k), w,
                           cfg.direct_products)
        return y_TxD.reshape(num_groups, num_tokens, d_model), stats
    block_rows = cfg.block_rows or auto_block_rows(num_rows * topo.num_expert_shards / cfg.num_experts)
    devices = max_devices_per_token(k, topo.num_expert_shards, cfg.expert_groups, cfg.routing_groups_limit)
    # auto: once per device where rows cross an interconnect (the ragged exchange) and a token reaches
    # fewer devices than it has experts; the CPU's padded exchange copies memory, where the receiver's
    # k slots per row cost more than the rows saved (benchmarks/moe_layer.py, trainer/moe/README.md).
    auto = topo.exchange == "ragged" and devices < k
    once = cfg.exchange_rows == "device" or (cfg.exchange_rows == "auto" and auto)
    if once and topo.expert_axis is not None and topo.num_expert_shards > 1:
        pairs = device_pairs(experts_GxTxK.reshape(-1, k), weights_GxTxK.reshape(-1, k), w.w_in_ExDxF.shape[0],
                             topo.num_expert_shards, devices)
        stats, sizes_AxSxJ = summed_stats(stats, topo, pairs.send_J)
        y_TxD = dropless_once_per_device(x_TxD, pairs, w, block_rows, topo, devices, sizes_AxSxJ)
        return y_TxD.reshape(num_groups, num_tokens, d_model), stats
    experts_N = cap.flatten_choices(experts_GxTxK.reshape(-1, k))
    gate_N = cap.flatten_choices(weights_GxTxK.reshape(-1, k))
    order_N, counts_E = dispatch.sort_by_expert(experts_N, cfg.num_experts)
    rank_N = dispatch.inverse_index(order_N, order_N.shape[0])
    stats, counts_AxSxE = summed_stats(stats, topo, counts_E if topo.expert_axis is not None else None)
    assignments = Assignments(order_N=order_N, rank_N=rank_N, counts_E=counts_E, top_k=k,
                              counts_AxSxE=counts_AxSxE, experts_N=experts_N.astype(jnp.int32))
    out_NxD = dropless_experts(x_TxD, assignments, w, block_rows, topo)
    y_TxD = dispatch.weighted_sum(out_NxD.reshape(k, -1, d_model), gate_N.reshape(k, -1))
    return y_TxD.reshape(num_groups, num_tokens, d_model), stats


def auto_block_rows(rows_per_expert: float) -> int:
    """The rows an expert expects over SPAN_BLOCKS, as a power of two in [8, 512 / SPAN_BLOCKS]: its
    rows then run as spans of up to that many rows (at most 512), padded to a multiple of a block."""
    target = max(rows_per_expert / dispatch.SPAN_BLOCKS, 1.0)
    return int(min(512 // dispatch.SPAN_BLOCKS, max(8, 2 ** math.floor(math.log2(target)))))


def expert_choice_moe(x_GxTxD, logits_GxTxE, w: ExpertWeights, cfg: MoEConfig, capacity: int, topo: Topology):
    """Expert choice: each expert takes its top-C tokens of the group; no expert is ever over."""
    num_groups, num_tokens, d_model = x_GxTxD.shape
    choose = lambda logits: routing.expert_choice_routing(logits, capacity)
    tokens_GxExC, weights_GxExC, probs_GxTxE = jax.vmap(choose)(logits_GxTxE)
    buf_GxExCxD = jax.vmap(lambda x, t: x[t])(x_GxTxD, tokens_GxExC)
    out_GxExCxD = experts_on_buffers(buf_GxExCxD, w, topo)

    def combine(out_ExCxD, tokens_ExC, weights_ExC):
        y_ExCxD = out_ExCxD.astype(jnp.float32) * weights_ExC[..., None]
        return jnp.zeros((num_tokens, d_model), jnp.float32).at[tokens_ExC.reshape(-1)].add(
            y_ExCxD.reshape(-1, d_model)
        )

    y_GxTxD = jax.vmap(combine)(out_GxExCxD, tokens_GxExC, weights_GxExC)
    chosen_GxT = jax.vmap(lambda t: jnp.zeros((num_tokens,), bool).at[t.reshape(-1)].set(True))(tokens_GxExC)
    counts_E = jnp.full((cfg.num_experts,), num_groups * capacity, jnp.float32)
    stats = Stats(
        counts_E=counts_E,
        prob_sums_E=jnp.sum(probs_GxTxE, axis=(0, 1)),
        num_tokens=jnp.float32(num_groups * num_tokens),
        z_sum=jnp.sum(jax.vmap(routing.router_z_loss_sum)(logits_GxTxE)),
        num_assignments=jnp.float32(num_groups * num_tokens),
        num_dropped=jnp.sum(~chosen_GxT).astype(jnp.float32),
        group_sum=jnp.float32(0),
    )
    return y_GxTxD, summed_stats(stats, topo)[0]


def token_choice_stats(experts_GxTxK, probs_GxTxE, logits_GxTxE, keep_GxN, per_group: int) -> Stats:
    counts_E, prob_sums_E = routing.balance_stats(experts_GxTxK, probs_GxTxE.reshape(-1, probs_GxTxE.shape[-1]))
    return Stats(
        counts_E=counts_E,
        prob_sums_E=prob_sums_E,
        num_tokens=jnp.float32(probs_GxTxE.shape[0] * probs_GxTxE.shape[1]),
        z_sum=jnp.sum(jax.vmap(routing.router_z_loss_sum)(logits_GxTxE)),
        num_assignments=jnp.float32(keep_GxN.size),
        num_dropped=jnp.sum(~keep_GxN).astype(jnp.float32),
        group_sum=jnp.sum(routing.distinct_groups(experts_GxTxK.reshape(-1, experts_GxTxK.shape[-1]), per_group))
        .astype(jnp.float32),
    )


# The largest matrix of every token shard's per-expert counts (float32) that rides in the statistics'
# all-reduce instead of taking an all-gather of its own: 256 KiB.
MERGED_COUNTS_LIMIT = 1 << 16


def summed_stats(stats: Stats, topo: Topology, counts_C=None) -> tuple[Stats, jax.Array | None]:
    """The statistics summed over every token shard (one all-reduce), and, given counts_C (this
    shard's rows per expert, or pairs per device for the once-per-device exchange), every shard's
    counts from the same all-reduce: int32 [A, S, C], S the expert axis, A the token shards beside
    it. Both sides of the dropless exchange need them, so the block takes one collective fewer
    than with an all-gather of its own, and the rounds of the padded exchange need no max over A.
    None where there is no token axis or the matrix would be large (the exchange then all-gathers
    its group's counts)."""
    axes = topo.token_axes
    if not axes:
        return stats, None
    shards = jax.lax.axis_size(axes)
    if counts_C is None or shards * counts_C.shape[0] > MERGED_COUNTS_LIMIT:
        return jax.lax.psum(stats, axes), None
    mine_Ax1 = (jnp.arange(shards) == jax.lax.axis_index(axes))[:, None]
    counts_AxC = jnp.where(mine_Ax1, jax.lax.stop_gradient(counts_C).astype(jnp.float32)[None], 0.0)
    stats, counts_AxC = jax.lax.psum((stats, counts_AxC), axes)
    # Counts are integers far below 2**24: exact in float32, which shares the statistics' all-reduce.
    return stats, counts_AxC.astype(jnp.int32).reshape(-1, topo.num_expert_shards, counts_C.shape[0])


def finish_stats(stats: Stats, cfg: MoEConfig) -> dict[str, jax.Array]:
    """The losses and metrics from the statistics summed over all token shards (summed_stats).

    Besides the losses: drop_fraction, expert_load ([E], sums to 1), the balance of that load
    (max / mean, min / mean, coefficient of variation), groups_per_token (token choice) and
    expert_counts ([E], the assignments per expert over all shards, what the bias follows).
    """
    balance = routing.load_balancing_loss(stats.counts_E, stats.prob_sums_E, stats.num_tokens)
    if cfg.routing == "expert_choice" or not cfg.uses_aux_loss:
        balance = jnp.zeros_like(balance)  # balanced by construction, or by the bias alone
    load_E = stats.counts_E / jnp.sum(stats.counts_E)
    mean_load = 1.0 / cfg.num_experts
    return {
        "aux_loss": cfg.aux_loss_coef * balance,
        "z_loss": cfg.z_loss_coef * stats.z_sum / stats.num_tokens,
        "drop_fraction": stats.num_dropped / stats.num_assignments,
        "expert_load": load_E,
        "load_max_over_mean": jnp.max(load_E) / mean_load,
        "load_min_over_mean": jnp.min(load_E) / mean_load,
        "load_cv": jnp.std(load_E) / mean_load,
        "groups_per_token": stats.group_sum / stats.num_tokens,
        "expert_counts": stats.counts_E,
    }
