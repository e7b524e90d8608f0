"""The serving plan of a config: one replica's chips and mesh, the price it is billed at (on the platform
its kind of target names: Kind.serve_platform), and the decode step at each precision (serving.py's
arithmetic)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from provision import catalogue
from provision.errors import UsageError
from provision.planner.estimates import Mesh, target_mesh
from provision.planner.plan import Plan, model_ways
from provision.planner.serving import (
    PRECISIONS,
    DecodeStep,
    Serving,
    cost_per_million_tokens,
    decode_step,
    precision_name,
    serving,
    serving_meshes,
)

if TYPE_CHECKING:
    from provision.config_sections import Config

# The serving engine's own defaults (trainer/serve/cli.py) where the config has no serve section.
ENGINE_SLOTS, ENGINE_MAX_LEN = 8, 1024


def row_name(weights: str, kv: str) -> str:
    """A precision row's name: "int8", or "int8/kv bf16" where the cache is kept otherwise."""
    return weights if weights == kv else f"{weights}/kv {kv}"


@dataclasses.dataclass(frozen=True)
class Row:
    """One precision of weights and KV cache on the replica."""

    serving: Serving
    slots: int
    step: DecodeStep  # at `slots`
    step_batch_1: DecodeStep
    largest_batch: int
    step_largest: DecodeStep | None  # at the largest batch (None: nothing fits)

    @property
    def name(self) -> str:
        return row_name(self.serving.weight_precision, self.serving.kv_precision)

    @property
    def fits(self) -> bool:
        return self.serving.fits(self.slots)


@dataclasses.dataclass(frozen=True)
class ServePlan:
    plan: Plan
    accelerator: catalogue.AcceleratorType
    mesh: Mesh
    mesh_source: str  # "--mesh", "serve.mesh", "plan" (the training plan's) or "serving" (chosen here)
    hardware_source: str  # "serve" (the serve section), "--accelerator" or "plan"
    slots: int
    max_len: int
    platform: str
    price_basis: str
    capacity: str
    price_per_chip_hour: float
    rows: tuple[Row, ...]
    configured: str  # the name of the row the config serves at
    claim_s: float | None = None  # a decode step time to check (--decode-step-ms)
    warnings: tuple[str, ...] = ()

    @property
    def chips(self) -> int:
        return self.mesh.chips

    def row(self, name: str) -> Row:
        return next(r for r in self.rows if r.name == name)

    def cost_per_million(self, step: DecodeStep) -> float:
        return cost_per_million_tokens(self.price_per_chip_hour, step.tokens_per_s_per_chip)


def _hardware(cfg: Config, plan: Plan, accelerator: str | None) -> tuple[catalogue.AcceleratorType, str]:
    if accelerator is not None:
        return plan.target.accelerator, "--accelerator"
    if cfg.serve is not None:
        acc = catalogue.accelerator_for_topology(cfg.serve.replica_topology)
        if acc is not None:
            return acc, "serve"
    return plan.target.accelerator, "plan"


def _configured(cfg: Config, model_cfg) -> tuple[str, str]:
    """(weights, KV cache) precision names the config serves at."""
    serve = cfg.serve
    weights = serve.weights if serve is not None and serve.weights != "auto" else precision_name(model_cfg.param_dtype)
    kv = serve.kv_cache_dtype if serve is not None and serve.kv_cache_dtype != "auto" else model_cfg.dtype
    return weights, precision_name(kv)


def serving_rows(params, model_cfg, mesh: Mesh, acc, pairs: Sequence[tuple[str, str]], slots: int, max_len: int,
                 headroom: float) -> tuple[Row, ...]:
    rows = []
    for weights, kv in pairs:
        s = serving(params, model_cfg, mesh, acc, weights, kv_precision=kv, max_len=max_len, headroom=headroom)
        largest = s.largest_batch()
        rows.append(Row(serving=s, slots=slots, step=decode_step(s, slots), step_batch_1=decode_step(s, 1),
                        largest_batch=largest, step_largest=decode_step(s, largest) if largest else None))
    return tuple(rows)


def best_mesh(candidates: Sequence[tuple[Mesh, Sequence[Row]]], configured: str) -> tuple[Mesh, str]:
    """The mesh where the configured precision (the one `deploy` serves at) fits with the fastest step;
    where it fits on none, the mesh where the most precise other precision fits, then the fastest step
    at that precision (the least memory when none fits); (mesh, why)."""
    def order(rows: Sequence[Row]) -> list[Row]:
        return sorted(rows, key=lambda row: row.name != configured)  # stable: the rest most precise first

    def score(entry: tuple[Mesh, Sequence[Row]]) -> tuple[int, float]:
        rows = order(entry[1])
        first = next((i for i, row in enumerate(rows) if row.fits), len(rows))
        if first == len(rows):
            return first, min(row.serving.memory(row.slots) for row in rows)
        return first, rows[first].step.lower_bound_s

    mesh, rows = min(candidates, key=score)
    first = score((mesh, rows))[0]
    if first == len(rows):
        return mesh, "no mesh fits at any precision; this one needs the least memory per chip"
    return mesh, (f"the fastest decode step of the meshes where {order(rows)[first].name} fits "
                  f"({len(candidates)} tried)")


