"""What every emulated service shares on the gRPC side: the call context, generic unary handlers
whose (de)serializers are the message types' own, errors as google.rpc.Status, paging, and a
service whose module loads on its first call."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf import timestamp_pb2
from google.rpc import status_pb2
from grpc_status import rpc_status

from provision.emulator.store import LockTimeout
from provision.emulator.validate import ApiError
from provision.errors import MoeTpuError

if TYPE_CHECKING:
    from provision.emulator.server import Emulator
    from provision.emulator.world import World

DEFAULT_PAGE_SIZE = 100


@dataclass(frozen=True)
class Call:
    """One RPC's view of the emulator: the world under its lock, at a fixed `now`."""

    world: World
    now: float
    scenario: str
    held: bool  # Emulator(external_workloads=True): resources stay up until a hook ends them


def timestamp(t: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(round(t * 1e9))
    return ts


def page(items: list, page_size: int, page_token: str) -> tuple[list, str]:
    """Offset paging: the token is the index of the next item."""
    try:
        start = int(page_token) if page_token else 0
    except ValueError:
        raise ApiError("INVALID_ARGUMENT", f"Invalid page_token {page_token!r}") from None
    if start < 0:
        raise ApiError("INVALID_ARGUMENT", f"Invalid page_token {page_token!r}")
    size = page_size if page_size > 0 else DEFAULT_PAGE_SIZE
    end = start + size
    return items[start:end], (str(end) if end < len(items) else "")


def abort(context: grpc.ServicerContext, error: ApiError) -> None:
    status = status_pb2.Status(code=grpc.StatusCode[error.code].value[0], message=error.message)
    for detail in error.details:
        status.details.add().Pack(detail)
    context.abort_with_status(rpc_status.to_status(status))


def unary(emulator: Emulator, impl: Callable[[Call, Any], Any], des: Callable, ser: Callable):
    """A unary handler that runs impl(call, request) as one transaction on the world."""

    def behaviour(request, context: grpc.ServicerContext):
        try:
            return emulator.call(lambda call: impl(call, request))
        except ApiError as error:
            abort(context, error)
        except LockTimeout as error:  # another process holds the world: a conflict, not worth retrying
            abort(context, ApiError("ABORTED", error.message))
        except MoeTpuError as error:  # the state file went bad under a running server
            abort(context, ApiError("INTERNAL", f"{error.message} ({error.hint})" if error.hint else error.message))
    return grpc.unary_unary_rpc_method_handler(behaviour, request_deserializer=des, response_serializer=ser)


def unimplemented(full_name: str):
    def behaviour(request, context: grpc.ServicerContext):
        context.abort(grpc.StatusCode.UNIMPLEMENTED, f"Method {full_name} is not implemented by the emulator")
    return grpc.unary_unary_rpc_method_handler(behaviour)


class Service(grpc.GenericRpcHandler):
    """One service's methods; those it does not model answer UNIMPLEMENTED.

    `module` names a module with SERVICE (the full service name) and METHODS (name -> (impl,
    request deserializer, response serializer)); it is imported on the service's first call.
    """

    def __init__(self, emulator: Emulator, service: str, module: str) -> None:
        self._emulator = emulator
        self._prefix = f"/{service}/"
        self._module = module
        self._handlers: dict[str, grpc.RpcMethodHandler] | None = None

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if not details.method.startswith(self._prefix):
            return None
        if self._handlers is None:
            module = importlib.import_module(self._module)
            self._handlers = {name: unary(self._emulator, *spec) for name, spec in module.METHODS.items()}
        method = details.method[len(self._prefix):]
        return self._handlers.get(method) or unimplemented(details.method[1:])
