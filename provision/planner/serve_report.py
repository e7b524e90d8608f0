"""`moe-tpu plan --serve` for people (its table and verdict) and for scripts (its JSON document, every
figure's unit in its key)."""

from __future__ import annotations

from typing import Any

from provision.planner.report import human_bytes, human_count, human_seconds, plan_rows
from provision.planner.report import usd as _usd
from provision.planner.serve_plan import Row, ServePlan
from provision.planner.serve_shapes import hosts_document, hosts_line
from provision.planner.serving import DecodeStep, latent_capacity
from trainer.arith.quant import QUANTIZED_WEIGHTS

# The weight precisions trainer/serve loads: the checkpoint's float dtype (--weights auto) and those it
# quantizes to on load (the engine's own list).
ENGINE_WEIGHTS = frozenset({"bf16", "float32", *QUANTIZED_WEIGHTS})


def engine_serves(row: Row) -> bool:
    return row.serving.weight_precision in ENGINE_WEIGHTS

def usd(x: float) -> str:
    """Dollars to the cent, or to three significant figures below a cent (a small model's tokens)."""
    return _usd(x) if x >= 0.01 or x == 0 else f"${x:.3g}"


# ----------------------------------------------------------------------------- JSON


def _step_document(plan: ServePlan, step: DecodeStep | None) -> dict[str, Any] | None:
    if step is None:
        return None
    return {
        "batch_slots": step.batch, "experts_touched_per_layer": step.experts_touched,
        "weight_read_bytes_per_chip": step.weight_read_bytes, "kv_read_bytes_per_chip": step.kv_read_bytes,
        "flops_per_chip": step.flops, "ici_bytes_per_chip": step.ici_bytes,
        "step_time_hbm_s": step.hbm_s, "step_time_compute_s": step.compute_s, "step_time_ici_s": step.ici_s,
        "step_time_lower_bound_s": step.lower_bound_s, "step_bound_by": step.bound_by,
        "step_time_expected_s": step.expected_s,
        "tokens_per_s_per_chip": step.tokens_per_s_per_chip,
        "tokens_per_s_per_replica": step.tokens_per_s_per_chip * step.chips,
        "cost_per_million_tokens_usd": plan.cost_per_million(step),
    }


def _row_document(plan: ServePlan, row: Row) -> dict[str, Any]:
    s = row.serving
    return {
        "weights_precision": s.weight_precision, "kv_cache_precision": s.kv_precision, "fits": row.fits,
        "configured": row.name == plan.configured,
        "weights_bytes_per_chip": s.weights.held, "kv_cache_bytes_per_chip": s.kv_cache_bytes(row.slots),
        "memory_bytes_per_chip": s.memory(row.slots), "hbm_usable_bytes_per_chip": s.usable(),
        "kv_cache_bytes_per_token": s.kv_per_token, "fsdp_gathered_bytes_per_chip": s.weights.gathered,
        "largest_batch_slots": row.largest_batch,
        "decode": _step_document(plan, row.step), "decode_batch_1": _step_document(plan, row.step_batch_1),
        "decode_largest_batch": _step_document(plan, row.step_largest),
        **latent_capacity_document(row),
    }


def latent_capacity_document(row: Row) -> dict[str, Any]:
    """Latent attention's cache against an uncompressed one in a chip's leftover HBM (empty otherwise)."""
    cap = latent_capacity(row.serving)
    if cap is None:
        return {}
    return {"latent_cache": {
        "context_tokens": cap.tokens, "leftover_hbm_bytes_per_chip": cap.leftover,
        "latent_bytes_per_token": cap.latent_per_token, "uncompressed_bytes_per_token": cap.uncompressed_per_token,
        "latent_cache_slots": cap.latent_sequences, "uncompressed_cache_slots": cap.uncompressed_sequences}}


