"""Expert capacity and which assignments keep a slot, without one-hot tensors.

Assignments of a group are flattened choice-major: index n = r * T + t is token
t's r-th choice. "position" priority serves them in that order (every token's
first choice before any second choice, then by position, as in GShard);
"probability" serves them by descending router probability, ties in that same
order (batch-prioritised routing, Riquelme et al. 2021).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from trainer.moe.config import expert_capacity  # noqa: F401 - counted once, where the planner reads it too


def flatten_choices(x_TxK: jax.Array) -> jax.Array:
    """[T, K] -> [K * T] choice-major, the order the priorities are defined in."""
    return x_TxK.T.reshape(-1)


def slot_positions(experts_N: jax.Array, priority_N: jax.Array, num_experts: int, by_probability: bool) -> jax.Array:
    """Each assignment's rank among the assignments of its expert, in priority order.

    Two stable sorts instead of a [N, E] cumulative sum: first by priority, then
    by expert, so each expert's run lists its assignments in priority order.
    """
    num = experts_N.shape[0]
    if by_probability:
        served_N = jnp.argsort(-priority_N, stable=True)
    else:
        served_N = jnp.arange(num, dtype=jnp.int32)
    by_expert_N = served_N[jnp.argsort(experts_N[served_N], stable=True)]
    counts_E = jnp.bincount(experts_N, length=num_experts)
    starts_E = jnp.cumsum(counts_E) - counts_E
    rank_sorted_N = jnp.arange(num, dtype=jnp.int32) - starts_E[experts_N[by_expert_N]].astype(jnp.int32)
    return jnp.zeros((num,), jnp.int32).at[by_expert_N].set(rank_sorted_N, unique_indices=True)


def assign_slots(
    experts_TxK: jax.Array, priority_TxK: jax.Array, num_experts: int, capacity: int, drop_priority: str
) -> tuple[jax.Array, jax.Array]:
    """(slot_N, keep_N), choice-major: the buffer row expert * C + position of each
    assignment, and whether it fits. Dropped assignments point at row E * C, a
    spare row that stays zero."""
    experts_N = flatten_choices(experts_TxK)
    position_N = slot_positions(
        experts_N, flatten_choices(priority_TxK), num_experts, drop_priority == "probability"
    )
    keep_N = position_N < capacity
    slot_N = jnp.where(keep_N, experts_N * capacity + position_N, num_experts * capacity)
    return slot_N, keep_N
