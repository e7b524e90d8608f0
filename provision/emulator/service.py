"""The gRPC face of the world: google.cloud.tpu.v2.Tpu and google.longrunning.Operations.

Handlers are generic method handlers whose (de)serializers are the proto-plus types' own,
so the real TpuClient (and api_core's OperationsClient) talk to it unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc
from google.cloud import tpu_v2
from google.longrunning import operations_pb2
from google.protobuf import empty_pb2
from google.rpc import status_pb2
from grpc_status import rpc_status

from provision.emulator import validate
from provision.emulator import world as w
from provision.emulator.validate import ApiError

if TYPE_CHECKING:
    from provision.emulator.server import Emulator

TPU_SERVICE = "google.cloud.tpu.v2.Tpu"
OPERATIONS_SERVICE = "google.longrunning.Operations"
UNAVAILABLE_MESSAGE = "The service is currently unavailable."
DEFAULT_PAGE_SIZE = 100


class Lost(Exception):
    """The request was applied but its answer is lost (flaky): the client sees UNAVAILABLE."""


def page(items: list, page_size: int, page_token: str) -> tuple[list, str]:
    """Offset paging: the token is the index of the next item."""
    try:
        start = int(page_token) if page_token else 0
    except ValueError:
        raise ApiError("INVALID_ARGUMENT", f"Invalid page_token {page_token!r}") from None
    size = page_size if page_size > 0 else DEFAULT_PAGE_SIZE
    end = start + size
    return items[start:end], (str(end) if end < len(items) else "")


class TpuService:
    """The RPC implementations; each runs under the emulator's lock with `now` fixed."""

    def __init__(self, emulator: Emulator) -> None:
        self.emu = emulator

    @property
    def world(self) -> w.World:
        return self.emu.world

    # --- queued resources ------------------------------------------------------
    def CreateQueuedResource(self, req: tpu_v2.CreateQueuedResourceRequest, now: float):
        op = self.world.create_queued_resource(req, now, self.emu.scenario)
        if self.emu.lose_this_create():
            raise Lost()
        return _pending(self.world.operation_view(op, now))

    def GetQueuedResource(self, req, now):
        validate.resource(req.name, "queuedResources")
        return self.world.queued_view(self.world.live_queued(req.name, now), now)

    def ListQueuedResources(self, req, now):
        validate.location(req.parent)
        recs = sorted((r for r in self.world.queued.values()
                       if r.name.startswith(req.parent + "/") and r.state_at(now) is not None),
                      key=lambda r: r.name)
        items, token = page(recs, req.page_size, req.page_token)
        return tpu_v2.ListQueuedResourcesResponse(
            queued_resources=[self.world.queued_view(r, now) for r in items], next_page_token=token)

    def DeleteQueuedResource(self, req, now):
        return self.world.operation_view(self.world.delete_queued_resource(req, now), now)

    def ResetQueuedResource(self, req, now):
        return _pending(self.world.operation_view(
            self.world.reset_queued_resource(req, now, self.emu.scenario), now))

    # --- nodes -------------------------------------------------------------------
    def GetNode(self, req, now):
        validate.resource(req.name, "nodes")
        rec, index = self.world.find_node(req.name, now)
        return self.world.node_view(rec, req.name, index, now)

    def ListNodes(self, req, now):
        validate.location(req.parent)
        nodes = sorted(((n, i, r) for r in self.world.queued.values() for n, i in r.nodes
                        if n.startswith(req.parent + "/") and r.node_state_at(n, now) is not None),
                       key=lambda item: item[0])
        items, token = page(nodes, req.page_size, req.page_token)
        return tpu_v2.ListNodesResponse(nodes=[self.world.node_view(r, n, i, now) for n, i, r in items],
                                        next_page_token=token)

    def DeleteNode(self, req, now):
        return self.world.operation_view(self.world.delete_node(req.name, now), now)

    def GetGuestAttributes(self, req, now):
        validate.resource(req.name, "nodes")
        rec, index = self.world.find_node(req.name, now)
        node = self.world.node_view(rec, req.name, index, now)
        workers = [str(i) for i in range(len(node.network_endpoints))]
        wanted = [x for x in workers if not req.worker_ids or x in req.worker_ids]
        # Plausible contents (unconfirmed): what a TPU VM's agent publishes per worker.
        return tpu_v2.GetGuestAttributesResponse(guest_attributes=[
            tpu_v2.GuestAttributes(query_path=req.query_path, query_value=tpu_v2.GuestAttributesValue(items=[
                tpu_v2.GuestAttributesEntry(namespace="tpu", key="worker-id", value=x),
                tpu_v2.GuestAttributesEntry(namespace="tpu", key="ip-address",
                                            value=node.network_endpoints[int(x)].ip_address),
                tpu_v2.GuestAttributesEntry(namespace="tpu", key="state", value=node.state.name),
                # what the VM's metadata server says under instance/preempted (API-FACTS)
                tpu_v2.GuestAttributesEntry(namespace="instance", key="preempted",
                                            value="TRUE" if node.state.name == "PREEMPTED" else "FALSE"),
            ])) for x in wanted])

    # --- catalogue ---------------------------------------------------------------
    def ListAcceleratorTypes(self, req, now):
        _, zone = validate.location(req.parent)
        items, token = page(w.accelerator_types(req.parent, zone), req.page_size, req.page_token)
        return tpu_v2.ListAcceleratorTypesResponse(accelerator_types=items, next_page_token=token)

    def GetAcceleratorType(self, req, now):
        _, zone, _ = validate.resource(req.name, "acceleratorTypes")
        parent = req.name.rsplit("/acceleratorTypes/", 1)[0]
        return _by_name(w.accelerator_types(parent, zone), req.name)

    def ListRuntimeVersions(self, req, now):
        _, zone = validate.location(req.parent)
        items, token = page(w.runtime_versions(req.parent, zone), req.page_size, req.page_token)
        return tpu_v2.ListRuntimeVersionsResponse(runtime_versions=items, next_page_token=token)

    def GetRuntimeVersion(self, req, now):
        _, zone, _ = validate.resource(req.name, "runtimeVersions")
        parent = req.name.rsplit("/runtimeVersions/", 1)[0]
        return _by_name(w.runtime_versions(parent, zone), req.name)

    # --- google.longrunning.Operations -----------------------------------------
    def operation(self, name: str) -> dict:
        op = self.world.operations.get(name)
        if op is None:
            raise w.not_found(name)
        return op

    def GetOperation(self, req, now):
        return self.world.operation_view(self.operation(req.name), now)

    def ListOperations(self, req, now):
        validate.location(req.name)
        ops = sorted((o for o in self.world.operations.values() if o["name"].startswith(req.name + "/")),
                     key=lambda o: o["name"])
        items, token = page(ops, req.page_size, req.page_token)
        return operations_pb2.ListOperationsResponse(
            operations=[self.world.operation_view(o, now) for o in items], next_page_token=token)

    def DeleteOperation(self, req, now):
        self.operation(req.name)
        del self.world.operations[req.name]
        return empty_pb2.Empty()

    def CancelOperation(self, req, now):
        # Unconfirmed: the TPU API records the request; the operation runs to its end anyway.
        self.operation(req.name)["cancel_requested"] = True
        return empty_pb2.Empty()


