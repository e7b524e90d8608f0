"""The expert-parallel wrapper: picks the layout, and under shard_map only moves data.

With a mesh whose `expert` axis has more than one device, tokens are split over
("data", "expert") and experts over "expert"; core.py runs per device with the
exchanges switched on. With a `model` axis of more than one device each expert's hidden
dimension is split over it as well (tensor parallelism inside an expert group): the T devices
of a group hold the same tokens, route them alike, exchange them over `expert` with their
peers of the same `model` index (a token's row reaches each device of its expert's group once),
run their slice of the FFN, and sum the partial outputs over `model` once, on the combined [T, D]
rows (everything after the FFN's last product is linear). Otherwise the same code runs once
over all tokens.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from trainer.moe import core
from trainer.moe.capacity import expert_capacity
from trainer.moe.config import MoEConfig
from trainer.moe.experts import ExpertWeights
from trainer.moe.gmm import default_impl

TOKEN_AXES = ("data", "expert")
MODEL_AXIS = "model"


def token_axes(mesh: Mesh | None) -> tuple[str, ...]:
    """The mesh axes tokens are split over; size-1 axes are left out so that no gradient
    takes a (not optimised away) all-reduce over one device."""
    if mesh is None:
        return ()
    return tuple(a for a in TOKEN_AXES if a in mesh.axis_names and mesh.shape[a] > 1)


def expert_shards(mesh: Mesh | None) -> int:
    return 1 if mesh is None or "expert" not in mesh.axis_names else mesh.shape["expert"]


def model_shards(mesh: Mesh | None) -> int:
    return 1 if mesh is None or MODEL_AXIS not in mesh.axis_names else mesh.shape[MODEL_AXIS]


def routing_groups(cfg: MoEConfig, mesh: Mesh | None, num_tokens: int) -> int:
    """Groups that capacity is counted in over the whole batch; see MoEConfig.routing_groups."""
    shards = 1
    for axis in token_axes(mesh):
        shards *= mesh.shape[axis]
    groups = cfg.routing_groups or shards
    if groups % shards or num_tokens % groups:
        raise ValueError(
            f"MoE: routing_groups={groups} must be a multiple of the {shards} token shards "
            f"and divide the {num_tokens} tokens of the batch"
        )
    return groups


def make_topology(cfg: MoEConfig, mesh: Mesh | None) -> core.Topology:
    platform = (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform
    exchange = cfg.exchange if cfg.exchange != "auto" else ("padded" if platform == "cpu" else "ragged")
    gmm = cfg.grouped_matmul if cfg.grouped_matmul != "auto" else default_impl(platform)
    shards = expert_shards(mesh)
    split = shards > 1 or model_shards(mesh) > 1  # under shard_map
    return core.Topology(
        expert_axis="expert" if shards > 1 else None,
        num_expert_shards=shards,
        token_axes=token_axes(mesh) if split else (),
        exchange=exchange,
        grouped_matmul=gmm,
        model_axis=MODEL_AXIS if model_shards(mesh) > 1 else None,
    )


def moe_groups(x_GxTxD, router_DxE, w: ExpertWeights, cfg: MoEConfig, topo: core.Topology, train: bool, key,
               bias_E=None, router_bias_E=None):
    """Routed-expert output (float32) and aux for the token groups this device holds."""
    logits_GxTxE = core.route_tokens(x_GxTxD, router_DxE, cfg, train, key, router_bias_E)
    if topo.model_axis is not None:
        # The rows the experts see vary over `model` from here (each device runs its hidden slice), so
        # the backward pass sums their gradient over `model` once, on these [G, T, D] rows (the
        # transpose of this cast), not on every expert's received buffer; routing stays invariant.
        x_GxTxD = jax.lax.pcast(x_GxTxD, topo.model_axis, to="varying")
    if cfg.is_dropless(train):
        y_GxTxD, stats = core.dropless_moe(x_GxTxD, logits_GxTxE, w, cfg, topo, bias_E, train=train)
    elif cfg.routing == "expert_choice":
        capacity = expert_capacity(
            x_GxTxD.shape[1], cfg.top_k, cfg.capacity_factor_for(train), cfg.num_experts, cfg.min_capacity
        )
        y_GxTxD, stats = core.expert_choice_moe(x_GxTxD, logits_GxTxE, w, cfg, capacity, topo)
    else:
        capacity = expert_capacity(
            x_GxTxD.shape[1], cfg.top_k, cfg.capacity_factor_for(train), cfg.num_experts, cfg.min_capacity
        )
        y_GxTxD, stats = core.capacity_moe(x_GxTxD, logits_GxTxE, w, cfg, capacity, topo, bias_E)
    return y_GxTxD, core.finish_stats(stats, cfg)


def keeps_stacks(cfg: MoEConfig, topo: core.Topology, train: bool) -> bool:
    """Whether the experts take a layer of stacked weights whole (trainer/moe/stacked.py): on one device's
    dropless path through a grouped kernel, where a slice would be copied out before the kernel; every other
    path reads the layer's slice."""
    return (not train and cfg.is_dropless(train) and topo.expert_axis is None and topo.model_axis is None
            and topo.grouped_matmul == "ragged_dot")


