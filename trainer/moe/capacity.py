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
from trainer.moe.routing import expert_counts


def flatten_choices(x_TxK: jax.Array) -> jax.Array:
    """[T, K] -> [K * T] choice-major, the order the priorities are defined in."""
    return x_TxK.T.reshape(-1)


def ordered_int(x: jax.Array) -> jax.Array:
    """int32 keys in the order lax.sort gives float32 x: -0 as 0, every NaN as one, after +inf."""
    x = x.astype(jnp.float32)
    x = jnp.where(jnp.isnan(x), jnp.nan, jnp.where(x == 0, 0.0, x))
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def slot_positions(experts_N: jax.Array, priority_N: jax.Array, num_experts: int, by_probability: bool) -> jax.Array:
    """Each assignment's rank among the assignments of its expert, in priority order.

    One stable sort instead of a [N, E] cumulative sum: by expert, then (by_probability) by descending
    priority, ties in assignment order, so each expert's run lists its assignments in priority order. (Two
    stable sorts, by priority and then by expert, give the same order at twice the sorting.)
    """
    num = experts_N.shape[0]
    iota_N = jnp.arange(num, dtype=jnp.int32)
    keys = (experts_N.astype(jnp.int32), ordered_int(-priority_N)) if by_probability else (experts_N.astype(jnp.int32),)
    # Integer keys, the assignment's index the last of them: the stable order, with no float compare in the sort.
    # A float key is compared in a total order inside the sort's comparator at every step; compiled for a v5e
    # (ahead of time on a CPU, 2026-12-06), moe-1b's capacity sort was the train step's costliest unit of
    # backend compile, 12.4 s of ~100 CPU s; as integers with the index a key it compiled in 9.0 s against 14.9 s
    # alone (the whole step: 0.94x and 0.98x the CPU seconds in two pairs, within the machine's noise).
    ordered = jax.lax.sort((*keys, iota_N), num_keys=len(keys) + 1, is_stable=False)
    expert_sorted_N, by_expert_N = ordered[0], ordered[-1]
    # Each sorted assignment's rank: its place less its expert's first place (the assignments of the experts
    # before it), by a compare over the few experts: on a v5e chip each element gather of 32,768 assignments
    # (the experts in sorted order, their starts) took 0.25 ms.
    counts_E = expert_counts(experts_N, num_experts)
    before_N = jnp.sum(jnp.where(jnp.arange(num_experts)[None, :] < expert_sorted_N[:, None], counts_E[None, :], 0),
                       axis=1, dtype=jnp.int32)
    return jnp.zeros((num,), jnp.int32).at[by_expert_N].set(iota_N - before_N, unique_indices=True)


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
