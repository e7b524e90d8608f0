"""The TPU v5e slice lifecycle on queued resources: up (with zone fallback), status, down, list.

Everything here talks to `session.tpu` and waits on `session.clock`; it does not
know whether the other end is Google Cloud or the emulator.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable

from provision import catalogue
from provision.errors import CloudError, StockoutError, UsageError
from provision.kinds.tpu_vm.slice_render import STATUS_FILE, create_queued_resource_request, queued_resource_id
from provision.rendering import trainer_context
from provision.resources import RUN_LABEL, Resource, is_managed, location_path, project_of, short, verify_deleted
from provision.waiting import format_duration, poll

# FAILED codes that mean "no capacity here", each worth another zone: RESOURCE_EXHAUSTED (8, a
# stockout), FAILED_PRECONDITION (9, insufficient reserved capacity). A request that outlived
# queueing_policy's valid-until (slice.max_wait) is recognised by its times instead (`expired`): the
# code it ends with is undocumented (13 has been seen).
STOCKOUT_CODES = {8, 9}
# Polls go on a little past slice.max_wait so that the API's own valid-until verdict is seen.
MAX_WAIT_GRACE_S = 600
SETTLED_QR_STATES = {"ACTIVE", "FAILED", "SUSPENDED"}


# --- names -------------------------------------------------------------------
def queued_resource_name(cfg, project: str, zone: str) -> str:
    return f"{location_path(project, zone)}/queuedResources/{queued_resource_id(cfg.run)}"


def state_name(qr) -> str:
    return qr.state.state.name


def expired(qr, now: float) -> bool:
    """Whether the service failed a queued resource because its valid-until passed: FAILED by the
    service (state_initiator SERVICE) at or after create_time + valid_until_duration (or
    valid_until_time), whatever error code it carries."""
    if state_name(qr) != "FAILED" or qr.state.state_initiator.name != "SERVICE" or "queueing_policy" not in qr:
        return False
    policy = qr.queueing_policy
    if "valid_until_time" in policy:
        deadline = policy.valid_until_time.timestamp()
    elif "valid_until_duration" in policy and "create_time" in qr:
        deadline = qr.create_time.timestamp() + policy.valid_until_duration.total_seconds()
    else:
        return False
    return now >= deadline


def failure_of(qr) -> tuple[int | None, str]:
    error = qr.state.failed_data.error if qr.state.failed_data else None
    if error is None or (not error.code and not error.message):
        return None, ""
    return error.code, error.message


# --- reading resources -------------------------------------------------------
def _node_labels_of(qr) -> dict[str, str]:
    for spec in qr.tpu.node_spec:
        if spec.node.labels:
            return dict(spec.node.labels)
    return {}


def _node_resource(node, zone: str) -> Resource:
    accel = catalogue.ACCELERATORS.get(node.accelerator_type)
    spot = bool(node.scheduling_config.spot or node.scheduling_config.preemptible)
    created = node.create_time.timestamp() if node.create_time else None
    return Resource(
        kind="node", name=node.name, state=node.state.name, zone=zone, run=node.labels.get(RUN_LABEL),
        accelerator=node.accelerator_type, created=created, chips=accel.chips if accel else 0,
        price_per_chip_hour=catalogue.price_per_chip_hour("spot" if spot else "on-demand"),
        workers=[e.ip_address for e in node.network_endpoints if e.ip_address],
    )


def _qr_resource(qr, zone: str) -> Resource:
    accel = qr.tpu.node_spec[0].node.accelerator_type if qr.tpu.node_spec else None
    code, message = failure_of(qr)
    created = qr.create_time.timestamp() if qr.create_time else None
    return Resource(kind="queued_resource", name=qr.name, state=state_name(qr), zone=zone,
                    run=_node_labels_of(qr).get(RUN_LABEL), accelerator=accel, created=created,
                    error=f"code {code}: {message}" if message else None)


def managed_resources(session, project: str, zones: Iterable[str], run: str | None = None) -> list[Resource]:
    """Every queued resource and node this tool made (by label, filtered here), optionally one run's."""
    found: list[Resource] = []
    for zone in zones:
        parent = location_path(project, zone)
        for qr in session.tpu.list_queued_resources(parent):
            labels = _node_labels_of(qr)
            if is_managed(labels, run):
                found.append(_qr_resource(qr, zone))
        for node in session.tpu.list_nodes(parent):
            labels = dict(node.labels)
            if is_managed(labels, run):
                found.append(_node_resource(node, zone))
    return found


