"""google.cloud.tpu.v2.Tpu: the changes requests make to the world, proto views, RPCs (checks: tpu_checks.py).

Every RPC is a function (call, request) -> response run as one transaction on the world (see
rpc.unary); the records it reads and writes are world.QueuedRecord.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable

from google.cloud import tpu_v2
from google.longrunning import operations_pb2
from google.rpc import status_pb2

from provision.emulator import offerings, rpc, scenarios, validate
from provision.emulator.scenarios import DELETING_S, NODE_DELETING_S, Timeline, timeline
from provision.emulator.tpu_checks import (
    accelerator_types,
    by_name,
    capacity,
    check_node,
    check_node_specs,
    check_reservation,
    quota_error,
    runtime_versions,
    valid_until_s,
)
from provision.emulator.validate import ApiError, not_found
from provision.emulator.world import Operation, QueuedRecord, World

SERVICE = "google.cloud.tpu.v2.Tpu"
QR = tpu_v2.QueuedResource
QRState = tpu_v2.QueuedResourceState
Node = tpu_v2.Node

STATE_DATA_FIELD = {
    "CREATING": "creating_data", "ACCEPTED": "accepted_data", "PROVISIONING": "provisioning_data",
    "FAILED": "failed_data", "DELETING": "deleting_data", "ACTIVE": "active_data",
    "SUSPENDING": "suspending_data", "SUSPENDED": "suspended_data",
}
SERVICE_INITIATED = ("FAILED", "SUSPENDING", "SUSPENDED")
DELETABLE_WITH_NODES = ("ACCEPTED", "FAILED", "SUSPENDED")
TPU_PORT = 8470


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


def as_json(message: QR | Node) -> dict:
    """A queued resource (or node) as proto JSON for the state file: set fields only, enums by name."""
    return json.loads(type(message).to_json(message, use_integers_for_enums=False,
                                            preserving_proto_field_name=True,
                                            always_print_fields_with_no_presence=False))


def _request(rec: QueuedRecord) -> QR:
    return QR.from_json(json.dumps(rec.request), ignore_unknown_fields=True)


# --- views -----------------------------------------------------------------------------


def queued_view(rec: QueuedRecord, now: float) -> QR:
    qr = _request(rec)
    qr.name = rec.name
    qr.create_time = rpc.timestamp(rec.create_time)
    state = rec.state_at(now) or "DELETING"
    qr_state = QRState(state=QRState.State[state])
    qr_state.state_initiator = (QRState.StateInitiator.SERVICE if state in SERVICE_INITIATED
                                else QRState.StateInitiator.USER)
    data_field = STATE_DATA_FIELD.get(state)
    if state == "FAILED":
        failure = rec.timeline.failure or {"code": 13, "message": "an internal error has occurred"}
        qr_state.failed_data = QRState.FailedData(
            error=status_pb2.Status(code=failure["code"], message=failure["message"]))
    elif data_field:
        setattr(qr_state, data_field, getattr(QRState, _class_name(data_field))())
    qr.state = qr_state
    return qr


def node_view(rec: QueuedRecord, node: str, index: int, now: float) -> Node:
    request = _request(rec)
    view = Node(request.tpu.node_spec[index].node)
    acc = rec.accelerator(index)
    state = rec.node_state_at(node, now) or "DELETING"
    view.name = node
    view.accelerator_type = acc.name
    view.accelerator_config = tpu_v2.AcceleratorConfig(
        type_=tpu_v2.AcceleratorConfig.Type[offerings.CONFIG_TYPE[acc.generation]], topology=acc.topology)
    view.state = Node.State[state]
    view.health = Node.Health.HEALTHY if state == "READY" else Node.Health.HEALTH_UNSPECIFIED
    view.api_version = Node.ApiVersion.V2
    view.queued_resource = "" if rec.standalone else rec.name
    view.multislice_node = rec.multislice
    provisioning = [at for at, s in rec.timeline.phases if s == "PROVISIONING"]
    view.create_time = rpc.timestamp(rec.create_time + (provisioning[0] if provisioning else 0.0))
    digest = _digest(node)
    view.id = int.from_bytes(digest[:7], "big")
    view.cidr_block = f"10.{digest[0]}.0.0/20"
    if capacity(request)[0]:
        view.scheduling_config.spot = True
    if state != "CREATING":
        view.network_endpoints = [
            tpu_v2.NetworkEndpoint(ip_address=f"10.{digest[0]}.{digest[1]}.{2 + i}", port=TPU_PORT)
            for i in range(acc.vms)]
    return view


def operation_metadata(op: Operation, now: float):
    metadata = tpu_v2.OperationMetadata(create_time=rpc.timestamp(op.create_time), target=op.target,
                                        verb=op.verb, api_version="v2", cancel_requested=op.cancel_requested)
    if op.done(now):
        metadata.end_time = rpc.timestamp(op.done_at)
    return tpu_v2.OperationMetadata.pb(metadata)


def operation_view(op: Operation, now: float) -> operations_pb2.Operation:
    """A TPU API operation as google.longrunning.Operation at `now`."""
    return rpc.longrunning(op, now, operation_metadata, operation_response)


def operation_response(op: Operation):
    if op.verb == "create" and "/nodes/" in op.target:  # CreateNode answers the Node
        return Node.pb(Node.from_json(json.dumps(op.response), ignore_unknown_fields=True))
    return QR.pb(QR.from_json(json.dumps(op.response), ignore_unknown_fields=True))


def _class_name(data_field: str) -> str:
    return "".join(part.capitalize() for part in data_field.split("_"))


# --- changes to the world --------------------------------------------------------------


def new_operation(world: World, parent: str, verb: str, target: str, now: float, done_at: float,
                  response: QR | None, request_id: str = "") -> Operation:
    tag = world.next_token()
    name = f"{parent}/operations/operation-{int(now * 1000)}-{tag[:13]}-{tag[13:21]}-{tag[21:29]}"
    op = Operation(name=name, service="tpu", verb=verb, target=target, create_time=now, done_at=done_at,
                   response=as_json(response) if response is not None else None)
    return world.add_operation(op, request_id)


def live_queued(world: World, name: str, now: float) -> QueuedRecord:
    rec = world.queued_at(name, now)
    if rec is None or rec.standalone:
        raise not_found(name)
    return rec


def find_node(world: World, name: str, now: float) -> tuple[QueuedRecord, int]:
    found = world.node_at(name, now)
    if found is None:
        raise not_found(name)
    return found


def create_queued_resource(world: World, req: tpu_v2.CreateQueuedResourceRequest, now: float, scenario: str,
                           held: bool = False) -> Operation:
    """Validate and accept a create; returns its operation."""
    project, zone = validate.location(req.parent)
    if req.request_id and (replayed := world.replayed(req.request_id, now)) is not None:
        return replayed
    validate.queued_resource_id(req.queued_resource_id)
    name = f"{req.parent}/queuedResources/{req.queued_resource_id}"
    qr = QR(req.queued_resource)
    nodes, multislice = check_node_specs(qr, req.parent, zone, req.queued_resource_id)
    spot, reserved = capacity(qr)
    chips = sum(offerings.accelerator_type(qr.tpu.node_spec[i].node.accelerator_type).chips for _, i in nodes)
    too_big = check_reservation(world, qr, project, zone, spot, chips)
    if world.queued_at(name, now) is not None:
        raise ApiError("ALREADY_EXISTS", f"Resource '{name}' already exists")
    in_use = world.node_names_in_use(now)
    for node, _ in nodes:
        if node in in_use:
            raise ApiError("ALREADY_EXISTS", f"Resource '{node}' already exists")
    if scenario == "quota":
        raise quota_error(project, zone, spot)
    if world.first_zone is None:
        world.first_zone = zone
    tl = timeline(scenario, zone=zone, spot=spot, reserved=reserved,
                  stocked_out=too_big or (scenario == "stockout" and zone == world.first_zone),
                  valid_until_s=valid_until_s(qr, now), held=held)
    qr.name = ""
    rec = QueuedRecord(name=name, request=as_json(qr), create_time=now, timeline=tl, nodes=nodes,
                       multislice=multislice)
    world.queued[name] = rec
    # The create operation is done at its first poll; its response is the queued resource then.
    return new_operation(world, req.parent, "create", name, now, now, queued_view(rec, now), req.request_id)


def create_node(world: World, req: tpu_v2.CreateNodeRequest, now: float, scenario: str) -> Operation:
    """CreateNode: a TPU VM without a queued resource (Google's samples create v5e this way). It is
    CREATING for PROVISIONING_S, then READY; under `stockout` (first zone) the operation fails with
    the stockout error and no node remains. Kept as a hidden QueuedRecord (standalone)."""
    project, zone = validate.location(req.parent)
    validate.node_id(req.node_id)
    node = Node(req.node)
    acc = check_node(node, zone)
    node.accelerator_type = acc.name
    name = f"{req.parent}/nodes/{req.node_id}"
    if name in world.node_names_in_use(now):
        raise ApiError("ALREADY_EXISTS", f"Resource '{name}' already exists")
    spot = node.scheduling_config.spot or node.scheduling_config.preemptible
    if scenario == "quota":
        raise quota_error(project, zone, spot)
    if world.first_zone is None:
        world.first_zone = zone
    if scenario == "stockout" and zone == world.first_zone:
        op = new_operation(world, req.parent, "create", name, now, now + scenarios.CREATING_S, None)
        op.error = {"code": scenarios.STOCKOUT_CODE, "message": scenarios.STOCKOUT_MESSAGE.format(zone=zone)}
        return op
    qr = QR(tpu=QR.Tpu(node_spec=[QR.Tpu.NodeSpec(parent=req.parent, node_id=req.node_id, node=node)]))
    tl = Timeline(((0.0, "PROVISIONING"), (scenarios.PROVISIONING_S, "ACTIVE")))
    rec = QueuedRecord(name=f"{name}#node", request=as_json(qr), create_time=now, timeline=tl,
                       nodes=[(name, 0)], multislice=False, standalone=True)
    world.queued[rec.name] = rec
    done_at = now + scenarios.PROVISIONING_S
    return new_operation(world, req.parent, "create", name, now, done_at, node_view(rec, name, 0, done_at))


def delete_queued_resource(world: World, req: tpu_v2.DeleteQueuedResourceRequest, now: float) -> Operation:
    validate.resource(req.name, "queuedResources")
    if req.request_id and (replayed := world.replayed(req.request_id, now)) is not None:
        return replayed
    rec = live_queued(world, req.name, now)
    state = rec.state_at(now)
    parent = req.name.rsplit("/queuedResources/", 1)[0]
    if state == "DELETING":
        return new_operation(world, parent, "delete", rec.name, now, rec.deleted_at + DELETING_S, None,
                             req.request_id)
    if not req.force and rec.live_nodes(now) and state not in DELETABLE_WITH_NODES:
        # Unconfirmed message; the code is the natural one (docs/api-facts.md).
        raise ApiError("FAILED_PRECONDITION",
                       f"Cannot delete queued resource '{rec.name}' in state {state} while it has nodes; "
                       "delete its nodes first or set force=true")
    rec.deleted_at = now
    return new_operation(world, parent, "delete", rec.name, now, now + DELETING_S, None, req.request_id)


def reset_queued_resource(world: World, req: tpu_v2.ResetQueuedResourceRequest, now: float, scenario: str,
                          held: bool = False) -> Operation:
    """Only a FAILED queued resource can be reset (unconfirmed); SUSPENDED must be deleted."""
    _, zone, _ = validate.resource(req.name, "queuedResources")
    rec = live_queued(world, req.name, now)
    state = rec.state_at(now)
    if state != "FAILED":
        raise ApiError("FAILED_PRECONDITION",
                       f"Cannot reset queued resource '{rec.name}' in state {state}; delete it and create it again")
    spot, reserved = capacity(_request(rec))
    fresh = timeline(scenario, zone=zone, spot=spot, reserved=reserved,
                     stocked_out=scenario == "stockout" and zone == world.first_zone, held=held)
    offset = now - rec.create_time
    shifted = tuple((offset + at - fresh.phases[1][0], s) for at, s in fresh.phases[1:])
    rec.timeline = Timeline(rec.timeline.phases + shifted, fresh.failure)
    parent = req.name.rsplit("/queuedResources/", 1)[0]
    return new_operation(world, parent, "reset", rec.name, now, now, queued_view(rec, now))


def delete_node(world: World, name: str, now: float) -> Operation:
    validate.resource(name, "nodes")
    rec, _ = find_node(world, name, now)
    if rec.node_state_at(name, now) != "DELETING":
        rec.node_deleted_at[name] = now
    # Already going, on its own or with its queued resource: done when the first of those ends.
    ends = [rec.node_deleted_at[name] + NODE_DELETING_S] if name in rec.node_deleted_at else []
    if rec.deleted_at is not None:
        ends.append(rec.deleted_at + DELETING_S)
    return new_operation(world, name.rsplit("/nodes/", 1)[0], "delete", name, now, min(ends), None)


# --- RPCs --------------------------------------------------------------------------------


def CreateQueuedResource(call: rpc.Call, req: tpu_v2.CreateQueuedResourceRequest):
    op = create_queued_resource(call.world, req, call.now, call.scenario, call.held)
    return rpc.started(operation_view(op, call.now))


def GetQueuedResource(call: rpc.Call, req: tpu_v2.GetQueuedResourceRequest):
    validate.resource(req.name, "queuedResources")
    return queued_view(live_queued(call.world, req.name, call.now), call.now)


def ListQueuedResources(call: rpc.Call, req: tpu_v2.ListQueuedResourcesRequest):
    validate.location(req.parent)
    recs = sorted((r for r in call.world.queued.values() if r.name.startswith(req.parent + "/")
                   and not r.standalone and r.state_at(call.now) is not None),
                  key=lambda r: r.name)
    items, token = rpc.page(recs, req.page_size, req.page_token)
    return tpu_v2.ListQueuedResourcesResponse(queued_resources=[queued_view(r, call.now) for r in items],
                                              next_page_token=token)


def DeleteQueuedResource(call: rpc.Call, req: tpu_v2.DeleteQueuedResourceRequest):
    return operation_view(delete_queued_resource(call.world, req, call.now), call.now)


def ResetQueuedResource(call: rpc.Call, req: tpu_v2.ResetQueuedResourceRequest):
    op = reset_queued_resource(call.world, req, call.now, call.scenario, call.held)
    return rpc.started(operation_view(op, call.now))


def CreateNode(call: rpc.Call, req: tpu_v2.CreateNodeRequest):
    return rpc.started(operation_view(create_node(call.world, req, call.now, call.scenario), call.now))


def GetNode(call: rpc.Call, req: tpu_v2.GetNodeRequest):
    validate.resource(req.name, "nodes")
    rec, index = find_node(call.world, req.name, call.now)
    return node_view(rec, req.name, index, call.now)


def ListNodes(call: rpc.Call, req: tpu_v2.ListNodesRequest):
    validate.location(req.parent)
    nodes = sorted(((n, i, r) for r in call.world.queued.values() for n, i in r.nodes
                    if n.startswith(req.parent + "/") and r.node_state_at(n, call.now) is not None),
                   key=lambda item: item[0])
    items, token = rpc.page(nodes, req.page_size, req.page_token)
    return tpu_v2.ListNodesResponse(nodes=[node_view(r, n, i, call.now) for n, i, r in items],
                                    next_page_token=token)


def DeleteNode(call: rpc.Call, req: tpu_v2.DeleteNodeRequest):
    return operation_view(delete_node(call.world, req.name, call.now), call.now)


def GetGuestAttributes(call: rpc.Call, req: tpu_v2.GetGuestAttributesRequest):
    """What each worker's guest wrote (World.set_guest_attributes), one GuestAttributes per worker in
    worker order. query_path "" reads every namespace, "NS/" one namespace, "NS/KEY" one key. A worker
    that wrote nothing that matches answers an empty value (unconfirmed: GCE answers NOT_FOUND for a
    single VM; the TPU API's answer for one worker of many is not documented)."""
    validate.resource(req.name, "nodes")
    rec, index = find_node(call.world, req.name, call.now)
    namespace, _, key = req.query_path.partition("/")
    if req.query_path and (not namespace or "/" in key):
        raise ApiError("INVALID_ARGUMENT", f"Invalid query_path {req.query_path!r}: use NAMESPACE/ or NAMESPACE/KEY")
    workers = len(node_view(rec, req.name, index, call.now).network_endpoints)
    known = [str(i) for i in range(workers)]
    for worker in req.worker_ids:
        if worker not in known:
            # Unconfirmed message.
            raise ApiError("INVALID_ARGUMENT", f"Invalid worker_id {worker!r}: the node has workers 0 to {workers - 1}")
    wanted = [w for w in known if not req.worker_ids or w in req.worker_ids]
    written = rec.guest_attributes.get(req.name, {})
    answer = tpu_v2.GetGuestAttributesResponse()
    for worker in wanted:
        items = []
        for path, value in sorted(written.get(worker, {}).items()):
            ns, _, name = path.partition("/")
            if (not namespace or ns == namespace) and (not key or name == key):
                items.append(tpu_v2.GuestAttributesEntry(namespace=ns, key=name, value=value))
        answer.guest_attributes.append(tpu_v2.GuestAttributes(
            query_path=req.query_path, query_value=tpu_v2.GuestAttributesValue(items=items)))
    return answer


def ListAcceleratorTypes(call: rpc.Call, req: tpu_v2.ListAcceleratorTypesRequest):
    _, zone = validate.location(req.parent)
    items, token = rpc.page(accelerator_types(req.parent, zone), req.page_size, req.page_token)
    return tpu_v2.ListAcceleratorTypesResponse(accelerator_types=items, next_page_token=token)


def GetAcceleratorType(call: rpc.Call, req: tpu_v2.GetAcceleratorTypeRequest):
    _, zone, _ = validate.resource(req.name, "acceleratorTypes")
    parent = req.name.rsplit("/acceleratorTypes/", 1)[0]
    return by_name(accelerator_types(parent, zone), req.name)


def ListRuntimeVersions(call: rpc.Call, req: tpu_v2.ListRuntimeVersionsRequest):
    _, zone = validate.location(req.parent)
    items, token = rpc.page(runtime_versions(req.parent, zone), req.page_size, req.page_token)
    return tpu_v2.ListRuntimeVersionsResponse(runtime_versions=items, next_page_token=token)


def GetRuntimeVersion(call: rpc.Call, req: tpu_v2.GetRuntimeVersionRequest):
    _, zone, _ = validate.resource(req.name, "runtimeVersions")
    parent = req.name.rsplit("/runtimeVersions/", 1)[0]
    return by_name(runtime_versions(parent, zone), req.name)


_OPERATION = operations_pb2.Operation.SerializeToString
# name -> (impl, request deserializer, response serializer); the other Tpu methods
# (StopNode, StartNode, UpdateNode, GenerateServiceIdentity) answer UNIMPLEMENTED.
METHODS: dict[str, tuple[Callable, Callable, Callable]] = {
    "CreateQueuedResource": (CreateQueuedResource, tpu_v2.CreateQueuedResourceRequest.deserialize, _OPERATION),
    "GetQueuedResource": (GetQueuedResource, tpu_v2.GetQueuedResourceRequest.deserialize, QR.serialize),
    "ListQueuedResources": (ListQueuedResources, tpu_v2.ListQueuedResourcesRequest.deserialize,
                            tpu_v2.ListQueuedResourcesResponse.serialize),
    "DeleteQueuedResource": (DeleteQueuedResource, tpu_v2.DeleteQueuedResourceRequest.deserialize, _OPERATION),
    "ResetQueuedResource": (ResetQueuedResource, tpu_v2.ResetQueuedResourceRequest.deserialize, _OPERATION),
    "CreateNode": (CreateNode, tpu_v2.CreateNodeRequest.deserialize, _OPERATION),
    "GetNode": (GetNode, tpu_v2.GetNodeRequest.deserialize, Node.serialize),
    "ListNodes": (ListNodes, tpu_v2.ListNodesRequest.deserialize, tpu_v2.ListNodesResponse.serialize),
    "DeleteNode": (DeleteNode, tpu_v2.DeleteNodeRequest.deserialize, _OPERATION),
    "GetGuestAttributes": (GetGuestAttributes, tpu_v2.GetGuestAttributesRequest.deserialize,
                           tpu_v2.GetGuestAttributesResponse.serialize),
    "ListAcceleratorTypes": (ListAcceleratorTypes, tpu_v2.ListAcceleratorTypesRequest.deserialize,
                             tpu_v2.ListAcceleratorTypesResponse.serialize),
    "GetAcceleratorType": (GetAcceleratorType, tpu_v2.GetAcceleratorTypeRequest.deserialize,
                           tpu_v2.AcceleratorType.serialize),
    "ListRuntimeVersions": (ListRuntimeVersions, tpu_v2.ListRuntimeVersionsRequest.deserialize,
                            tpu_v2.ListRuntimeVersionsResponse.serialize),
    "GetRuntimeVersion": (GetRuntimeVersion, tpu_v2.GetRuntimeVersionRequest.deserialize,
                          tpu_v2.RuntimeVersion.serialize),
}
