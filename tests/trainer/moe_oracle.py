"""Test code: the naive MoE reference, and ragged_all_to_all for the CPU backend.

The reference computes one expert at a time, over every token, in plain jnp and numpy.
Written independently of the fast path (no sorting, no slots, no buffers) so
that agreeing with it means something. Which assignments survive capacity is
decided by a plain Python loop over groups and experts, in the documented
priority order; the arithmetic after that is differentiable jnp.

Tests import it as `moe_oracle` (pytest puts tests/trainer on sys.path); the package never
imports it (a benchmark that wants it would add tests/trainer to sys.path).
"""

from __future__ import annotations

import contextlib
import math

import jax
import jax.numpy as jnp
import numpy as np

from trainer.moe.config import MoEConfig


def oracle_routing(x_TxD, router_DxE, cfg: MoEConfig, bias_E=None):
    """(logits, probs, experts_TxK, weights_TxK, priority_TxK) for token choice.

    The selection sorts (no top_k): the bias shifts the selection scores only; with a groups
    limit each group's score is the sum of its two largest selection scores (after a sort),
    and experts outside the token's best groups cannot be chosen.
    """
    logits_TxE = jnp.dot(x_TxD.astype(jnp.float32), router_DxE.astype(jnp.float32), precision="highest")
    if cfg.score == "sigmoid":
        scores_TxE = jax.nn.sigmoid(logits_TxE)
        probs_TxE = scores_TxE / scores_TxE.sum(-1, keepdims=True)
    else:
        probs_TxE = jax.nn.softmax(logits_TxE, axis=-1)
        scores_TxE = probs_TxE if cfg.softmax_before_topk else logits_TxE
    select_TxE = scores_TxE if bias_E is None else scores_TxE + bias_E
    if cfg.routing_groups_limit:
        groups, num_tokens = cfg.expert_groups, x_TxD.shape[0]
        per_group = cfg.num_experts // groups
        sorted_TxGxP = jnp.sort(select_TxE.reshape(num_tokens, groups, per_group), axis=-1)
        group_score_TxG = sorted_TxGxP[..., -min(2, per_group):].sum(-1)
        best_TxM = jnp.argsort(-group_score_TxG, axis=-1, stable=True)[:, : cfg.routing_groups_limit]
        allowed_TxG = (best_TxM[:, :, None] == jnp.arange(groups)).any(axis=1)
        select_TxE = jnp.where(jnp.repeat(allowed_TxG, per_group, axis=1), select_TxE, -jnp.inf)
    experts_TxK = jnp.argsort(-jax.lax.stop_gradient(select_TxE), axis=-1, stable=True)[:, : cfg.top_k]
    chosen_TxK = jnp.take_along_axis(scores_TxE, experts_TxK, axis=-1)
    softmax_after = cfg.score == "softmax" and not cfg.softmax_before_topk
    priority_TxK = jax.nn.softmax(chosen_TxK, axis=-1) if softmax_after else chosen_TxK
    weights_TxK = priority_TxK
    if cfg.renormalize and not softmax_after and (cfg.score == "softmax" or cfg.top_k > 1):
        weights_TxK = priority_TxK / priority_TxK.sum(-1, keepdims=True)
    return logits_TxE, probs_TxE, experts_TxK, weights_TxK * cfg.route_scale, priority_TxK


def oracle_keep(experts_TxK, priority_TxK, cfg: MoEConfig, num_groups: int, capacity: int | None) -> np.ndarray:
    """bool [T, K]: which assignments get a slot. capacity None keeps everything."""
    experts = np.asarray(experts_TxK)
    priority = np.asarray(priority_TxK)
    num_tokens, k = experts.shape
    keep = np.ones((num_tokens, k), bool)
    if capacity is None:
        return keep
    per_group = num_tokens // num_groups
    for g in range(num_groups):
        for e in range(cfg.num_experts):
            # (choice rank, position) is the "position" order and the probability tie-break.
            mine = [(r, t) for r in range(k) for t in range(g * per_group, (g + 1) * per_group) if experts[t, r] == e]
            if cfg.drop_priority == "probability":
                mine.sort(key=lambda rt: -priority[rt[1], rt[0]])
            for r, t in mine[capacity:]:
                keep[t, r] = False
    return keep


def oracle_capacity(num_group_tokens: int, cfg: MoEConfig, train: bool) -> int | None:
    factor = cfg.capacity_factor if train else cfg.eval_capacity_factor
    if cfg.capacity_factor <= 0 or factor <= 0:
        return None
    c = math.ceil(num_group_tokens * cfg.top_k * factor / cfg.num_experts)
    return max(1, min(num_group_tokens, max(cfg.min_capacity, c)))


def expert_ffn(x_TxD, w_in_DxF, w_gate_DxF, w_out_FxD):
    return (jax.nn.silu(x_TxD @ w_gate_DxF) * (x_TxD @ w_in_DxF)) @ w_out_FxD


