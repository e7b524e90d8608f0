"""The parameters a config's model holds, listed from the config alone: names, shapes, dtypes, logical axes.

The same list trainer.params.param_inventory reads off the model built abstractly under jax (the trainer's
Transformer, trainer/model.py), written out here so that the planner needs no jax: tests/control/test_plan.py
checks that the two are equal, name for name, for every named config and the model options past them.
A config is read by attribute (trainer.config.Config); nothing of pydantic is imported.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from trainer.stacks import STACK_PREFIX, layer_stacks

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
LAYERS_AXIS = "layers"  # the stacked parameters' leading axis (trainer/stacks.py), never split


@dataclasses.dataclass(frozen=True)
class ParamInfo:
    """One parameter: its dotted name (as ParamCodec names it), shape, dtype and logical axis names."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    axes: tuple[str | None, ...]

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.size * DTYPE_BYTES[self.dtype]

    @property
    def is_expert(self) -> bool:
        """A routed expert's weight: one slice per expert along the "expert" axis."""
        return "expert" in self.axes

    @property
    def is_matrix(self) -> bool:
        """A weight tokens are multiplied by: two axes or more besides the stacked layers' (trainer/stacks.py),
        where a norm's scale is one."""
        return sum(a != LAYERS_AXIS for a in self.axes) >= 2

    @property
    def is_vocab(self) -> bool:
        """The embedding table or the output head."""
        return "vocab" in self.axes


Shapes = dict[str, tuple[tuple[int, ...], tuple[str | None, ...]]]  # name in a block -> (shape, axes)


def vocab_axis(shard_vocab: bool) -> str:
    """The logical name of the vocabulary axis: split over `model` with `train.shard_vocab`, else whole."""
    return "sharded_vocab" if shard_vocab else "vocab"


def attention_shapes(m) -> Shapes:
    """Multi-head (grouped-query) attention's parameters (trainer/layers.py's Attention) of a ModelConfig."""
    D, N, K, H = m.d_model, m.num_heads, m.kv_heads, m.head_size
    out: Shapes = {"wq": ((D, N, H), ("embed", "heads", "kv")), "wk": ((D, K, H), ("embed", "kv_heads", "kv")),
                   "wv": ((D, K, H), ("embed", "kv_heads", "kv")), "wo": ((N, H, D), ("heads", "kv", "embed"))}
    if m.qkv_bias:
        out |= {"bq": ((N, H), ("heads", "kv")), "bk": ((K, H), ("kv_heads", "kv")), "bv": ((K, H), ("kv_heads", "kv"))}
    if m.qk_norm == "full":
        out |= {"q_norm.scale": ((N, H), ("heads", "kv")), "k_norm.scale": ((K, H), ("kv_heads", "kv"))}
    elif m.qk_norm != "none":
        out |= {"q_norm.scale": ((H,), ("norm",)), "k_norm.scale": ((H,), ("norm",))}
    if m.out_bias:
        out["bo"] = ((D,), ("embed",))
    if m.attention_sinks:
        out["sinks"] = ((N,), ("heads",))
    return out


def latent_attention_shapes(m) -> Shapes:
    """Multi-head latent attention's parameters (trainer/mla.py's MLAttention) of a ModelConfig."""
    D, N, mla = m.d_model, m.num_heads, m.mla
    C, R, Q, V = mla.kv_lora_rank, mla.qk_rope_head_dim, mla.qk_head_dim, mla.v_head_dim
    out: Shapes = {}
    if mla.q_lora_rank:
        out |= {"wq_a": ((D, mla.q_lora_rank), ("embed", None)), "q_norm.scale": ((mla.q_lora_rank,), ("norm",)),
                "wq_b": ((mla.q_lora_rank, N, Q), (None, "heads", "kv"))}
    else:
        out["wq"] = ((D, N, Q), ("embed", "heads", "kv"))
    return out | {"wkv_a": ((D, C + R), ("embed", None)), "kv_norm.scale": ((C,), ("norm",)),
                  "wkv_b": ((C, N, mla.qk_nope_head_dim + V), (None, "heads", "kv")),
                  "wo": ((N, V, D), ("heads", "kv", "embed"))}


def moe_shapes(moe, d_model: int) -> Shapes:
    """A MoE block's parameters (trainer/moe/layer.py's MoEBlock) of a MoEConfig."""
    e, d, f = moe.num_experts, d_model, moe.d_ff
    out: Shapes = {"router": ((d, e), ("embed", None)), "w_in": ((e, d, f), ("expert", "embed", "mlp")),
                   "w_gate": ((e, d, f), ("expert", "embed", "mlp")), "w_out": ((e, f, d), ("expert", "mlp", "embed"))}
    if moe.num_shared_experts:
        fs = moe.num_shared_experts * (moe.shared_d_ff or moe.d_ff)
        out |= {"shared_w_in": ((d, fs), ("embed", "mlp")), "shared_w_gate": ((d, fs), ("embed", "mlp")),
                "shared_w_out": ((fs, d), ("mlp", "embed"))}
        if moe.shared_gate:
            out["shared_gate"] = ((d, 1), ("embed", None))
    if moe.router_bias:
        out["router_bias"] = ((e,), (None,))
    if moe.ffn_bias:
        out |= {"b_in": ((e, f), ("expert", "mlp")), "b_gate": ((e, f), ("expert", "mlp")),
                "b_out": ((e, d), ("expert", "embed"))}
    return out


def block_shapes(cfg, layer: int) -> Shapes:
    """Layer `layer`'s parameters (trainer/model.py's Block), named within the block."""
    m = cfg.model
    attn = latent_attention_shapes(m) if m.mla is not None else attention_shapes(m)
    if m.is_moe_layer(layer):
        ffn = moe_shapes(cfg.moe, m.d_model)
    else:
        ffn = {"w_in": ((m.d_model, m.d_ff), ("embed", "mlp")), "w_gate": ((m.d_model, m.d_ff), ("embed", "mlp")),
               "w_out": ((m.d_ff, m.d_model), ("mlp", "embed"))}
    norm = ((m.d_model,), ("norm",))
    return {"attn_norm.scale": norm, **{f"attn.{k}": v for k, v in attn.items()}, "ffn_norm.scale": norm,
            **{f"ffn.{k}": v for k, v in ffn.items()}}


def _order(name: str) -> tuple:
    """The order the model's parameters flatten in: each level's names sorted, a list's indices as numbers."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in name.split("."))


@functools.lru_cache(maxsize=64)
def inventory(cfg) -> tuple[ParamInfo, ...]:
    """Every parameter the trainer's Transformer(cfg) creates, in its order: the embedding, each stack's
    blocks (a leading "layers" axis of the stack's repeats), the final norm and the untied head."""
    m, dtype = cfg.model, cfg.param_dtype
    vocab = vocab_axis(cfg.train.shard_vocab)
    found = [ParamInfo("embed", (m.vocab_size, m.d_model), dtype, (vocab, "embed")),
             ParamInfo("final_norm.scale", (m.d_model,), dtype, ("norm",))]
    if not m.tie_embeddings:
        found.append(ParamInfo("head", (m.d_model, m.vocab_size), dtype, ("embed", vocab)))
    for s, stack in enumerate(layer_stacks(m)):
        for j in range(stack.period):
            for name, (shape, axes) in block_shapes(cfg, stack.layer(j, 0)).items():
                found.append(ParamInfo(f"{STACK_PREFIX}{s}.{j}.{name}", (stack.repeats, *shape), dtype,
                                       (LAYERS_AXIS, *axes)))
    return tuple(sorted(found, key=lambda p: _order(p.name)))
