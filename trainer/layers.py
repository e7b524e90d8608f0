"""Dense building blocks of the decoder: RMSNorm, rotary positions, causal attention, gated FFN.

Every parameter carries the logical names of its axes (`out_sharding=`); trainer.sharding maps them to
the mesh. Parameters are stored in `param_dtype` (float32 master weights) and cast to the compute `dtype`
at use.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from trainer import initializers
from trainer.attention import causal_attention, local_attention, sink_attention
from trainer.rope import turn, yarn_frequencies
from trainer.sharding import constrain, model_ways

lecun = initializers.lecun


def named_param(rngs: nnx.Rngs, init: initializers.Init, shape: tuple[int, ...], names: tuple[str, ...], dtype,
                **metadata) -> nnx.Param:
    """A Param drawn by `init` (trainer/initializers.py's: it takes the axes' names, to draw in slabs along
    the axes the mesh leaves whole), its logical axis names for the sharding rules."""
    return nnx.Param(init(rngs.params(), shape, dtype, names), out_sharding=names, **metadata)


class RMSNorm(nnx.Module):
    """RMSNorm over the last len(shape) axes (one, or a head axis and its features: q/k over all heads), in
    float32; `names` are the scale's logical axes."""

    def __init__(self, dim: int | tuple[int, ...], *, eps: float, dtype, param_dtype, rngs: nnx.Rngs,
                 names: tuple[str, ...] = ("norm",)):
        shape = (dim,) if isinstance(dim, int) else tuple(dim)
        self.scale = nnx.Param(jnp.ones(shape, param_dtype), out_sharding=names)
        self.eps, self.dtype = eps, dtype

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        axes = tuple(range(-self.scale.ndim, 0))
        x = x_BxLxD.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=axes, keepdims=True) + self.eps)
        return (x * self.scale[...].astype(jnp.float32)).astype(self.dtype)


def rotary(x_BxLxNxH: jax.Array, theta: float, offset: int | jax.Array = 0,
           inv_freq: tuple[float, ...] | None = None) -> jax.Array:
    """Rotates feature pairs (i, i + H/2) by position-dependent angles (RoFormer), in float32; the first of
    the L positions is `offset` (decoding with a key/value cache), a scalar or one per batch row. `inv_freq`
    (H/2 frequencies) replaces theta's (a scaled RoPE: trainer/mla.py's YaRN)."""
    length, half = x_BxLxNxH.shape[1], x_BxLxNxH.shape[-1] // 2
    inv_freq_K = (theta ** (-jnp.arange(half, dtype=jnp.float32) / half) if inv_freq is None
                  else jnp.asarray(inv_freq, jnp.float32))
    # offset is a scalar or one start per batch row ([B]): positions are [L] or [B, L].
    positions = jnp.arange(length, dtype=jnp.float32) + jnp.asarray(offset, jnp.float32)[..., None]
    angle = positions[..., None] * inv_freq_K
    sin_H, cos_H = (jnp.concatenate([f(angle)] * 2, axis=-1)[..., None, :] for f in (jnp.sin, jnp.cos))
    return turn(x_BxLxNxH, cos_H, sin_H)


