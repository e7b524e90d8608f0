"""The plan for a config: the target it asks for, the mesh chosen, advice, warnings and the verdict."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from provision import catalogue
from provision.errors import MissingDependency, UsageError
from provision.planner.estimates import (
    DROP_WARNING,
    GIB,
    MAX_SLICES,
    Cost,
    Layout,
    Mesh,
    StepBounds,
    Traffic,
    chip_layout,
    cost,
    hardware_flops_per_chip,
    mesh_options,
    mfu_ceiling,
    min_drop_fraction,
    routing_groups,
    step_bounds,
    target_mesh,
    traffic_per_chip,
)
from provision.planner.memory import Memory, memory_per_chip
from trainer.arith.counts import ParamCounts, count_params
from trainer.arith.counts import model_flops_per_token as flops_per_token
from trainer.arith.params import ParamInfo
from trainer.meshspec import tensor_problems

if TYPE_CHECKING:
    from provision.config_sections import Config
    from trainer import config as trainer_config

# ----------------------------------------------------------------------------- target, advice, warnings


@dataclasses.dataclass(frozen=True)
class Hardware:
    """The chips a plan is for (the config's slice or Vertex topology); not provision.kinds.Target,
    which provisions them."""

    accelerator: catalogue.AcceleratorType
    slices: int
    capacity: str  # a catalogue price: on-demand, spot or reserved

    @property
    def chips(self) -> int:
        return self.accelerator.chips * self.slices




def target_of(cfg: Config, accelerator: str | None = None, slices: int | None = None) -> Hardware:
    """The chips the config's kind of target asks for (its Kind.hardware: a slice times its count, a
    Vertex AI topology, ...), or the accelerator and slice count given on the command line."""
    acc, count, capacity = cfg.kind.hardware(cfg)
    if accelerator is not None:
        acc = catalogue.accelerator(accelerator)
    return Hardware(accelerator=acc, slices=slices or count, capacity=capacity)


# The tensor-parallel ways the planner tries: within one v5e host's 8 chips, where the all-reduces of
# every layer stay on the fastest links.
MODEL_WAYS = (1, 2, 4, 8)


def model_ways(cfg: trainer_config.Config) -> tuple[int, ...]:
    """The model axes (of MODEL_WAYS) that the config's heads and hidden sizes divide over."""
    return tuple(t for t in MODEL_WAYS if not tensor_problems(cfg, t))


def _options(cfg: trainer_config.Config, acc: catalogue.AcceleratorType, slices: int) -> list[Mesh]:
    return mesh_options(cfg.moe.num_experts, cfg.model.num_moe_layers > 0, acc.chips * slices, slices,
                        model_ways(cfg))


def choose_mesh(params: Sequence[ParamInfo], cfg: trainer_config.Config, acc: catalogue.AcceleratorType,
                slices: int = 1) -> tuple[Mesh, Memory]:
    """The largest expert axis (of `mesh_options`) whose memory fits, with the smallest model axis that
    makes it fit (tensor parallelism splits each expert, for few large experts); if none fits, the one
    that needs least. With FSDP a smaller expert axis leaves more data ways to shard the dense weights
    over."""
    options = _options(cfg, acc, slices)
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
    elif options[best].model > 1:
        reason = (f"{divisor}, with each expert and attention split {options[best].model} ways over model "
                  "(tensor parallelism): every mesh with a smaller model axis needs more memory per chip")
    else:
        larger = ", ".join(str(m.expert) for m in options[:best])
        reason = f"{divisor} and fits; expert={larger} need{'s' if best == 1 else ''} more memory per chip"
    chosen = options[best]
    label = f"expert={chosen.expert}" + (f",model={chosen.model}" if chosen.model > 1 else "")
    return dataclasses.replace(chosen, reason=f"{label}: {reason}"), memories[best]


def fits_on(params: Sequence[ParamInfo], cfg: trainer_config.Config, acc: catalogue.AcceleratorType,
            slices: int) -> bool:
    return any(memory_per_chip(params, cfg, mesh, acc).fits for mesh in _options(cfg, acc, slices))


