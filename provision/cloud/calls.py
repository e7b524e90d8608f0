"""Records every RPC a client sends (polls included) for `--output json` and `-vv`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from provision.cloud.messages import proto_dict


class CallRecorder(grpc.UnaryUnaryClientInterceptor):
    """A client interceptor that appends {"rpc", "request", "status"} for each unary call."""

    def __init__(self, calls: list[dict[str, Any]], on_call: Callable[[dict[str, Any]], None] | None = None):
        self.calls = calls
        self._on_call = on_call

    def intercept_unary_unary(self, continuation, client_call_details, request):
        entry = {"rpc": client_call_details.method.lstrip("/"), "request": proto_dict(request)}
        self.calls.append(entry)
        outcome = continuation(client_call_details, request)
        code = outcome.code() if hasattr(outcome, "code") else None
        entry["status"] = code.name if code is not None else "OK"
        if self._on_call:
            self._on_call(entry)
        return outcome
