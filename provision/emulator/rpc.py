"""What every emulated service shares on the gRPC side: the call context, the transaction that runs
a call, generic unary handlers whose (de)serializers are the message types' own, errors as
google.rpc.Status, paging, long-running operations' proto views, and a service whose methods load
on its first call.

Handlers never see the Emulator: they get a `Transact` (Emulator.call), which runs one function
of a `Call` as one transaction on the world.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from google.longrunning import operations_pb2
from google.protobuf import empty_pb2, timestamp_pb2
from google.rpc import status_pb2
from grpc_status import rpc_status

from provision.emulator.store import LockTimeout
from provision.emulator.validate import ApiError
from provision.errors import MoeTpuError

if TYPE_CHECKING:
    from provision.emulator.world import Operation, World

DEFAULT_PAGE_SIZE = 100
# name -> (impl, request deserializer, response serializer[, "stream"]): a service module's METHODS.
Methods = dict[str, tuple]


@dataclass(frozen=True)
class Call:
    """One RPC's view of the emulator: the world under its lock, at a fixed `now`."""

    world: World
    now: float
    scenario: str
    held: bool  # Emulator(external_workloads=True): resources stay up until a hook ends them
    # () -> (host:port, base64 CA PEM) of the Kubernetes API server, started on first use.
    kube_endpoint: Callable[[], tuple[str, str]] | None = None
    # The dry run's model servers (local_server.LocalServers); None where the emulator has no state directory.
    servers: Any = None


@dataclass(frozen=True)
class Later:
    """What a handler answers when the answer takes a while and needs no world (a prediction forwarded to a
    model server): `fn()` runs after the transaction, outside the world's lock."""

    fn: Callable[[], Any]


# fn(call) as one transaction: under the world's lock, on the freshest world, saved after.
Transact = Callable[[Callable[[Call], Any]], Any]


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


def longrunning(op: Operation, now: float, metadata: Callable[[Operation, float], Any],
                response: Callable[[Operation], Any]) -> operations_pb2.Operation:
    """`op` as google.longrunning.Operation at `now`, with its service's metadata(op, now) and, once
    done without an error, its response(op) (google.protobuf.Empty when it records none)."""
    done = op.done(now)
    result = operations_pb2.Operation(name=op.name, done=done)
    result.metadata.Pack(metadata(op, now))
    if done and op.error is not None:
        result.error.CopyFrom(status_pb2.Status(code=op.error["code"], message=op.error["message"]))
    elif done:
        result.response.Pack(response(op) if op.response is not None else empty_pb2.Empty())
    return result


def started(answer: operations_pb2.Operation) -> operations_pb2.Operation:
    """The answer to the RPC that starts an operation (its view, `answer`): it has only just begun."""
    answer.done = False
    answer.ClearField("response")
    answer.ClearField("error")
    return answer


def abort(context: grpc.ServicerContext, error: ApiError) -> None:
    status = status_pb2.Status(code=grpc.StatusCode[error.code].value[0], message=error.message)
    for detail in error.details:
        status.details.add().Pack(detail)
    context.abort_with_status(rpc_status.to_status(status))


def _answer(transact: Transact, impl: Callable[[Call, Any], Any], request, context: grpc.ServicerContext):
    """impl(call, request) as one transaction (a `Later` then run outside it), errors as google.rpc.Status."""
    try:
        result = transact(lambda call: impl(call, request))
        return result.fn() if isinstance(result, Later) else result
    except ApiError as error:
        abort(context, error)
    except LockTimeout as error:  # another process holds the world: a conflict, not worth retrying
        abort(context, ApiError("ABORTED", error.message))
    except MoeTpuError as error:  # the state file went bad under a running server
        abort(context, ApiError("INTERNAL", f"{error.message} ({error.hint})" if error.hint else error.message))


def unary(transact: Transact, impl: Callable[[Call, Any], Any], des: Callable, ser: Callable, kind: str = "unary"):
    """A handler that runs impl(call, request) as one transaction on the world; kind "stream": a server
    stream of the messages impl's answer (an iterable, or a Later giving one) yields."""
    if kind == "stream":
        def streaming(request, context: grpc.ServicerContext):
            messages = _answer(transact, impl, request, context)
            try:
                yield from messages
            except ApiError as error:
                abort(context, error)
        return grpc.unary_stream_rpc_method_handler(streaming, request_deserializer=des, response_serializer=ser)

    def behaviour(request, context: grpc.ServicerContext):
        return _answer(transact, impl, request, context)
    return grpc.unary_unary_rpc_method_handler(behaviour, request_deserializer=des, response_serializer=ser)


def unimplemented(full_name: str):
    def behaviour(request, context: grpc.ServicerContext):
        context.abort(grpc.StatusCode.UNIMPLEMENTED, f"Method {full_name} is not implemented by the emulator")
    return grpc.unary_unary_rpc_method_handler(behaviour)


class Service(grpc.GenericRpcHandler):
    """One service's methods; those it does not model answer UNIMPLEMENTED.

    `methods()` gives the service module's METHODS; it is called (and so the module imported) on
    the service's first call.
    """

    def __init__(self, transact: Transact, service: str, methods: Callable[[], Methods]) -> None:
        self._transact = transact
        self._prefix = f"/{service}/"
        self._methods = methods
        self._handlers: dict[str, grpc.RpcMethodHandler] | None = None

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if not details.method.startswith(self._prefix):
            return None
        if self._handlers is None:
            self._handlers = {name: unary(self._transact, *spec) for name, spec in self._methods().items()}
        method = details.method[len(self._prefix):]
        return self._handlers.get(method) or unimplemented(details.method[1:])
