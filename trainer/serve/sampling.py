"""Per-row sampling inside the jitted steps: greedy, temperature, top-k and top-p, each row its own, at the
cost each row's choice needs.

A row's randomness is its request's seed folded with the position it generates, so a request draws
the same tokens alone or in any batch, and on a retry with the same seed.

Costs: a greedy row (temperature 0, and every idle slot) takes an argmax. Rows that filter (top-k or top-p)
draw among the PRESELECT best tokens (`lax.top_k`, not a sort of the whole vocabulary), which holds exactly
what they may draw unless top_k exceeds PRESELECT or the nucleus of a top-p without top-k reaches past it;
only then, and only when some row of the step needs it, the whole vocabulary is sorted (`exact`). Rows that
sample the whole softmax draw with Gumbel noise over it. Each of these branches runs under a `lax.cond`, so a
step whose rows need none of it does not run it (and nothing compiles again when one does).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

PRESELECT = 64  # the candidates a filtering row draws among: top-k up to this, and most nuclei
BLOCK = 128  # the vocabulary's blocks for the two-level argmax and draw


def _blocks(x_BxV: jax.Array):
    """x as [B, blocks, BLOCK] when the vocabulary divides into blocks, else None."""
    rows, vocab = x_BxV.shape
    return x_BxV.reshape(rows, vocab // BLOCK, BLOCK) if vocab % BLOCK == 0 and vocab > BLOCK else None


def argmax(x_BxV: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis (the first best on ties), in two levels: the best block, then the best in
    it. Written by hand because XLA's CPU argmax, a reduction over (value, index) pairs, took 7x a plain max
    over 8 x 32,768 logits (1.6 ms against 0.2 ms for this, measured), more than the tiny model's forward."""
    blocks_BxNxW = _blocks(x_BxV)
    if blocks_BxNxW is None:
        return jnp.argmax(x_BxV, axis=-1).astype(jnp.int32)
    block_B = jnp.argmax(blocks_BxNxW.max(axis=-1), axis=-1)
    inside_BxW = jnp.take_along_axis(blocks_BxNxW, block_B[:, None, None], axis=1)[:, 0]
    return (block_B * BLOCK + jnp.argmax(inside_BxW, axis=-1)).astype(jnp.int32)


def best(x_BxV: jax.Array, count: int) -> tuple[jax.Array, jax.Array]:
    """lax.top_k(x, count) in two levels: the `count` blocks of the highest maxima hold every one of the
    `count` best values, so the top-k runs over those blocks alone (8 x 32,768 logits: 0.4 ms against 0.6 ms
    for one top-k over all of them on CPU, measured)."""
    blocks_BxNxW = _blocks(x_BxV)
    if blocks_BxNxW is None or blocks_BxNxW.shape[1] <= count:
        return jax.lax.top_k(x_BxV, count)
    _, chosen_BxC = jax.lax.top_k(blocks_BxNxW.max(axis=-1), count)
    rows = x_BxV.shape[0]
    held_BxCW = jnp.take_along_axis(blocks_BxNxW, chosen_BxC[:, :, None], axis=1).reshape(rows, count * BLOCK)
    values_BxC, at_BxC = jax.lax.top_k(held_BxCW, count)
    block_BxC = jnp.take_along_axis(chosen_BxC, at_BxC // BLOCK, axis=-1)
    return values_BxC, block_BxC * BLOCK + at_BxC % BLOCK


def softmax_draw(keys_B, logits_BxV: jax.Array) -> jax.Array:
    """A draw from each row's softmax by its inverse distribution function: one uniform number a row, where
    jax.random.categorical's Gumbel noise is one a token (8 x 32,768 of them took 15 ms a step on CPU, ten
    times the tiny model's forward). Sums run in two levels (blocks, then within the chosen block), so float32
    rounding stays that of a sum of a few hundred terms."""
    blocks_BxNxW = _blocks(logits_BxV)
    if blocks_BxNxW is None:
        return _draw(keys_B, logits_BxV)
    weights_BxNxW = jnp.exp(blocks_BxNxW - logits_BxV.max(axis=-1)[:, None, None])
    sums_BxN = weights_BxNxW.sum(axis=-1)
    cum_BxN = jnp.cumsum(sums_BxN, axis=-1)
    u_B = jax.vmap(lambda key: jax.random.uniform(key, dtype=jnp.float32))(keys_B) * cum_BxN[:, -1]
    last = sums_BxN.shape[1] - 1
    block_B = jnp.minimum(jnp.sum(cum_BxN <= u_B[:, None], axis=-1), last)
    before_B = jnp.take_along_axis(cum_BxN - sums_BxN, block_B[:, None], axis=-1)[:, 0]
    inside_BxW = jnp.cumsum(jnp.take_along_axis(weights_BxNxW, block_B[:, None, None], axis=1)[:, 0], axis=-1)
    at_B = jnp.minimum(jnp.sum(inside_BxW <= (u_B - before_B)[:, None], axis=-1), BLOCK - 1)
    return (block_B * BLOCK + at_B).astype(jnp.int32)


def _key(seed, position):
    return jax.random.fold_in(jax.random.key(seed.astype(jnp.uint32)), position)


def _draw(keys_B, logits_BxN: jax.Array) -> jax.Array:
    return jax.vmap(jax.random.categorical)(keys_B, logits_BxN).astype(jnp.int32)


def exact(scaled_BxV, top_k_B, top_p_B, keys_B) -> jax.Array:
    """Top-k then top-p over the whole vocabulary, by a full sort: each row's draw from the softmax of its
    top_k best (0: all), cut to the smallest set of best tokens whose probability reaches top_p."""
    vocab = scaled_BxV.shape[-1]
    sorted_BxV = jnp.sort(scaled_BxV, axis=-1)[:, ::-1]
    k_B = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, vocab), vocab)
    kth_B = jnp.take_along_axis(sorted_BxV, (k_B - 1)[:, None], axis=-1)[:, 0]
    ranked_BxV = jnp.where(jnp.arange(vocab)[None, :] < k_B[:, None], sorted_BxV, -jnp.inf)
    probs_BxV = jax.nn.softmax(ranked_BxV, axis=-1)
    before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV  # probability of the better tokens
    keep_BxV = (before_BxV < top_p_B[:, None]) & (ranked_BxV > -jnp.inf)
    floor_B = jnp.maximum(jnp.min(jnp.where(keep_BxV, sorted_BxV, jnp.inf), axis=-1), kth_B)
    return _draw(keys_B, jnp.where(scaled_BxV >= floor_B[:, None], scaled_BxV, -jnp.inf))


