"""google.longrunning.Operations, shared by every emulated service.

An operation is a typed record (`Operation`) in the world. Its proto view packs the metadata
and response types of the service that started it: each service module (tpu.py, vertex.py)
provides `operation_metadata(op, now)` and `operation_response(op)`, loaded on first use so a
world that holds only TPU operations never imports the Vertex AI types.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import grpc
from google.longrunning import operations_pb2
from google.protobuf import empty_pb2
from google.rpc import status_pb2

from provision.emulator import rpc, validate
from provision.errors import MoeTpuError

if TYPE_CHECKING:
    from provision.emulator.server import Emulator

SERVICE = "google.longrunning.Operations"
# Which module renders the operations of a service (its metadata and response types).
SERVICE_MODULES = {"tpu": "provision.emulator.tpu", "vertex": "provision.emulator.vertex"}


@dataclass
class Operation:
    """A long-running operation: done once `now >= done_at`, then with `response` or `error`.

    `response` is the proto JSON of the response message (None for google.protobuf.Empty);
    `error` is {"code": google.rpc.Code, "message": ...} for an operation that fails.
    """

    name: str
    service: str  # a key of SERVICE_MODULES
    verb: str
    target: str
    create_time: float
    done_at: float
    response: dict | None = None
    error: dict | None = None
    cancel_requested: bool = False

    def done(self, now: float) -> bool:
        return now >= self.done_at

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Operation:
        op = cls(**data)
        if op.service not in SERVICE_MODULES:
            raise ValueError(f"operation {op.name!r} of unknown service {op.service!r}")
        return op


def view(op: Operation, now: float) -> operations_pb2.Operation:
    """The operation as google.longrunning.Operation at `now`."""
    module = importlib.import_module(SERVICE_MODULES[op.service])
    done = op.done(now)
    result = operations_pb2.Operation(name=op.name, done=done)
    result.metadata.Pack(module.operation_metadata(op, now))
    if done and op.error is not None:
        result.error.CopyFrom(status_pb2.Status(code=op.error["code"], message=op.error["message"]))
    elif done:
        result.response.Pack(module.operation_response(op) if op.response is not None else empty_pb2.Empty())
    return result


def started(op: Operation, now: float) -> operations_pb2.Operation:
    """The answer to the RPC that starts an operation: it has only just begun."""
    answer = view(op, now)
    answer.done = False
    answer.ClearField("response")
    answer.ClearField("error")
    return answer


# --- the Operations service ------------------------------------------------------------


def _operation(call: rpc.Call, name: str) -> Operation:
    op = call.world.operations.get(name)
    if op is None:
        raise validate.not_found(name)
    return op


def GetOperation(call: rpc.Call, req: operations_pb2.GetOperationRequest):
    return view(_operation(call, req.name), call.now)


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


def handler(emulator: Emulator) -> grpc.GenericRpcHandler:
    methods = {name: rpc.unary(emulator, impl, des, ser) for name, (impl, des, ser) in METHODS.items()}
    methods["WaitOperation"] = grpc.unary_unary_rpc_method_handler(
        _wait_operation(emulator), request_deserializer=operations_pb2.WaitOperationRequest.FromString,
        response_serializer=operations_pb2.Operation.SerializeToString)
    return grpc.method_handlers_generic_handler(SERVICE, methods)


def _wait_operation(emulator: Emulator):
    """WaitOperation: the server waits on the emulator's clock (outside the world's lock) until the
    operation is done or the timeout passes."""

    def look(call: rpc.Call, req) -> tuple[operations_pb2.Operation, float]:
        return GetOperation(call, req), _operation(call, req.name).done_at - call.now

    def behaviour(request: operations_pb2.WaitOperationRequest, context: grpc.ServicerContext):
        try:
            op, wait = emulator.call(lambda call: look(call, request))
            if not op.done:
                if request.HasField("timeout"):
                    wait = min(wait, request.timeout.ToTimedelta().total_seconds())
                emulator.clock.sleep(max(wait, 0.0))
                op, _ = emulator.call(lambda call: look(call, request))
            return op
        except validate.ApiError as error:
            rpc.abort(context, error)
        except MoeTpuError as error:  # the state file went bad under a running server
            rpc.abort(context, validate.ApiError("INTERNAL", error.message))
    return behaviour
