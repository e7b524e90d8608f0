"""`moe-tpu plan --serve`: the serving decode step, per chip, at bfloat16, int8 and int4.

Pure arithmetic over the trainer's parameter inventory (trainer/arith/params.py), a mesh and a chip (a catalogue
entry): nothing is compiled. The model behind the figures, for one replica decoding a batch of B slots
whose attention spans `max_len` positions (the engine's fixed-shape step attends over its whole cache; a
sliding layer over its window, the most positions its cache holds):
- memory per chip: the chip's shard of every weight (as trainer.sharding splits them; int8 adds a float32
  scale per output channel, int4 one per group of 128 input values, router and norms stay in float) plus
  its part of the KV cache;
- a layer's routed experts touched by B tokens: E(1-(1-k/E)^B) (each token picks k of E);
- three lower bounds on the step, each resource at its peak: HBM (the weights the busiest chip reads,
  the touched experts only, plus its share of the KV cache), compute (2 FLOPs per active matmul weight
  per token plus attention over the cache, over every chip), ICI (the expert all-to-all, the
  tensor-parallel all-reduces and, with FSDP, the weight gathers; bandwidth only, no per-hop latency);
- the largest batch whose cache fits beside the weights, tokens/s per chip and the cost per million
  output tokens at the catalogue's chip-hour price.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from provision import catalogue
from provision.planner.estimates import Mesh, hbm_bytes_per_s, ici_bytes_per_s, mesh_options
from trainer.arith import quant
from trainer.arith.kv import latent_split_ways, slot_positions
from trainer.arith.mesh import shard_ways
from trainer.arith.params import DTYPE_BYTES, ParamInfo

if TYPE_CHECKING:
    from trainer import config as trainer_config

# Bytes per stored value of each precision plan --serve reports (int4: two values a byte).
PRECISION_BYTES: dict[str, float] = {"float32": 4.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5}
PRECISIONS = ("bf16", "int8", "int4")
# A quantized weight keeps float32 scales (int8: one per output channel, int4: one per group of input values),
# a quantized cache one per position and KV head (trainer/arith/quant.py, kvcache.py).
SCALE_BYTES = 4
_NAMES = {"bfloat16": "bf16", "float32": "float32", "float16": "bf16", "int8": "int8"}


def precision_name(dtype: str) -> str:
    """The precision row a dtype name (a config's) belongs to."""
    return _NAMES.get(dtype, dtype)


def experts_touched(num_experts: int, top_k: int, tokens: int) -> float:
    """The experts of one layer a batch of `tokens` tokens routes to, on average: E(1-(1-k/E)^B)
    (a given expert escapes one token's k picks with probability 1 - k/E)."""
    if num_experts <= 0:
        return 0.0
    return num_experts * (1 - (1 - top_k / num_experts) ** tokens)


# ----------------------------------------------------------------------------- per chip


@dataclasses.dataclass(frozen=True)
class ChipWeights:
    """The weights on the busiest chip of a mesh, at one precision."""

    dense: float  # bytes of every weight but the routed experts' (read whole every step)
    experts: float  # bytes of the routed experts' shards it holds
    experts_held: int  # experts of one layer it holds
    gathered: float  # bytes FSDP gathers onto it every step (the shards of data-split weights it lacks)

    @property
    def held(self) -> float:
        return self.dense + self.experts

    def read(self, touched: float) -> float:
        """Bytes read in a step that touches `touched` experts a layer: at most those it holds."""
        if not self.experts_held:
            return self.dense
        return self.dense + self.experts * min(math.ceil(touched - 1e-9), self.experts_held) / self.experts_held


def _quantized_axes(p: ParamInfo) -> tuple[int, ...] | None:
    return quant.input_axes(p.name, len(p.shape))  # which weights the engine quantizes, and over which axes


def _value_bytes(p: ParamInfo, precision: str | None) -> float:
    """Bytes of the whole parameter stored at `precision` (None: its own dtype). The scales are counted
    over the whole parameter and split with its values: exact where the mesh splits output channels; where
    it splits the input axes, each chip really keeps every channel's scale (a 4 / width share more, a few
    hundredths of a percent at a real model's width)."""
    if precision == "mxfp4":  # the routed experts' weights only (the engine refuses ones not in whole blocks)
        return p.size * quant.MXFP4_BITS / 8 if quant.is_routed_expert(p.name, len(p.shape)) else float(p.nbytes)
    axes = None if precision is None else _quantized_axes(p)
    if axes is None or (precision == "int4" and quant.group_axis(p.name, p.shape) is None):
        return float(p.nbytes)
    values = p.size * PRECISION_BYTES[precision]
    if precision in ("bf16", "float32"):
        return values
    if precision == "int4":
        return values + SCALE_BYTES * p.size / quant.group_size(p.shape[quant.group_axis(p.name, p.shape)])
    return values + SCALE_BYTES * p.size / math.prod(p.shape[a] for a in axes)


def chip_weights(params: Sequence[ParamInfo], cfg: trainer_config.Config, mesh: Mesh,
                 precision: str | None = None) -> ChipWeights:
    """The busiest chip's weights as the serving engine shards them (trainer/serve/weights.py: the
    training layout, FSDP included); `precision` None keeps each parameter's dtype."""
    fsdp, shape = cfg.train.fsdp, mesh.shape()
    dense = experts = gathered = 0.0
    held = 0
    for p in params:
        whole = _value_bytes(p, precision)
        ways, unsplit = shard_ways(p.axes, p.shape, shape, fsdp), shard_ways(p.axes, p.shape, shape, False)
        if ways > unsplit:  # split over data by FSDP: gathered whole (over data) for every step
            gathered += whole / unsplit - whole / ways
        if p.is_expert:
            count = p.shape[p.axes.index("expert")]
            held = count // mesh.expert if mesh.expert > 1 and count % mesh.expert == 0 else count
            experts += whole / ways
        else:
            dense += whole / ways
    return ChipWeights(dense=dense, experts=experts, experts_held=held, gathered=gathered)


def decode_weight_bytes_per_chip(params: Sequence[ParamInfo], cfg: trainer_config.Config, mesh: Mesh,
                                 tokens: int = 1) -> int:
    """Weight bytes the busiest chip reads in one decode step of `tokens` tokens (one a request), each
    parameter in its own dtype, as the serving engine shards them (trainer/serve/weights.py's
    decode_weight_bytes measures the same from its arrays)."""
    touched = experts_touched(cfg.moe.num_experts, cfg.moe.top_k, tokens)
    return round(chip_weights(params, cfg, mesh).read(touched))


@dataclasses.dataclass(frozen=True)
class KvLayout:
    """How a replica's KV cache sits on its chips."""

    hold_ways: int  # chips it is split over in memory (1: every chip holds all of it)
    read_ways: int  # chips a step's attention reads are split over
    note: str = ""


def engine_kv_layout(cfg: trainer_config.Config, mesh: Mesh, max_len: int | None = None) -> KvLayout:
    """As trainer/serve/engine.py lays it out (KVCache.sharding): the KV heads split over `model` where it
    divides them, else every chip holding all of them; each chip attending for its own batch rows
    (data x expert) and its heads. Latent attention's cache (LatentCache.sharding), which every head reads,
    is split by position over `model` (latent_split_ways; max_len None: one it divides), each chip attending
    over its own positions."""
    if cfg.model.mla is not None:
        ways = latent_split_ways(mesh.model, max_len or 0)
        note = (f"latent attention's positions split over model={mesh.model}, as the engine holds them" if ways > 1
                else "latent attention's latents whole on every chip, as the engine holds them")
        return KvLayout(hold_ways=ways, read_ways=mesh.token_shards * ways, note=note)
    heads = mesh.model if cfg.model.kv_heads % mesh.model == 0 else 1
    note = (f"KV heads split over model={mesh.model}, as the engine holds them" if heads > 1
            else "every chip holds all KV heads, as the engine does")
    return KvLayout(hold_ways=heads, read_ways=mesh.token_shards * heads, note=note)


def kv_bytes_per_token(cfg: trainer_config.Config, precision: str) -> float:
    """K and V of one position in every layer (a float32 scale per KV head when quantized); with latent
    attention its latent and rotary key instead (kv_lora_rank + qk_rope_head_dim values, a float32 scale
    each when quantized: trainer/serve/latentcache.py)."""
    m = cfg.model
    if m.mla is not None:
        per_layer = (m.mla.kv_lora_rank + m.mla.qk_rope_head_dim) * PRECISION_BYTES[precision]
        return m.num_layers * (per_layer + (2 * SCALE_BYTES if precision not in ("bf16", "float32") else 0))
    per_layer = m.kv_heads * m.head_size * PRECISION_BYTES[precision]
    if precision not in ("bf16", "float32"):
        per_layer += m.kv_heads * SCALE_BYTES
    return 2 * m.num_layers * per_layer


def kv_bytes_per_slot(cfg: trainer_config.Config, precision: str, max_len: int) -> float:
    """One slot's cache of `max_len` positions: kv_bytes_per_token's share of a layer for each position a layer
    holds, a sliding layer's window at most (trainer/arith/kv.py)."""
    return kv_bytes_per_token(cfg, precision) * slot_positions(cfg.model, max_len) / cfg.model.num_layers


def uncompressed_kv_bytes_per_token(cfg: trainer_config.Config, precision: str) -> float:
    """Latent attention's keys and values expanded: every head's key (qk_nope_head_dim + qk_rope_head_dim)
    and value (v_head_dim) of one position in every layer, as a cache of heads would keep them (a float32
    scale per head's key and per head's value when quantized)."""
    m, mla = cfg.model, cfg.model.mla
    per_layer = m.num_heads * (mla.qk_head_dim + mla.v_head_dim) * PRECISION_BYTES[precision]
    if precision not in ("bf16", "float32"):
        per_layer += 2 * m.num_heads * SCALE_BYTES
    return m.num_layers * per_layer


# ----------------------------------------------------------------------------- the decode step


@dataclasses.dataclass(frozen=True)
class Serving:
    """One model on one replica's chips, at one precision of weights and KV cache."""

    cfg: trainer_config.Config
    mesh: Mesh
    acc: catalogue.AcceleratorType
    weights: ChipWeights
    kv: KvLayout
    kv_per_token: float  # bytes, a position of every layer
    kv_per_slot: float  # bytes, a slot of max_len positions (a sliding layer's window at most)
    matmul_params: int  # weights one token multiplies by (ParamCounts.matmul_active)
    max_len: int
    weight_precision: str
    kv_precision: str
    headroom: float = 0.0  # share of HBM kept for activations and XLA's scratch
    hbm_bytes: float = 0.0  # per chip; 0: the catalogue's
    slot_multiple: int = 0  # what the slots must be a multiple of; 0: the token shards, as the engine's

    @property
    def hbm(self) -> float:
        return self.hbm_bytes or self.acc.hbm_gib_per_chip * (1 << 30)

    def kv_cache_bytes(self, slots: int) -> float:
        """Per chip, for `slots` slots of max_len positions."""
        return slots * self.kv_per_slot / self.kv.hold_ways

    def memory(self, slots: int) -> float:
        return self.weights.held + self.kv_cache_bytes(slots)

    def usable(self) -> float:
        return self.hbm * (1 - self.headroom)

    def fits(self, slots: int) -> bool:
        return self.memory(slots) <= self.usable()

    def largest_batch(self) -> int:
        """The most slots whose cache fits beside the weights (a multiple of `slot_multiple`: the engine
        splits its slots over the token shards); 0 when none fits."""
        free = self.usable() - self.weights.held
        slot = self.kv_per_slot / self.kv.hold_ways
        if free < slot:
            return 0
        multiple = self.slot_multiple or self.mesh.token_shards
        return int(free // slot) // multiple * multiple


def serving(params: Sequence[ParamInfo], cfg: trainer_config.Config, mesh: Mesh, acc: catalogue.AcceleratorType,
            precision: str, *, max_len: int, kv_precision: str | None = None, kv: KvLayout | None = None,
            headroom: float = 0.0, hbm_bytes: float = 0.0, slot_multiple: int = 0) -> Serving:
    from trainer.arith.counts import count_params

    kv_precision = kv_precision or precision
    return Serving(cfg=cfg, mesh=mesh, acc=acc, weights=chip_weights(params, cfg, mesh, precision),
                   kv=kv or engine_kv_layout(cfg, mesh, max_len), kv_per_token=kv_bytes_per_token(cfg, kv_precision),
                   kv_per_slot=kv_bytes_per_slot(cfg, kv_precision, max_len),
                   matmul_params=count_params(params, cfg).matmul_active, max_len=max_len,
                   weight_precision=precision, kv_precision=kv_precision, headroom=headroom, hbm_bytes=hbm_bytes,
                   slot_multiple=slot_multiple)


# The decode step to expect from the engine, fitted to its steps on one v5e chip (benchmarks/serve_weights.py
# --accelerator, moe-1b at 1, 8 and 32 slots, the steps attending over 88 positions; the chip session of
# 2026-12-07 afternoon, call 2, at e1a5261: a decode step's layers unrolled, an int8 embedding's rows read from
# their tiles): a fixed cost a layer (the step's small ops, and what the host adds) plus the bytes the step reads
# at the share of the HBM's bandwidth each weight format reached. The fit (benchmarks/fit_decode.py) is within 13%
# of every one of those nine steps (the furthest: bf16 at one slot, 1.22 ms against 1.08). MXFP4 is not measured
# (a TPU reads its experts widened): int4's share stands for it.
DECODE_LAYER_S = 0.347e-3 / 12
DECODE_HBM_SHARE = {"bf16": 0.83, "float32": 0.83, "int8": 0.63, "int4": 0.43, "mxfp4": 0.43}


@dataclasses.dataclass(frozen=True)
class DecodeStep:
    batch: int
    experts_touched: float  # a layer
    weight_read_bytes: float  # per chip
    kv_read_bytes: float  # per chip
    flops: float  # per chip
    ici_bytes: float  # per chip
    hbm_s: float
    compute_s: float
    ici_s: float
    chips: int
    expected_s: float = 0.0  # the step to expect (DECODE_LAYER_S, DECODE_HBM_SHARE)

    @property
    def lower_bound_s(self) -> float:
        return max(self.hbm_s, self.compute_s, self.ici_s)

    @property
    def bound_by(self) -> str:
        named = {"HBM": self.hbm_s, "compute": self.compute_s, "ICI": self.ici_s}
        return max(named, key=named.__getitem__)

    @property
    def tokens_per_s_per_chip(self) -> float:
        return self.batch / self.lower_bound_s / self.chips


def decode_ici_bytes(s: Serving, batch: int) -> float:
    """Bytes over ICI per chip in one step: each MoE layer sends its rows' k assignments to the expert
    chips and back, each layer all-reduces attention's and the FFN's output over `model` (a ring moves
    2 (T - 1) / T of it), and FSDP gathers the weights split over data."""
    m, e, mesh = s.cfg.model, s.cfg.moe, s.mesh
    rows = math.ceil(batch / mesh.token_shards)
    act = rows * m.d_model * DTYPE_BYTES.get(s.cfg.dtype, 2)
    a2a = m.num_moe_layers * 2 * act * e.top_k * (mesh.expert - 1) / mesh.expert
    tp = m.num_layers * 2 * act * 2 * (mesh.model - 1) / mesh.model
    return a2a + tp + s.weights.gathered


def decode_step(s: Serving, batch: int) -> DecodeStep:
    m, e, chips = s.cfg.model, s.cfg.moe, s.mesh.chips
    touched = experts_touched(e.num_experts, e.top_k, batch) if m.num_moe_layers else 0.0
    weights = s.weights.read(touched)
    kv = batch * s.kv_per_slot / s.kv.read_ways
    attention = batch * slot_positions(m, s.max_len) * attention_flops_per_position(s.cfg)
    flops = (2.0 * s.matmul_params * batch + attention) / chips
    ici = decode_ici_bytes(s, batch)
    hbm_s = (weights + kv) / hbm_bytes_per_s(s.acc)
    compute_s = flops / (s.acc.peak_bf16_tflops_per_chip * 1e12)
    ici_s = ici / ici_bytes_per_s(s.acc)
    share = DECODE_HBM_SHARE.get(s.weight_precision, DECODE_HBM_SHARE["bf16"])
    expected = max(m.num_layers * DECODE_LAYER_S + hbm_s / share, compute_s, ici_s)
    return DecodeStep(batch=batch, experts_touched=touched, weight_read_bytes=weights, kv_read_bytes=kv,
                      flops=flops, ici_bytes=ici, hbm_s=hbm_s, compute_s=compute_s, ici_s=ici_s, chips=chips,
                      expected_s=expected)


def attention_flops_per_position(cfg: trainer_config.Config) -> float:
    """FLOPs of one token's attention to one cached position in one layer: each head's score and weighted
    sum, 2 FLOPs a multiply-add. Latent attention decodes by absorption (trainer/mla.py): the score is over
    the latent and the rotary key (kv_lora_rank + qk_rope_head_dim), the sum over the latent; folding the
    up-projections into the query and the output is a matmul per token, counted with the weights."""
    m = cfg.model
    if m.mla is not None:
        return 2.0 * m.num_heads * (2 * m.mla.kv_lora_rank + m.mla.qk_rope_head_dim)
    return 4.0 * m.num_heads * m.head_size


@dataclasses.dataclass(frozen=True)
class LatentCapacity:
    """Latent attention's cache against an uncompressed one, on one chip: how many sequences of `tokens`
    tokens each holds in the HBM left beside the chip's weights."""

    tokens: int
    leftover: float  # bytes: usable HBM less the weights
    latent_per_token: float  # bytes, every layer's
    uncompressed_per_token: float  # bytes, every layer's
    latent_sequences: int
    uncompressed_sequences: int


def latent_capacity(s: Serving, tokens: int = 2048) -> LatentCapacity | None:
    """For latent attention (None otherwise): the sequences one chip holds with the engine's latent cache
    (split by position over `model` as the engine splits it: engine_kv_layout) and with the heads' keys and
    values (split over `model` where it divides the heads, as the engine splits a cache of heads)."""
    m = s.cfg.model
    if m.mla is None:
        return None
    leftover = max(s.usable() - s.weights.held, 0.0)
    expanded = uncompressed_kv_bytes_per_token(s.cfg, s.kv_precision)
    heads = s.mesh.model if m.num_heads % s.mesh.model == 0 else 1
    count = lambda per_token, ways: int(leftover // (tokens * per_token / ways))  # noqa: E731
    return LatentCapacity(tokens=tokens, leftover=leftover, latent_per_token=s.kv_per_token,
                          uncompressed_per_token=expanded, latent_sequences=count(s.kv_per_token, s.kv.hold_ways),
                          uncompressed_sequences=count(expanded, heads))


def cost_per_million_tokens(price_per_chip_hour: float, tokens_per_s_per_chip: float) -> float:
    """USD per million output tokens: a chip-hour's price over the tokens it decodes in an hour."""
    return price_per_chip_hour / (tokens_per_s_per_chip * 3600) * 1e6


# ----------------------------------------------------------------------------- the serving mesh


def serving_meshes(cfg: trainer_config.Config, chips: int, slots: int, models: Sequence[int]) -> list[Mesh]:
    """One replica's meshes (experts over `expert`, tensor parallel over `model`, the rest on data) whose
    token shards divide the slots, as the engine requires; every mesh when none does."""
    options = mesh_options(cfg.moe.num_experts, cfg.model.num_moe_layers > 0, chips, 1, models)
    usable = [mesh for mesh in options if slots % mesh.token_shards == 0]
    return usable or options