def _preselected(scaled_BxV, top_k_B, top_p_B, keys_B):
    """(the draws among the PRESELECT best, whether those held every token the row may draw)."""
    vocab = scaled_BxV.shape[-1]
    count = min(PRESELECT, vocab)
    best_BxK, ids_BxK = best(scaled_BxV, count)
    whole_B = top_k_B <= 0
    k_B = jnp.where(whole_B, count, jnp.minimum(top_k_B, count))
    ranked_BxK = jnp.where(jnp.arange(count)[None, :] < k_B[:, None], best_BxK, -jnp.inf)
    # Over the whole vocabulary without top-k (its softmax's normaliser), else over the top-k.
    norm_B = jnp.where(whole_B, jax.nn.logsumexp(scaled_BxV, axis=-1), jax.nn.logsumexp(ranked_BxK, axis=-1))
    probs_BxK = jnp.exp(ranked_BxK - norm_B[:, None])
    before_BxK = jnp.cumsum(probs_BxK, axis=-1) - probs_BxK
    keep_BxK = (before_BxK < top_p_B[:, None]) & (ranked_BxK > -jnp.inf)
    held_B = jnp.where(whole_B, jnp.sum(probs_BxK, axis=-1) >= top_p_B, top_k_B <= count) | (vocab <= count)
    choice_B = _draw(keys_B, jnp.where(keep_BxK, ranked_BxK, -jnp.inf))
    return jnp.take_along_axis(ids_BxK, choice_B[:, None], axis=-1)[:, 0].astype(jnp.int32), held_B


def allowed(logits_BxV: jax.Array, mask_BxW: jax.Array) -> jax.Array:
    """The logits with -inf where a row's bit mask (trainer.serve.structured: bit v % 32 of word v // 32, int32)
    has token v off; a step whose rows are all unconstrained (every bit set) skips the unpacking."""
    def masked():  # shifts of each word by 0..31, not a gather of a word per token (slow on CPU)
        rows, vocab = logits_BxV.shape
        on_BxWx32 = (mask_BxW[:, :, None] >> jnp.arange(32, dtype=mask_BxW.dtype)) & 1
        on_BxV = on_BxWx32.reshape(rows, -1)[:, :vocab]
        return jnp.where(on_BxV == 1, logits_BxV, -jnp.inf)

    return jax.lax.cond(jnp.all(mask_BxW == -1), lambda: logits_BxV, masked)


def sample_tokens(logits_BxV: jax.Array, temperature_B: jax.Array, top_k_B: jax.Array, top_p_B: jax.Array,
                  seed_B: jax.Array, position_B: jax.Array) -> jax.Array:
    """The next token of each row, int32 [B]: argmax where temperature is 0, else a draw from the softmax
    at that temperature restricted to the top_k best (0: all) and to the smallest set of best tokens whose
    probability reaches top_p."""
    rows, vocab = logits_BxV.shape
    top_k_B = jnp.where(top_k_B >= vocab, 0, top_k_B)  # the whole vocabulary
    hot_B = temperature_B > 0
    greedy_B = jax.lax.cond(jnp.all(hot_B), lambda: jnp.zeros(rows, jnp.int32), lambda: argmax(logits_BxV))
    filters_B = hot_B & ((top_k_B > 0) | (top_p_B < 1))
    plain_B = hot_B & ~filters_B
    none_B = jnp.zeros(rows, jnp.int32)

    def scaled():  # inside each branch: a greedy step divides nothing
        return logits_BxV / jnp.maximum(temperature_B, 1e-6)[:, None]

    def keys():  # and derives no random keys (0.1 ms for 8 rows on CPU, measured)
        return jax.vmap(_key)(seed_B, position_B)

    plain = jax.lax.cond(jnp.any(plain_B), lambda: softmax_draw(keys(), scaled()), lambda: none_B)
    picked_B, held_B = jax.lax.cond(jnp.any(filters_B), lambda: _preselected(scaled(), top_k_B, top_p_B, keys()),
                                    lambda: (none_B, jnp.ones(rows, bool)))
    wide_B = filters_B & ~held_B
    wide = jax.lax.cond(jnp.any(wide_B), lambda: exact(scaled(), top_k_B, top_p_B, keys()), lambda: none_B)
    drawn_B = jnp.where(plain_B, plain, jnp.where(wide_B, wide, picked_B))
    return jnp.where(hot_B, drawn_B, greedy_B)
