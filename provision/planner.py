"""`moe-tpu plan`: will this MoE fit on this slice, how fast can it go, what will it cost.

Pure functions over typed inputs: the trainer's model config, the parameters the trainer instantiates
(trainer.params, built abstractly), a mesh and a catalogue entry. Only `plan_for` and `verdict` read
files. jax starts lazily, inside trainer.params and the trainer's config loader, so importing this module
(and `moe-tpu --help`) stays cheap.

The model behind the figures, per chip and per train step:
- memory: parameters, gradients (param dtype) and AdamW's mu and nu (param dtype, as optax keeps
  them), sharded as trainer.sharding shards them; activations from the shapes the trainer's layers
  create (`attention_activation_bytes`, `ffn_activation_bytes`, `head_activation_bytes`); with remat
  only the block inputs are kept, plus one block recomputed at a time.
- time: lower bounds, each resource used at its peak and perfectly overlapped: matmul FLOPs over the
  bf16 peak, bytes that must cross HBM, bytes of the expert all-to-all and the data-parallel
  collectives over ICI, and over DCN between slices. The step can be no faster than the slowest.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from provision import catalogue
from provision.errors import MissingDependency, UsageError
from trainer.flops import ParamCounts, attention_flops_per_token, count_params
from trainer.flops import model_flops_per_token as flops_per_token
from trainer.params import DTYPE_BYTES, ParamInfo, shard_ways

if TYPE_CHECKING:
    from provision.config import Config
    from trainer.config import Config as ModelConfig

GIB = 1 << 30
# Data-center network (DCN) bandwidth of v5e: 6.4 Tbps per 256-chip pod ("TPU v5e", Cloud TPU docs),
# i.e. 25 Gbps per chip (100 Gbps per 4-chip VM). Slices of a multislice job talk over it.
DCN_GBPS_PER_CHIP = 6400.0 / 256
# The most slices `advice` tries before it gives up on finding a count that fits.
MAX_SLICES = 64
# A capacity factor that must drop at least this fraction of assignments earns a warning.
DROP_WARNING = 0.1


# ----------------------------------------------------------------------------- parameters


# ParamCounts and count_params live with the trainer's MFU (trainer/flops.py): one count for both.


# ----------------------------------------------------------------------------- mesh


@dataclasses.dataclass(frozen=True)
class Mesh:
    """The trainer's ("data", "expert") mesh; with several slices, data spans them over DCN."""

    data: int
    expert: int
    slices: int = 1
    reason: str = ""

    @property
    def chips(self) -> int:
        return self.data * self.expert

    @property
    def data_per_slice(self) -> int:
        return self.data // self.slices

    def shape(self) -> tuple[tuple[str, int], ...]:
        return (("data", self.data), ("expert", self.expert))

    def text(self) -> str:
        return f"data={self.data},expert={self.expert}"


