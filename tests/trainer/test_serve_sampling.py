"""The sampler draws from the distribution each row asks for, against a numpy oracle of top-k then top-p,
on the fast path (a preselection of the best tokens) and on the exact one (a full sort) alike; greedy rows
take the argmax; and no sort of the whole vocabulary runs outside a branch that some row must ask for."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer.serve.sampling import PRESELECT, sample_tokens

pytestmark = pytest.mark.compile_bound

VOCAB, DRAWS = 512, 2000


def oracle(logits_V, temperature, top_k, top_p):
    """The probabilities a row draws with: softmax at temperature over its top_k best (0: all), cut to the
    smallest set of best tokens whose probability reaches top_p, renormalised."""
    scaled = logits_V.astype(np.float64) / temperature
    order = np.argsort(-scaled, kind="stable")
    k = top_k if 0 < top_k < VOCAB else VOCAB
    kept = order[:k]
    probs = np.exp(scaled[kept] - scaled[kept].max())
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    kept, probs = kept[before < top_p], probs[before < top_p]
    out = np.zeros(VOCAB)
    out[kept] = probs / probs.sum()
    return out


ROWS = [  # (temperature, top_k, top_p, how peaked the logits are)
    (0.0, 0, 1.0, 1.0),     # greedy
    (1.0, 5, 1.0, 1.0),     # top-k inside the preselection
    (0.7, 0, 0.6, 4.0),     # a peaked nucleus inside it
    (1.0, 0, 0.95, 0.2),    # a flat nucleus past it: the exact path
    (1.0, PRESELECT + 36, 0.9, 1.0),  # top-k past it: the exact path
    (1.3, 0, 1.0, 1.0),     # the whole softmax
    (1.0, 3, 0.5, 3.0),     # both
]


def test_each_row_draws_from_the_distribution_it_asks_for():
    rng = np.random.RandomState(0)
    logits = np.stack([rng.randn(VOCAB) * scale for *_, scale in ROWS]).astype(np.float32)
    temperature, top_k, top_p = (np.asarray([r[i] for r in ROWS], dtype) for i, dtype in
                                 ((0, np.float32), (1, np.int32), (2, np.float32)))
    draw = jax.jit(jax.vmap(lambda seed: sample_tokens(jnp.asarray(logits), temperature, top_k, top_p,
                                                       jnp.full(len(ROWS), seed, jnp.int32),
                                                       jnp.full(len(ROWS), 3, jnp.int32))))
    drawn = np.asarray(draw(jnp.arange(DRAWS, dtype=jnp.int32)))  # [DRAWS, rows]
    for row, (t, k, p, _) in enumerate(ROWS):
        if t == 0:
            assert (drawn[:, row] == logits[row].argmax()).all()
            continue
        want = oracle(logits[row], t, k, p)
        seen = np.bincount(drawn[:, row], minlength=VOCAB) / DRAWS
        assert set(np.flatnonzero(seen)) <= set(np.flatnonzero(want)), ROWS[row]  # nothing it may not draw
        best = np.argsort(-want)[:8]  # the likeliest tokens come as often as they should
        np.testing.assert_allclose(seen[best], want[best], atol=0.04, err_msg=str(ROWS[row]))


def test_no_whole_vocabulary_sort_runs_unless_a_branch_asks_for_it():
    args = (jnp.zeros((8, VOCAB)), jnp.zeros(8), jnp.zeros(8, jnp.int32), jnp.ones(8), jnp.zeros(8, jnp.int32),
            jnp.zeros(8, jnp.int32))
    top = jax.make_jaxpr(sample_tokens)(*args).jaxpr
    names = {eqn.primitive.name for eqn in top.eqns}
    assert "sort" not in names and "top_k" not in names and "argmax" not in names and "cond" in names


def test_the_two_level_argmax_is_jnps_ties_included():
    from trainer.serve.sampling import argmax

    rng = np.random.RandomState(1)
    x = rng.randint(0, 40, (16, 1024)).astype(np.float32)  # many ties
    np.testing.assert_array_equal(np.asarray(jax.jit(argmax)(jnp.asarray(x))), x.argmax(-1))


def test_the_two_level_top_k_is_lax_top_k():
    from trainer.serve.sampling import best

    x = jnp.asarray(np.random.RandomState(2).randn(8, 32768).astype(np.float32))
    values, ids = jax.jit(lambda x: best(x, 64))(x)
    want_values, want_ids = jax.lax.top_k(x, 64)
    np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
