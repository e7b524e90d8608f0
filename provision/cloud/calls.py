"""Records every RPC a client sends (polls included) for `--output json` and `-vv`."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc

from provision.cloud.messages import proto_dict


class CallLog:
    """A session's calls log: {"rpc", "request", "status"} for each call, in the order they were sent;
    `on_call` sees each entry once it has its status."""

    def __init__(self, calls: list[dict[str, Any]], on_call: Callable[[dict[str, Any]], None] | None = None):
        self.calls = calls
        self._on_call = on_call

    def start(self, rpc: str, request: dict[str, Any]) -> dict[str, Any]:
        entry = {"rpc": rpc, "request": request}
        self.calls.append(entry)
        return entry

    def end(self, entry: dict[str, Any], status: str) -> None:
        entry["status"] = status
        if self._on_call:
            self._on_call(entry)

    @contextmanager
    def call(self, rpc: str, request: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Log the call made inside the block: OK, or the status of the error that leaves it."""
        entry = self.start(rpc, request)
        try:
            yield entry
        except BaseException as exc:
            self.end(entry, status_of(exc))
            raise
        self.end(entry, "OK")


def status_of(exc: BaseException) -> str:
    """A failed call's status as the log writes it: the gRPC code's name of a google.api_core error (an
    HTTP API's errors map onto them too: 404 is NOT_FOUND), else its HTTP code, else the error's type."""
    code = getattr(exc, "grpc_status_code", None)
    if code is not None:
        return code.name
    http = getattr(exc, "code", None)
    return f"HTTP {http}" if isinstance(http, int) else type(exc).__name__


class CallRecorder(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """A client interceptor that logs {"rpc", "request", "status"} for each unary call and each call with a
    stream of answers (its status once the stream has ended)."""

    def __init__(self, log: CallLog):
        self.log = log

    def intercept_unary_unary(self, continuation, client_call_details, request):
        entry = self.log.start(client_call_details.method.lstrip("/"), proto_dict(request))
        outcome = continuation(client_call_details, request)
        code = outcome.code() if hasattr(outcome, "code") else None
        self.log.end(entry, code.name if code is not None else "OK")
        return outcome

    def intercept_unary_stream(self, continuation, client_call_details, request):
        entry = self.log.start(client_call_details.method.lstrip("/"), proto_dict(request))
        outcome = continuation(client_call_details, request)
        outcome.add_callback(lambda: self.log.end(entry, outcome.code().name))
        return outcome