def serve_document(plan: ServePlan) -> dict[str, Any]:
    """The `serve` part of `plan --serve --output json`."""
    mesh, acc = plan.mesh, plan.accelerator
    return {"serve": {
        "verdict": serve_verdict(plan),
        "model": plan.plan.model_name, "accelerator": acc.name, "topology": acc.topology, "chips": plan.chips,
        "hardware_source": plan.hardware_source,
        "mesh": {"data_ways": mesh.data, "expert_ways": mesh.expert, "model_ways": mesh.model,
                 "server_flag": f"--mesh {mesh.text()}", "source": plan.mesh_source, "reason": mesh.reason},
        "batch_slots": plan.slots, "max_len_tokens": plan.max_len,
        "kv_cache_layout": plan.rows[0].serving.kv.note,
        "platform": plan.platform, "price_basis": plan.price_basis, "capacity": plan.capacity,
        "price_per_chip_hour_usd": plan.price_per_chip_hour,
        "price_per_replica_hour_usd": plan.price_per_chip_hour * plan.chips,
        "configured_precision": plan.configured,
        "precisions": {row.name: _row_document(plan, row) for row in plan.rows},
        **({"claim": _claim_document(plan)} if plan.claim_s is not None else {}),
        "hosts": hosts_document(plan),
        "warnings": list(plan.warnings),
    }}


def _claim_document(plan: ServePlan) -> dict[str, Any]:
    return {"step_time_s": plan.claim_s,
            "meets": {row.name: {bound: plan.claim_s >= seconds for bound, seconds in _bounds(row.step)}
                      for row in plan.rows},
            "reachable": [row.name for row in plan.rows if row.fits and plan.claim_s >= row.step.lower_bound_s]}


def _bounds(step: DecodeStep) -> tuple[tuple[str, float], ...]:
    return (("HBM", step.hbm_s), ("compute", step.compute_s), ("ICI", step.ici_s))


# ----------------------------------------------------------------------------- the verdict


def _best(plan: ServePlan) -> Row | None:
    """The row to headline: the configured precision when it fits, else the most precise that fits and
    that the engine serves."""
    fitting = [row for row in plan.rows if row.fits and engine_serves(row)]
    return next((r for r in fitting if r.name == plan.configured), fitting[0] if fitting else None)


def claim_text(plan: ServePlan) -> str:
    """Which bounds a claimed step time meets, at each precision (those that do not fit said so)."""
    parts = []
    for row in plan.rows:
        met = [f"{name} ({human_seconds(s)})" for name, s in _bounds(row.step) if plan.claim_s >= s]
        broken = [f"{name} ({human_seconds(s)})" for name, s in _bounds(row.step) if plan.claim_s < s]
        where = row.name + ("" if row.fits else " (which does not fit)")
        text = f"at {where} it meets the {_join(met)} bound{'s' if len(met) > 1 else ''}" if met else \
            f"at {where} it meets no bound"
        if broken:
            text += f" but not the {_join(broken)} bound{'s' if len(broken) > 1 else ''}"
        parts.append(text)
    reachable = [row.name for row in plan.rows if row.fits and plan.claim_s >= row.step.lower_bound_s]
    verdict = (f"reachable at {', '.join(reachable)} only" if reachable else "reachable at no precision that fits")
    return (f"a claimed {plan.claim_s * 1e3:g} ms decode step at {plan.slots} slots is {verdict}: "
            + "; ".join(parts))