class Attention(nnx.Module):
    """Causal multi-head (or grouped-query) self-attention with rotary positions.

    Options the open checkpoints need: `bias` on q, k and v (Qwen2-MoE); `qk_norm` an RMSNorm of q and k
    before the rotary positions, over each head ("head", Qwen3-MoE) or over all heads at once ("full",
    OLMoE), with epsilon `norm_eps`; GPT-OSS's `out_bias` on the output projection, attention `sinks` (a
    learned logit per head in the softmax, trainer/attention.py's sink_attention), a sliding `window` (the
    positions a token attends to, its own included; 0: all before it) and YaRN rotary scaling (`yarn`).
    """

    def __init__(self, d_model: int, num_heads: int, kv_heads: int, head_dim: int, *, rope_theta: float,
                 dtype, param_dtype, rngs: nnx.Rngs, bias: bool = False, qk_norm: str = "none",
                 norm_eps: float = 1e-6, attention: str = "auto", out_bias: bool = False, sinks: bool = False,
                 window: int = 0, yarn=None):
        D, N, K, H = d_model, num_heads, kv_heads, head_dim
        self.wq = named_param(rngs, lecun, (D, N, H), ("embed", "heads", "kv"), param_dtype)
        self.wk = named_param(rngs, lecun, (D, K, H), ("embed", "kv_heads", "kv"), param_dtype)
        self.wv = named_param(rngs, lecun, (D, K, H), ("embed", "kv_heads", "kv"), param_dtype)
        out_init = initializers.variance_scaling(in_axis=(0, 1), out_axis=2)
        self.wo = named_param(rngs, out_init, (N, H, D), ("heads", "kv", "embed"), param_dtype)
        if bias:
            zeros = initializers.zeros
            self.bq = named_param(rngs, zeros, (N, H), ("heads", "kv"), param_dtype)
            self.bk = named_param(rngs, zeros, (K, H), ("kv_heads", "kv"), param_dtype)
            self.bv = named_param(rngs, zeros, (K, H), ("kv_heads", "kv"), param_dtype)
        if qk_norm != "none":
            whole = qk_norm == "full"
            norm = lambda heads, name: RMSNorm((heads, H) if whole else H, eps=norm_eps, dtype=dtype,  # noqa: E731
                                               param_dtype=param_dtype, rngs=rngs,
                                               names=(name, "kv") if whole else ("norm",))
            self.q_norm, self.k_norm = norm(N, "heads"), norm(K, "kv_heads")
        if out_bias:
            self.bo = named_param(rngs, initializers.zeros, (D,), ("embed",), param_dtype)
        if sinks:
            self.sinks = named_param(rngs, initializers.zeros, (N,), ("heads",), param_dtype)
        self.bias, self.qk_norm, self.out_bias, self.has_sinks, self.window = bias, qk_norm, out_bias, sinks, window
        self.rope_theta, self.dtype, self.attention = rope_theta, dtype, attention
        self.inv_freq, self.rope_factor = None, 1.0
        if yarn is not None:
            self.inv_freq, self.rope_factor, _ = yarn_frequencies(H, rope_theta, yarn)

    def __call__(self, x_BxLxD: jax.Array, cache=None):
        """The attention output [B, L, D]; with `cache` (trainer.serve.kvcache.LayerCache) the L tokens
        sit at the cache's start positions, their keys and values go into it, they attend to every cached
        position up to their own, and the call returns (output, cache)."""
        q_BxLxNxH, k_BxLxKxH, v_BxLxKxH = self._project(x_BxLxD.astype(self.dtype))
        if self.bias:
            q_BxLxNxH, k_BxLxKxH, v_BxLxKxH = (x + b[...].astype(self.dtype) for x, b in
                                               ((q_BxLxNxH, self.bq), (k_BxLxKxH, self.bk), (v_BxLxKxH, self.bv)))
        if self.qk_norm != "none":
            q_BxLxNxH, k_BxLxKxH = self.q_norm(q_BxLxNxH), self.k_norm(k_BxLxKxH)
        offset = 0 if cache is None else cache.starts_B
        # Tensor parallelism: heads split over `model` (KV heads replicated when fewer); trainer/sharding.py.
        q_BxLxNxH = constrain(self._rotary(q_BxLxNxH, offset), ("batch", "length", "heads", "kv"))
        k_BxLxKxH = constrain(self._rotary(k_BxLxKxH, offset), ("batch", "length", "kv_heads", "kv"))
        v_BxLxKxH = constrain(v_BxLxKxH, ("batch", "length", "kv_heads", "kv"))
        sinks_N = self.sinks[...] if self.has_sinks else None
        if cache is None and (self.window or self.has_sinks):
            o_BxLxNxH = local_attention(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, window=self.window, sinks_N=sinks_N)
        elif cache is None:
            o_BxLxNxH = causal_attention(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, impl=self.attention)
        else:
            cache, k_BxSxKxH, v_BxSxKxH, mask_Bx1xLxS = cache.append(k_BxLxKxH, v_BxLxKxH)
            o_BxLxNxH = self._cached(q_BxLxNxH, k_BxSxKxH.astype(self.dtype), v_BxSxKxH.astype(self.dtype),
                                     mask_Bx1xLxS, sinks_N)
        out_BxLxD = times_leading(o_BxLxNxH, self.wo.get_value(), 2, self.dtype)
        if self.out_bias:
            out_BxLxD = out_BxLxD + self.bo[...].astype(self.dtype)
        return out_BxLxD if cache is None else (out_BxLxD, cache)

    def _rotary(self, x_BxLxNxH: jax.Array, offset) -> jax.Array:
        """Rotary positions from `offset`; YaRN also scales the rotated values (its cos and sin)."""
        x_BxLxNxH = rotary(x_BxLxNxH, self.rope_theta, offset, self.inv_freq)
        return x_BxLxNxH * self.rope_factor if self.rope_factor != 1.0 else x_BxLxNxH

    def _cached(self, q_BxLxNxH, k_BxSxKxH, v_BxSxKxH, mask_Bx1xLxS, sinks_N):
        """Attention over the cached keys the mask lets in: the cache's view masks a sliding layer's keys
        before its window (the model asks it for the layer's window: trainer/serve/kvcache.py, ringcache.py)."""
        if not self.window and sinks_N is None:
            return jax.nn.dot_product_attention(q_BxLxNxH, k_BxSxKxH, v_BxSxKxH, mask=mask_Bx1xLxS)
        return sink_attention(q_BxLxNxH, k_BxSxKxH, v_BxSxKxH, mask_Bx1xLxS, sinks_N)

    def _project(self, x_BxLxD: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q, k and v. Split over `model` (T devices, KV heads too), as one product with the three weights
        side by side in each device's T-th: the backward pass then sums the input's gradient over
        `model` once, not once per projection. The concatenation is each device's own slices, so it moves
        nothing; the parameters stay three (checkpoints are unchanged)."""
        ways = model_ways()
        if ways == 1:  # one device's whole heads: each weight as held (an int4 one group by group)
            return tuple(times_leading(x_BxLxD, w.get_value(), 1, self.dtype) for w in (self.wq, self.wk, self.wv))
        wq_DxNxH, wk_DxKxH, wv_DxKxH = (w[...].astype(self.dtype) for w in (self.wq, self.wk, self.wv))
        (d_model, heads, size), kv_heads = wq_DxNxH.shape, wk_DxKxH.shape[1]
        if heads % ways or kv_heads % ways:  # KV replicated
            return tuple(jnp.tensordot(x_BxLxD, w, 1) for w in (wq_DxNxH, wk_DxKxH, wv_DxKxH))
        per_device = lambda w: w.reshape(d_model, ways, w.shape[1] // ways, size)  # noqa: E731
        w_DxTxFxH = constrain(jnp.concatenate([per_device(wq_DxNxH), per_device(wk_DxKxH), per_device(wv_DxKxH)],
                                              axis=2), ("embed", "heads", None, "kv"))
        qkv_BxLxTxFxH = jnp.einsum("bld,dtfh->bltfh", x_BxLxD, w_DxTxFxH)
        batch, length = x_BxLxD.shape[:2]
        q, kv = heads // ways, kv_heads // ways
        parts = (qkv_BxLxTxFxH[..., :q, :], qkv_BxLxTxFxH[..., q:q + kv, :], qkv_BxLxTxFxH[..., q + kv:, :])
        return tuple(p.reshape(batch, length, -1, size) for p in parts)


class DenseFFN(nnx.Module):
    """Gated (SwiGLU) feed-forward: (silu(x W_gate) * x W_in) W_out."""

    SAVED = ("ffn_gate", "ffn_in")  # the hidden products, named for a remat policy (trainer/model.py)

    def __init__(self, d_model: int, d_ff: int, *, dtype, param_dtype, rngs: nnx.Rngs, products: str = "auto",
                 layer_product=None):
        self.w_in = named_param(rngs, lecun, (d_model, d_ff), ("embed", "mlp"), param_dtype)
        self.w_gate = named_param(rngs, lecun, (d_model, d_ff), ("embed", "mlp"), param_dtype)
        self.w_out = named_param(rngs, lecun, (d_ff, d_model), ("mlp", "embed"), param_dtype)
        self.dtype = dtype
        # A serving step's product with a weight held as its whole quantized stack (trainer/moe/stacked.py
        # split_stacks): trainer.moe.direct.layer_product, handed in by the model (this module imports nothing
        # of trainer.moe, which imports it), with MoEConfig.direct_products.
        self.products, self.layer_product = products, layer_product

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        x = x_BxLxD.astype(self.dtype)
        gate_BxLxF = jax.nn.silu(checkpoint_name(self._times(x, self.w_gate), "ffn_gate"))
        in_BxLxF = checkpoint_name(self._times(x, self.w_in), "ffn_in")
        h_BxLxF = constrain(gate_BxLxF * in_BxLxF, ("batch", "length", "mlp"))
        return self._times(h_BxLxF, self.w_out)

    def _times(self, x: jax.Array, w: nnx.Param) -> jax.Array:
        held = w.get_value()
        if self.layer_product is not None and hasattr(held, "group_offset"):  # a stacked.LayerOf
            return self.layer_product(x, held, self.dtype, self.products)
        return times(x, held, self.dtype)


def times_leading(x: jax.Array, held, n: int, dtype) -> jax.Array:
    """x's last `n` axes contracted with a weight's first `n`, in `dtype`: an array, or a serving weight as held;
    an int4 one (quant4.py) group by group (Widened.contract_leading), never widened whole at a decode step."""
    if hasattr(held, "contract_leading"):
        return held.contract_leading(x, n, dtype).astype(dtype)
    w = held if isinstance(held, jax.Array) else held[...]
    return jnp.tensordot(x, w.astype(dtype), n)


def times(x: jax.Array, held, dtype) -> jax.Array:
    """x @ a 2-D weight as held, in `dtype`: an array, or a serving weight (trainer/serve/) widened where it is
    used; an int4 weight (quant4.py) contracted group by group, never widened whole (at one decode row XLA
    widened its scales to the weight's size in float32 first)."""
    if hasattr(held, "contract"):
        return held.contract(x, dtype).astype(dtype)
    return x @ (held if isinstance(held, jax.Array) else held[...]).astype(dtype)
