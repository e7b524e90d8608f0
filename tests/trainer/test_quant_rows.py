"""The quantized weights' row reads and products that pad a step's few rows for the TPU's sake
(trainer/serve/quant.py take_padded, quant4.py Widened.contract and contract_leading) give what the plain forms
give."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer.serve import quant, quant4

# The inputs are numpy's (jax.random compiles programs for every shape it draws), and each test's reads and products
# run as one program, as a serving step runs them: op by op each of their operations would compile one of its own.
# Those small programs run once each: XLA's optimisations cost more than they save (the module 7.9 -> 4.5 CPU s).
pytestmark = pytest.mark.compile_bound


@pytest.mark.parametrize("shape, axis, index_shape", [
    ((50, 6), 0, (1, 1)),  # a decode step of one slot: fewer rows than SUBLANES
    ((50, 6), 0, (3, 5)),  # more
    ((4, 50, 6), 1, (2,)),  # another axis
    ((4, 50, 6), -2, (1, 3)),
])
@pytest.mark.parametrize("platform", ["cpu", "tpu"])  # "tpu": a narrow table's few rows sliced one by one
def test_take_padded_is_jnp_take(shape, axis, index_shape, platform, monkeypatch):
    monkeypatch.setattr("trainer.sharding.current_platform", lambda: platform)
    rng = np.random.default_rng(0)
    a = rng.standard_normal(shape, np.float32)
    indices = rng.integers(0, shape[axis], index_shape, np.int32)
    got, want = jax.jit(lambda a, i: (quant.take_padded(a, i, axis), jnp.take(a, i, axis)))(a, indices)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("rows, index_shape", [(100, (1, 1)), (100, (3, 4)), (64, (2,))])
def test_an_int8_embeddings_few_rows_read_from_their_tiles_are_its_rows(rows, index_shape, monkeypatch):
    """Int8Weight.take of a decode step's rows on a TPU goes through take_tiles (Pallas' interpreter here): the
    widened rows jnp.take gives, in the last, partial tile too; an index past the table reads its last row (the
    kernel never reads outside it)."""
    monkeypatch.setattr("trainer.sharding.current_platform", lambda: "tpu")
    monkeypatch.setattr(quant, "take_tiles", functools.partial(quant.take_tiles, interpret=True))  # no TPU here
    rng = np.random.default_rng(0)
    indices = rng.integers(0, rows, index_shape, np.int32)
    indices[(0,) * len(index_shape)] = rows - 1

    @jax.jit
    def reads(w, indices):
        table = quant.quantize_weight(w, (1,))
        return [(quant.take_tiles(table.values, indices), jnp.take(table.values, indices, 0)),
                (quant.take_tiles(table.values, jnp.asarray([rows + 5])), table.values[-1:]),
                (table.take(indices), jnp.take(table.dequantize(), indices, 0))]

    for got, want in reads(rng.standard_normal((rows, 256), np.float32), indices):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("lead", [(1, 1), (3, 2), (2, 9)])
def test_int4_contract_at_few_and_many_rows_is_the_widened_product(lead):
    rng = np.random.default_rng(2)
    q = quant4.quantize_params({"head": jnp.asarray(rng.standard_normal((256, 40), np.float32))},
                               storage="nibbles")["head"]
    x = rng.standard_normal((*lead, 256), np.float32)
    cols = jnp.asarray([3, 37, 5])

    @jax.jit
    def products(q, x):
        return (q.contract(x, jnp.float32), jnp.einsum("...k,kn->...n", x, q.dequantize().astype(jnp.float32)),
                q.take(cols, axis=1), jnp.take(q.dequantize(), cols, axis=1))

    got, want, taken, widened = products(q, x)
    assert got.shape == (*lead, 40)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    # and its columns by take (as the embedding's rows are read) are the widened weight's
    np.testing.assert_array_equal(taken, widened)


@pytest.mark.parametrize("name, shape, n, lead", [
    ("wq", (256, 4, 16), 1, (1, 1)),  # an attention projection [D, N, H], grouped along D: one decode row
    ("wq", (256, 4, 16), 1, (2, 3)),
    ("wq", (256, 4, 16), 1, (2, 70)),  # a prefill chunk: more rows than a group has values, the widened weight
    ("wo", (4, 128, 24), 2, (1, 1)),  # its output [N, H, D], grouped along H, one group a head
    ("wo", (4, 128, 24), 2, (3, 5)),
])
@pytest.mark.parametrize("storage", ["nibbles", "native"])
def test_int4_contract_leading_is_the_widened_product(name, shape, n, lead, storage):
    """A projection's product group by group agrees with the widened weight's, held to float64."""
    rng = np.random.default_rng(4)
    q = quant4.quantize_params({name: jnp.asarray(rng.standard_normal(shape, np.float32))}, storage=storage)[name]
    x = rng.standard_normal((*lead, *shape[:n]), np.float32)
    got, widened = jax.jit(lambda q, x: (q.contract_leading(x, n, jnp.float32), q.dequantize()))(q, x)
    want = np.tensordot(np.asarray(x, np.float64), np.asarray(widened, np.float64), n)
    assert got.shape == (*lead, *shape[n:])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="contract over"):  # refused as it is traced
        jax.eval_shape(lambda q, x: q.contract_leading(x, n, jnp.float32), q, x[..., :1])