def _pending(op: operations_pb2.Operation) -> operations_pb2.Operation:
    """The answer to the starting RPC: the operation has only just begun."""
    answer = operations_pb2.Operation()
    answer.CopyFrom(op)
    answer.done = False
    answer.ClearField("response")
    return answer


def _by_name(items: list, name: str):
    for item in items:
        if item.name == name:
            return item
    raise w.not_found(name)


# method -> (request deserializer, response serializer)
_TPU_METHODS: dict[str, tuple[Callable, Callable]] = {
    "CreateQueuedResource": (tpu_v2.CreateQueuedResourceRequest.deserialize,
                             operations_pb2.Operation.SerializeToString),
    "GetQueuedResource": (tpu_v2.GetQueuedResourceRequest.deserialize, tpu_v2.QueuedResource.serialize),
    "ListQueuedResources": (tpu_v2.ListQueuedResourcesRequest.deserialize,
                            tpu_v2.ListQueuedResourcesResponse.serialize),
    "DeleteQueuedResource": (tpu_v2.DeleteQueuedResourceRequest.deserialize,
                             operations_pb2.Operation.SerializeToString),
    "ResetQueuedResource": (tpu_v2.ResetQueuedResourceRequest.deserialize,
                            operations_pb2.Operation.SerializeToString),
    "GetNode": (tpu_v2.GetNodeRequest.deserialize, tpu_v2.Node.serialize),
    "ListNodes": (tpu_v2.ListNodesRequest.deserialize, tpu_v2.ListNodesResponse.serialize),
    "DeleteNode": (tpu_v2.DeleteNodeRequest.deserialize, operations_pb2.Operation.SerializeToString),
    "GetGuestAttributes": (tpu_v2.GetGuestAttributesRequest.deserialize,
                           tpu_v2.GetGuestAttributesResponse.serialize),
    "ListAcceleratorTypes": (tpu_v2.ListAcceleratorTypesRequest.deserialize,
                             tpu_v2.ListAcceleratorTypesResponse.serialize),
    "GetAcceleratorType": (tpu_v2.GetAcceleratorTypeRequest.deserialize, tpu_v2.AcceleratorType.serialize),
    "ListRuntimeVersions": (tpu_v2.ListRuntimeVersionsRequest.deserialize,
                            tpu_v2.ListRuntimeVersionsResponse.serialize),
    "GetRuntimeVersion": (tpu_v2.GetRuntimeVersionRequest.deserialize, tpu_v2.RuntimeVersion.serialize),
}
# The Tpu methods this emulator does not model answer UNIMPLEMENTED.
_TPU_UNIMPLEMENTED = ("CreateNode", "StopNode", "StartNode", "UpdateNode", "GenerateServiceIdentity")
_OPERATIONS_METHODS: dict[str, tuple[Callable, Callable]] = {
    "GetOperation": (operations_pb2.GetOperationRequest.FromString, operations_pb2.Operation.SerializeToString),
    "ListOperations": (operations_pb2.ListOperationsRequest.FromString,
                       operations_pb2.ListOperationsResponse.SerializeToString),
    "DeleteOperation": (operations_pb2.DeleteOperationRequest.FromString, empty_pb2.Empty.SerializeToString),
    "CancelOperation": (operations_pb2.CancelOperationRequest.FromString, empty_pb2.Empty.SerializeToString),
    "WaitOperation": (operations_pb2.WaitOperationRequest.FromString, operations_pb2.Operation.SerializeToString),
}