# --- up ----------------------------------------------------------------------
def _describe_qr(zone: str):
    def describe(qr, elapsed: float) -> str:
        return f"  {short(qr.name)} in {zone}: {state_name(qr)} (waited {format_duration(elapsed)})"

    return describe


def _wait_settled(context, name: str, zone: str):
    """Poll the queued resource until ACTIVE, FAILED or SUSPENDED (or slice.max_wait passes)."""
    session, max_wait = context.session, context.config.slice.max_wait

    def fetch():
        qr = session.tpu.get_queued_resource(name)
        if qr is None:
            raise CloudError(f"queued resource {name} disappeared while waiting for it",
                             hint="someone deleted it; run `moe-tpu slice up` again")
        return qr

    with context.console.progress(f"  waiting for {short(name)} in {zone}") as bar:
        return poll(fetch, lambda qr: state_name(qr) in SETTLED_QR_STATES, session.clock,
                    timeout_s=max_wait.total_seconds() + MAX_WAIT_GRACE_S, describe=_describe_qr(zone),
                    progress=bar, what=f"queued resource {short(name)} in {zone}")


def nodes_of(session, project: str, zone: str, qr) -> list:
    """The nodes a queued resource made: by back-reference, else by the ids in its node spec."""
    ids: set[str] = set()
    prefixes: list[str] = []
    for spec in qr.tpu.node_spec:
        if spec.node_id:
            ids.add(spec.node_id)
        elif spec.multislice_params.node_id_prefix:
            prefixes.append(spec.multislice_params.node_id_prefix + "-")
    nodes = []
    for node in session.tpu.list_nodes(location_path(project, zone)):
        node_short = short(node.name)
        if node.queued_resource == qr.name or node_short in ids or any(node_short.startswith(p) for p in prefixes):
            nodes.append(node)
    return sorted(nodes, key=lambda n: n.name)


def _wait_nodes_ready(context, project: str, zone: str, qr) -> list:
    session = context.session
    expected = max(1, context.config.slice.count)

    def ready(nodes) -> bool:
        return len(nodes) >= expected and all(n.state.name == "READY" for n in nodes)

    def describe(nodes, elapsed: float) -> str:
        states = ", ".join(f"{short(n.name)} {n.state.name}" for n in nodes) or "no nodes yet"
        return f"  nodes: {states}"

    with context.console.progress("  waiting for the nodes") as bar:
        return poll(lambda: nodes_of(session, project, zone, qr), ready, session.clock,
                    timeout_s=1800, describe=describe, progress=bar, what="the slice's nodes")


