"""The routed experts' weights as one pytree (ExpertWeights) and their gating (Activation): what every expert
path takes (experts.py's batched and grouped products, tiled.py's loop)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from trainer.moe.stacked import LayerOf, read


@dataclasses.dataclass(frozen=True)
class Activation:
    """The experts' gating of their two hidden products: silu(gate) * up, or with `clamped` (GPT-OSS) gate
    clamped to at most `limit` and up to [-limit, limit], then (up + 1) * gate * sigmoid(alpha * gate)."""

    clamped: bool = False
    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, g_xF: jax.Array, h_xF: jax.Array) -> jax.Array:
        if not self.clamped:
            return jax.nn.silu(g_xF) * h_xF
        g_xF = jnp.minimum(g_xF, jnp.asarray(self.limit, g_xF.dtype))
        h_xF = jnp.clip(h_xF, -self.limit, self.limit).astype(h_xF.dtype)
        return (h_xF + 1) * (g_xF * jax.nn.sigmoid(g_xF * jnp.asarray(self.alpha, g_xF.dtype)))

    @staticmethod
    def of(cfg) -> Activation:
        """A MoEConfig's."""
        return Activation(cfg.activation == "clamped_swiglu", cfg.swiglu_alpha, cfg.swiglu_limit)


SWIGLU = Activation()
_ARRAYS = ["w_in_ExDxF", "w_gate_ExDxF", "w_out_ExFxD", "b_in_ExF", "b_gate_ExF", "b_out_ExD"]


@functools.partial(jax.tree_util.register_dataclass, data_fields=_ARRAYS, meta_fields=["activation"])
@dataclasses.dataclass(frozen=True)
class ExpertWeights:
    """The routed experts' weights (a pytree: the biases None where the experts have none) and their gating
    (static)."""

    w_in_ExDxF: jax.Array
    w_gate_ExDxF: jax.Array
    w_out_ExFxD: jax.Array
    b_in_ExF: jax.Array | None = None
    b_gate_ExF: jax.Array | None = None
    b_out_ExD: jax.Array | None = None
    activation: Activation = SWIGLU

    def cast(self, dtype) -> ExpertWeights:
        # a layer of stacked weights (trainer/moe/stacked.py) is cast as a whole: never its stack or its index
        return jax.tree.map(lambda w: w.astype(dtype), self, is_leaf=lambda w: isinstance(w, LayerOf))

    @property
    def biased(self) -> bool:
        return self.b_in_ExF is not None

    def specs(self, in_spec, out_spec, bias_spec, out_bias_spec) -> ExpertWeights:
        """The same tree of partition specs: `in_spec` for W_in and W_gate, `out_spec` for W_out, `bias_spec`
        for their biases and `out_bias_spec` for W_out's."""
        if not self.biased:
            return ExpertWeights(in_spec, in_spec, out_spec, activation=self.activation)
        return ExpertWeights(in_spec, in_spec, out_spec, bias_spec, bias_spec, out_bias_spec, self.activation)

    def read(self) -> ExpertWeights:
        """The weights as arrays (a layer of stacked weights, trainer/moe/stacked.py, read as its slice)."""
        return dataclasses.replace(self, **{f: read(getattr(self, f)) for f in _ARRAYS[:3]})
