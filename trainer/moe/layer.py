"""MoEBlock: the Flax NNX module that owns the parameters and wires routing, dispatch, experts."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from trainer import initializers
from trainer.layers import named_param
from trainer.moe.config import MoEConfig
from trainer.moe.experts import Activation, ExpertWeights, shared_ffn
from trainer.moe.parallel import expert_shards, model_shards, moe_apply
from trainer.moe.routing import updated_bias
from trainer.moe.stacked import LayerOf


class ExpertBias(nnx.Variable):
    """The auxiliary-loss-free balancing bias, float32 [E]: state, not a parameter (no gradient,
    no weight decay, no optimizer state). Each training call moves it after routing with it."""


def _param(rngs: nnx.Rngs, shape, fan_in: int, names: tuple[str, ...], dtype) -> nnx.Param:
    """Truncated-normal init scaled by 1/sqrt(fan_in); `out_sharding` carries logical axis names
    (not applied here: the trainer's sharding module maps them onto the mesh)."""
    return named_param(rngs, initializers.truncated_normal(fan_in**-0.5), shape, names, dtype, eager_sharding=False)


class MoEBlock(nnx.Module):
    """Mixture-of-Experts feed-forward block.

    __call__(x_BxLxD, train=...) returns (y_BxLxD, aux): y is the routed (plus shared)
    experts' output without the residual; aux holds "aux_loss" and "z_loss" (already
    times their coefficients), "drop_fraction", "expert_load" ([E] float32, sums to 1)
    and the balance metrics of core.finish_stats.

    With balance "bias" or "both" the block holds `expert_bias` (ExpertBias); a training
    call routes with it, then moves it by bias_rate towards the mean load of that call's
    whole batch (every shard's tokens).
    """

    def __init__(
        self,
        cfg: MoEConfig,
        d_model: int,
        *,
        mesh: Mesh | None = None,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        shards = expert_shards(mesh)
        if cfg.num_experts % shards:
            raise ValueError(
                f"MoEBlock: num_experts={cfg.num_experts} must divide over the mesh's expert axis of size {shards}"
            )
        if cfg.d_ff % model_shards(mesh):
            raise ValueError(
                f"MoEBlock: moe.d_ff={cfg.d_ff} must divide over the mesh's model axis of size {model_shards(mesh)}"
            )
        self.cfg, self.d_model, self.mesh, self.dtype = cfg, d_model, mesh, dtype
        e, d, f = cfg.num_experts, d_model, cfg.d_ff
        # Replicated, not split over `expert`: every device routes its tokens to all experts.
        self.router = _param(rngs, (d, e), d, ("embed", None), param_dtype)
        self.w_in = _param(rngs, (e, d, f), d, ("expert", "embed", "mlp"), param_dtype)
        self.w_gate = _param(rngs, (e, d, f), d, ("expert", "embed", "mlp"), param_dtype)
        self.w_out = _param(rngs, (e, f, d), f, ("expert", "mlp", "embed"), param_dtype)
        if cfg.num_shared_experts:
            fs = cfg.num_shared_experts * (cfg.shared_d_ff or cfg.d_ff)
            self.shared_w_in = _param(rngs, (d, fs), d, ("embed", "mlp"), param_dtype)
            self.shared_w_gate = _param(rngs, (d, fs), d, ("embed", "mlp"), param_dtype)
            self.shared_w_out = _param(rngs, (fs, d), fs, ("mlp", "embed"), param_dtype)
            if cfg.shared_gate:
                self.shared_gate = _param(rngs, (d, 1), d, ("embed", None), param_dtype)
        zeros = lambda shape, names: nnx.Param(jnp.zeros(shape, param_dtype), out_sharding=names,  # noqa: E731
                                               eager_sharding=False)
        if cfg.router_bias:
            self.router_bias = zeros((e,), (None,))
        if cfg.ffn_bias:  # the experts' biases (GPT-OSS), split as the products they add to
            self.b_in, self.b_gate = zeros((e, f), ("expert", "mlp")), zeros((e, f), ("expert", "mlp"))
            self.b_out = zeros((e, d), ("expert", "embed"))
        if cfg.uses_bias:
            self.expert_bias = ExpertBias(jnp.zeros((e,), jnp.float32))
        # Jitter needs fresh noise every call, so only then does the block keep an RNG stream.
        self.jitter_rngs = rngs.fork() if cfg.jitter > 0 else None

    def __call__(self, x_BxLxD: jax.Array, *, train: bool = True) -> tuple[jax.Array, dict[str, jax.Array]]:
        x_BxLxD = x_BxLxD.astype(self.dtype)
        key = self.jitter_rngs.default() if (train and self.jitter_rngs is not None) else None
        biases = (self.b_in[...], self.b_gate[...], self.b_out[...]) if self.cfg.ffn_bias else (None,) * 3
        weights = ExpertWeights(*(expert_weight(w) for w in (self.w_in, self.w_gate, self.w_out)), *biases,
                                activation=Activation.of(self.cfg))
        bias = self.expert_bias[...] if self.cfg.uses_bias else None
        router_bias = self.router_bias[...] if self.cfg.router_bias else None
        y_BxLxD, aux = moe_apply(x_BxLxD, self.router[...], weights, self.cfg, self.mesh, train=train, key=key,
                                 bias_E=bias, router_bias_E=router_bias)
        counts_E = aux.pop("expert_counts")
        if train and bias is not None:
            self.expert_bias[...] = updated_bias(bias, jax.lax.stop_gradient(counts_E), self.cfg.bias_rate)
        if self.cfg.num_shared_experts:
            shared = (self.shared_w_in[...], self.shared_w_gate[...], self.shared_w_out[...])
            shared_BxLxD = shared_ffn(x_BxLxD, *(w.astype(self.dtype) for w in shared))
            if self.cfg.shared_gate:  # Qwen2-MoE: a learned per-token share of the shared expert
                shared_BxLxD = jax.nn.sigmoid(x_BxLxD @ self.shared_gate[...].astype(self.dtype)) * shared_BxLxD
            y_BxLxD = y_BxLxD + shared_BxLxD
        return y_BxLxD, aux


def expert_weight(var: nnx.Variable):
    """What the experts read of a routed weight: its value, or a LayerOf kept whole (trainer/moe/stacked.py)."""
    value = var.get_value()
    return value if isinstance(value, LayerOf) else var[...]