def mesh_options(num_experts: int, has_moe: bool, chips: int, slices: int = 1) -> list[Mesh]:
    """Meshes the trainer accepts, largest expert axis first: the expert axis divides num_experts and
    the chips of one slice (the all-to-all stays on ICI); every other chip goes on data."""
    per_slice = chips // slices
    top = math.gcd(num_experts, per_slice) if has_moe else 1
    return [Mesh(data=chips // e, expert=e, slices=slices) for e in range(top, 0, -1) if top % e == 0]


def parse_mesh(text: str, chips: int, slices: int) -> Mesh:
    """`data=D,expert=E` (either may be left out); ValueError when it does not cover the chips."""
    given: dict[str, int] = {}
    for part in text.split(","):
        key, _, value = (s.strip() for s in part.partition("="))
        if key not in ("data", "expert") or not value.isdigit() or int(value) < 1 or key in given:
            raise ValueError(f"--mesh expects data=D,expert=E with positive integers, got {text!r}")
        given[key] = int(value)
    expert = given.get("expert", chips // given["data"] if "data" in given else 1)
    data = given.get("data", chips // expert)
    if data * expert != chips:
        raise ValueError(f"--mesh {text} covers {data * expert} chips, but the target has {chips}")
    if (chips // slices) % expert:
        raise ValueError(f"--mesh expert={expert} must divide the {chips // slices} chips of one slice")
    return Mesh(data=data, expert=expert, slices=slices, reason=f"expert={expert}: given with --mesh")


# ----------------------------------------------------------------------------- per-chip layout


def expert_capacity(num_tokens: int, top_k: int, capacity_factor: float, num_experts: int, min_capacity: int) -> int:
    """Slots per expert and routing group, as trainer.moe.capacity.expert_capacity counts them."""
    capacity = math.ceil(num_tokens * top_k * capacity_factor / num_experts)
    return max(1, min(num_tokens, max(min_capacity, capacity)))


@dataclasses.dataclass(frozen=True)
class Layout:
    """What one chip holds of one step: its batch rows and its expert buffer rows per MoE layer."""

    rows: int
    seq_len: int
    expert_rows: int  # token rows through the experts of one MoE layer on this chip (slots, padding included)
    assignments: int  # token-to-expert assignments routed from this chip's tokens per MoE layer
    expert_parallel: bool

    @property
    def tokens(self) -> int:
        return self.rows * self.seq_len


def routing_groups(cfg: ModelConfig, mesh: Mesh) -> int:
    """Groups capacity is counted in (MoEConfig.routing_groups): default one per chip's token shard."""
    return cfg.moe.routing_groups or mesh.chips


def chip_layout(cfg: ModelConfig, mesh: Mesh) -> Layout:
    rows = max(1, -(-cfg.data.global_batch_size // mesh.chips))
    tokens = rows * cfg.data.seq_len
    moe = cfg.moe
    assignments = tokens * moe.top_k
    if moe.is_dropless(train=True):
        expert_rows = assignments
    else:
        groups = routing_groups(cfg, mesh)
        group_tokens = max(1, cfg.data.global_batch_size * cfg.data.seq_len // groups)
        capacity = expert_capacity(group_tokens, moe.top_k, moe.capacity_factor, moe.num_experts, moe.min_capacity)
        expert_rows = max(1, groups // mesh.chips) * moe.num_experts * capacity
    return Layout(rows=rows, seq_len=cfg.data.seq_len, expert_rows=expert_rows, assignments=assignments,
                  expert_parallel=mesh.expert > 1)


def min_drop_fraction(layout: Layout, cfg: ModelConfig) -> float:
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


def attention_activation_bytes(cfg: ModelConfig, layout: Layout) -> int:
    """Kept for the backward pass by one attention sub-block: the residual (float32 in RMSNorm) and its
    normalised copy, q/k/v and the rotated q/k, the softmax (float32 and its compute-dtype copy), the
    attention output and its projection."""
    m, c, t = cfg.model, _bytes(cfg.dtype), layout.tokens
    heads = m.head_size * (m.num_heads + 2 * m.kv_heads) + m.head_size * (m.num_heads + m.kv_heads)
    probs = layout.rows * m.num_heads * layout.seq_len ** 2 * (4 + c)
    return t * m.d_model * (4 + c) + t * heads * c + probs + t * (m.num_heads * m.head_size + m.d_model) * c


def ffn_activation_bytes(cfg: ModelConfig, layout: Layout, moe: bool) -> int:
    """Kept by one FFN sub-block. Dense: the residual pair and the gated hidden (three [T, F]).
    MoE: router logits and probabilities (float32), the expert buffers (sent, received when experts
    are spread, hidden x3, output, returned), the float32 combine, and any shared experts."""
    m, c, t = cfg.model, _bytes(cfg.dtype), layout.tokens
    stream = t * m.d_model * (4 + c)
    if not moe:
        return stream + 3 * t * m.d_ff * c + t * m.d_model * c
    e = cfg.moe
    buffers = (4 if layout.expert_parallel else 2) * m.d_model + 3 * e.d_ff
    shared = 3 * t * e.num_shared_experts * (e.shared_d_ff or e.d_ff) * c
    return (stream + 2 * t * e.num_experts * 4 + layout.expert_rows * buffers * c
            + e.top_k * t * m.d_model * 4 + shared)


def head_activation_bytes(cfg: ModelConfig, layout: Layout) -> int:
    """The final norm, and the float32 logits, their log-softmax and its gradient ([T, V] each)."""
    t = layout.tokens
    return t * cfg.model.d_model * (4 + _bytes(cfg.dtype)) + 3 * t * cfg.model.vocab_size * 4


def activation_bytes(cfg: ModelConfig, layout: Layout, remat: bool) -> int:
    """Activations alive at the peak of the backward pass on one chip."""
    m = cfg.model
    attention = attention_activation_bytes(cfg, layout)
    blocks = [attention + ffn_activation_bytes(cfg, layout, m.is_moe_layer(i)) for i in range(m.num_layers)]
    if remat:  # block inputs only, and one block's activations recomputed at a time
        kept = m.num_layers * layout.tokens * m.d_model * _bytes(cfg.dtype) + max(blocks)
    else:
        kept = sum(blocks)
    return kept + head_activation_bytes(cfg, layout)


@dataclasses.dataclass(frozen=True)
class Memory:
    params: int
    grads: int
    optimizer: int
    activations: int  # with the config's remat setting
    activations_remat: int
    activations_no_remat: int
    hbm: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.activations

    @property
    def fits(self) -> bool:
        return self.total <= self.hbm

    @property
    def shortfall(self) -> int:
        """Bytes per chip over the HBM (0 when it fits)."""
        return max(0, self.total - self.hbm)


def memory_per_chip(params: Sequence[ParamInfo], cfg: ModelConfig, mesh: Mesh,
                    acc: catalogue.AcceleratorType) -> Memory:
    """Gradients are in the param dtype; AdamW keeps mu and nu in it too (optax's default)."""
    weights = param_bytes_per_chip(params, mesh, cfg.train.fsdp)
    layout = chip_layout(cfg, mesh)
    with_remat, without = activation_bytes(cfg, layout, True), activation_bytes(cfg, layout, False)
    return Memory(params=weights, grads=weights, optimizer=2 * weights,
                  activations=with_remat if cfg.model.remat else without,
                  activations_remat=with_remat, activations_no_remat=without,
                  hbm=int(acc.hbm_gib_per_chip * GIB))


# ----------------------------------------------------------------------------- speed


def hardware_flops_per_chip(counts: ParamCounts, cfg: ModelConfig, layout: Layout, chips: int) -> float:
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


def all_to_all_bytes(cfg: ModelConfig, layout: Layout, mesh: Mesh) -> float:
    """Expert buffers leaving the chip: two exchanges forward, two backward (and two more under remat);
    of each buffer, the (E - 1) / E that belongs to other chips."""
    if mesh.expert <= 1:
        return 0.0
    passes = 4 + (2 if cfg.model.remat else 0)
    share = (mesh.expert - 1) / mesh.expert
    return cfg.model.num_moe_layers * passes * layout.expert_rows * cfg.model.d_model * _bytes(cfg.dtype) * share


def collective_bytes(params: Sequence[ParamInfo], cfg: ModelConfig, mesh: Mesh) -> tuple[float, float]:
    """(ICI, DCN) bytes per chip of the data-axis collectives: weights FSDP shards over data are
    all-gathered for the forward and backward passes (and the recompute) and their gradients
    reduce-scattered; weights replicated over data get their gradients all-reduced. Hierarchical:
    inside a slice over ICI, between slices over DCN."""
    d_ici, slices, c = mesh.data_per_slice, mesh.slices, _bytes(cfg.dtype)
    gathers = 2 + (1 if cfg.model.remat else 0)
    ici = dcn = 0.0
    for p in params:
        whole = shard_ways(p.axes, p.shape, mesh.shape(), False)
        ways = shard_ways(p.axes, p.shape, mesh.shape(), cfg.train.fsdp)
        gathered = p.size / whole  # elements per chip once gathered over data
        if ways > whole:  # sharded over data: gather in compute dtype, reduce-scatter the gradient
            moved = gathered * (gathers * c + _bytes(p.dtype))
            ici += moved * (d_ici - 1) / d_ici
            dcn += moved * (slices - 1) / mesh.data
        else:
            grad = gathered * _bytes(p.dtype)
            ici += 2 * grad * (d_ici - 1) / d_ici
            dcn += 2 * grad * (slices - 1) / slices / d_ici
    return ici, dcn


def traffic_per_chip(params: Sequence[ParamInfo], cfg: ModelConfig, mesh: Mesh, memory: Memory) -> Traffic:
    """HBM: the layer weights read in the forward and backward passes (again under remat) in compute
    dtype, the optimizer reading params, grads, mu, nu and writing params, mu, nu, and the kept
    activations written once and read once."""
    layout = chip_layout(cfg, mesh)
    reads = 2 + (1 if cfg.model.remat else 0)
    weights = sum(p.size / shard_ways(p.axes, p.shape, mesh.shape(), False) for p in params)
    hbm = reads * weights * _bytes(cfg.dtype) + 7 * memory.params + 2 * memory.activations
    a2a = all_to_all_bytes(cfg, layout, mesh)
    ici, dcn = collective_bytes(params, cfg, mesh)
    return Traffic(hbm=hbm, all_to_all=a2a, ici=a2a + ici, dcn=dcn)


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
    def bound_by(self) -> str:
        named = {"compute": self.compute_s, "HBM": self.hbm_s, "ICI": self.ici_s, "DCN": self.dcn_s}
        return max(named, key=named.__getitem__)


def step_bounds(flops_per_chip: float, traffic: Traffic, acc: catalogue.AcceleratorType) -> StepBounds:
    return StepBounds(
        compute_s=flops_per_chip / (acc.peak_bf16_tflops_per_chip * 1e12),
        hbm_s=traffic.hbm / (acc.hbm_gbps_per_chip * 1e9),
        ici_s=traffic.ici / (acc.ici_gbps_per_chip / 8 * 1e9),
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


# ----------------------------------------------------------------------------- target, advice, warnings


@dataclasses.dataclass(frozen=True)
class Target:
    accelerator: catalogue.AcceleratorType
    slices: int
    capacity: str  # a catalogue price: on-demand, spot or reserved

    @property
    def chips(self) -> int:
        return self.accelerator.chips * self.slices


# Vertex scheduling -> the price it is billed at (FLEX_START: at most the on-demand price).
_VERTEX_CAPACITY = {"STANDARD": "on-demand", "SPOT": "spot", "FLEX_START": "on-demand"}


def target_of(cfg: Config, accelerator: str | None = None, slices: int | None = None) -> Target:
    """The slice the config asks for (tpu-vm: slice.accelerator x slice.count; vertex: the topology),
    or the one given on the command line."""
    if cfg.target == "vertex":
        acc = catalogue.accelerator_for_topology(cfg.vertex.topology)
        capacity, count = _VERTEX_CAPACITY[cfg.vertex.scheduling], 1
    else:
        acc, capacity, count = cfg.accelerator_type(), cfg.slice.capacity, cfg.slice.count
    if accelerator is not None:
        acc = catalogue.accelerator(accelerator)
    if acc is None:
        raise ValueError(f"no v5e accelerator type has topology {cfg.vertex.topology!r}")
    return Target(accelerator=acc, slices=slices or count, capacity=capacity)


def choose_mesh(params: Sequence[ParamInfo], cfg: ModelConfig, acc: catalogue.AcceleratorType,
                slices: int = 1) -> tuple[Mesh, Memory]:
    """The largest expert axis (of `mesh_options`) whose memory fits; if none fits, the one that needs
    least. With FSDP a smaller expert axis leaves more data ways to shard the dense weights over."""
    options = mesh_options(cfg.moe.num_experts, cfg.model.num_moe_layers > 0, acc.chips * slices, slices)
    memories = [memory_per_chip(params, cfg, mesh, acc) for mesh in options]
    fitting = [i for i, memory in enumerate(memories) if memory.fits]
    best = fitting[0] if fitting else min(range(len(options)), key=lambda i: memories[i].total)
    per_slice = f"{acc.chips} chips{' per slice' if slices > 1 else ''}"
    divisor = f"the largest divisor of {cfg.moe.num_experts} experts that divides {per_slice}"
    if cfg.model.num_moe_layers == 0:
        reason = "no MoE layers: every chip on data"
    elif not fitting:
        reason = "no expert axis fits; this one needs the least memory per chip"
    elif best == 0:
        reason = divisor
    else:
        larger = ", ".join(str(m.expert) for m in options[:best])
        reason = f"{divisor} and fits; expert={larger} need{'s' if best == 1 else ''} more memory per chip"
    return dataclasses.replace(options[best], reason=f"expert={options[best].expert}: {reason}"), memories[best]


def fits_on(params: Sequence[ParamInfo], cfg: ModelConfig, acc: catalogue.AcceleratorType, slices: int) -> bool:
    options = mesh_options(cfg.moe.num_experts, cfg.model.num_moe_layers > 0, acc.chips * slices, slices)
    return any(memory_per_chip(params, cfg, mesh, acc).fits for mesh in options)


@dataclasses.dataclass(frozen=True)
class Advice:
    smallest_slice: catalogue.AcceleratorType | None  # the smallest single slice that fits
    slices_needed: int | None  # how many slices of the target's type fit (None: not within MAX_SLICES)
    accelerator: catalogue.AcceleratorType


def advise(params: Sequence[ParamInfo], cfg: ModelConfig, acc: catalogue.AcceleratorType) -> Advice:
    by_size = sorted(catalogue.ACCELERATORS.values(), key=lambda a: a.chips)
    smallest = next((a for a in by_size if fits_on(params, cfg, a, 1)), None)
    needed = next((s for s in range(1, MAX_SLICES + 1) if fits_on(params, cfg, acc, s)), None)
    return Advice(smallest_slice=smallest, slices_needed=needed, accelerator=acc)


def warnings_for(cfg: ModelConfig, mesh: Mesh, layout: Layout, bounds: StepBounds) -> list[str]:
    """What would stop the run or waste the slice."""
    found: list[str] = []
    e, batch = cfg.moe, cfg.data.global_batch_size
    has_moe = cfg.model.num_moe_layers > 0
    if has_moe and e.num_experts % mesh.expert:
        found.append(f"{e.num_experts} experts do not divide over the expert axis of {mesh.expert}: "
                     "the trainer refuses this mesh")
    if has_moe and mesh.expert == 1 and e.num_experts > 1:
        held = ("every chip gathers all of them (FSDP) for every step" if cfg.train.fsdp and mesh.data > 1
                else "they are replicated on every chip")
        found.append(f"expert axis of 1: no expert parallelism for {e.num_experts} experts; {held}")
    if has_moe and routing_groups(cfg, mesh) % mesh.chips:
        found.append(f"moe.routing_groups={e.routing_groups} is not a multiple of the {mesh.chips} token "
                     "shards: the trainer refuses it")
    drop = min_drop_fraction(layout, cfg) if has_moe else 0.0
    if drop >= DROP_WARNING:
        most = "most tokens' assignments" if drop > 0.5 else "assignments"
        found.append(f"capacity factor {e.capacity_factor:g} drops {most}: at least {drop:.0%} even with "
                     "perfectly balanced routing")
    if batch < mesh.chips:
        found.append(f"batch too small: {batch} rows for {mesh.chips} chips leaves {mesh.chips - batch} "
                     "chips without data (and the trainer refuses it)")
    elif batch % mesh.chips:
        found.append(f"data.global_batch_size={batch} is not a multiple of the {mesh.chips} chips: the "
                     "trainer refuses it")
    if bounds.bound_by == "DCN":
        gathers = " and FSDP's weight gathers" if cfg.train.fsdp else ""
        found.append(f"the step is bound by DCN between slices: gradient reductions{gathers} cross the "
                     f"{mesh.slices} slices every step")
    if bounds.bound_by == "HBM":
        found.append(f"{layout.tokens} tokens per chip are too few to keep the chips busy: the step is "
                     "bound by HBM bandwidth, not compute; a larger batch would fill them")
    return found


# ----------------------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True)
class Plan:
    model_name: str
    model: ModelConfig
    counts: ParamCounts
    target: Target
    mesh: Mesh
    memory: Memory
    flops_per_token: float
    traffic: Traffic
    bounds: StepBounds
    mfu_ceiling: float
    cost: Cost
    advice: Advice
    warnings: tuple[str, ...]

    @property
    def fits(self) -> bool:
        return self.memory.fits

    @property
    def tokens_per_step(self) -> int:
        return self.model.data.global_batch_size * self.model.data.seq_len

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.bounds.lower_bound_s


def make_plan(params: Sequence[ParamInfo], cfg: ModelConfig, target: Target, steps: int,
              mesh: Mesh | None = None) -> Plan:
    """Every figure for one model on one target; `mesh` None: `choose_mesh` picks it."""
    acc = target.accelerator
    mesh = mesh or choose_mesh(params, cfg, acc, target.slices)[0]
    counts = count_params(params, cfg)
    layout = chip_layout(cfg, mesh)
    memory = memory_per_chip(params, cfg, mesh, acc)
    traffic = traffic_per_chip(params, cfg, mesh, memory)
    bounds = step_bounds(hardware_flops_per_chip(counts, cfg, layout, mesh.chips), traffic, acc)
    per_token = flops_per_token(counts, cfg)
    tokens = cfg.data.global_batch_size * cfg.data.seq_len
    return Plan(
        model_name=cfg.name, model=cfg, counts=counts, target=target, mesh=mesh, memory=memory,
        flops_per_token=per_token, traffic=traffic, bounds=bounds,
        mfu_ceiling=mfu_ceiling(per_token * tokens, bounds.lower_bound_s, mesh.chips, acc),
        cost=cost(target.chips, target.capacity, steps, bounds.lower_bound_s),
        advice=advise(params, cfg, acc), warnings=tuple(warnings_for(cfg, mesh, layout, bounds)),
    )


def load_model_config(cfg: Config, model: str | None = None) -> ModelConfig:
    """The trainer config the run would use: `trainer.config` (or `model`) with `trainer.overrides`.
    A relative path is looked up from the working directory, then beside the config file."""
    from trainer.config import load_config

    name = model or cfg.trainer.config
    path = Path(name)
    if not path.is_absolute() and not path.exists() and (Path(cfg.source).parent / path).exists():
        name = str(Path(cfg.source).parent / path)
    overrides = [flag for flag in cfg.trainer.set_flags() if flag != "--set"]
    return load_config(name, overrides)


def mesh_problems(cfg: Config) -> list[tuple[str, str]]:
    """(dotted key, message) for each mesh the trainer would refuse, found before anything is created:
    trainer.mesh against the target's chips (times slices), dry_run.mesh against dry_run.devices, each
    expert axis against its model's moe.num_experts; and a dry_run.trainer_config the trainer does not know."""
    from trainer.config import ConfigError, load_config

    found: list[tuple[str, str]] = []
    target = target_of(cfg)
    overrides = [flag for flag in cfg.trainer.set_flags() if flag != "--set"]
    where = f"{target.accelerator.name}" + (f" x {target.slices}" if target.slices > 1 else "")
    checks = [("trainer.mesh", cfg.trainer.mesh, target.chips, target.slices,
               f"the target ({where}) has {target.chips}", lambda: load_model_config(cfg))]
    if cfg.dry_run.mesh:
        checks.append(("dry_run.mesh", cfg.dry_run.mesh, cfg.dry_run.devices, 1,
                       f"dry_run.devices is {cfg.dry_run.devices}",
                       lambda: load_config(cfg.dry_run.trainer_config, overrides)))
    for key, text, chips, slices, against, model in checks:
        try:
            model_cfg = model()
        except ConfigError as exc:
            if key == "dry_run.mesh":
                found.append(("dry_run.trainer_config", f"the trainer rejects it: {exc}"))
            continue
        if not text:
            continue
        try:
            mesh = parse_mesh(text, chips, slices)
        except ValueError as exc:
            message = str(exc).replace("--mesh ", "mesh ").replace(f"the target has {chips}", against)
            found.append((key, f"the trainer refuses it: {message}"))
            continue
        experts = model_cfg.moe.num_experts
        if model_cfg.model.num_moe_layers and experts % mesh.expert:
            found.append((key, f"the trainer refuses it: moe.num_experts ({experts}) is not divisible by the "
                               f"mesh's expert axis ({mesh.expert})"))
    return found


def plan_for(cfg: Config, *, model: str | None = None, accelerator: str | None = None,
             slices: int | None = None, mesh_text: str | None = None) -> Plan:
    """The plan for a control-plane config. A model or mesh that cannot be used raises UsageError
    (exit 2); without the trainer's dependencies, MissingDependency."""
    try:
        from trainer.config import ConfigError
        from trainer.params import param_inventory
    except ImportError as exc:
        raise MissingDependency(exc.name or "jax", "trainer") from exc
    try:
        model_cfg = load_model_config(cfg, model)
        target = target_of(cfg, accelerator, slices)
        mesh_text = mesh_text or cfg.trainer.mesh
        mesh = parse_mesh(mesh_text, target.chips, target.slices) if mesh_text else None
        params = param_inventory(model_cfg)
    except (ConfigError, ValueError) as exc:
        raise UsageError(f"cannot plan {model or cfg.trainer.config}: {exc}",
                         hint="check trainer.config and trainer.overrides in the config, and --mesh") from None
    steps = cfg.trainer.steps or model_cfg.train.steps
    plan = make_plan(params, model_cfg, target, steps, mesh)
    if mesh_text is None and model_cfg.model.num_moe_layers:
        # Planned with the mesh it picked; the trainer runs with trainer.mesh, or all chips on data.
        plan = dataclasses.replace(plan, warnings=(*plan.warnings, (
            f"trainer.mesh is not set, so the trainer puts every chip on data; set `trainer.mesh: "
            f"{plan.mesh.text()}` to train with this plan's mesh")))
    return plan


@dataclasses.dataclass(frozen=True)
class Verdict:
    fits: bool
    line: str
    shortfall_bytes: int  # per chip; 0 when it fits


def verdict_of(plan: Plan) -> Verdict:
    return Verdict(fits=plan.fits, line=verdict_line(plan), shortfall_bytes=plan.memory.shortfall)


def verdict(cfg: Config) -> Verdict:
    """The one-line answer for a config, as `run` prints it before it creates anything."""
    return verdict_of(plan_for(cfg))


# ----------------------------------------------------------------------------- output


def human_count(n: float) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.2f}{suffix}"
    return f"{n:.0f}"


def human_bytes(n: float) -> str:
    for scale, suffix in ((GIB, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if abs(n) >= scale / 10:
            return f"{n / scale:.2f} {suffix}"
    return f"{n:.0f} B"


def human_flops(n: float) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f} {prefix}FLOP"
    return f"{n:.0f} FLOP"


def human_seconds(s: float) -> str:
    for scale, suffix in ((86400, "days"), (3600, "h"), (60, "min"), (1, "s"), (1e-3, "ms")):
        if s >= scale:
            return f"{s / scale:.3g} {suffix}"
    return f"{s * 1e6:.3g} us"


def usd(x: float) -> str:
    return f"${x:,.2f}"


def target_text(target: Target) -> str:
    acc = target.accelerator
    return f"{target.slices} x {acc.name} ({acc.topology}, {target.chips} chips)"


def verdict_line(plan: Plan) -> str:
    mem, target = plan.memory, plan.target
    head = (f"{plan.model_name} ({human_count(plan.counts.total)} params, {human_count(plan.counts.active)} "
            f"active) on {target.slices} x {target.accelerator.name}, mesh {plan.mesh.text()}")
    if plan.fits:
        return (f"FITS: {head}: {human_bytes(mem.total)} of {human_bytes(mem.hbm)} HBM per chip; step >= "
                f"{human_seconds(plan.bounds.lower_bound_s)}, MFU <= {plan.mfu_ceiling:.0%}, "
                f"{usd(plan.cost.per_hour)}/h {plan.cost.capacity}")
    return (f"DOES NOT FIT: {head}: {human_bytes(mem.total)} per chip, {human_bytes(mem.shortfall)} over its "
            f"{human_bytes(mem.hbm)} HBM; {advice_text(plan.advice)}")


def advice_text(advice: Advice) -> str:
    parts = []
    if advice.smallest_slice is not None:
        parts.append(f"smallest slice that fits: {advice.smallest_slice.name}")
    if advice.slices_needed is not None:
        parts.append(f"fits on {advice.slices_needed} x {advice.accelerator.name}")
    return "; ".join(parts) or (f"fits on no v5e slice, nor on {MAX_SLICES} x {advice.accelerator.name}")


def plan_document(plan: Plan) -> dict[str, Any]:
    """Every figure, its unit in its key."""
    mem, b, t, c, n = plan.memory, plan.bounds, plan.traffic, plan.cost, plan.counts
    acc, advice = plan.target.accelerator, plan.advice
    return {
        "model": plan.model_name, "fits": plan.fits, "verdict": verdict_line(plan),
        "target": {"accelerator": acc.name, "topology": acc.topology, "slices": plan.target.slices,
                   "chips": plan.target.chips, "capacity": plan.target.capacity},
        "mesh": {"data": plan.mesh.data, "expert": plan.mesh.expert, "slices": plan.mesh.slices,
                 "fsdp": plan.model.train.fsdp, "remat": plan.model.model.remat, "reason": plan.mesh.reason,
                 "trainer_flag": f"--mesh {plan.mesh.text()}"},
        "params_total": n.total, "params_active": n.active, "params_per_expert": n.per_expert,
        "params_embedding": n.embedding, "params_experts": n.experts, "params_matmul_per_token": n.matmul_active,
        "param_dtype": plan.model.param_dtype, "compute_dtype": plan.model.dtype,
        "memory_per_chip_bytes": mem.total, "hbm_per_chip_bytes": mem.hbm,
        "memory_params_per_chip_bytes": mem.params, "memory_grads_per_chip_bytes": mem.grads,
        "memory_optimizer_per_chip_bytes": mem.optimizer, "memory_activations_per_chip_bytes": mem.activations,
        "memory_activations_remat_per_chip_bytes": mem.activations_remat,
        "memory_activations_no_remat_per_chip_bytes": mem.activations_no_remat,
        "memory_headroom_per_chip_bytes": mem.hbm - mem.total, "memory_shortfall_per_chip_bytes": mem.shortfall,
        "tokens_per_step": plan.tokens_per_step, "flops_per_token": plan.flops_per_token,
        "flops_per_token_matmul": 6.0 * n.matmul_active,
        "flops_per_token_attention": attention_flops_per_token(plan.model),
        "flops_per_step": plan.flops_per_token * plan.tokens_per_step,
        "hbm_bytes_per_step_per_chip": t.hbm, "all_to_all_bytes_per_step_per_chip": t.all_to_all,
        "ici_bytes_per_step_per_chip": t.ici, "dcn_bytes_per_step_per_chip": t.dcn,
        "step_time_compute_bound_s": b.compute_s, "step_time_hbm_bound_s": b.hbm_s,
        "step_time_ici_bound_s": b.ici_s, "step_time_dcn_bound_s": b.dcn_s,
        "step_time_lower_bound_s": b.lower_bound_s, "step_time_bound_by": b.bound_by,
        "mfu_ceiling_fraction": plan.mfu_ceiling, "tokens_per_s_upper_bound": plan.tokens_per_s,
        "price_per_chip_hour_usd": catalogue.price_per_chip_hour(c.capacity),
        "cost_per_hour_usd": c.per_hour, "cost_per_hour_on_demand_usd": c.per_hour_on_demand,
        "cost_per_hour_spot_usd": c.per_hour_spot, "steps": c.steps, "run_time_lower_bound_s": c.run_s,
        "run_cost_lower_bound_usd": c.run_usd(c.per_hour),
        "run_cost_on_demand_lower_bound_usd": c.run_usd(c.per_hour_on_demand),
        "run_cost_spot_lower_bound_usd": c.run_usd(c.per_hour_spot),
        "advice": {"smallest_slice": advice.smallest_slice.name if advice.smallest_slice else None,
                   "slices_needed": advice.slices_needed, "slices_needed_accelerator": advice.accelerator.name},
        "warnings": list(plan.warnings),
    }


def plan_lines(plan: Plan) -> list[str]:
    """The compact table `moe-tpu plan` prints."""
    return _head_lines(plan) + _memory_lines(plan) + _speed_lines(plan) + _cost_lines(plan) + _advice_lines(plan)


def _head_lines(plan: Plan) -> list[str]:
    n, m, mesh = plan.counts, plan.model, plan.mesh
    extras = ", ".join(x for x in ("fsdp" if m.train.fsdp else "", "remat" if m.model.remat else "") if x)
    return [
        f"model     {plan.model_name}: {human_count(n.total)} params, {human_count(n.active)} active per token, "
        f"{human_count(n.per_expert)} per expert, {human_count(n.embedding)} embedding",
        f"target    {target_text(plan.target)}, {plan.target.capacity}",
        f"mesh      {mesh.text()}{', ' + extras if extras else ''} ({mesh.reason})",
    ]


def _row(label: str, value: str, note: str = "") -> str:
    return f"  {label:<30}{value:>12}{'   ' + note if note else ''}"


def _memory_lines(plan: Plan) -> list[str]:
    mem, m = plan.memory, plan.model
    other = "without" if m.model.remat else "with"
    other_bytes = mem.activations_no_remat if m.model.remat else mem.activations_remat
    status = (f"FITS ({human_bytes(mem.hbm - mem.total)} free)" if plan.fits
              else f"DOES NOT FIT ({human_bytes(mem.shortfall)} over)")
    return [
        "", "memory per chip",
        _row(f"parameters ({m.param_dtype})", human_bytes(mem.params)),
        _row("gradients", human_bytes(mem.grads)),
        _row("optimizer (AdamW mu, nu)", human_bytes(mem.optimizer)),
        _row(f"activations ({'remat' if m.model.remat else 'no remat'})", human_bytes(mem.activations),
             f"{other} remat: {human_bytes(other_bytes)}"),
        _row("total", human_bytes(mem.total), f"of {human_bytes(mem.hbm)} HBM: {status}"),
    ]


def _speed_lines(plan: Plan) -> list[str]:
    b, t, acc = plan.bounds, plan.traffic, plan.target.accelerator
    dcn = _row("DCN between slices", human_seconds(b.dcn_s), f"{human_bytes(t.dcn)} per chip")
    return [
        "", "speed (lower bounds per step)",
        _row("FLOPs per token", human_flops(plan.flops_per_token),
             f"matmuls {human_flops(6.0 * plan.counts.matmul_active)}, "
             f"attention {human_flops(attention_flops_per_token(plan.model))}"),
        _row(f"compute ({acc.peak_bf16_tflops_per_chip:g} TFLOP/s x {plan.mesh.chips})", human_seconds(b.compute_s)),
        _row(f"HBM ({acc.hbm_gbps_per_chip:g} GB/s)", human_seconds(b.hbm_s), f"{human_bytes(t.hbm)} per chip"),
        _row(f"ICI ({acc.ici_gbps_per_chip:g} Gbps)", human_seconds(b.ici_s),
             f"{human_bytes(t.ici)} per chip, all-to-all {human_bytes(t.all_to_all)}"),
        *([dcn] if plan.mesh.slices > 1 else []),
        _row("step time", human_seconds(b.lower_bound_s), f"bound by {b.bound_by}"),
        _row("MFU ceiling", f"{plan.mfu_ceiling:.1%}", f"{human_count(plan.tokens_per_s)} tokens/s at most"),
    ]


def _cost_lines(plan: Plan) -> list[str]:
    c = plan.cost
    return [
        "", "cost",
        _row(f"per hour ({c.capacity})", usd(c.per_hour),
             f"on demand {usd(c.per_hour_on_demand)}, spot {usd(c.per_hour_spot)}"),
        _row(f"{c.steps} steps", f">= {human_seconds(c.run_s)}",
             f">= {usd(c.run_usd(c.per_hour))} {c.capacity} (on demand {usd(c.run_usd(c.per_hour_on_demand))})"),
    ]


def _advice_lines(plan: Plan) -> list[str]:
    lines = ["", f"advice    {advice_text(plan.advice)}"]
    lines += [f"warning   {w}" for w in plan.warnings]
    return lines + ["", verdict_line(plan)]