def _create_or_adopt(context, project: str, zone: str, name: str, attempt: int = 0, recreate: bool = False):
    cfg, session, console = context.config, context.session, context.console

    existing = session.tpu.get_queued_resource(name)
    if existing is not None and state_name(existing) in ("FAILED", "SUSPENDED"):
        console.info(f"  {short(name)} in {zone} is {state_name(existing)} from an earlier attempt; "
                     "deleting it first (it still counts against quota)")
        _delete_and_wait(context, name)
        existing = None
    elif existing is not None and state_name(existing) == "DELETING":
        # An earlier teardown that was cut short (a kill during `down` or at a run's end): finish it,
        # then create anew; a resource on its way out is never adopted.
        console.info(f"  {short(name)} in {zone} is being deleted (an earlier teardown); waiting until it is gone")
        _delete_and_wait(context, name)
        existing = None
    render_ctx = trainer_context(cfg, context.image, project, status_file=STATUS_FILE)
    request = create_queued_resource_request(cfg.slice, render_ctx, zone, context.renderer, attempt=attempt)
    if existing is not None:
        differences = qr_differences(request.queued_resource, existing)
        if differences and recreate:
            console.info(f"  {short(name)} in {zone} differs from the config ({'; '.join(differences)}); "
                         "deleting it to create it anew (--recreate)")
            _delete_and_wait(context, name)
            existing = None
        elif differences:
            raise CloudError(f"queued resource {short(name)} in {zone} ({state_name(existing)}) exists but no longer "
                             f"matches the config: {'; '.join(differences)}",
                             hint=f"run `moe-tpu down -c {cfg.source}` to delete it, then `moe-tpu slice up` again "
                                  "(or `moe-tpu slice up --recreate`)")
        else:
            console.info(f"  adopting existing queued resource {short(name)} in {zone} ({state_name(existing)})")
            return
    console.info(f"  creating queued resource {short(name)} in {zone}: "
                 f"{cfg.slice.count} x {cfg.slice.accelerator}, {cfg.slice.capacity}")
    operation = session.tpu.create_queued_resource(request)
    if operation is None:
        console.info(f"  {short(name)} already exists (an earlier attempt created it); adopting it")
        return
    session.tpu.wait_operation(operation, f"create {short(name)}", timeout_s=600)
    if session.tpu.get_queued_resource(name) is None:
        # The deterministic request_id was spent on an earlier incarnation that has since been
        # deleted (down, or recovery from a stockout or preemption): the API answered with that
        # old operation. Ask again under a fresh id derived from this moment.
        request.request_id = str(uuid.uuid5(uuid.UUID(request.request_id), repr(session.clock.now())))
        console.detail(f"  request id already used by a deleted {short(name)}; creating with a new one")
        operation = session.tpu.create_queued_resource(request)
        if operation is not None:
            session.tpu.wait_operation(operation, f"create {short(name)}", timeout_s=600)


def _shape(qr) -> dict[str, object]:
    """What a queued resource provisions: the fields a config change can alter."""
    specs = list(qr.tpu.node_spec)
    node = specs[0].node if specs else None
    multislice = specs[0].multislice_params.node_count if specs else 0
    capacity = ("spot" if "spot" in qr else "reserved" if qr.reservation_name
                else "on-demand" if "guaranteed" in qr else "default")
    return {"accelerator": node.accelerator_type if node else None,
            "runtime version": node.runtime_version if node else None,
            "slice count": multislice or len(specs), "capacity": capacity,
            "reservation": qr.reservation_name or None}


def qr_differences(wanted, existing) -> list[str]:
    """How an existing queued resource differs from the one the config asks for ("" when it matches)."""
    want, have = _shape(wanted), _shape(existing)
    return [f"{key} is {have[key]} (the config asks for {want[key]})" for key in want if want[key] != have[key]]


def check_zones_offer(cfg, session) -> None:
    """Each zone the catalogue does not list for v5e must offer the slice's accelerator type by the
    API's own list (ListAcceleratorTypes); a zone that does not is a UsageError naming what it offers."""
    unknown = [zone for zone in cfg.zones if zone not in catalogue.V5E_ZONES]
    if not unknown:
        return
    project = project_of(cfg, session)
    for zone in unknown:
        offered = session.tpu.list_accelerator_types(location_path(project, zone))
        if cfg.slice.accelerator not in offered:
            v5e = [name for name in offered if name in catalogue.ACCELERATORS]
            raise UsageError(f"zone {zone} does not offer {cfg.slice.accelerator}: the API lists "
                             + (", ".join(v5e) if v5e else "no TPU v5e type") + " there",
                             hint=f"use a zone Google documents for v5e: {', '.join(catalogue.V5E_ZONES)}")


