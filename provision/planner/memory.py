"""The plan's memory per chip: the parameters, AdamW's moments, the gradients as the backward pass holds them,
FSDP's gathered layers and the activations at the step's peak (see provision/planner/__init__.py for the model
behind the figures; benchmarks/aot_topology.py holds them to the compiled steps)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from provision import catalogue
from provision.planner.estimates import GIB, Layout, Mesh, chip_layout, dtype_bytes
from trainer.arith.mesh import shard_ways
from trainer.arith.params import LAYERS_AXIS, ParamInfo
from trainer.kernels import tpu_attention

if TYPE_CHECKING:
    from trainer import config as trainer_config


def param_bytes_per_chip(params: Sequence[ParamInfo], mesh: Mesh, fsdp: bool) -> int:
    """Bytes of the parameters one chip holds, sharded as trainer.sharding shards them."""
    return sum(p.nbytes // shard_ways(p.axes, p.shape, mesh.shape(), fsdp) for p in params)


def attention_activation_bytes(cfg: trainer_config.Config, layout: Layout) -> int:
    """Kept for the backward pass by one attention sub-block: the residual (float32 in RMSNorm) and its normalised
    copy, q/k/v and the rotated q/k, the softmax (XLA's attention: float32 and its compute-dtype copy; the
    splash kernel: its log-sum-exp), the attention output and its projection."""
    m, c, t = cfg.model, dtype_bytes(cfg.dtype), layout.tokens
    n, k = _split(m.num_heads, layout.model), _split(m.kv_heads, layout.model)  # heads on this chip
    heads = m.head_size * (n + 2 * k) + m.head_size * (n + k)
    splash = tpu_attention(m.attention, layout.seq_len) == "splash"
    probs = t * n * 4 if splash else layout.rows * n * layout.seq_len ** 2 * (4 + c)
    return t * m.d_model * (4 + c) + t * heads * c + probs + t * (n * m.head_size + m.d_model) * c


def saved_by_policy(cfg: trainer_config.Config, layout: Layout, moe: bool) -> int:
    """What a rematerialised block keeps beside its input under model.remat_policy: attention's q, k, v, output and
    log-sum-exp, and the dense FFN's hidden products ("attention_ffn") or the MoE capacity path's slots, their
    tokens and the experts' outputs ("attention_moe"); "dots*": the whole block."""
    m, c, t, policy = cfg.model, dtype_bytes(cfg.dtype), layout.tokens, cfg.model.remat_policy
    if policy in ("dots", "dots_no_batch", "full"):  # the whole block, or nothing
        return (policy != "full") * (attention_activation_bytes(cfg, layout) + ffn_activation_bytes(cfg, layout, moe))
    n, k = _split(m.num_heads, layout.model), _split(m.kv_heads, layout.model)
    kept = t * m.head_size * (2 * n + 2 * k) * c + t * n * 4
    if policy == "attention_ffn" and not moe:
        kept += 2 * t * _split(m.d_ff, layout.model) * c
    moe_kept = layout.assignments * 9 + 2 * layout.expert_rows * m.d_model * c  # slots, keep, gates; tokens, outputs
    return kept + (moe_kept if policy == "attention_moe" and moe else 0)


def _split(size: int, ways: int) -> int:
    """What one chip of `ways` tensor-parallel chips holds of a dimension: a share, or all of it where
    `ways` does not divide it (replicated, as KV heads fewer than the model axis are)."""
    return size // ways if size % ways == 0 else size


def ffn_activation_bytes(cfg: trainer_config.Config, layout: Layout, moe: bool) -> int:
    """Kept by one FFN sub-block. Dense: the residual pair and the gated hidden (three [T, F]).
    MoE: router logits and probabilities (float32), the expert buffers (sent, received when experts
    are spread, hidden x3, output, returned), the float32 combine, and any shared experts."""
    m, c, t = cfg.model, dtype_bytes(cfg.dtype), layout.tokens
    stream = t * m.d_model * (4 + c)
    if not moe:
        return stream + 3 * t * _split(m.d_ff, layout.model) * c + t * m.d_model * c
    e = cfg.moe
    buffers = (4 if layout.expert_parallel else 2) * m.d_model + 3 * _split(e.d_ff, layout.model)
    shared = 3 * t * _split(e.num_shared_experts * (e.shared_d_ff or e.d_ff), layout.model) * c
    return (stream + 2 * t * e.num_experts * 4 + layout.expert_rows * buffers * c
            + e.top_k * t * m.d_model * 4 + shared)


def head_activation_bytes(cfg: trainer_config.Config, layout: Layout) -> int:
    """The head's peak: the final norm, and the float32 logits, their log-softmax and its gradient ([T, V]
    each; with train.loss_chunk, one chunk's: [rows x chunk, V]). It comes before any layer's gradient
    exists (v5e-64's 2 layers on v5litepod-8 peak there, in the forward, with two of the three,
    benchmarks/aot_topology.py; XLA:CPU holds the three in the loss's backward)."""
    return norm_bytes(cfg, layout) + 3 * logits_bytes(cfg, layout)


def norm_bytes(cfg: trainer_config.Config, layout: Layout) -> int:
    """The final norm's float32 input and its normalised copy."""
    return layout.tokens * cfg.model.d_model * (4 + dtype_bytes(cfg.dtype))


def logits_bytes(cfg: trainer_config.Config, layout: Layout) -> int:
    """One float32 [tokens, V] array (one chunk's with train.loss_chunk)."""
    return layout.rows * (cfg.train.loss_chunk or layout.seq_len) * cfg.model.vocab_size * 4


