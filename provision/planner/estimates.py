"""The per-step estimates of a plan: mesh, per-chip layout, time bounds and cost (the memory per chip:
provision/planner/memory.py).

Pure functions over the trainer's model config, its parameter inventory, a mesh and a catalogue
entry (see provision/planner/__init__.py for the model behind the figures)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from provision import catalogue
from trainer.arith.counts import ParamCounts
from trainer.arith.counts import model_flops_per_token as flops_per_token
from trainer.arith.mesh import shard_ways
from trainer.arith.params import DTYPE_BYTES, ParamInfo
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


class Held(Protocol):
    """What traffic_per_chip reads of the memory per chip (provision/planner/memory.py's Memory)."""

    params: int
    activations: int


def dtype_bytes(dtype: str) -> int:
    return DTYPE_BYTES[dtype]




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
    m, e, c = cfg.model, cfg.moe, dtype_bytes(cfg.dtype)
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
    return cfg.model.num_moe_layers * passes * layout.expert_rows * cfg.model.d_model * dtype_bytes(cfg.dtype) * share


def collective_bytes(params: Sequence[ParamInfo], cfg: trainer_config.Config, mesh: Mesh) -> tuple[float, float]:
    """(ICI, DCN) bytes per chip of the gradient and FSDP collectives, as XLA compiles them for a v5e slice
    (benchmarks/aot_topology.py): FSDP's weights gathered in the compute dtype twice a step (the backward
    pass and its recompute share one) and the compute-dtype gradients reduce-scattered; replicated weights'
    gradients all-reduced; those the expert axis does not split all-reduced over it too (it splits the
    batch). Inside a slice over ICI, between slices over DCN."""
    d_ici, slices, c, experts = mesh.data_per_slice, mesh.slices, dtype_bytes(cfg.dtype), mesh.expert
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
            grad = gathered * dtype_bytes(p.dtype)
            ici += 2 * grad * (d_ici - 1) / d_ici
            dcn += 2 * grad * (slices - 1) / slices / d_ici
            shard = grad
        if experts > 1 and shard_ways(p.axes, p.shape, (("expert", experts),), False) == 1:
            ici += 2 * shard * (experts - 1) / experts
    return ici, dcn


def traffic_per_chip(params: Sequence[ParamInfo], cfg: trainer_config.Config, mesh: Mesh, memory: Held) -> Traffic:
    """HBM: the layer weights read in the forward and backward passes (again under remat) in compute
    dtype, the optimizer reading params, grads, mu, nu and writing params, mu, nu, and the kept
    activations written once and read once."""
    layout = chip_layout(cfg, mesh)
    reads = 2 + (1 if cfg.model.remat else 0)
    weights = sum(p.size / shard_ways(p.axes, p.shape, mesh.shape(), False) for p in params)
    hbm = reads * weights * dtype_bytes(cfg.dtype) + 7 * memory.params + 2 * memory.activations
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


