"""The next-token loss of the head's logits, with the backward pass written out (jax.custom_vjp).

Left to autodiff, the cross-entropy of a chunk of positions keeps or recomputes its float32 logits in the
backward pass, reduces them again for the log-sum-exp, writes the float32 gradient of the logits
(softmax - one-hot) out whole and reads it back twice, once for the hidden states' gradient and once for the
head's (float32 [16, 256, 32,768] a chunk for moe-1b). Here the forward pass keeps only each position's
log-sum-exp; the backward pass makes the logits again and turns them into their gradient in the same pass (an
epilogue XLA fuses into the matmul), in the compute dtype the two matmuls that read it take as their operand
anyway (where that is bfloat16, as the matrix unit reads a float32 operand at default precision), float32
where the model computes in float32: the same loss and, in float32, the same gradients as autodiff's. On a
v5e chip moe-1b's step took 343.4 ms against autodiff's 354.2 (`bash benchmarks/on_chip.sh levers`,
2026-12-06).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from trainer import sharding


def _logits(h_BxKxD: jax.Array, w_DxV: jax.Array, mesh, vocab: str) -> jax.Array:
    logits_BxKxV = jnp.einsum("bkd,dv->bkv", h_BxKxD, w_DxV, preferred_element_type=jnp.float32)
    if vocab == "vocab":  # whole: XLA lays the logits out as their batch
        return logits_BxKxV
    with sharding.logical_mesh(mesh):  # the backward pass is traced after the model's own context has closed
        return sharding.constrain(logits_BxKxV, ("batch", "length", vocab))


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def nll_sum(h_BxKxD: jax.Array, w_DxV: jax.Array, targets_BxK: jax.Array, mesh, vocab: str) -> jax.Array:
    """The sum over positions of -log softmax(h @ w)[target], in float32. `mesh` and `vocab` (the logits'
    logical vocabulary axis, trainer/model.py) lay the logits out as the model does."""
    return _forward(h_BxKxD, w_DxV, targets_BxK, mesh, vocab)[0]


def _forward(h_BxKxD, w_DxV, targets_BxK, mesh, vocab):
    logits_BxKxV = _logits(h_BxKxD, w_DxV, mesh, vocab)
    lse_BxK = jax.nn.logsumexp(logits_BxKxV, axis=-1)
    picked_BxK = jnp.take_along_axis(logits_BxKxV, targets_BxK[..., None], axis=-1)[..., 0]
    return jnp.sum(lse_BxK - picked_BxK), (h_BxKxD, w_DxV, targets_BxK, lse_BxK)


def _backward(mesh, vocab, residuals, g):
    h_BxKxD, w_DxV, targets_BxK, lse_BxK = residuals
    logits_BxKxV = _logits(h_BxKxD, w_DxV, mesh, vocab)
    target_BxKxV = jnp.arange(logits_BxKxV.shape[-1]) == targets_BxK[..., None]
    dlogits_BxKxV = ((jnp.exp(logits_BxKxV - lse_BxK[..., None]) - target_BxKxV) * g).astype(h_BxKxD.dtype)
    dh_BxKxD = jnp.einsum("bkv,dv->bkd", dlogits_BxKxV, w_DxV, preferred_element_type=jnp.float32)
    dw_DxV = jnp.einsum("bkd,bkv->dv", h_BxKxD, dlogits_BxKxV, preferred_element_type=jnp.float32)
    zeros = jnp.zeros(targets_BxK.shape, jax.dtypes.float0)  # integer targets take no gradient
    return dh_BxKxD.astype(h_BxKxD.dtype), dw_DxV.astype(w_DxV.dtype), zeros


nll_sum.defvjp(_forward, _backward)
