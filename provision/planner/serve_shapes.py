"""Which v5e shapes hold a model for serving: the replica's hosts, the most one host holds (2x4, 8 chips),
and the smallest shape where a precision the engine serves fits. `plan --serve` says whether the model
needs more than one host; `deploy` refuses a replica it does not fit, naming the shape that holds it and
the kind of target that places it (a multi-host shape: GKE's LeaderWorkerSet; Vertex AI serves one host).
Arithmetic only (serving.py's), a mesh chosen per shape as `plan --serve` chooses one."""

from __future__ import annotations

import dataclasses

from provision import catalogue
from provision.planner.plan import model_ways
from provision.planner.serve_plan import ServePlan, best_mesh, serving_rows
from provision.planner.serving import PRECISIONS, serving_meshes

# The largest v5e shape on one host (what a Vertex AI endpoint or a GKE Deployment's pod can hold).
ONE_HOST = max((a for a in catalogue.ACCELERATORS.values() if not a.multi_host), key=lambda a: a.chips)


@dataclasses.dataclass(frozen=True)
class Shape:
    accelerator: catalogue.AcceleratorType
    precision: str | None  # the most precise the engine serves that fits (None: none)
    mesh: str


def _engine_serves(name: str) -> bool:
    """A row's weights are a precision trainer/serve loads (serve_report.engine_serves, by name)."""
    from trainer.arith.quant import QUANTIZED_WEIGHTS

    return name.split("/", 1)[0] in {"bf16", "float32", *QUANTIZED_WEIGHTS}


def hosts_document(plan: ServePlan) -> dict:
    """The replica's hosts for `plan --serve`: how many, their chips, each precision's bytes per host
    (the busiest chip's times the host's chips), and whether one host could hold the model at all."""
    acc, one = plan.accelerator, shape_fit(plan, ONE_HOST)
    return {"hosts": acc.vms, "chips_per_host": acc.chips_per_vm, "multi_host": acc.multi_host,
            "precisions": {row.name: {"memory_bytes_per_host": row.serving.memory(row.slots) * acc.chips_per_vm}
                           for row in plan.rows},
            "hbm_usable_bytes_per_host": plan.rows[0].serving.usable() * acc.chips_per_vm,
            "one_host": {"topology": ONE_HOST.topology, "chips": ONE_HOST.chips, "fits_at": one.precision},
            "needs_multi_host": one.precision is None, "smallest_shape": _smallest(plan, one)}


def _smallest(plan: ServePlan, one: Shape) -> dict | None:
    """Where one host cannot hold the model: the smallest multi-host shape that can (None: one host can, or
    no v5e shape does)."""
    shape = smallest_shape(plan, multi_host=True) if one.precision is None else None
    if shape is None:
        return None
    acc = shape.accelerator
    return {"topology": acc.topology, "chips": acc.chips, "hosts": acc.vms, "fits_at": shape.precision,
            "mesh": shape.mesh}


def hosts_line(plan: ServePlan, document: dict) -> str:
    """One line of `plan --serve`'s text: the hosts, the configured precision per host, the placement."""
    from provision.planner.report import human_bytes

    acc, configured = plan.accelerator, plan.configured
    hosts = f"{acc.vms} host{'s' if acc.multi_host else ''} x {acc.chips_per_vm} chips"
    per_host = (f"{configured}: {human_bytes(document['precisions'][configured]['memory_bytes_per_host'])} per host of "
                f"{human_bytes(document['hbm_usable_bytes_per_host'])} usable")
    where = ("multi-host: GKE serves it as a LeaderWorkerSet (a group of pods per replica); Vertex AI cannot"
             if acc.multi_host else "one host: a Vertex AI endpoint or a GKE Deployment")
    one = document["one_host"]
    need = (f"one host ({one['topology']}, {one['chips']} chips) holds it at no precision the engine serves: it "
            "needs multi-host" if document["needs_multi_host"] else
            f"one host ({one['topology']}, {one['chips']} chips) holds it at {one['fits_at']}")
    smallest = document["smallest_shape"]
    if smallest is not None:
        need += (f", the smallest shape that holds it being {smallest['topology']} ({smallest['hosts']} hosts) at "
                 f"{smallest['fits_at']}")
    return f"hosts     {hosts} ({where}); {per_host}; {need}"


