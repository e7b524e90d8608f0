"""Multi-head latent attention (DeepSeek-V2/V3): keys and values expanded from one small latent per token.

Per token, x [D] becomes a latent c [C] (kv_lora_rank, RMS-normalised) and one rotary key r [R]
(qk_rope_head_dim) that every head shares; each head's key is (c W_k [P], r) and its value c W_v [V], with
P = qk_nope_head_dim and V = v_head_dim. The query is x W_q, or x W_qa -> RMSNorm -> W_qb through a rank
q_lora_rank bottleneck; each head's query is P values without positions and R with them. The rotary part uses
trainer/layers.py's half-split pairs (i, i + R/2); hf import permutes the Hub's interleaved pairs into it.

Training expands the heads: q, k and v are padded to one head size (the larger of P + R and V; zeros
change no dot product) and go through the same attention as trainer/layers.py's. Decoding caches the
latent (c, r) alone (trainer/serve/latentcache.py) and absorbs the up-projections (DeepSeek-V2's "weight
absorption"): a head's score q_nope . (c W_k) is (q_nope W_k^T) . c, a query in latent space, and its
output (sum_s p_s c_s) W_v, the weighted latents up-projected once per query; so a decode step attends over
the cached latents, never over expanded keys and values. A long prefill chunk, whose many queries would each
pay the latent's width, expands the span's keys and values from the cache instead, where that costs fewer
FLOPs (MLAttention.expands). Heads split over the mesh's `model` axis as there;
the cached latent, which every head reads, is split by position over it instead: each device attends over its
own positions for every head and the softmax's parts are merged (latent_softmax_parts,
trainer/serve/latentcache.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from trainer import initializers
from trainer.attention import causal_attention
from trainer.layers import RMSNorm, lecun, named_param, rotary
from trainer.model_config import MLAConfig
from trainer.rope import yarn_frequencies
from trainer.sharding import constrain

# The latents' RMSNorms keep this epsilon whatever the layers' norm_eps (as DeepSeek's checkpoints have them).
LATENT_NORM_EPS = 1e-6
_HEADS_OUT = ("batch", "length", "heads", "kv")


def _init(in_axis, out_axis):
    return initializers.variance_scaling(in_axis=in_axis, out_axis=out_axis)


class MLAttention(nnx.Module):
    """Causal multi-head latent attention; `__call__(x_BxLxD, cache=None)` as trainer.layers.Attention's."""

    def __init__(self, d_model: int, num_heads: int, mla: MLAConfig, *, rope_theta: float, dtype, param_dtype,
                 rngs: nnx.Rngs, attention: str = "auto"):
        D, N, C, R = d_model, num_heads, mla.kv_lora_rank, mla.qk_rope_head_dim
        Q, V = mla.qk_head_dim, mla.v_head_dim

        def norm(dim: int) -> RMSNorm:
            return RMSNorm(dim, eps=LATENT_NORM_EPS, dtype=dtype, param_dtype=param_dtype, rngs=rngs)

        to_heads = _init(0, (1, 2))
        if mla.q_lora_rank:
            self.wq_a = named_param(rngs, lecun, (D, mla.q_lora_rank), ("embed", None), param_dtype)
            self.q_norm = norm(mla.q_lora_rank)
            self.wq_b = named_param(rngs, to_heads, (mla.q_lora_rank, N, Q), (None, "heads", "kv"), param_dtype)
        else:
            self.wq = named_param(rngs, to_heads, (D, N, Q), ("embed", "heads", "kv"), param_dtype)
        self.wkv_a = named_param(rngs, lecun, (D, C + R), ("embed", None), param_dtype)
        self.kv_norm = norm(C)
        self.wkv_b = named_param(rngs, to_heads, (C, N, mla.qk_nope_head_dim + V), (None, "heads", "kv"),
                                 param_dtype)
        self.wo = named_param(rngs, _init((0, 1), 2), (N, V, D), ("heads", "kv", "embed"), param_dtype)
        self.mla, self.rope_theta, self.dtype, self.attention = mla, rope_theta, dtype, attention
        self.head_size = max(Q, V)  # the key/value cache's (ModelConfig.head_size)
        self.inv_freq, self.rope_factor, softmax = None, 1.0, 1.0
        if mla.yarn is not None:
            self.inv_freq, self.rope_factor, softmax = yarn_frequencies(R, rope_theta, mla.yarn)
        self.scale = Q ** -0.5 * softmax

    def __call__(self, x_BxLxD: jax.Array, cache=None):
        """The attention output [B, L, D]; with `cache` (trainer.serve.latentcache.LatentLayerCache) the L
        tokens sit at the cache's start positions, their latents go into it, and the call returns
        (output, cache)."""
        x_BxLxD = x_BxLxD.astype(self.dtype)
        if cache is not None:
            return self._absorbed(x_BxLxD, cache)
        q_BxLxNxQ, k_BxLxNxQ, v_BxLxNxV = self._heads(x_BxLxD)
        pad = lambda a: jnp.pad(a, ((0, 0),) * 3 + ((0, self.head_size - a.shape[-1]),))  # noqa: E731
        q_BxLxNxH, k_BxLxNxH, v_BxLxNxH = (constrain(pad(a), _HEADS_OUT) for a in (q_BxLxNxQ, k_BxLxNxQ, v_BxLxNxV))
        o_BxLxNxH = causal_attention(q_BxLxNxH, k_BxLxNxH, v_BxLxNxH, impl=self.attention, scale=self.scale)
        o_BxLxNxV = o_BxLxNxH[..., :self.mla.v_head_dim]  # scale above: of the unpadded heads
        return jnp.einsum("blnv,nvd->bld", o_BxLxNxV, self.wo[...].astype(self.dtype))

    def _absorbed(self, x_BxLxD: jax.Array, cache):
        """(output [B, L, D], the updated cache): attention over the cached latents, W_k folded into the
        query and W_v into the output (the module's docstring), in float32 softmax; each device of a cache
        split by position attends over its own positions (trainer/serve/latentcache.py merges them)."""
        P, dtype = self.mla.qk_nope_head_dim, self.dtype
        q_nope_BxLxNxP, q_rope_BxLxNxR = self._queries(x_BxLxD, cache.starts_B)
        cache = cache.write(*self._latent(x_BxLxD, cache.starts_B))
        wkv_b_CxNxF = self.wkv_b[...].astype(dtype)
        if self.expands(x_BxLxD.shape[1], cache.positions):
            latent_BxSxC, rope_BxSxR, mask_Bx1xLxS = cache.read(x_BxLxD.shape[1])
            o_BxLxNxV = self._expanded(q_nope_BxLxNxP, q_rope_BxLxNxR, latent_BxSxC.astype(dtype),
                                       rope_BxSxR.astype(dtype), mask_Bx1xLxS, wkv_b_CxNxF)
            return jnp.einsum("blnv,nvd->bld", o_BxLxNxV, self.wo[...].astype(dtype)), cache
        q_BxLxNxC = constrain(jnp.einsum("blnp,cnp->blnc", q_nope_BxLxNxP, wkv_b_CxNxF[..., :P]), _HEADS_OUT)
        parts = functools.partial(latent_softmax_parts, scale=self.scale)
        o_BxLxNxC = constrain(cache.attend(parts, q_BxLxNxC, q_rope_BxLxNxR).astype(dtype), _HEADS_OUT)
        o_BxLxNxV = jnp.einsum("blnc,cnv->blnv", o_BxLxNxC, wkv_b_CxNxF[..., P:])
        return jnp.einsum("blnv,nvd->bld", o_BxLxNxV, self.wo[...].astype(dtype)), cache

    def expands(self, length: int, span: int) -> bool:
        """Whether L new tokens attending over a span of S cached positions cost fewer FLOPs (a head's) with the
        span's keys and values expanded from its latents, S C (P + V) for the expansion and L S (P + R + V) for
        the attention, than absorbed, L P C + L C V for the projections and L S (2C + R) for the attention. A
        decode step (L = 1) never does; a long prefill chunk does: DeepSeek-V3's shapes (C 512, P 128, R 64,
        V 128) past about 171 tokens a chunk; a whole 2,048-token prompt in a third of the absorbed FLOPs."""
        m = self.mla
        C, P, R, V = m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        expanded = span * C * (P + V) + length * span * (P + R + V)
        absorbed = length * C * (P + V) + length * span * (2 * C + R)
        return expanded < absorbed

    def _expanded(self, q_nope_BxLxNxP, q_rope_BxLxNxR, latent_BxSxC, rope_BxSxR, mask_Bx1xLxS, wkv_b_CxNxF):
        """Each head's output [B, L, N, V] over the span's keys and values expanded from its latents (as
        training computes them), in float32 softmax."""
        P = self.mla.qk_nope_head_dim
        k_BxSxNxP = constrain(jnp.einsum("bsc,cnp->bsnp", latent_BxSxC, wkv_b_CxNxF[..., :P]), _HEADS_OUT)
        v_BxSxNxV = constrain(jnp.einsum("bsc,cnv->bsnv", latent_BxSxC, wkv_b_CxNxF[..., P:]), _HEADS_OUT)
        scores_BxNxLxS = (jnp.einsum("blnp,bsnp->bnls", q_nope_BxLxNxP, k_BxSxNxP, preferred_element_type=jnp.float32)
                          + jnp.einsum("blnr,bsr->bnls", q_rope_BxLxNxR, rope_BxSxR,
                                       preferred_element_type=jnp.float32)) * self.scale
        scores_BxNxLxS = jnp.where(mask_Bx1xLxS, scores_BxNxLxS, jnp.finfo(jnp.float32).min)
        probs_BxNxLxS = jax.nn.softmax(scores_BxNxLxS, axis=-1).astype(v_BxSxNxV.dtype)
        return jnp.einsum("bnls,bsnv->blnv", probs_BxNxLxS, v_BxSxNxV)

    def _queries(self, x_BxLxD: jax.Array, offset) -> tuple[jax.Array, jax.Array]:
        """Each head's query without positions [B, L, N, P] and its rotary part [B, L, N, R], rotated."""
        w = lambda p: p[...].astype(self.dtype)  # noqa: E731
        if self.mla.q_lora_rank:
            q_BxLxN_Q = jnp.einsum("blr,rnq->blnq", self.q_norm(x_BxLxD @ w(self.wq_a)), w(self.wq_b))
        else:
            q_BxLxN_Q = jnp.einsum("bld,dnq->blnq", x_BxLxD, w(self.wq))
        P = self.mla.qk_nope_head_dim
        return q_BxLxN_Q[..., :P], self._rotary(q_BxLxN_Q[..., P:], offset)

    def _latent(self, x_BxLxD: jax.Array, offset) -> tuple[jax.Array, jax.Array]:
        """The token's latent [B, L, C] (normalised) and its rotary key [B, L, R] (rotated): what the serving
        cache keeps."""
        C = self.mla.kv_lora_rank
        latent_BxLxA = x_BxLxD @ self.wkv_a[...].astype(self.dtype)
        rope_BxLx1xR = self._rotary(latent_BxLxA[..., None, C:], offset)
        return self.kv_norm(latent_BxLxA[..., :C]), rope_BxLx1xR[:, :, 0]

    def _rotary(self, x_BxLxNxR: jax.Array, offset) -> jax.Array:
        """Rotary positions from `offset`; YaRN scales the rotated values (its cos and sin)."""
        x_BxLxNxR = rotary(x_BxLxNxR, self.rope_theta, offset, self.inv_freq)
        return x_BxLxNxR * self.rope_factor if self.rope_factor != 1.0 else x_BxLxNxR

    def _heads(self, x_BxLxD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Each head's query [B, L, N, P + R], key [B, L, N, P + R] and value [B, L, N, V], positions applied
        (from 0: training's whole sequences)."""
        P = self.mla.qk_nope_head_dim
        q_nope_BxLxNxP, q_rope_BxLxNxR = self._queries(x_BxLxD, 0)
        latent_BxLxC, rope_BxLxR = self._latent(x_BxLxD, 0)
        kv_BxLxNxF = jnp.einsum("blc,cnf->blnf", latent_BxLxC, self.wkv_b[...].astype(self.dtype))
        k_nope_BxLxNxP = kv_BxLxNxF[..., :P]
        k_rope_BxLxNxR = jnp.broadcast_to(rope_BxLxR[:, :, None], k_nope_BxLxNxP.shape[:-1] + rope_BxLxR.shape[-1:])
        q_BxLxNxQ = jnp.concatenate([q_nope_BxLxNxP, q_rope_BxLxNxR], axis=-1)
        k_BxLxNxQ = jnp.concatenate([k_nope_BxLxNxP, k_rope_BxLxNxR], axis=-1)
        return q_BxLxNxQ, k_BxLxNxQ, kv_BxLxNxF[..., P:]


def latent_softmax_parts(q_BxLxNxC: jax.Array, q_rope_BxLxNxR: jax.Array, latent_BxSxC: jax.Array,
                         rope_BxSxR: jax.Array, mask_Bx1xLxS: jax.Array, *, scale: float):
    """Softmax's parts over S positions of the cache, to be merged with other positions' or normalised alone
    (trainer/serve/latentcache.py's attend): each query's highest score [B, N, L], the sum of its exponentials
    relative to it [B, N, L] and the latents they weigh [B, L, N, C], all float32. A masked position weighs
    nothing, so a query with none of the S positions to attend to contributes nothing to the merge."""
    latent_BxSxC, rope_BxSxR = latent_BxSxC.astype(q_BxLxNxC.dtype), rope_BxSxR.astype(q_BxLxNxC.dtype)
    scores_BxNxLxS = (jnp.einsum("blnc,bsc->bnls", q_BxLxNxC, latent_BxSxC, preferred_element_type=jnp.float32)
                      + jnp.einsum("blnr,bsr->bnls", q_rope_BxLxNxR, rope_BxSxR,
                                   preferred_element_type=jnp.float32)) * scale
    max_BxNxL = jnp.max(jnp.where(mask_Bx1xLxS, scores_BxNxLxS, jnp.finfo(jnp.float32).min), axis=-1)
    exp_BxNxLxS = jnp.where(mask_Bx1xLxS, jnp.exp(scores_BxNxLxS - max_BxNxL[..., None]), 0.0)
    weighted_BxLxNxC = jnp.einsum("bnls,bsc->blnc", exp_BxNxLxS.astype(latent_BxSxC.dtype), latent_BxSxC,
                                  preferred_element_type=jnp.float32)
    return max_BxNxL, jnp.sum(exp_BxNxLxS, axis=-1), weighted_BxLxNxC