def slice_up(context, attempt: int = 0, recreate: bool = False, zones: list[str] | None = None) -> list[Resource]:
    """Provision the run's slice (provision.context.RunContext: its config, session, console and
    renderer), trying each zone in order on stockout: `zones`, by default the config's. Returns its
    resources.

    `attempt` counts deliberate re-creations (recovery after a preemption): each gets its own
    request id, so the API never answers a new create with an earlier incarnation's operation.
    `recreate` deletes a queued resource of the run that no longer matches the config instead of
    failing on it."""
    cfg, session, console = context.config, context.session, context.console
    check_zones_offer(cfg, session)
    project = project_of(cfg, session)
    tried: list[str] = []
    for zone in cfg.zones if zones is None else zones:
        name = queued_resource_name(cfg, project, zone)
        _create_or_adopt(context, project, zone, name, attempt, recreate)
        qr = _wait_settled(context, name, zone)
        state = state_name(qr)
        if state == "ACTIVE":
            nodes = _wait_nodes_ready(context, project, zone, qr)
            return [_qr_resource(qr, zone)] + [_node_resource(n, zone) for n in nodes]
        code, message = failure_of(qr)
        timed_out = expired(qr, session.clock.now())
        if state == "FAILED" and (timed_out or code in STOCKOUT_CODES):
            # In the config's own syntax (its parser's inverse), as the user wrote it.
            why = (f"not provisioned within slice.max_wait ({format_duration(cfg.slice.max_wait, exact=True)})"
                   if timed_out else "no capacity")
            tried.append(f"{zone} ({why})")
            console.warn(f"{why} in {zone}: {message}")
            _delete_and_wait(context, name)
            continue
        raise CloudError(f"queued resource {short(name)} in {zone} ended {state}"
                         + (f" (code {code}: {message})" if message else ""),
                         hint="run `moe-tpu down` to clean up, then `moe-tpu slice up` to try again")
    raise StockoutError(
        f"no capacity for {cfg.slice.count} x {cfg.slice.accelerator} ({cfg.slice.capacity}) "
        f"in any zone tried: {', '.join(tried)}",
        hint=_stockout_hint(cfg))


def _stockout_hint(cfg) -> str:
    """What else to try, leaving out what the config already does."""
    tries = ["add zones to `zones:`", "raise `slice.max_wait`"]
    if cfg.slice.capacity != "spot":
        tries.append("try `slice.capacity: spot`")
    if cfg.slice.capacity != "reserved":
        tries.append("use a reservation (`slice.capacity: reserved` with `slice.reservation`)")
    else:
        tries.append("check that the reservation `slice.reservation` has room for this slice")
    return ", ".join(tries[:-1]) + ", or " + tries[-1]


# --- down --------------------------------------------------------------------
def _delete_and_wait(context, name: str) -> bool:
    """Delete a queued resource with force=true (its nodes go too); True if there was one."""
    tpu = context.session.tpu
    operation = tpu.delete_queued_resource(name, force=True)
    if operation is None:
        return False
    context.console.info(f"  deleting {short(name)} (force: its nodes go with it)")
    tpu.wait_operation(operation, f"delete {short(name)}", timeout_s=3600)
    return True


def slice_down(context) -> list[Resource]:
    """Delete every queued resource and node of this run in all its zones, then verify none is left."""
    cfg, session, console = context.config, context.session, context.console
    project = project_of(cfg, session)
    deleted: list[Resource] = []
    for zone in cfg.zones:
        for res in managed_resources(session, project, [zone], run=cfg.run):
            if res.kind == "queued_resource" and _delete_and_wait(context, res.name):
                deleted.append(res)
        # Nodes left without a queued resource (e.g. made by hand with our labels).
        for res in managed_resources(session, project, [zone], run=cfg.run):
            if res.kind == "node":
                operation = session.tpu.delete_node(res.name)
                if operation is not None:
                    console.info(f"  deleting node {short(res.name)}")
                    session.tpu.wait_operation(operation, f"delete {short(res.name)}", timeout_s=3600)
                    deleted.append(res)
    verify_deleted(managed_resources(session, project, cfg.zones, run=cfg.run))
    return deleted


def slice_status(context) -> list[Resource]:
    cfg, session = context.config, context.session
    return managed_resources(session, project_of(cfg, session), cfg.zones, run=cfg.run)