def _join(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


def serve_verdict(plan: ServePlan) -> str:
    acc = plan.accelerator
    head = (f"{plan.plan.model_name} ({human_count(plan.plan.counts.total)} params) on {plan.chips} v5e chips "
            f"({acc.topology}), mesh {plan.mesh.text()}, {plan.slots} slots x {plan.max_len} tokens")
    fits = [r.name for r in plan.rows if r.fits and engine_serves(r)]
    misfits = [r.name for r in plan.rows if not r.fits and engine_serves(r)]
    unserved = [r.name for r in plan.rows if r.fits and not engine_serves(r)]
    engine = f"the engine serves {_join(sorted(ENGINE_WEIGHTS))} weights (trainer/serve)"
    best = _best(plan)
    if best is None:
        least = min(plan.rows, key=lambda r: r.serving.memory(r.slots))
        text = (f"SERVES AT NO PRECISION: {head}: even {least.name} needs "
                f"{human_bytes(least.serving.memory(least.slots))} per chip of {human_bytes(least.serving.usable())}"
                if not unserved else
                f"SERVES AT NO PRECISION THE ENGINE SERVES: {head}: only {_join(unserved)} fits, and {engine}")
    else:
        step = best.step
        text = (f"SERVES at {', '.join(fits)}{' (not ' + ', '.join(misfits) + ')' if misfits else ''}: {head}; "
                f"{best.name}: step >= {human_seconds(step.lower_bound_s)} ({step.bound_by}-bound), "
                f"{step.tokens_per_s_per_chip:,.1f} tokens/s per chip, {usd(plan.cost_per_million(step))} per "
                f"million output tokens ({plan.platform}, {plan.capacity})")
        if unserved:
            text += f"; {_join(unserved)} would fit too, but {engine}"
    if plan.claim_s is not None:
        claim = claim_text(plan)
        text += f". {claim[0].upper()}{claim[1:]}"
    return text


# ----------------------------------------------------------------------------- text


def serve_lines(plan: ServePlan) -> list[str]:
    acc, mesh = plan.accelerator, plan.mesh
    where = {"serve": "the serve section", "--accelerator": "--accelerator", "plan": "the plan's target"}
    mesh_from = {"--mesh": "given with --mesh", "serve.mesh": "given in serve.mesh", "plan": "the plan's mesh",
                 "serving": f"chosen for serving: {mesh.reason}"}[plan.mesh_source]
    lines = ["", f"serving   one replica: {plan.chips} chips ({acc.topology}, from {where[plan.hardware_source]}), "
                 f"{plan.slots} slots x {plan.max_len} tokens",
             f"          mesh {mesh.text()} ({mesh_from}); {_deployed_with(plan)}",
             f"          KV cache {plan.rows[0].serving.kv.note}; {plan.platform} at "
             f"{usd(plan.price_per_chip_hour)} per chip-hour ({plan.capacity}: {plan.price_basis})",
             hosts_line(plan, hosts_document(plan))]
    for row in plan.rows:
        lines += _row_lines(plan, row)
    lines += [""] + [f"warning   {w}" for w in plan.warnings] if plan.warnings else []
    return lines + ["", serve_verdict(plan)]


def _deployed_with(plan: ServePlan) -> str:
    """Which server the mesh is for: `deploy` renders it into each replica's argv where it is the serve
    section's (its serve.mesh, or the plan's choice), not where --mesh only asks what if."""
    flag = f"--mesh {plan.mesh.text()}"
    if plan.hardware_source == "serve" and plan.mesh_source != "--mesh":
        return f"deploy starts each replica's server with {flag}"
    if plan.hardware_source == "serve":
        return f"the server takes {flag} (deploy uses it once it is the config's serve.mesh)"
    return f"the server takes {flag}"


def _row_lines(plan: ServePlan, row: Row) -> list[str]:
    s, step, one = row.serving, row.step, row.step_batch_1
    status = "FITS" if row.fits else "DOES NOT FIT"
    conf = " (configured)" if row.name == plan.configured else ""
    largest = (f"{row.largest_batch} slots: {row.step_largest.tokens_per_s_per_chip:,.1f} tokens/s per chip, "
               f"{usd(plan.cost_per_million(row.step_largest))}/M" if row.step_largest else "none")
    return ["", f"  {row.name}{conf}: {status}", *plan_rows(
        ("weights + KV cache per chip", human_bytes(s.memory(row.slots)),
         f"{human_bytes(s.weights.held)} + {human_bytes(s.kv_cache_bytes(row.slots))} of "
         f"{human_bytes(s.usable())} usable"),
        (f"decode step at {step.batch} slots", human_seconds(step.lower_bound_s),
         f"bound by {step.bound_by}: HBM {human_seconds(step.hbm_s)}, compute {human_seconds(step.compute_s)}, "
         f"ICI {human_seconds(step.ici_s)}; {step.experts_touched:.1f} experts a layer"),
        ("tokens/s per chip", f"{step.tokens_per_s_per_chip:,.1f}",
         f"{usd(plan.cost_per_million(step))} per million output tokens"),
        (f"expected step at {step.batch} slots", human_seconds(step.expected_s),
         f"at batch 1 {human_seconds(one.expected_s)}: the engine's steps as measured on a v5e chip"),
        ("decode step at batch 1", human_seconds(one.lower_bound_s), f"bound by {one.bound_by}"),
        ("largest batch that fits", str(row.largest_batch), largest),
        *latent_capacity_rows(row),
    )]


def latent_capacity_rows(row: Row) -> tuple[tuple[str, str, str], ...]:
    """The row's line on latent attention's cache against an uncompressed one (none otherwise)."""
    cap = latent_capacity(row.serving)
    if cap is None:
        return ()
    return ((f"sequences of {cap.tokens:,} tokens", f"{cap.latent_sequences:,}",
             f"in the {human_bytes(cap.leftover)} a chip has beside its weights: latent cache "
             f"{human_bytes(cap.latent_per_token)} a token; an uncompressed cache "
             f"({human_bytes(cap.uncompressed_per_token)} a token) would hold {cap.uncompressed_sequences:,}"),)
