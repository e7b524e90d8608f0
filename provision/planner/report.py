"""The plan for people (`moe-tpu plan` as text) and for scripts (its JSON document)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from provision import catalogue
from provision.console import table_lines
from provision.planner.estimates import COMPUTE_EFFICIENCY, GIB, MAX_SLICES
from provision.planner.plan import Advice, Hardware, Plan, plan_for
from trainer.arith.counts import attention_flops_per_token

if TYPE_CHECKING:
    from provision.config_sections import Config

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


def target_text(target: Hardware) -> str:
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
    """What to change, in agreement with the verdict beside it: where another mesh fits on the very target
    refused, that mesh (not a "smallest slice" that is the same slice); else larger slices, or more."""
    parts = []
    target_fits = advice.fitting_mesh is not None
    if target_fits:
        parts.append(f"fits on {advice.slices} x {advice.accelerator.name} with --mesh {advice.fitting_mesh.text()} "
                     "(the plan's choice) instead")
    smaller = advice.smallest_slice is not None and advice.smallest_slice.chips < advice.accelerator.chips
    if advice.smallest_slice is not None and (not target_fits or smaller):
        parts.append(f"smallest slice that fits: {advice.smallest_slice.name}")
    if advice.slices_needed is not None and not (target_fits and advice.slices_needed == advice.slices):
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
        "mesh": {"data": plan.mesh.data, "expert": plan.mesh.expert,
                 **({"model": plan.mesh.model} if plan.mesh.model > 1 else {}), "slices": plan.mesh.slices,
                 "fsdp": plan.model.train.fsdp, "remat": plan.model.model.remat, "reason": plan.mesh.reason,
                 "trainer_flag": f"--mesh {plan.mesh.text()}", "source": plan.mesh_source,
                 "source_text": mesh_source_text(plan)},
        "params_total": n.total, "params_active": n.active, "params_per_expert": n.per_expert,
        "params_embedding": n.embedding, "params_experts": n.experts, "params_matmul_per_token": n.matmul_active,
        "param_dtype": plan.model.param_dtype, "compute_dtype": plan.model.dtype,
        "memory_per_chip_bytes": mem.total, "hbm_per_chip_bytes": mem.hbm,
        "memory_params_per_chip_bytes": mem.params, "memory_grads_per_chip_bytes": mem.grads,
        "memory_optimizer_per_chip_bytes": mem.optimizer, "memory_activations_per_chip_bytes": mem.activations,
        "memory_gathered_per_chip_bytes": mem.gathered,
        "memory_activations_remat_per_chip_bytes": mem.activations_remat,
        "memory_activations_no_remat_per_chip_bytes": mem.activations_no_remat,
        "memory_headroom_per_chip_bytes": mem.hbm - mem.total, "memory_shortfall_per_chip_bytes": mem.shortfall,
        "tokens_per_step": plan.tokens_per_step, "flops_per_token": plan.flops_per_token,
        "flops_per_token_matmul": 6.0 * n.matmul_active,
        "flops_per_token_attention": attention_flops_per_token(plan.model),
        "flops_per_step": plan.flops_per_token * plan.tokens_per_step,
        "hbm_bytes_per_step_per_chip": t.hbm, "all_to_all_bytes_per_step_per_chip": t.all_to_all,
        "ici_bytes_per_step_per_chip": t.ici, "dcn_bytes_per_step_per_chip": t.dcn,
        **({"tensor_parallel_bytes_per_step_per_chip": t.tensor_parallel} if plan.mesh.model > 1 else {}),
        "step_time_compute_bound_s": b.compute_s, "step_time_hbm_bound_s": b.hbm_s,
        "step_time_ici_bound_s": b.ici_s, "step_time_dcn_bound_s": b.dcn_s,
        "step_time_lower_bound_s": b.lower_bound_s, "step_time_bound_by": b.bound_by,
        "step_time_expected_s": b.expected_s,
        "mfu_ceiling_fraction": plan.mfu_ceiling, "tokens_per_s_upper_bound": plan.tokens_per_s,
        "price_per_chip_hour_usd": catalogue.price_per_chip_hour(c.capacity),
        "cost_per_hour_usd": c.per_hour, "cost_per_hour_on_demand_usd": c.per_hour_on_demand,
        "cost_per_hour_spot_usd": c.per_hour_spot, "steps": c.steps, "run_time_lower_bound_s": c.run_s,
        "run_cost_lower_bound_usd": c.run_usd(c.per_hour),
        "run_cost_on_demand_lower_bound_usd": c.run_usd(c.per_hour_on_demand),
        "run_cost_spot_lower_bound_usd": c.run_usd(c.per_hour_spot),
        "advice": {"smallest_slice": advice.smallest_slice.name if advice.smallest_slice else None,
                   "slices_needed": advice.slices_needed, "slices_needed_accelerator": advice.accelerator.name,
                   **({"fitting_mesh": advice.fitting_mesh.text()} if advice.fitting_mesh else {})},
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
        f"          {mesh_source_text(plan)}",
    ]


def mesh_source_text(plan: Plan) -> str:
    """Where the plan's mesh came from, and whether the run's trainer is started with it."""
    flag = f"--mesh {plan.mesh.text()}"
    if plan.mesh_source == "--mesh":
        return "given with --mesh (a what-if: the run's trainer gets trainer.mesh, or its own plan's choice)"
    if plan.mesh_source == "trainer.mesh":
        return f"given in trainer.mesh: the trainer is started with {flag}"
    if plan.config_mesh:
        return (f"chosen by the plan for this target (trainer.mesh {plan.config_mesh} covers the config's own "
                "target, not this one: the run's trainer is started with it there)")
    if plan.what_if:
        return ("chosen by the plan for this model and target (trainer.mesh is not set: the run's trainer "
                "gets the plan's choice for the config's own target)")
    return f"chosen by the plan (trainer.mesh is not set): the trainer is started with {flag}"


def plan_rows(*rows: tuple[str, ...]) -> list[str]:
    """(label, value[, note]) rows in the plan's columns: labels at least 30 wide, values right-aligned
    in at least 12, then the note."""
    cells = [(label, value, f"   {note[0]}" if note and note[0] else "") for label, value, *note in rows]
    return ["  " + line for line in table_lines(cells, right=(1,), min_widths=(30, 12), gap=0)]


def _memory_lines(plan: Plan) -> list[str]:
    mem, m = plan.memory, plan.model
    other = "without" if m.model.remat else "with"
    other_bytes = mem.activations_no_remat if m.model.remat else mem.activations_remat
    status = (f"FITS ({human_bytes(mem.hbm - mem.total)} free)" if plan.fits
              else f"DOES NOT FIT ({human_bytes(mem.shortfall)} over)")
    return ["", "memory per chip", *plan_rows(
        (f"parameters ({m.param_dtype})", human_bytes(mem.params)),
        ("gradients", human_bytes(mem.grads)),
        ("optimizer (AdamW mu, nu)", human_bytes(mem.optimizer)),
        *([("gathered weights (FSDP)", human_bytes(mem.gathered))] if mem.gathered else []),
        (f"activations ({'remat' if m.model.remat else 'no remat'})", human_bytes(mem.activations),
         f"{other} remat: {human_bytes(other_bytes)}"),
        ("total", human_bytes(mem.total), f"of {human_bytes(mem.hbm)} HBM: {status}"),
    )]


def _speed_lines(plan: Plan) -> list[str]:
    b, t, acc = plan.bounds, plan.traffic, plan.target.accelerator
    dcn = ("DCN between slices", human_seconds(b.dcn_s), f"{human_bytes(t.dcn)} per chip")
    return ["", "speed (per step: lower bounds, then what to expect)", *plan_rows(
        ("FLOPs per token", human_flops(plan.flops_per_token),
         f"matmuls {human_flops(6.0 * plan.counts.matmul_active)}, "
         f"attention {human_flops(attention_flops_per_token(plan.model))}"),
        (f"compute ({acc.peak_bf16_tflops_per_chip:g} TFLOP/s x {plan.mesh.chips})", human_seconds(b.compute_s)),
        (f"HBM ({acc.hbm_gbps_per_chip:g} GB/s)", human_seconds(b.hbm_s), f"{human_bytes(t.hbm)} per chip"),
        (f"ICI ({acc.ici_gbps_per_chip:g} Gbps)", human_seconds(b.ici_s),
         f"{human_bytes(t.ici)} per chip, all-to-all {human_bytes(t.all_to_all)}"
         + (f", tensor-parallel {human_bytes(t.tensor_parallel)}" if plan.mesh.model > 1 else "")),
        *([dcn] if plan.mesh.slices > 1 else []),
        ("step time", human_seconds(b.lower_bound_s), f"bound by {b.bound_by}"),
        ("expected step", human_seconds(b.expected_s),
         f"compute at {COMPUTE_EFFICIENCY:.0%} of peak, as measured on a v5e chip"),
        ("MFU ceiling", f"{plan.mfu_ceiling:.1%}", f"{human_count(plan.tokens_per_s)} tokens/s at most"),
    )]


def _cost_lines(plan: Plan) -> list[str]:
    c = plan.cost
    return ["", "cost", *plan_rows(
        (f"per hour ({c.capacity})", usd(c.per_hour),
         f"on demand {usd(c.per_hour_on_demand)}, spot {usd(c.per_hour_spot)}"),
        (f"{c.steps} steps", f">= {human_seconds(c.run_s)}",
         f">= {usd(c.run_usd(c.per_hour))} {c.capacity} (on demand {usd(c.run_usd(c.per_hour_on_demand))})"),
    )]


def _advice_lines(plan: Plan) -> list[str]:
    lines = ["", f"advice    {advice_text(plan.advice)}"]
    lines += [f"warning   {w}" for w in plan.warnings]
    return lines + ["", verdict_line(plan)]


# ----------------------------------------------------------------------------- the verdict


@dataclasses.dataclass(frozen=True)
class Verdict:
    fits: bool
    line: str
    shortfall_bytes: int  # per chip; 0 when it fits
    fitting_mesh: str | None = None  # where the mesh given does not fit: the one that does on the target


def verdict_of(plan: Plan) -> Verdict:
    fitting = plan.advice.fitting_mesh
    return Verdict(fits=plan.fits, line=verdict_line(plan), shortfall_bytes=plan.memory.shortfall,
                   fitting_mesh=fitting.text() if fitting is not None and not plan.fits else None)


def verdict(cfg: Config) -> Verdict:
    """The one-line answer for a config, as `run` prints it before it creates anything."""
    return verdict_of(plan_for(cfg))


