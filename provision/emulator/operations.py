"""google.longrunning.Operations, shared by the TPU API and Vertex AI.

An operation is a typed record (world.Operation). Its proto view packs the metadata and response
types of the service that started it (tpu.operation_view, vertex.operation_view); `view` picks
the service's, importing it on first use so a world that holds only TPU operations never imports
the Vertex AI types.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
from google.longrunning import operations_pb2
from google.protobuf import empty_pb2

from provision.emulator import rpc, validate
from provision.emulator.world import Operation
from provision.errors import MoeTpuError

SERVICE = "google.longrunning.Operations"


def _tpu_view(op: Operation, now: float) -> operations_pb2.Operation:
    from provision.emulator import tpu

    return tpu.operation_view(op, now)


def _vertex_view(op: Operation, now: float) -> operations_pb2.Operation:
    if op.verb in SERVING_VERBS:  # online prediction's operations, each with its method's own types
        from provision.emulator import vertex_serving_rpcs

        return vertex_serving_rpcs.operation_view(op, now)
    from provision.emulator import vertex

    return vertex.operation_view(op, now)


SERVING_VERBS = ("upload_model", "create_endpoint", "deploy", "undeploy")


# world.Operation.service -> how that service shows its operations (world.OPERATION_SERVICES).
VIEWS: dict[str, Callable[[Operation, float], operations_pb2.Operation]] = {"tpu": _tpu_view, "vertex": _vertex_view}


def _vertex_settle(call: rpc.Call, op: Operation) -> None:
    if op.verb == "deploy":  # a deploy ends when its model server answers its health route, not at a time
        from provision.emulator import vertex_serving

        vertex_serving.settle(call)


# world.Operation.service -> what brings its operation up to now before it is shown, where the operation
# ends on something outside the world (a model server's health) rather than at a set time.
SETTLE: dict[str, Callable[[rpc.Call, Operation], None]] = {"vertex": _vertex_settle}


def view(op: Operation, now: float) -> operations_pb2.Operation:
    """The operation as google.longrunning.Operation at `now`, as its service shows it."""
    return VIEWS[op.service](op, now)


# --- the Operations service ------------------------------------------------------------


def _operation(call: rpc.Call, name: str) -> Operation:
    op = call.world.operations.get(name)
    if op is None:
        raise validate.not_found(name)
    return op


def GetOperation(call: rpc.Call, req: operations_pb2.GetOperationRequest):
    op = _operation(call, req.name)
    if (settle := SETTLE.get(op.service)) is not None:  # also at its end: a deploy's may fail there
        settle(call, op)
    return view(op, call.now)


def ListOperations(call: rpc.Call, req: operations_pb2.ListOperationsRequest):
    validate.any_location(req.name)
    ops = sorted((o for o in call.world.operations.values() if o.name.startswith(req.name + "/")),
                 key=lambda o: o.name)
    items, token = rpc.page(ops, req.page_size, req.page_token)
    return operations_pb2.ListOperationsResponse(operations=[view(o, call.now) for o in items],
                                                 next_page_token=token)


def DeleteOperation(call: rpc.Call, req: operations_pb2.DeleteOperationRequest):
    _operation(call, req.name)
    del call.world.operations[req.name]
    return empty_pb2.Empty()


def CancelOperation(call: rpc.Call, req: operations_pb2.CancelOperationRequest):
    # Unconfirmed: the request is recorded; the operation runs to its end anyway.
    _operation(call, req.name).cancel_requested = True
    return empty_pb2.Empty()


METHODS: dict[str, tuple[Callable, Callable, Callable]] = {
    "GetOperation": (GetOperation, operations_pb2.GetOperationRequest.FromString,
                     operations_pb2.Operation.SerializeToString),
    "ListOperations": (ListOperations, operations_pb2.ListOperationsRequest.FromString,
                       operations_pb2.ListOperationsResponse.SerializeToString),
    "DeleteOperation": (DeleteOperation, operations_pb2.DeleteOperationRequest.FromString,
                        empty_pb2.Empty.SerializeToString),
    "CancelOperation": (CancelOperation, operations_pb2.CancelOperationRequest.FromString,
                        empty_pb2.Empty.SerializeToString),
}


def handler(transact: rpc.Transact, sleep: Callable[[float], None]) -> grpc.GenericRpcHandler:
    """The Operations service; WaitOperation waits with `sleep` (the emulator's clock's)."""
    methods = {name: rpc.unary(transact, impl, des, ser) for name, (impl, des, ser) in METHODS.items()}
    methods["WaitOperation"] = grpc.unary_unary_rpc_method_handler(
        _wait_operation(transact, sleep), request_deserializer=operations_pb2.WaitOperationRequest.FromString,
        response_serializer=operations_pb2.Operation.SerializeToString)
    return grpc.method_handlers_generic_handler(SERVICE, methods)


def _wait_operation(transact: rpc.Transact, sleep: Callable[[float], None]):
    """WaitOperation: the server waits on the emulator's clock (outside the world's lock) until the
    operation is done or the timeout passes."""

    def look(call: rpc.Call, req) -> tuple[operations_pb2.Operation, float]:
        return GetOperation(call, req), _operation(call, req.name).done_at - call.now

    def behaviour(request: operations_pb2.WaitOperationRequest, context: grpc.ServicerContext):
        try:
            op, wait = transact(lambda call: look(call, request))
            if not op.done:
                if request.HasField("timeout"):
                    wait = min(wait, request.timeout.ToTimedelta().total_seconds())
                sleep(max(wait, 0.0))
                op, _ = transact(lambda call: look(call, request))
            return op
        except validate.ApiError as error:
            rpc.abort(context, error)
        except MoeTpuError as error:  # the state file went bad under a running server
            rpc.abort(context, validate.ApiError("INTERNAL", error.message))
    return behaviour
