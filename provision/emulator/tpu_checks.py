"""The Cloud TPU v2 request checks: node specs, capacity, reservations, quota, what a zone offers.

Pure checks on a request and the emulated world, raising the API's errors (validate.ApiError);
provision/emulator/tpu.py makes the changes and serves the RPCs.
"""

from __future__ import annotations

from google.cloud import tpu_v2
from google.rpc import error_details_pb2

from provision.emulator import offerings, validate
from provision.emulator.validate import ApiError, not_found
from provision.emulator.world import World

QR = tpu_v2.QueuedResource
Node = tpu_v2.Node


def _accelerator_name(zone: str, node: Node) -> str:
    if node.accelerator_type:
        return node.accelerator_type
    if "accelerator_config" in node and node.accelerator_config.topology:
        config = node.accelerator_config
        return validate.accelerator_from_config(zone, config.type_.name, config.topology)
    return ""


def capacity(qr: QR) -> tuple[bool, bool]:
    """(spot?, reserved?) of a queued resource request: its tier or its nodes' scheduling config."""
    scheduling = [spec.node.scheduling_config for spec in qr.tpu.node_spec]
    spot = "spot" in qr or any(s.spot or s.preemptible for s in scheduling)
    reserved = bool(qr.reservation_name) or "guaranteed" in qr or any(s.reserved for s in scheduling)
    return spot, reserved and not spot


def _node_ids(spec: QR.Tpu.NodeSpec, index: int, qr_id: str) -> tuple[list[str], bool]:
    """The node ids one node spec names, and whether it is a multislice."""
    strategy = QR.Tpu.NodeSpec.pb(spec).WhichOneof("name_strategy")
    if strategy is None:
        raise ApiError("INVALID_ARGUMENT",
                       f"node_spec[{index}]: exactly one of node_id or multislice_params must be set")
    if strategy == "node_id":
        validate.node_id(spec.node_id)
        return [spec.node_id], False
    count = spec.multislice_params.node_count
    if count < 2:
        raise ApiError("INVALID_ARGUMENT",
                       f"node_spec[{index}].multislice_params.node_count must be > 1, got {count}")
    prefix = spec.multislice_params.node_id_prefix or qr_id
    validate.node_id(prefix)
    return [f"{prefix}-{i}" for i in range(count)], True


def check_node_specs(qr: QR, parent: str, zone: str, qr_id: str) -> tuple[list[tuple[str, int]], bool]:
    """Validate every node spec; (node names with their spec index, multislice?)."""
    if not qr.tpu.node_spec:
        raise ApiError("INVALID_ARGUMENT", "queued_resource.tpu.node_spec must name at least one node")
    nodes: list[tuple[str, int]] = []
    multislice = False
    for index, spec in enumerate(qr.tpu.node_spec):
        if spec.parent != parent:
            raise ApiError("INVALID_ARGUMENT",
                           f"node_spec[{index}].parent {spec.parent!r} must equal the request parent {parent!r}")
        ids, many = _node_ids(spec, index, qr_id)
        multislice = multislice or many
        acc = check_node(spec.node, zone)
        spec.node.accelerator_type = acc.name  # recorded: the world reads the type back by name
        nodes.extend((f"{parent}/nodes/{i}", index) for i in ids)
    if len({n for n, _ in nodes}) != len(nodes):
        raise ApiError("INVALID_ARGUMENT", "node ids in queued_resource.tpu.node_spec must be unique")
    return nodes, multislice


def check_node(node: Node, zone: str):
    """A node's own checks, for queued resources and CreateNode alike; its accelerator type."""
    acc = validate.accelerator(zone, _accelerator_name(zone, node))
    validate.runtime_version(acc, node.runtime_version)
    validate.labels(dict(node.labels))
    validate.metadata(dict(node.metadata))
    return acc


def check_reservation(world: World, qr: QR, project: str, zone: str, spot: bool, chips: int) -> bool:
    """Check reservation_name against the emulated world's reservations (World.reservations, set with
    MOE_TPU_EMULATOR_RESERVATIONS); True when the request is too big for the reservation (it queues,
    then fails with insufficient reserved capacity). Sources and confirmation: docs/emulator-fidelity.md."""
    if not qr.reservation_name:
        return False
    if spot:
        # Unconfirmed message: Spot VMs cannot consume reservations (Compute Engine docs).
        raise ApiError("INVALID_ARGUMENT", f"Invalid reservation_name {qr.reservation_name!r}: spot capacity "
                                           "cannot consume a reservation")
    res_project, res_zone, res_id = validate.reservation(qr.reservation_name, project, zone)
    size = world.reservations.get(f"{res_zone}/{res_id}") if res_project == project else None
    if size is None:
        # Unconfirmed: NOT_FOUND at create, as Compute Engine answers for a named reservation it lacks.
        raise ApiError("NOT_FOUND", f"Reservation '{qr.reservation_name}' was not found")
    return chips > size


def valid_until_s(qr: QR, now: float) -> float | None:
    if "queueing_policy" not in qr:
        return None
    policy = qr.queueing_policy
    if "valid_until_duration" in policy:
        return policy.valid_until_duration.total_seconds()
    if "valid_until_time" in policy:
        return policy.valid_until_time.timestamp() - now
    return None


def quota_error(project: str, zone: str, spot: bool) -> ApiError:
    quota_id = ("TPUV5sPreemptibleLitepodPerProjectPerZoneForTPUAPI" if spot
                else "TPUV5sLitepodPerProjectPerZoneForTPUAPI")
    message = f"Quota limit '{quota_id}' has been exceeded. Limit: 0 in zone {zone}."
    failure = error_details_pb2.QuotaFailure(violations=[error_details_pb2.QuotaFailure.Violation(
        subject=f"project:{project}", description=message, api_service="tpu.googleapis.com",
        quota_id=quota_id, quota_dimensions={"zone": zone}, quota_value=0)])
    return ApiError("RESOURCE_EXHAUSTED", message, [failure])


def accelerator_types(parent: str, zone: str) -> list[tpu_v2.AcceleratorType]:
    return [tpu_v2.AcceleratorType(
        name=f"{parent}/acceleratorTypes/{a.name}", type_=a.name,
        accelerator_configs=[tpu_v2.AcceleratorConfig(
            type_=tpu_v2.AcceleratorConfig.Type[offerings.CONFIG_TYPE[a.generation]], topology=a.topology)])
        for a in offerings.types_in(zone)]


def runtime_versions(parent: str, zone: str) -> list[tpu_v2.RuntimeVersion]:
    versions = offerings.runtime_versions_in(zone)
    return [tpu_v2.RuntimeVersion(name=f"{parent}/runtimeVersions/{v}", version=v) for v in versions]


def by_name(items: list, name: str):
    for item in items:
        if item.name == name:
            return item
    raise not_found(name)


