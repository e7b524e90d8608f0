"""The per-step estimates of a plan: mesh, per-chip layout, memory, time bounds and cost.

Pure functions over the trainer's model config, its parameter inventory, a mesh and a catalogue
entry (see provision/planner/__init__.py for the model behind the figures)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from provision import catalogue
from trainer.arith.counts import ParamCounts
from trainer.arith.counts import model_flops_per_token as flops_per_token
from trainer.arith.mesh import shard_ways
from trainer.arith.params import DTYPE_BYTES, LAYERS_AXIS, ParamInfo
from trainer.kernels import tpu_attention
from trainer.meshspec import filled, mesh_axes, text_of
from trainer.moe.config import expert_capacity

if TYPE_CHECKING:
    from trainer import config as trainer_config


GIB = 1 << 30
# Data-center network (DCN) bandwidth of v5e: 6.4 Tbps per 256-chip pod ("TPU v5e", Cloud TPU docs),
# i.e. 25 Gbps per chip (100 Gbps per 4-chip VM). Slices of a multislice job talk over it.
DCN_GBPS_PER_CHIP = 6400.0 / 256
# The most slices `advice` tries before it gives up on finding a count that fits.
MAX_SLICES = 64
# A capacity factor that must drop at least this fraction of assignments earns a warning.
DROP_WARNING = 0.1



# ----------------------------------------------------------------------------- parameters


# ParamCounts and count_params live with the trainer's MFU (trainer/arith/counts.py): one count for both.


# ----------------------------------------------------------------------------- mesh


@dataclasses.dataclass(frozen=True)
class Mesh:
    """The trainer's ("data", "expert", "model") mesh; with several slices, data spans them over DCN.
    Tokens are split over data x expert; the `model` axis (tensor parallelism) splits the FFNs' hidden
    dimension and attention's heads, and its chips hold the same tokens."""

    data: int
    expert: int
    slices: int = 1
    reason: str = ""
    model: int = 1

    @property
    def chips(self) -> int:
        return self.data * self.expert * self.model

    @property
    def token_shards(self) -> int:
        return self.data * self.expert

    @property
    def data_per_slice(self) -> int:
        return self.data // self.slices

    def shape(self) -> tuple[tuple[str, int], ...]:
        return (("data", self.data), ("expert", self.expert), ("model", self.model))

    def text(self) -> str:
        return text_of(self.data, self.expert, self.model)