def shape_fit(plan: ServePlan, acc: catalogue.AcceleratorType) -> Shape:
    """The best mesh of `acc`'s chips for the plan's model, slots and length, and what fits on it."""
    from trainer.arith.params import inventory as param_inventory
    from trainer.arith.quant import HEADROOM

    model_cfg = plan.plan.model
    params = param_inventory(model_cfg)
    pairs = [(p, p) for p in PRECISIONS]
    configured = next(row for row in plan.rows if row.name == plan.configured)
    if (configured.serving.weight_precision, configured.serving.kv_precision) not in pairs:
        pairs.append((configured.serving.weight_precision, configured.serving.kv_precision))
    candidates = [(m, serving_rows(params, model_cfg, m, acc, pairs, plan.slots, plan.max_len, HEADROOM))
                  for m in serving_meshes(model_cfg, acc.chips, plan.slots, model_ways(model_cfg))]
    if not candidates:
        return Shape(acc, None, "")
    mesh, _ = best_mesh(candidates, plan.configured)
    rows = next(rows for m, rows in candidates if m == mesh)
    fits = [row.name for row in rows if row.fits and _engine_serves(row.name)]
    first = plan.configured if plan.configured in fits else (fits[0] if fits else None)
    return Shape(acc, first, mesh.text())


def smallest_shape(plan: ServePlan, multi_host: bool = False) -> Shape | None:
    """The v5e shape with the fewest chips (of the multi-host ones with `multi_host`) where a precision the
    engine serves fits; None: not even 16x16."""
    for acc in sorted(catalogue.ACCELERATORS.values(), key=lambda a: a.chips):
        if multi_host and not acc.multi_host:
            continue
        shape = shape_fit(plan, acc)
        if shape.precision is not None:
            return shape
    return None


def _cache_problem(plan: ServePlan) -> str | None:
    """Where the weights fit at a precision the engine serves but not with the KV cache beside them: the
    cache's keys (serve.slots x serve.max_len), to lower; None otherwise."""
    served = [row for row in plan.rows if _engine_serves(row.name) and row.serving.memory(0) <= row.serving.usable()]
    if not served:
        return None
    row = min(served, key=lambda r: r.serving.kv_cache_bytes(plan.slots))
    room = row.serving.largest_batch()
    per_slot = int((row.serving.usable() - row.serving.weights.held) // max(row.serving.kv_cache_bytes(1) /
                                                                          row.serving.max_len, 1))
    return (f"its KV cache of serve.slots {plan.slots} x serve.max_len {plan.max_len:,} tokens does not fit beside "
            f"the weights ({row.name}: room for {room} slot(s) of that length, or {per_slot:,} tokens in all): lower "
            "serve.max_len or serve.slots")


def placement_problem(plan: ServePlan, multi_host: bool) -> str | None:
    """Why `deploy` cannot serve the plan's replica, naming the shape that can (and, where the config's kind
    serves no replica over several hosts, `multi_host` False, the kind that does); None when a precision the
    engine serves fits the replica."""
    if any(row.fits and _engine_serves(row.name) for row in plan.rows):
        return None
    acc = plan.accelerator
    head = (f"{plan.plan.model_name} fits one replica of {acc.topology} ({acc.chips} chips) at no precision the "
            "engine serves (`moe-tpu plan --serve` shows each)")
    cache = _cache_problem(plan)
    if cache is not None:
        head += f": {cache}"
    shape = smallest_shape(plan)
    if shape is None:
        return head if cache else f"{head}, nor any v5e shape up to 16x16"
    where = shape.accelerator
    setting = (f"serve.topology: {where.topology} (serve.machine_type: {where.vertex_machine_type})" if where.multi_host
               else f"serve.machine_type: {where.vertex_machine_type} (serve.topology unset)")
    text = (f"{head}; {'or: ' if cache else ''}the smallest shape that holds it is {where.topology} "
            f"({where.chips} chips on {where.vms} "
            f"host{'s' if where.vms > 1 else ''}) at {shape.precision}: set {setting}")
    if where.multi_host and not multi_host:
        text += " on target: gke (a LeaderWorkerSet serves a replica over several hosts; Vertex AI serves one)"
    return text