@dataclasses.dataclass(frozen=True)
class Advice:
    smallest_slice: catalogue.AcceleratorType | None  # the smallest single slice that fits
    slices_needed: int | None  # how many slices of the target's type fit (None: not within MAX_SLICES)
    accelerator: catalogue.AcceleratorType
    # Where the mesh given (--mesh, trainer.mesh) does not fit but the plan's own choice on the same
    # target does: that mesh (the advice is then to change the mesh, not the slice).
    fitting_mesh: Mesh | None = None
    slices: int = 1  # the target's


def advise(params: Sequence[ParamInfo], cfg: trainer_config.Config, acc: catalogue.AcceleratorType) -> Advice:
    by_size = sorted(catalogue.ACCELERATORS.values(), key=lambda a: a.chips)
    smallest = next((a for a in by_size if fits_on(params, cfg, a, 1)), None)
    needed = next((s for s in range(1, MAX_SLICES + 1) if fits_on(params, cfg, acc, s)), None)
    return Advice(smallest_slice=smallest, slices_needed=needed, accelerator=acc)


def warnings_for(cfg: trainer_config.Config, mesh: Mesh, layout: Layout, bounds: StepBounds) -> list[str]:
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
    if has_moe and routing_groups(cfg, mesh) % mesh.token_shards:
        found.append(f"moe.routing_groups={e.routing_groups} is not a multiple of the {mesh.token_shards} token "
                     "shards: the trainer refuses it")
    drop = min_drop_fraction(layout, cfg) if has_moe else 0.0
    if drop >= DROP_WARNING:
        most = "most tokens' assignments" if drop > 0.5 else "assignments"
        found.append(f"capacity factor {e.capacity_factor:g} drops {most}: at least {drop:.0%} even with "
                     "perfectly balanced routing")
    shards, what = mesh.token_shards, "chips" if mesh.model == 1 else "token shards (data x expert)"
    if batch < shards:
        found.append(f"batch too small: {batch} rows for {shards} {what} leaves {shards - batch} "
                     f"{'chips' if mesh.model == 1 else 'shards'} without data (and the trainer refuses it)")
    elif batch % shards:
        found.append(f"data.global_batch_size={batch} is not a multiple of the {shards} {what}: the "
                     "trainer refuses it")
    found += [f"{problem}: the trainer refuses this mesh" for problem in tensor_problems(cfg, mesh.model)]
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
    model: trainer_config.Config
    counts: ParamCounts
    target: Hardware
    mesh: Mesh
    memory: Memory
    flops_per_token: float
    traffic: Traffic
    bounds: StepBounds
    mfu_ceiling: float
    cost: Cost
    advice: Advice
    warnings: tuple[str, ...]
    # Where the mesh came from: "trainer.mesh" (given in the config), "--mesh" (given to `plan`) or "plan"
    # (chosen here: trainer.mesh unset, so the run's trainer is started with the plan's choice);
    # `what_if`: planned for another model, target or mesh than the run's own (command-line overrides).
    mesh_source: str = "plan"
    what_if: bool = False
    # trainer.mesh, set aside: it does not cover the chips of the other slice planned for (--accelerator, --slices)
    config_mesh: str | None = None

    @property
    def fits(self) -> bool:
        return self.memory.fits

    @property
    def tokens_per_step(self) -> int:
        return self.model.data.global_batch_size * self.model.data.seq_len

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.bounds.lower_bound_s


def make_plan(params: Sequence[ParamInfo], cfg: trainer_config.Config, target: Hardware, steps: int,
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
        advice=_advice(params, cfg, target, memory.fits), warnings=tuple(warnings_for(cfg, mesh, layout, bounds)),
    )


def _advice(params: Sequence[ParamInfo], cfg: trainer_config.Config, target: Hardware, fits: bool) -> Advice:
    """`advise`, and where the plan's mesh does not fit the plan's own choice on the same target that does."""
    advice = dataclasses.replace(advise(params, cfg, target.accelerator), slices=target.slices)
    if fits:
        return advice
    chosen, memory = choose_mesh(params, cfg, target.accelerator, target.slices)
    return dataclasses.replace(advice, fitting_mesh=chosen) if memory.fits else advice


