"""Parameter counts and training FLOPs of a model, from its parameter list (trainer/arith/params.py): the one
count the trainer's MFU (trainer/flops.py) and `moe-tpu plan` both take."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from trainer.arith.kv import slot_positions
from trainer.arith.params import ParamInfo


@dataclasses.dataclass(frozen=True)
class ParamCounts:
    total: int
    active: int  # all but the routed experts a token does not visit
    per_expert: int  # one routed expert of one MoE layer
    embedding: int  # embedding table and output head
    experts: int  # every routed expert of every layer
    matmul_active: int  # the weights one token multiplies by (FLOPs: 6 per weight per token)


def count_params(params: Sequence[ParamInfo], cfg) -> ParamCounts:
    """Counts from the model's parameter list (a trainer config `cfg`, read by attribute)."""
    total = sum(p.size for p in params)
    experts = sum(p.size for p in params if p.is_expert)
    num_experts, top_k = cfg.moe.num_experts, cfg.moe.top_k
    n_moe = cfg.model.num_moe_layers
    unvisited = experts * (num_experts - top_k) // num_experts
    # The embedding lookup is a gather, not a matmul; tied, the table is also the head (one matmul).
    lookup = 0 if cfg.model.tie_embeddings else sum(p.size for p in params if p.name == "embed")
    dense = sum(p.size for p in params if p.is_matrix and not p.is_expert)
    return ParamCounts(
        total=total, active=total - unvisited, per_expert=experts // (num_experts * n_moe) if n_moe else 0,
        embedding=sum(p.size for p in params if p.is_vocab), experts=experts,
        matmul_active=dense - lookup + experts * top_k // num_experts,
    )


def attention_flops_per_token(cfg) -> float:
    """Training FLOPs of the attention scores and their weighted sum: 12 x seq_len x heads x head_size a layer
    (the PaLM convention, which counts every position for causal attention too), a sliding layer's window in
    place of seq_len where it is shorter (kv.py); with latent attention the scores take
    the q/k head size and the sum the value head size, 6 x ... x each."""
    m = cfg.model
    width = m.head_size if m.mla is None else (m.mla.qk_head_dim + m.mla.v_head_dim) / 2
    return 12.0 * slot_positions(m, cfg.data.seq_len) * m.num_heads * width


def model_flops_per_token(counts: ParamCounts, cfg) -> float:
    """Model FLOPs per token for training: 6 per active matmul weight (forward 2, backward 4), plus attention."""
    return 6.0 * counts.matmul_active + attention_flops_per_token(cfg)
