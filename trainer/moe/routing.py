"""Routing as pure functions of arrays: router logits, top-k and expert choice, the aux losses.

Shapes: T tokens of one routing group, D model width, E experts, K = top_k, C capacity.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def router_logits(x_TxD: jax.Array, router_DxE: jax.Array, bias_E: jax.Array | None = None) -> jax.Array:
    """Router logits in float32 whatever the compute dtype: top-k is sensitive to rounding. bias_E: the
    router's own learned bias (GPT-OSS), not the balancing one."""
    logits_TxE = jnp.einsum(
        "td,de->te", x_TxD.astype(jnp.float32), router_DxE.astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    )
    return logits_TxE if bias_E is None else logits_TxE + bias_E.astype(jnp.float32)


def multiplicative_jitter(x_TxD: jax.Array, key: jax.Array, eps: float) -> jax.Array:
    """Switch Transformer's jitter: router inputs times uniform(1 - eps, 1 + eps)."""
    noise = jax.random.uniform(key, x_TxD.shape, jnp.float32, 1.0 - eps, 1.0 + eps)
    return x_TxD.astype(jnp.float32) * noise


def top_k_routing(
    logits_TxE: jax.Array,
    k: int,
    *,
    softmax_before_topk: bool = True,
    renormalize: bool = True,
    score: str = "softmax",
    bias_E: jax.Array | None = None,
    expert_groups: int = 0,
    groups_limit: int = 0,
    route_scale: float = 1.0,
    group_score: str = "top2_sum",
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Token choice: each token picks its k highest-scoring experts.

    Returns (experts_TxK int32, weights_TxK, priority_TxK, probs_TxE), all float32.
    weights combine the expert outputs; priority is the assignment's score before
    renormalisation (what batch-prioritised routing sorts by); probs is the full
    softmax (for sigmoid scores: the scores normalised over the experts), used by the
    balancing loss.

    bias_E (the auxiliary-loss-free balancing bias) is added to the scores for the
    selection only: weights and priority come from the unbiased scores. With
    groups_limit M, the experts form expert_groups groups of consecutive experts,
    each scored by the sum of its two best biased scores (group_score "top2_sum") or by
    its best one ("max"), and a token picks its k experts from its M best groups.
    """
    if score == "sigmoid":
        scores_TxE = jax.nn.sigmoid(logits_TxE)
        probs_TxE = scores_TxE / jnp.sum(scores_TxE, axis=-1, keepdims=True)
    else:
        probs_TxE = jax.nn.softmax(logits_TxE, axis=-1)
        # Mixtral-style (softmax after top-k): the selection is over the logits.
        scores_TxE = probs_TxE if softmax_before_topk else logits_TxE
    if bias_E is None and not groups_limit:
        chosen_TxK, experts_TxK = jax.lax.top_k(scores_TxE, k)
    else:
        select_TxE = scores_TxE if bias_E is None else scores_TxE + jax.lax.stop_gradient(bias_E)
        if groups_limit:
            select_TxE = limit_to_best_groups(jax.lax.stop_gradient(select_TxE), expert_groups, groups_limit,
                                             group_score)
        _, experts_TxK = jax.lax.top_k(jax.lax.stop_gradient(select_TxE), k)
        chosen_TxK = jnp.take_along_axis(scores_TxE, experts_TxK, axis=-1)
    priority_TxK = chosen_TxK if score == "sigmoid" or softmax_before_topk else jax.nn.softmax(chosen_TxK, axis=-1)
    weights_TxK = priority_TxK
    # Normalising one sigmoid weight would make it 1 and leave the router no gradient.
    if renormalize and softmax_before_topk and (score == "softmax" or k > 1):
        weights_TxK = priority_TxK / jnp.sum(priority_TxK, axis=-1, keepdims=True)
    if route_scale != 1.0:
        weights_TxK = weights_TxK * route_scale
    return experts_TxK.astype(jnp.int32), weights_TxK, priority_TxK, probs_TxE


def limit_to_best_groups(select_TxE: jax.Array, num_groups: int, limit: int, group_score: str = "top2_sum"
                         ) -> jax.Array:
    """The selection scores with every expert outside the token's `limit` best groups at -inf.

    A group's score is the sum of its two best selection scores (its one, for single-expert groups), or with
    group_score "max" its best one.
    """
    num_tokens, num_experts = select_TxE.shape
    per_group = num_experts // num_groups
    grouped_TxGxP = select_TxE.reshape(num_tokens, num_groups, per_group)
    best_TxGx2, _ = jax.lax.top_k(grouped_TxGxP, 1 if group_score == "max" else min(2, per_group))
    group_score_TxG = best_TxGx2[..., 0] if best_TxGx2.shape[-1] == 1 else best_TxGx2[..., 0] + best_TxGx2[..., 1]
    _, groups_TxM = jax.lax.top_k(group_score_TxG, limit)
    kept_TxG = jnp.any(groups_TxM[:, :, None] == jnp.arange(num_groups, dtype=groups_TxM.dtype), axis=1)
    kept_TxE = jnp.repeat(kept_TxG, per_group, axis=1)
    return jnp.where(kept_TxE, select_TxE, -jnp.inf)


def distinct_groups(experts_TxK: jax.Array, experts_per_group: int) -> jax.Array:
    """How many distinct expert groups each token's k experts lie in, int32 [T]."""
    groups_TxK = jnp.sort(experts_TxK // experts_per_group, axis=-1)
    return 1 + jnp.sum(groups_TxK[:, 1:] != groups_TxK[:, :-1], axis=-1).astype(jnp.int32)


def updated_bias(bias_E: jax.Array, counts_E: jax.Array, rate: float) -> jax.Array:
    """One step of auxiliary-loss-free balancing: bias += rate * sign(mean load - load).

    counts_E are the assignments per expert over the whole global batch; the comparison
    total vs E * count is exact in float32 (integers), so every device and every layout
    takes the same step.
    """
    num_experts = counts_E.shape[-1]
    direction_E = jnp.sign(jnp.sum(counts_E) - num_experts * counts_E)
    return bias_E + jnp.float32(rate) * direction_E


def expert_choice_routing(logits_TxE: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Expert choice (Zhou et al. 2022): each expert takes its top-C tokens by router probability.

    Returns (tokens_ExC int32, weights_ExC float32, probs_TxE).
    """
    probs_TxE = jax.nn.softmax(logits_TxE, axis=-1)
    weights_ExC, tokens_ExC = jax.lax.top_k(probs_TxE.T, capacity)
    return tokens_ExC.astype(jnp.int32), weights_ExC, probs_TxE


def expert_counts(experts: jax.Array, num_experts: int, dtype=jnp.int32) -> jax.Array:
    """How many of `experts` (any shape) name each expert, [E]: a compare with each expert and a sum, where a
    scatter-add or jnp.bincount of every assignment into E counters took 0.29 ms on a v5e chip for moe-1b's
    32,768 assignments (benchmarks/train_levers.py --profile, 2026-12-06; the compare and sum fuse into one
    pass)."""
    return jnp.sum(experts.reshape(-1, 1) == jnp.arange(num_experts, dtype=experts.dtype), axis=0, dtype=dtype)


def balance_stats(experts_NK: jax.Array, probs_TxE: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-expert assignment counts and summed router probabilities, float32 [E] each.

    Kept as sums so that shards can add them up before the loss is formed.
    """
    num_experts = probs_TxE.shape[-1]
    counts_E = expert_counts(experts_NK, num_experts, jnp.float32)
    return counts_E, jnp.sum(probs_TxE, axis=0)


def load_balancing_loss(counts_E: jax.Array, prob_sums_E: jax.Array, num_tokens: jax.Array) -> jax.Array:
    """Switch Transformer's balancing loss: num_experts * sum_i f_i * P_i.

    f_i is the share of token-expert assignments routed to expert i (for top-k,
    out of tokens * k) and P_i the mean router probability of expert i. It is 1
    for a perfectly uniform router and num_experts when everything goes to one expert.
    """
    num_experts = counts_E.shape[-1]
    f_E = counts_E / jnp.maximum(jnp.sum(counts_E), 1.0)
    p_E = prob_sums_E / jnp.maximum(num_tokens, 1.0)
    return num_experts * jnp.sum(f_E * p_E)


def router_z_loss_sum(logits_TxE: jax.Array) -> jax.Array:
    """Sum over tokens of logsumexp(logits)^2; ST-MoE's z-loss is its mean over tokens."""
    return jnp.sum(jnp.square(jax.nn.logsumexp(logits_TxE, axis=-1)))


def router_z_loss(logits_TxE: jax.Array) -> jax.Array:
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2."""
    return router_z_loss_sum(logits_TxE) / logits_TxE.shape[0]