def load_model_config(cfg: Config, model: str | None = None) -> trainer_config.Config:
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
            mesh = target_mesh(text, chips, slices)
        except ValueError as exc:
            message = str(exc).replace("--mesh ", "mesh ").replace(f"the target has {chips}", against)
            found.append((key, f"the trainer refuses it: {message}"))
            continue
        experts = model_cfg.moe.num_experts
        if model_cfg.model.num_moe_layers and experts % mesh.expert:
            found.append((key, f"the trainer refuses it: moe.num_experts ({experts}) is not divisible by the "
                               f"mesh's expert axis ({mesh.expert})"))
        found += [(key, f"the trainer refuses it: {problem}") for problem in tensor_problems(model_cfg, mesh.model)]
    return found


def mesh_choice(cfg: Config) -> tuple[str | None, str]:
    """Where trainer.mesh is unset: the mesh the plan chooses for the config's own target (`choose_mesh`,
    the mesh `plan` shows and the trainer is then started with) and ""; or None and why the plan
    cannot choose one (the trainer config cannot be read, or no mesh of the target fits the model)."""
    try:
        from trainer.arith.params import inventory as param_inventory
        from trainer.config import ConfigError

        target = target_of(cfg)
        model_cfg = load_model_config(cfg)
        params = param_inventory(model_cfg)
    except ImportError as exc:
        return None, f"the plan needs the trainer's packages to choose one ({exc.name or 'jax'} is missing)"
    except (ConfigError, ValueError) as exc:
        return None, f"the plan cannot read trainer.config {cfg.trainer.config!r} to choose one ({exc})"
    mesh, memory = choose_mesh(params, model_cfg, target.accelerator, target.slices)
    if not memory.fits:
        advice = advise(params, model_cfg, target.accelerator)
        larger = (f"; it fits on {advice.slices_needed} x {target.accelerator.name}" if advice.slices_needed
                  else "")
        return None, (f"no mesh of the target's {target.chips} chips fits {model_cfg.name} (the one needing "
                      f"least, {mesh.text()}, needs {memory.total / GIB:.2f} GiB per chip of "
                      f"{memory.hbm / GIB:.0f} GiB{larger})")
    return mesh.text(), ""


def _config_mesh(cfg: Config, target, what_if: bool) -> str | None:
    """The config's trainer.mesh where it applies: always on the config's own slice (a mesh that does not cover
    it is refused), and on another (--accelerator, --slices) only when it covers that one's chips; else None,
    and the plan picks a mesh for the slice it is given."""
    text = cfg.trainer.mesh
    if not text or not what_if:
        return text
    try:
        target_mesh(text, target.chips, target.slices)
    except ValueError:
        return None
    return text


def plan_for(cfg: Config, *, model: str | None = None, accelerator: str | None = None,
             slices: int | None = None, mesh_text: str | None = None) -> Plan:
    """The plan for a control-plane config. A model or mesh that cannot be used raises UsageError
    (exit 2); without the trainer's dependencies, MissingDependency."""
    try:
        from trainer.arith.params import inventory as param_inventory
        from trainer.config import ConfigError
    except ImportError as exc:
        raise MissingDependency(exc.name or "jax", "trainer") from exc
    try:
        model_cfg = load_model_config(cfg, model)
        target = target_of(cfg, accelerator, slices)
        given = mesh_text
        mesh_text = mesh_text or _config_mesh(cfg, target, what_if=accelerator is not None or slices is not None)
        mesh = target_mesh(mesh_text, target.chips, target.slices) if mesh_text else None
        params = param_inventory(model_cfg)
    except ImportError as exc:
        raise MissingDependency(exc.name or "jax", "trainer") from exc
    except (ConfigError, ValueError) as exc:
        raise UsageError(f"cannot plan {model or cfg.trainer.config}: {exc}",
                         hint="check trainer.config and trainer.overrides in the config, and --mesh") from None
    steps = cfg.trainer.steps or model_cfg.train.steps
    plan = make_plan(params, model_cfg, target, steps, mesh)
    source = "--mesh" if given else ("trainer.mesh" if mesh is not None else "plan")
    if source == "trainer.mesh":
        plan = dataclasses.replace(plan, mesh=dataclasses.replace(
            plan.mesh, reason=plan.mesh.reason.replace("given with --mesh", "given in trainer.mesh")))
    elif source == "plan" and cfg.trainer.mesh:  # the config's mesh is for its own slice, not this one
        plan = dataclasses.replace(plan, config_mesh=cfg.trainer.mesh)
    what_if = any(x is not None for x in (model, accelerator, slices)) or source == "--mesh"
    return dataclasses.replace(plan, mesh_source=source, what_if=what_if)