def oracle_moe(x_TxD, params: dict, cfg: MoEConfig, keep_TxK=None, dtype=jnp.float32):
    """Routed-experts output [T, D] (float32) of token-choice routing: a loop over experts.

    params: router, w_in, w_gate, w_out (unsharded), and bias (the balancing bias) if the
    config routes with one. keep_TxK: from oracle_keep, computed outside any jax.grad trace
    since it is a discrete decision (None keeps all).
    """
    _, _, experts_TxK, weights_TxK, _ = oracle_routing(x_TxD, params["router"], cfg, params.get("bias"))
    if keep_TxK is not None:
        weights_TxK = weights_TxK * jnp.asarray(keep_TxK, jnp.float32)
    y_TxD = jnp.zeros(x_TxD.shape, jnp.float32)
    x = x_TxD.astype(dtype)
    for e in range(cfg.num_experts):
        gate_T = jnp.sum(jnp.where(experts_TxK == e, weights_TxK, 0.0), axis=-1)
        ws = (params["w_in"][e], params["w_gate"][e], params["w_out"][e])
        out_TxD = expert_ffn(x, *(w.astype(dtype) for w in ws)).astype(jnp.float32)
        y_TxD = y_TxD + gate_T[:, None] * out_TxD
    return y_TxD


def oracle_aux(x_TxD, params: dict, cfg: MoEConfig) -> dict:
    """The losses from their formulas, over all tokens (token choice)."""
    logits_TxE, probs_TxE, experts_TxK, _, _ = oracle_routing(x_TxD, params["router"], cfg, params.get("bias"))
    e = cfg.num_experts
    f_E = jnp.stack([jnp.mean(experts_TxK == i) for i in range(e)])
    p_E = probs_TxE.mean(0)
    z = jnp.mean(jax.nn.logsumexp(logits_TxE, axis=-1) ** 2)
    coef = 0.0 if cfg.balance == "bias" else cfg.aux_loss_coef
    return {"aux_loss": coef * e * jnp.sum(f_E * p_E), "z_loss": cfg.z_loss_coef * z}


def oracle_expert_choice(x_TxD, params: dict, cfg: MoEConfig, num_groups: int, capacity: int):
    """Expert choice, naively: in each group each expert takes its C most probable tokens."""
    logits_TxE = jnp.dot(x_TxD.astype(jnp.float32), params["router"], precision="highest")
    probs_TxE = jax.nn.softmax(logits_TxE, axis=-1)
    per_group = x_TxD.shape[0] // num_groups
    y_TxD = jnp.zeros(x_TxD.shape, jnp.float32)
    for e in range(cfg.num_experts):
        out_TxD = expert_ffn(x_TxD, params["w_in"][e], params["w_gate"][e], params["w_out"][e])
        gate_T = jnp.zeros((x_TxD.shape[0],), jnp.float32)
        for g in range(num_groups):
            rows = slice(g * per_group, (g + 1) * per_group)
            chosen = np.argsort(-np.asarray(probs_TxE[rows, e]), kind="stable")[:capacity] + g * per_group
            gate_T = gate_T.at[chosen].set(probs_TxE[chosen, e])
        y_TxD = y_TxD + gate_T[:, None] * out_TxD
    return y_TxD


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name):
    """jax.lax.ragged_all_to_all's documented semantics, from all_gather and selects, to test
    the ragged exchange on CPU (whose backend cannot compile the real one). One slice per
    device: slice j of every caller goes to device j, at that caller's output_offsets[j]."""
    del recv_sizes  # the senders' send_sizes, gathered below, say the same
    num_devices = jax.lax.axis_size(axis_name)
    assert input_offsets.shape == (num_devices,), "one slice per device"
    me = jax.lax.axis_index(axis_name)
    operand_SxNxD = jax.lax.all_gather(operand, axis_name)
    plan = (input_offsets, send_sizes, output_offsets)
    starts_SxJ, sizes_SxJ, dests_SxJ = (jax.lax.all_gather(a, axis_name) for a in plan)
    rows_R = jnp.arange(output.shape[0])
    result = output
    for src in range(num_devices):
        start, size, dest = starts_SxJ[src, me], sizes_SxJ[src, me], dests_SxJ[src, me]
        inside_R = (rows_R >= dest) & (rows_R < dest + size)
        values = operand_SxNxD[src].at[start + rows_R - dest].get(mode="fill", fill_value=0)
        result = jnp.where(inside_R[:, None], values, result)
    return result


@contextlib.contextmanager
def ragged_all_to_all_on_cpu():
    """Lets XLA:CPU compile jax.lax.ragged_all_to_all, lowered as the emulation above.

    The production code calls the real primitive; only its CPU lowering is supplied here, so its own
    JVP and transpose rules (the backward exchange) are what run. The lowered emulation carries no
    varying-axes types: trace the shard_map around it with check_vma=False.
    """
    from jax._src.interpreters import mlir as mlir_internal  # the table, to remove the rule afterwards
    from jax.interpreters import mlir

    def lowering(ctx, *args, axis_name, axis_index_groups):
        assert axis_index_groups is None, "the emulation covers the whole axis"
        emulate = lambda *a: emulated_ragged_all_to_all(*a, axis_name=axis_name)
        return mlir.lower_fun(emulate, multiple_results=False)(ctx, *args)

    rules = mlir_internal._platform_specific_lowerings["cpu"]
    previous = rules.get(jax.lax.ragged_all_to_all_p)
    mlir.register_lowering(jax.lax.ragged_all_to_all_p, lowering, platform="cpu")
    try:
        yield
    finally:
        if previous is None:
            rules.pop(jax.lax.ragged_all_to_all_p, None)
        else:
            rules[jax.lax.ragged_all_to_all_p] = previous