def head_kept_bytes(cfg: trainer_config.Config, layout: Layout) -> int:
    """What the head keeps through the layers' backward pass: the whole loss's float32 log-softmax (XLA
    forms the head's weight gradient from it late); a chunked loss makes each chunk's again and keeps none."""
    return 0 if cfg.train.loss_chunk else logits_bytes(cfg, layout)


def kept_bytes(cfg: trainer_config.Config, layout: Layout, remat: bool) -> tuple[int, int]:
    """(kept for the backward pass by the blocks, one block's activations recomputed at a time under remat)."""
    m = cfg.model
    attention = attention_activation_bytes(cfg, layout)
    # A block keeps what its kind keeps: one figure a kind, times its layers (the planner asks this for
    # every mesh of every slice it weighs, and a 61-layer model's blocks one by one made `plan` seconds slower).
    moe_layers = m.num_moe_layers
    count = {True: moe_layers, False: m.num_layers - moe_layers}
    block = {moe: attention + ffn_activation_bytes(cfg, layout, moe) for moe, n in count.items() if n}
    if remat:  # block inputs and what the policy keeps, and one block's activations recomputed at a time
        return (m.num_layers * layout.tokens * m.d_model * dtype_bytes(cfg.dtype)
                + sum(count[moe] * saved_by_policy(cfg, layout, moe) for moe in block)), max(block.values())
    return sum(count[moe] * size for moe, size in block.items()), 0


def activation_bytes(cfg: trainer_config.Config, layout: Layout, remat: bool, grads: int = 0) -> int:
    """Activations at the step's peak on one chip, beside `grads` bytes of gradients: the later of two
    peaks. The head's forward (what the blocks kept, and the head's logits) comes before any gradient;
    the layers' backward holds the gradients, what the blocks kept, one block recomputed under remat and
    what the head keeps (`head_kept_bytes`). Returned as that peak less `grads`."""
    kept, recomputed = kept_bytes(cfg, layout, remat)
    backward = kept + recomputed + head_kept_bytes(cfg, layout)
    return max(backward, kept + head_activation_bytes(cfg, layout) - grads)


def gradient_bytes(params: Sequence[ParamInfo], cfg: trainer_config.Config, mesh: Mesh) -> int:
    """Gradients one chip holds in the layers' backward pass. A scanned stack's (its leading axis the
    layers', more than one) are the backward scan's ys: a zero-filled buffer and the loop's own, both in
    the param dtype as sharded (moe-1b's 1.81 GiB of zeros, benchmarks/stack_grads.py; v5e-64's float32
    expert stacks twice at its peak); a stack of one is not looped: its gradient once, in the compute dtype
    where that is narrower. The embedding's and the head's are formed whole (before any reduce-scatter over
    data) in the param dtype."""
    c, total = dtype_bytes(cfg.dtype), 0
    for p in params:
        if p.axes and p.axes[0] == LAYERS_AXIS:
            ways = shard_ways(p.axes, p.shape, mesh.shape(), cfg.train.fsdp)
            total += 2 * p.nbytes // ways if p.shape[0] > 1 else p.size * min(c, dtype_bytes(p.dtype)) // ways
        else:
            total += p.nbytes // shard_ways(p.axes, p.shape, mesh.shape(), False)
    return total


def gathered_weight_bytes(params: Sequence[ParamInfo], cfg: trainer_config.Config, mesh: Mesh) -> int:
    """FSDP's weights gathered over data in the compute dtype: the layer being computed and the next one's,
    fetched ahead (two layers' worth, the largest layer's; v5e-64's expert weights, two layers' at once
    in its compiled step)."""
    if not cfg.train.fsdp or mesh.data <= 1:
        return 0
    layers: dict[str, float] = {}
    for p in params:
        if p.axes and p.axes[0] == LAYERS_AXIS:
            layer = ".".join(p.name.split(".")[:3])  # stacks.<stack>.<position in the period>
            whole = shard_ways(p.axes, p.shape, mesh.shape(), False)
            layers[layer] = layers.get(layer, 0) + p.size // p.shape[0] // whole * dtype_bytes(cfg.dtype)
    return 2 * int(max(layers.values(), default=0))


@dataclasses.dataclass(frozen=True)
class Memory:
    params: int
    grads: int
    optimizer: int
    activations: int  # with the config's remat setting
    activations_remat: int
    activations_no_remat: int
    hbm: int
    gathered: int = 0  # FSDP's layer weights gathered over data

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations + self.gathered

    @property
    def fits(self) -> bool:
        return self.total <= self.hbm

    @property
    def shortfall(self) -> int:
        """Bytes per chip over the HBM (0 when it fits)."""
        return max(0, self.total - self.hbm)


def memory_per_chip(params: Sequence[ParamInfo], cfg: trainer_config.Config, mesh: Mesh,
                    acc: catalogue.AcceleratorType) -> Memory:
    """AdamW keeps mu and nu in the param dtype (optax's default); gradients as `gradient_bytes` counts
    them, FSDP's gathered weights as `gathered_weight_bytes`, activations at the step's peak beside them."""
    weights = param_bytes_per_chip(params, mesh, cfg.train.fsdp)
    layout = chip_layout(cfg, mesh)
    grads, gathered = gradient_bytes(params, cfg, mesh), gathered_weight_bytes(params, cfg, mesh)
    with_remat = activation_bytes(cfg, layout, True, grads + gathered)
    without = activation_bytes(cfg, layout, False, grads + gathered)
    return Memory(params=weights, grads=grads, optimizer=2 * weights,
                  activations=with_remat if cfg.model.remat else without,
                  activations_remat=with_remat, activations_no_remat=without,
                  hbm=int(acc.hbm_gib_per_chip * GIB), gathered=gathered)