def abort(context: grpc.ServicerContext, error: ApiError) -> None:
    status = status_pb2.Status(code=grpc.StatusCode[error.code].value[0], message=error.message)
    for detail in error.details:
        status.details.add().Pack(detail)
    context.abort_with_status(rpc_status.to_status(status))


def handlers(emulator: Emulator) -> list[grpc.GenericRpcHandler]:
    service = TpuService(emulator)

    def unary(full_name: str, impl: Callable, des: Callable, ser: Callable):
        def behaviour(request, context: grpc.ServicerContext):
            try:
                return emulator.handle(full_name, lambda now: impl(request, now))
            except ApiError as error:
                abort(context, error)
        return grpc.unary_unary_rpc_method_handler(behaviour, request_deserializer=des,
                                                   response_serializer=ser)

    def unimplemented(full_name: str):
        def behaviour(request, context: grpc.ServicerContext):
            context.abort(grpc.StatusCode.UNIMPLEMENTED, f"Method {full_name} is not implemented by the emulator")
        return grpc.unary_unary_rpc_method_handler(behaviour)

    tpu = {m: unary(f"{TPU_SERVICE}/{m}", getattr(service, m), *io) for m, io in _TPU_METHODS.items()}
    tpu.update({m: unimplemented(f"{TPU_SERVICE}/{m}") for m in _TPU_UNIMPLEMENTED})
    ops = {m: unary(f"{OPERATIONS_SERVICE}/{m}", getattr(service, m), *io)
           for m, io in _OPERATIONS_METHODS.items() if m != "WaitOperation"}
    ops["WaitOperation"] = grpc.unary_unary_rpc_method_handler(
        _wait_operation(emulator, service), request_deserializer=_OPERATIONS_METHODS["WaitOperation"][0],
        response_serializer=_OPERATIONS_METHODS["WaitOperation"][1])
    return [grpc.method_handlers_generic_handler(TPU_SERVICE, tpu),
            grpc.method_handlers_generic_handler(OPERATIONS_SERVICE, ops)]


def _wait_operation(emulator: Emulator, service: TpuService):
    """WaitOperation: the server waits on the emulator's clock until done or the timeout."""
    name = f"{OPERATIONS_SERVICE}/WaitOperation"

    def behaviour(request: operations_pb2.WaitOperationRequest, context: grpc.ServicerContext):
        def look(now: float) -> tuple[operations_pb2.Operation, float]:
            return service.GetOperation(request, now), service.operation(request.name)["done_at"] - now

        try:
            op, wait = emulator.handle(name, look)
            if not op.done:
                if request.HasField("timeout"):
                    wait = min(wait, request.timeout.ToTimedelta().total_seconds())
                emulator.clock.sleep(max(wait, 0.0))
                op, _ = emulator.handle(name, look, count=False)
            return op
        except ApiError as error:
            abort(context, error)
    return behaviour
