"""Causal self-attention over a whole sequence (training, evaluation): XLA's fused attention or the splash
kernel (Pallas, TPU).

XLA's `dot_product_attention` materialises each head's [L, L] scores in float32 (1 GiB a layer for moe-1b's
batch of 16 x 1,024) and, under remat, computes them twice. jax's own splash kernel
(`jax.experimental.pallas.ops.tpu.splash_attention`) keeps the scores in VMEM block by block, skips the
blocks above the diagonal, and has a fused backward pass: it is what a TPU should run. "auto" takes it on a
TPU where its blocks fit the shapes (length a multiple of 128, the same head size for keys and values) and
XLA's elsewhere (the CPU path every test compares against). On a CPU "splash" runs the same kernel through
Pallas' interpreter, so its tests need no chip. Sliding windows and attention sinks (GPT-OSS) run in XLA
(local_attention), with their [L, L] scores materialised.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from trainer import sharding
from trainer.kernels import tpu_attention

# What attention's backward pass needs, by name, for a remat policy that keeps it (trainer/model.py's
# REMAT_POLICIES "attention"): XLA's q, k, v and output, or the splash kernel's residuals (the same and the
# softmax's log-sum-exp).
SAVED = ("attention_q", "attention_k", "attention_v", "attention_out", "attention_residuals")


def resolve(impl: str, length: int, qk_size: int, v_size: int) -> str:
    """The implementation "auto" stands for here: splash on a TPU where its blocks fit
    (trainer/kernels.py's tpu_attention), else XLA's."""
    if impl != "auto":
        return impl
    if qk_size != v_size or sharding.current_platform() != "tpu":
        return "xla"
    return tpu_attention("auto", length)


def causal_attention(q_BxLxNxH: jax.Array, k_BxLxKxH: jax.Array, v_BxLxKxH: jax.Array, *, impl: str = "auto",
                     scale: float | None = None) -> jax.Array:
    """softmax(q k^T * scale, causal) v for [batch, length, heads, size] q and [batch, length, kv heads, size]
    k and v (grouped-query: each of the K key/value heads serves N/K query heads); scale defaults to
    size**-0.5."""
    length, size = q_BxLxNxH.shape[1], q_BxLxNxH.shape[-1]
    if resolve(impl, length, size, v_BxLxKxH.shape[-1]) == "xla":
        q_BxLxNxH, k_BxLxKxH, v_BxLxKxH = (checkpoint_name(a, n) for a, n in zip(
            (q_BxLxNxH, k_BxLxKxH, v_BxLxKxH), SAVED, strict=False))
        out_BxLxNxH = jax.nn.dot_product_attention(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, is_causal=True, scale=scale)
        return checkpoint_name(out_BxLxNxH, "attention_out")
    if length % 128:
        raise ValueError(f"splash attention needs a length that is a multiple of 128, got {length}")
    q_BxLxNxH = q_BxLxNxH * jnp.asarray(size ** -0.5 if scale is None else scale, q_BxLxNxH.dtype)
    local = functools.partial(_splash, interpret=sharding.current_platform() != "tpu")
    if sharding.on_one_device():
        return local(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH)
    mesh = sharding.current_mesh()
    # A Pallas call is opaque to XLA's partitioner: each device runs it on its own rows (and its own heads
    # where the mesh splits them over `model`).
    ways = dict(mesh.shape).get("model", 1)
    heads = "model" if q_BxLxNxH.shape[2] % ways == 0 and k_BxLxKxH.shape[2] % ways == 0 else None
    spec = P(sharding.BATCH_AXES, None, heads, None)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec,
                         check_vma=False)(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH)


def window_mask(positions_BxL: jax.Array, length: int, window: int) -> jax.Array:
    """[B, 1, L, S]: which of the positions 0..S-1 each query (at positions_BxL) attends to: its own and those
    before it, and with `window` only the last `window` of them (its own included; 0: all)."""
    s_S = jnp.arange(length)
    causal = s_S[None, None, None, :] <= positions_BxL[:, None, :, None]
    if not window:
        return causal
    return causal & (s_S[None, None, None, :] > positions_BxL[:, None, :, None] - window)


def sink_attention(q_BxLxNxH: jax.Array, k_BxSxKxH: jax.Array, v_BxSxKxH: jax.Array, mask_Bx1xLxS: jax.Array,
                   sinks_N: jax.Array | None = None, scale: float | None = None) -> jax.Array:
    """softmax(q k^T * scale) v over the masked-in keys, in XLA with float32 scores, where each head's softmax
    may take one more logit, sinks_N[n], that no value goes with (GPT-OSS's attention sinks: the head's
    weights on its keys then sum to less than 1). Grouped-query as causal_attention's: query head n reads key
    head n // (N / K)."""
    batch, length, heads, size = q_BxLxNxH.shape
    kv_heads = k_BxSxKxH.shape[2]
    q_BxLxKxGxH = q_BxLxNxH.reshape(batch, length, kv_heads, heads // kv_heads, size)
    scores_BxKxGxLxS = jnp.einsum("blkgh,bskh->bkgls", q_BxLxKxGxH, k_BxSxKxH, preferred_element_type=jnp.float32)
    scores_BxKxGxLxS = scores_BxKxGxLxS * jnp.float32(size ** -0.5 if scale is None else scale)
    scores_BxKxGxLxS = jnp.where(mask_Bx1xLxS[:, :, None], scores_BxKxGxLxS, jnp.finfo(jnp.float32).min)
    if sinks_N is not None:
        sinks_BxKxGxLx1 = jnp.broadcast_to(sinks_N.astype(jnp.float32).reshape(1, kv_heads, -1, 1, 1),
                                           (*scores_BxKxGxLxS.shape[:-1], 1))
        scores_BxKxGxLxS = jnp.concatenate([scores_BxKxGxLxS, sinks_BxKxGxLx1], axis=-1)
    probs_BxKxGxLxS = jax.nn.softmax(scores_BxKxGxLxS, axis=-1)
    if sinks_N is not None:
        probs_BxKxGxLxS = probs_BxKxGxLxS[..., :-1]
    out_BxLxKxGxH = jnp.einsum("bkgls,bskh->blkgh", probs_BxKxGxLxS.astype(v_BxSxKxH.dtype), v_BxSxKxH)
    return out_BxLxKxGxH.reshape(batch, length, heads, size)


def local_attention(q_BxLxNxH: jax.Array, k_BxLxKxH: jax.Array, v_BxLxKxH: jax.Array, *, window: int = 0,
                    sinks_N: jax.Array | None = None) -> jax.Array:
    """Causal attention over whole sequences (training) with a sliding window (0: none) and attention sinks
    (sink_attention), named for the remat policies as causal_attention's XLA path is."""
    q_BxLxNxH, k_BxLxKxH, v_BxLxKxH = (checkpoint_name(a, n) for a, n in zip(
        (q_BxLxNxH, k_BxLxKxH, v_BxLxKxH), SAVED, strict=False))
    length = q_BxLxNxH.shape[1]
    mask_1x1xLxL = window_mask(jnp.arange(length)[None], length, window)
    out_BxLxNxH = sink_attention(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, mask_1x1xLxL, sinks_N)
    return checkpoint_name(out_BxLxNxH, "attention_out")


def block_sizes(length: int):
    """Splash's tiles for a sequence of `length`: the largest of 512, 256 and 128 that divides it, for the
    forward pass and the fused backward pass alike."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    b = next(b for b in (512, 256, 128) if length % b == 0)
    return sa.BlockSizes(block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b, block_kv_dkv=b,
                         block_kv_dkv_compute=b, use_fused_bwd_kernel=True)


def _splash(q_BxLxNxH: jax.Array, k_BxLxKxH: jax.Array, v_BxLxKxH: jax.Array, *, interpret: bool) -> jax.Array:
    """The splash kernel on one device's rows; q already scaled. Grouped-query attention runs the kernel's
    multi-query form once per key/value head, over that head's N/K query heads."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    batch, length, heads, size = q_BxLxNxH.shape
    kv_heads = k_BxLxKxH.shape[2]
    group = heads // kv_heads
    mask = sa.MultiHeadMask([sa.CausalMask((length, length)) for _ in range(group)])
    make = sa.make_splash_mha if group == 1 else sa.make_splash_mqa
    kernel = make(mask, block_sizes=block_sizes(length), head_shards=1, q_seq_shards=1, interpret=interpret,
                  residual_checkpoint_name="attention_residuals")
    k_BxKxLxH, v_BxKxLxH = k_BxLxKxH.transpose(0, 2, 1, 3), v_BxLxKxH.transpose(0, 2, 1, 3)
    if group == 1:
        o_BxNxLxH = jax.vmap(kernel)(q_BxLxNxH.transpose(0, 2, 1, 3), k_BxKxLxH, v_BxKxLxH)
        return o_BxNxLxH.transpose(0, 2, 1, 3)
    q_BxKxGxLxH = q_BxLxNxH.reshape(batch, length, kv_heads, group, size).transpose(0, 2, 3, 1, 4)
    o_BxKxGxLxH = jax.vmap(jax.vmap(kernel))(q_BxKxGxLxH, k_BxKxLxH, v_BxKxLxH)
    return o_BxKxGxLxH.transpose(0, 3, 1, 2, 4).reshape(batch, length, heads, size)
