"""The quantized weights' row reads and products that pad a step's few rows for the TPU's sake
(trainer/serve/quant.py take_padded, quant4.py Widened.contract) give what the plain forms give."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from trainer.serve import quant, quant4


@pytest.mark.parametrize("shape, axis, index_shape", [
    ((50, 6), 0, (1, 1)),  # a decode step of one slot: fewer rows than SUBLANES
    ((50, 6), 0, (3, 5)),  # more
    ((4, 50, 6), 1, (2,)),  # another axis
    ((4, 50, 6), -2, (1, 3)),
])
def test_take_padded_is_jnp_take(shape, axis, index_shape):
    a = jax.random.normal(jax.random.key(0), shape)
    indices = jax.random.randint(jax.random.key(1), index_shape, 0, shape[axis])
    np.testing.assert_array_equal(quant.take_padded(a, indices, axis), jnp.take(a, indices, axis))


@pytest.mark.parametrize("lead", [(1, 1), (3, 2), (2, 9)])
def test_int4_contract_at_few_and_many_rows_is_the_widened_product(lead):
    w = jax.random.normal(jax.random.key(2), (256, 40))
    q = quant4.quantize_params({"head": w}, storage="nibbles")["head"]
    x = jax.random.normal(jax.random.key(3), (*lead, 256))
    want = jnp.einsum("...k,kn->...n", x, q.dequantize().astype(jnp.float32))
    got = q.contract(x, jnp.float32)
    assert got.shape == (*lead, 40)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    # and its columns by take (as the embedding's rows are read) are the widened weight's
    cols = jnp.asarray([3, 37, 5])
    np.testing.assert_array_equal(q.take(cols, axis=1), jnp.take(q.dequantize(), cols, axis=1))