def moe_apply(x_BxLxD, router_DxE, w: ExpertWeights, cfg: MoEConfig, mesh: Mesh | None, *, train: bool, key=None,
              bias_E=None, router_bias_E=None):
    """The routed experts' output [B, L, D] in x's dtype, and the aux dict (core.finish_stats).

    Expert weights are cast to x's dtype where they are used (on their shard). bias_E (float32
    [E], replicated) shifts the selection scores only (auxiliary-loss-free balancing); router_bias_E
    ([E], replicated) is the router's own bias, part of its logits.
    """
    batch, length, d_model = x_BxLxD.shape
    groups = routing_groups(cfg, mesh, batch * length)
    topo = make_topology(cfg, mesh)

    def local(x_bxLxD, router, w_local, key, bias, router_bias):
        num_groups = groups // (jax.lax.axis_size(topo.token_axes) if topo.token_axes else 1)
        x_GxTxD = x_bxLxD.reshape(num_groups, -1, d_model)
        if key is not None and topo.token_axes:
            key = jax.random.fold_in(key, jax.lax.axis_index(topo.token_axes))
        if topo.model_axis is not None and w_local.biased:  # the partial sums are added over `model`: one bias
            first = jax.lax.axis_index(topo.model_axis) == 0
            w_local = dataclasses.replace(w_local, b_out_ExD=jnp.where(first, w_local.b_out_ExD, 0))
        w_cast = w_local.cast(x_bxLxD.dtype)
        if not keeps_stacks(cfg, topo, train):
            w_cast = w_cast.read()
        y_GxTxD, aux = moe_groups(x_GxTxD, router, w_cast, cfg, topo, train, key, bias, router_bias)
        if topo.model_axis is not None:  # each device of the group holds its hidden slice's partial sums
            y_GxTxD = jax.lax.psum(y_GxTxD, topo.model_axis)
        return y_GxTxD.reshape(x_bxLxD.shape).astype(x_bxLxD.dtype), aux

    if topo.expert_axis is None and topo.model_axis is None:
        return local(x_BxLxD, router_DxE, w, key, bias_E, router_bias_E)
    w = w.read()  # a layer of stacked weights (trainer/moe/stacked.py) goes into shard_map as its own slice
    experts, hidden = topo.expert_axis, topo.model_axis
    in_spec, out_spec = P(experts, None, hidden), P(experts, hidden, None)
    # Optional arguments (the jitter key, the bias) go in only when given: shard_map takes arrays.
    optional = {name: a for name, a in (("key", key), ("bias", bias_E), ("router_bias", router_bias_E))
                if a is not None}
    args = (x_BxLxD, router_DxE, w, *optional.values())
    specs = (P(topo.token_axes), P(), w.specs(in_spec, out_spec, P(experts, hidden), P(experts, None)),
             *(P(),) * len(optional))
    if any(t == AxisType.Explicit for t in mesh.axis_types):
        # Explicit-sharding meshes want arguments already laid out as the specs say.
        args = jax.tree.map(lambda a, s: jax.sharding.reshard(a, NamedSharding(mesh, s)), args, specs)

    def run(x, r, w_local, *rest):
        given = dict(zip(optional, rest, strict=True))
        return local(x, r, w_local, given.get("key"), given.get("bias"), given.get("router_bias"))

    sharded = jax.shard_map(run, mesh=mesh, in_specs=specs, out_specs=(P(topo.token_axes), P()))
    return sharded(*args)