def mesh_options(num_experts: int, has_moe: bool, chips: int, slices: int = 1,
                 models: Sequence[int] = (1,)) -> list[Mesh]:
    """Meshes the trainer accepts, largest expert axis first and, for each, the model axes of `models`
    (those the config can split) smallest first: the expert and model axes divide the chips of one slice
    (the all-to-all and the tensor-parallel all-reduces stay on ICI), the expert axis divides
    num_experts; every other chip goes on data."""
    per_slice = chips // slices
    top = math.gcd(num_experts, per_slice) if has_moe else 1
    return [Mesh(data=chips // (e * t), expert=e, slices=slices, model=t)
            for e in range(top, 0, -1) if top % e == 0
            for t in sorted(models) if (per_slice // e) % t == 0 and (chips // (e * t)) % slices == 0]


def target_mesh(text: str, chips: int, slices: int) -> Mesh:
    """The mesh `--mesh` text gives on the target's chips (trainer/meshspec.py reads it, as the trainer
    does); ValueError when it does not cover the chips."""
    given = mesh_axes(text)
    data, expert, model = filled(given, chips)
    if "data" not in given and chips % (expert * model):  # data fills the chips left: none may be left over
        raise ValueError(f"--mesh {text} needs a multiple of expert x model = {expert * model} chips, but the "
                         f"target has {chips}")
    if data * expert * model != chips:
        raise ValueError(f"--mesh {text} covers {data * expert * model} chips, but the target has {chips}")
    if (chips // slices) % (expert * model):
        what = f"expert={expert}" if model == 1 else f"expert x model = {expert * model}"
        raise ValueError(f"--mesh {what} must divide the {chips // slices} chips of one slice")
    given = f"expert={expert}" + (f",model={model}" if model > 1 else "")
    return Mesh(data=data, expert=expert, slices=slices, reason=f"{given}: given with --mesh", model=model)


# ----------------------------------------------------------------------------- per-chip layout


@dataclasses.dataclass(frozen=True)
class Layout:
    """What one chip holds of one step: its batch rows and its expert buffer rows per MoE layer."""

    rows: int
    seq_len: int
    expert_rows: int  # token rows through the experts of one MoE layer on this chip (slots, padding included)
    assignments: int  # token-to-expert assignments routed from this chip's tokens per MoE layer
    expert_parallel: bool
    model: int = 1  # the tensor-parallel ways: hidden activations split this many ways, the rest whole

    @property
    def tokens(self) -> int:
        return self.rows * self.seq_len


def routing_groups(cfg: trainer_config.Config, mesh: Mesh) -> int:
    """Groups capacity is counted in (MoEConfig.routing_groups): default one per token shard."""
    return cfg.moe.routing_groups or mesh.token_shards


def chip_layout(cfg: trainer_config.Config, mesh: Mesh) -> Layout:
    rows = max(1, -(-cfg.data.global_batch_size // mesh.token_shards))
    tokens = rows * cfg.data.seq_len
    moe = cfg.moe
    assignments = tokens * moe.top_k
    if moe.is_dropless(train=True):
        expert_rows = assignments
    else:
        groups = routing_groups(cfg, mesh)
        group_tokens = max(1, cfg.data.global_batch_size * cfg.data.seq_len // groups)
        capacity = expert_capacity(group_tokens, moe.top_k, moe.capacity_factor, moe.num_experts, moe.min_capacity)
        expert_rows = max(1, groups // mesh.token_shards) * moe.num_experts * capacity
    return Layout(rows=rows, seq_len=cfg.data.seq_len, expert_rows=expert_rows, assignments=assignments,
                  expert_parallel=mesh.expert > 1, model=mesh.model)


def min_drop_fraction(layout: Layout, cfg: trainer_config.Config) -> float:
    """The fraction of assignments that overflow even when routing is perfectly balanced."""
    if cfg.moe.is_dropless(train=True) or cfg.moe.routing != "token_choice":
        return 0.0
    return max(0.0, 1.0 - layout.expert_rows / layout.assignments)


# ----------------------------------------------------------------------------- memory


def _bytes(dtype: str) -> int:
    return DTYPE_BYTES[dtype]


def param_bytes_per_chip(params: Sequence[ParamInfo], mesh: Mesh, fsdp: bool) -> int:
    """Bytes of the parameters one chip holds, sharded as trainer.sharding shards them."""
    return sum(p.nbytes // shard_ways(p.axes, p.shape, mesh.shape(), fsdp) for p in params)


def attention_activation_bytes(cfg: trainer_config.Config, layout: Layout) -> int:
    """Kept for the backward pass by one attention sub-block: the residual (float32 in RMSNorm) and its normalised
    copy, q/k/v and the rotated q/k, the softmax (XLA's attention: float32 and its compute-dtype copy; the
    splash kernel: its log-sum-exp), the attention output and its projection."""
    m, c, t = cfg.model, _bytes(cfg.dtype), layout.tokens
    n, k = _split(m.num_heads, layout.model), _split(m.kv_heads, layout.model)  # heads on this chip
    heads = m.head_size * (n + 2 * k) + m.head_size * (n + k)
    splash = tpu_attention(m.attention, layout.seq_len) == "splash"
    probs = t * n * 4 if splash else layout.rows * n * layout.seq_len ** 2 * (4 + c)
    return t * m.d_model * (4 + c) + t * heads * c + probs + t * (n * m.head_size + m.d_model) * c


def saved_by_policy(cfg: trainer_config.Config, layout: Layout, moe: bool) -> int:
    """What a rematerialised block keeps beside its input under model.remat_policy: attention's q, k, v, output and
    log-sum-exp, and the dense FFN's hidden products ("attention_ffn") or the MoE capacity path's slots, their
    tokens and the experts' outputs ("attention_moe"); "dots*": the whole block."""
    m, c, t, policy = cfg.model, _bytes(cfg.dtype), layout.tokens, cfg.model.remat_policy
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
    m, c, t = cfg.model, _bytes(cfg.dtype), layout.tokens
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
    return layout.tokens * cfg.model.d_model * (4 + _bytes(cfg.dtype))


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
        return (m.num_layers * layout.tokens * m.d_model * _bytes(cfg.dtype)
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
    c, total = _bytes(cfg.dtype), 0
    for p in params:
        if p.axes and p.axes[0] == LAYERS_AXIS:
            ways = shard_ways(p.axes, p.shape, mesh.shape(), cfg.train.fsdp)
            total += 2 * p.nbytes // ways if p.shape[0] > 1 else p.size * min(c, _bytes(p.dtype)) // ways
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
            layers[layer] = layers.get(layer, 0) + p.size // p.shape[0] // whole * _bytes(cfg.dtype)
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


# ----------------------------------------------------------------------------- speed


def hardware_flops_per_chip(counts: ParamCounts, cfg: trainer_config.Config, layout: Layout, chips: int) -> float:
    """FLOPs one chip executes per step: the model's, plus the expert slots computed beyond top_k
    (capacity padding), plus the forward pass again under remat."""
    tokens = cfg.data.global_batch_size * cfg.data.seq_len
    model = flops_per_token(counts, cfg) * tokens
    routed = 6.0 * counts.experts / max(cfg.moe.num_experts, 1) * cfg.moe.top_k * tokens
    padding = routed * (layout.expert_rows / layout.assignments - 1.0)
    total = model + padding
    return total * (4.0 / 3.0 if cfg.model.remat else 1.0) / chips


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Bytes one chip moves per step: through HBM, over ICI (all-to-all and the rest), over DCN."""

    hbm: float
    all_to_all: float
    ici: float
    dcn: float
    tensor_parallel: float = 0.0  # of ici: the all-reduces over `model`


def tensor_parallel_bytes(cfg: trainer_config.Config, layout: Layout) -> float:
    """Bytes one chip all-reduces over the `model` axis per step (the payload, as the compiled step's
    all-reduces hold it; a ring moves 2 (T - 1) / T of it in and out). Per layer, forward: attention's
    output and the FFN's, one [tokens, D] each (the MoE block's in float32: its partial sums of the
    combined tokens; shared experts one more); backward: attention's input gradient once (q, k and v are
    one product when `model` splits the KV heads too; three when they are replicated), the dense FFN's
    once per input projection (2), the MoE block's input gradient and its gates' [tokens, k] float32.
    Under remat the forward's twice."""
    if layout.model <= 1:
        return 0.0
    m, e, c = cfg.model, cfg.moe, _bytes(cfg.dtype)
    rows = layout.tokens * m.d_model
    attention = (1 if m.kv_heads % layout.model == 0 else 3) * rows * c
    total = 0.0
    for i in range(m.num_layers):
        if m.is_moe_layer(i):
            shared = rows * c if e.num_shared_experts else 0
            forward = rows * c + rows * 4 + shared
            backward = attention + rows * c + layout.tokens * e.top_k * 4 + 2 * shared
        else:
            forward, backward = 2 * rows * c, attention + 2 * rows * c
        total += forward * (2 if m.remat else 1) + backward
    return total


def all_to_all_bytes(cfg: trainer_config.Config, layout: Layout, mesh: Mesh) -> float:
    """Expert buffers leaving the chip: two exchanges forward, two backward (and two more under remat);
    of each buffer, the (E - 1) / E that belongs to other chips."""
    if mesh.expert <= 1:
        return 0.0
    passes = 4 + (2 if cfg.model.remat else 0)
    share = (mesh.expert - 1) / mesh.expert
    return cfg.model.num_moe_layers * passes * layout.expert_rows * cfg.model.d_model * _bytes(cfg.dtype) * share


def collective_bytes(params: Sequence[ParamInfo], cfg: trainer_config.Config, mesh: Mesh) -> tuple[float, float]:
    """(ICI, DCN) bytes per chip of the gradient and FSDP collectives, as XLA compiles them for a v5e slice
    (benchmarks/aot_topology.py): FSDP's weights gathered in the compute dtype twice a step (the backward
    pass and its recompute share one) and the compute-dtype gradients reduce-scattered; replicated weights'
    gradients all-reduced; those the expert axis does not split all-reduced over it too (it splits the
    batch). Inside a slice over ICI, between slices over DCN."""
    d_ici, slices, c, experts = mesh.data_per_slice, mesh.slices, _bytes(cfg.dtype), mesh.expert
    ici = dcn = 0.0
    for p in params:
        whole = shard_ways(p.axes, p.shape, mesh.shape(), False)
        ways = shard_ways(p.axes, p.shape, mesh.shape(), cfg.train.fsdp)
        gathered = p.size / whole  # elements per chip once gathered over data
        if ways > whole:  # sharded over data: gather in compute dtype, reduce-scatter the gradient
            moved = gathered * 3 * c
            ici += moved * (d_ici - 1) / d_ici
            dcn += moved * (slices - 1) / mesh.data
            shard = gathered * c * whole / ways
        else:
            grad = gathered * _bytes(p.dtype)
            ici += 2 * grad * (d_ici - 1) / d_ici
            dcn += 2 * grad * (slices - 1) / slices / d_ici
            shard = grad
        if experts > 1 and shard_ways(p.axes, p.shape, (("expert", experts),), False) == 1:
            ici += 2 * shard * (experts - 1) / experts
    return ici, dcn


def traffic_per_chip(params: Sequence[ParamInfo], cfg: trainer_config.Config, mesh: Mesh, memory: Memory) -> Traffic:
    """HBM: the layer weights read in the forward and backward passes (again under remat) in compute
    dtype, the optimizer reading params, grads, mu, nu and writing params, mu, nu, and the kept
    activations written once and read once."""
    layout = chip_layout(cfg, mesh)
    reads = 2 + (1 if cfg.model.remat else 0)
    weights = sum(p.size / shard_ways(p.axes, p.shape, mesh.shape(), False) for p in params)
    hbm = reads * weights * _bytes(cfg.dtype) + 7 * memory.params + 2 * memory.activations
    a2a = all_to_all_bytes(cfg, layout, mesh)
    ici, dcn = collective_bytes(params, cfg, mesh)
    tp = tensor_parallel_bytes(cfg, layout) * 2 * (mesh.model - 1) / mesh.model
    return Traffic(hbm=hbm, all_to_all=a2a, ici=a2a + ici + tp, dcn=dcn, tensor_parallel=tp)


# The share of peak bf16 FLOP/s the train step reached where compute-bound: moe-1b on one v5e chip, 311.1 ms
# against the plan's 209 ms bound (`bash benchmarks/on_chip.sh levers`, moe-1b as written, 2026-12-06 evening).
COMPUTE_EFFICIENCY = 0.67


@dataclasses.dataclass(frozen=True)
class StepBounds:
    compute_s: float
    hbm_s: float
    ici_s: float
    dcn_s: float

    @property
    def lower_bound_s(self) -> float:
        return max(self.compute_s, self.hbm_s, self.ici_s, self.dcn_s)

    @property
    def expected_s(self) -> float:
        """The step to expect: the compute bound at COMPUTE_EFFICIENCY, or a longer traffic bound."""
        return max(self.compute_s / COMPUTE_EFFICIENCY, self.hbm_s, self.ici_s, self.dcn_s)

    @property
    def bound_by(self) -> str:
        named = {"compute": self.compute_s, "HBM": self.hbm_s, "ICI": self.ici_s, "DCN": self.dcn_s}
        return max(named, key=named.__getitem__)


def hbm_bytes_per_s(acc: catalogue.AcceleratorType) -> float:
    return acc.hbm_gbps_per_chip * 1e9  # the catalogue's HBM figure is in gigabytes per second


def ici_bytes_per_s(acc: catalogue.AcceleratorType) -> float:
    return acc.ici_gbps_per_chip / 8 * 1e9  # the catalogue's ICI figure is in gigabits per second


def step_bounds(flops_per_chip: float, traffic: Traffic, acc: catalogue.AcceleratorType) -> StepBounds:
    return StepBounds(
        compute_s=flops_per_chip / (acc.peak_bf16_tflops_per_chip * 1e12),
        hbm_s=traffic.hbm / hbm_bytes_per_s(acc),
        ici_s=traffic.ici / ici_bytes_per_s(acc),
        dcn_s=traffic.dcn / (DCN_GBPS_PER_CHIP / 8 * 1e9),
    )


def mfu_ceiling(model_flops_per_step: float, step_s: float, chips: int, acc: catalogue.AcceleratorType) -> float:
    """Model FLOPs over what the chips could do in the fastest possible step."""
    return model_flops_per_step / (step_s * chips * acc.peak_bf16_tflops_per_chip * 1e12)


# ----------------------------------------------------------------------------- cost


@dataclasses.dataclass(frozen=True)
class Cost:
    capacity: str
    per_hour: float
    per_hour_on_demand: float
    per_hour_spot: float
    steps: int
    run_s: float

    def run_usd(self, per_hour: float) -> float:
        return per_hour * self.run_s / 3600


def cost(chips: int, capacity: str, steps: int, step_s: float) -> Cost:
    """Catalogue prices per chip-hour times the chips of every slice; the run at the step-time bound."""
    return Cost(
        capacity=capacity, per_hour=chips * catalogue.price_per_chip_hour(capacity),
        per_hour_on_demand=chips * catalogue.price_per_chip_hour("on-demand"),
        per_hour_spot=chips * catalogue.price_per_chip_hour("spot"), steps=steps, run_s=steps * step_s,
    )