def serve_warnings(model_cfg, mesh: Mesh, slots: int, rows: Sequence[Row]) -> list[str]:
    """What would stop the server on this mesh, or slow every step."""
    found = []
    if slots % mesh.token_shards:
        found.append(f"{slots} slots do not divide over the mesh's {mesh.token_shards} token shards (data x "
                     "expert): the server refuses it; give it slots a multiple of them, or another --mesh")
    gathered = rows[0].serving.weights.gathered
    if gathered:
        found.append(f"the trainer's FSDP splits weights over data={mesh.data}: every decode step gathers "
                     f"{gathered / 2**30:.2f} GiB a chip ({rows[0].name}) over ICI; a mesh with data=1 holds "
                     "them whole")
    return found


# Where the serving mesh was given: the flag or config key named in what is said of it.
_GIVEN = {"--mesh": "--mesh", "serve.mesh": "serve.mesh"}


def _given_mesh(plan: Plan, mesh_text: str | None, source: str, chips: int) -> tuple[Mesh, str]:
    """`mesh_text` (from --mesh or serve.mesh) on the replica's chips (UsageError naming the source where
    it does not cover them, or the model cannot be split over it), or the plan's mesh."""
    if not mesh_text:
        return plan.mesh, "plan"
    name = _GIVEN[source]
    try:
        mesh = target_mesh(mesh_text, chips, 1)
    except ValueError as exc:
        message = str(exc).replace("the target has", "the serving replica has").replace("--mesh", name)
        hint = f"{name} must cover one serving replica's chips (the serve section's topology)"
        raise UsageError(f"cannot plan serving: {message}", hint=hint) from None
    problems = serving_mesh_problems(plan.model, mesh)
    if problems:
        raise UsageError(f"cannot plan serving: {name} {mesh.text()}: {'; '.join(problems)}",
                         hint="the server refuses such a mesh; `moe-tpu plan --serve` without it chooses one")
    return dataclasses.replace(mesh, reason=mesh.reason.replace("--mesh", name)), source


def serving_mesh_problems(model_cfg, mesh: Mesh) -> list[str]:
    """What the server (trainer/serve/startup.py) refuses of this model on this mesh: experts that the
    expert axis does not divide, and heads or hidden sizes that the model axis does not split."""
    from trainer import meshspec

    found = []
    if model_cfg.model.num_moe_layers > 0 and model_cfg.moe.num_experts % mesh.expert:
        found.append(f"expert={mesh.expert} must divide moe.num_experts ({model_cfg.moe.num_experts})")
    return found + meshspec.tensor_problems(model_cfg, mesh.model)


def serve_plan_for(cfg: Config, plan: Plan, *, accelerator: str | None = None, mesh_text: str | None = None,
                   claim_ms: float | None = None) -> ServePlan:
    """The serving plan for a config whose training plan is `plan` (`plan_for` with the same options):
    the serve section's replica (else the plan's target) on the mesh given, the plan's, or the best for
    serving."""
    from trainer.arith.params import inventory as param_inventory
    from trainer.arith.quant import HEADROOM

    params, model_cfg = param_inventory(plan.model), plan.model
    acc, hardware_source = _hardware(cfg, plan, accelerator)
    chips = plan.target.chips if hardware_source != "serve" else acc.chips
    serve = cfg.serve
    slots = serve.slots if serve is not None else ENGINE_SLOTS
    max_len = serve.max_len if serve is not None else ENGINE_MAX_LEN
    configured = _configured(cfg, model_cfg)
    pairs = [(p, p) for p in PRECISIONS]
    if configured not in pairs:
        pairs.append(configured)
    given, source = (mesh_text, "--mesh") if mesh_text else (serve.mesh if serve is not None else None, "serve.mesh")
    if given or (hardware_source == "plan" and plan.mesh.chips == chips):
        mesh, mesh_source = _given_mesh(plan, given, source, chips)
    else:
        candidates = [(m, serving_rows(params, model_cfg, m, acc, pairs, slots, max_len, HEADROOM))
                      for m in serving_meshes(model_cfg, chips, slots, model_ways(model_cfg))]
        mesh, why = best_mesh(candidates, row_name(*configured))
        mesh, mesh_source = dataclasses.replace(mesh, reason=why), "serving"
    rows = serving_rows(params, model_cfg, mesh, acc, pairs, slots, max_len, HEADROOM)
    capacity = ("spot" if serve.spot else "on-demand") if serve is not None else plan.target.capacity
    return ServePlan(plan=plan, accelerator=acc, mesh=mesh, mesh_source=mesh_source,
                     hardware_source=hardware_source, slots=slots, max_len=max_len,
                     platform=cfg.kind.serve_platform, price_basis=cfg.kind.serve_price_basis,
                     capacity=capacity, price_per_chip_hour=catalogue.price_per_chip_hour(capacity), rows=rows,
                     configured=row_name(*configured), claim_s=None if claim_ms is None else claim_ms / 1000,
                     warnings=tuple(serve_warnings(model_cfg, mesh, slots, rows)))
