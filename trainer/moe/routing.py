"""Routing as pure functions of arrays: router logits, top-k and expert choice, the aux losses.

Shapes: T tokens of one routing group, D model width, E experts, K = top_k, C capacity.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def router_logits(x_TxD: jax.Array, router_DxE: jax.Array) -> jax.Array:
    """Router logits in float32 whatever the compute dtype: top-k is sensitive to rounding."""
    return jnp.einsum(
        "td,de->te", x_TxD.astype(jnp.float32), router_DxE.astype(jnp.float32),
        precision=jax.lax.Precision.HIGHEST,
    )


def multiplicative_jitter(x_TxD: jax.Array, key: jax.Array, eps: float) -> jax.Array:
    """Switch Transformer's jitter: router inputs times uniform(1 - eps, 1 + eps)."""
    noise = jax.random.uniform(key, x_TxD.shape, jnp.float32, 1.0 - eps, 1.0 + eps)
    return x_TxD.astype(jnp.float32) * noise


def top_k_routing(
    logits_TxE: jax.Array, k: int, *, softmax_before_topk: bool = True, renormalize: bool = True
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Token choice: each token picks its k highest-scoring experts.

    Returns (experts_TxK int32, weights_TxK, priority_TxK, probs_TxE), all float32.
    weights combine the expert outputs; priority is the assignment's router
    probability before renormalisation (what batch-prioritised routing sorts by);
    probs is the full softmax, used by the balancing loss.
    """
    probs_TxE = jax.nn.softmax(logits_TxE, axis=-1)
    if softmax_before_topk:
        priority_TxK, experts_TxK = jax.lax.top_k(probs_TxE, k)
    else:
        # Mixtral-style: softmax over the k chosen logits only.
        top_logits_TxK, experts_TxK = jax.lax.top_k(logits_TxE, k)
        priority_TxK = jax.nn.softmax(top_logits_TxK, axis=-1)
    weights_TxK = priority_TxK
    if renormalize and softmax_before_topk:
        weights_TxK = priority_TxK / jnp.sum(priority_TxK, axis=-1, keepdims=True)
    return experts_TxK.astype(jnp.int32), weights_TxK, priority_TxK, probs_TxE


def expert_choice_routing(logits_TxE: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Expert choice (Zhou et al. 2022): each expert takes its top-C tokens by router probability.

    Returns (tokens_ExC int32, weights_ExC float32, probs_TxE).
    """
    probs_TxE = jax.nn.softmax(logits_TxE, axis=-1)
    weights_ExC, tokens_ExC = jax.lax.top_k(probs_TxE.T, capacity)
    return tokens_ExC.astype(jnp.int32), weights_ExC, probs_TxE


def balance_stats(experts_NK: jax.Array, probs_TxE: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per-expert assignment counts and summed router probabilities, float32 [E] each.

    Kept as sums so that shards can add them up before the loss is formed.
    """
    num_experts = probs_TxE.shape[-1]
    counts_E = jnp.zeros((num_experts,), jnp.float32).at[experts_NK.reshape(-1)].add(1.0)
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
