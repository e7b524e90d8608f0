"""The Cloud TPU v2 API as the lifecycle needs it: a real TpuClient, our retry policy, our errors.

The generated client retries nothing by default, so every call goes through
`call_with_retry`. Errors that the user must act on become CloudError / QuotaError
with a message that says what to do.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, TypeVar

from provision.errors import CloudError, QuotaError, UsageError
from provision.waiting import call_with_retry, is_rate_limit, poll

T = TypeVar("T")

QUOTA_RE = re.compile(r"Quota limit '([^']+)'")


def quota_name(exc: BaseException) -> str | None:
    """The quota id from a RESOURCE_EXHAUSTED error's QuotaFailure detail, or from its message."""
    for detail in getattr(exc, "details", None) or []:
        for violation in getattr(detail, "violations", []) or []:
            subject = getattr(violation, "subject", "") or ""
            match = QUOTA_RE.search(getattr(violation, "description", "") or "")
            if match:
                return match.group(1)
            if subject:
                return subject.rsplit("/", 1)[-1]
    match = QUOTA_RE.search(str(exc))
    return match.group(1) if match else None


def translate(exc: BaseException, action: str) -> BaseException:
    """A google.api_core error as the error the user sees."""
    from google.api_core import exceptions as gexc

    message = getattr(exc, "message", None) or str(exc)
    if isinstance(exc, gexc.ResourceExhausted) and not is_rate_limit(exc):
        quota = quota_name(exc)
        return QuotaError(
            f"{action}: quota exceeded{f' ({quota})' if quota else ''}: {message}",
            hint="request more TPU v5e quota in the console (IAM & Admin > Quotas), "
                 "or try another zone or capacity type")
    if isinstance(exc, gexc.InvalidArgument):
        return UsageError(f"{action}: the API rejected the request: {message}",
                          hint="check the config against `moe-tpu validate`")
    if isinstance(exc, gexc.PermissionDenied):
        return CloudError(f"{action}: permission denied: {message}",
                          hint="check the project id, that the Cloud TPU API is enabled, and your roles")
    if isinstance(exc, gexc.Unauthenticated):
        return CloudError(f"{action}: not authenticated: {message}",
                          hint="run `gcloud auth application-default login`")
    if isinstance(exc, gexc.GoogleAPICallError):
        code = getattr(exc, "grpc_status_code", None)
        name = code.name if code is not None else type(exc).__name__
        return CloudError(f"{action}: {name}: {message}")
    return exc


class TpuApi:
    """Thin, retrying wrapper over google.cloud.tpu_v2.TpuClient."""

    def __init__(self, client, clock, console) -> None:
        self.client = client
        self.clock = clock
        self.console = console

    def _call(self, action: str, fn: Callable[[], T]) -> T:
        def on_retry(attempt: int, exc: BaseException | None) -> None:
            self.console.detail(f"{action}: transient error ({type(exc).__name__}), retry {attempt}")

        try:
            return call_with_retry(fn, self.clock, on_retry=on_retry)
        except Exception as exc:  # noqa: BLE001 - translated below, original chained
            translated = translate(exc, action)
            if translated is exc:
                raise
            raise translated from exc

    def _get_or_none(self, action: str, fn: Callable[[], T]) -> T | None:
        from google.api_core import exceptions as gexc

        try:
            return call_with_retry(fn, self.clock)
        except gexc.NotFound:
            return None
        except Exception as exc:  # noqa: BLE001
            translated = translate(exc, action)
            if translated is exc:
                raise
            raise translated from exc

    # --- queued resources ------------------------------------------------
    def create_queued_resource(self, request) -> Any:
        """Send the create; ALREADY_EXISTS is returned as None so the caller adopts the resource."""
        from google.api_core import exceptions as gexc

        try:
            return self._call("create queued resource",
                              lambda: self.client.create_queued_resource(request=request))
        except CloudError as exc:
            if isinstance(exc.__cause__, gexc.AlreadyExists):
                return None
            raise

    def get_queued_resource(self, name: str):
        return self._get_or_none("get queued resource",
                                 lambda: self.client.get_queued_resource(name=name))

    def list_queued_resources(self, parent: str) -> list:
        return self._call("list queued resources",
                          lambda: list(self.client.list_queued_resources(parent=parent)))

    def delete_queued_resource(self, name: str, force: bool = True):
        """Start the delete; NOT_FOUND (already gone) returns None."""
        from google.cloud import tpu_v2

        request = tpu_v2.DeleteQueuedResourceRequest(name=name, force=force)
        return self._get_or_none("delete queued resource",
                                 lambda: self.client.delete_queued_resource(request=request))

    # --- nodes -----------------------------------------------------------
    def get_node(self, name: str):
        return self._get_or_none("get node", lambda: self.client.get_node(name=name))

    def list_nodes(self, parent: str) -> list:
        return self._call("list nodes", lambda: list(self.client.list_nodes(parent=parent)))

    def delete_node(self, name: str):
        return self._get_or_none("delete node", lambda: self.client.delete_node(name=name))

    # --- operations ------------------------------------------------------
    def wait_operation(self, operation, what: str, timeout_s: float = 3600.0):
        """Poll a long-running operation on our clock (not api_core's real-time sleep)."""
        poll(lambda: self._call(f"poll {what}", operation.done), bool, self.clock,
             timeout_s=timeout_s, what=what)
        try:
            return operation.result(timeout=0)
        except Exception as exc:  # noqa: BLE001
            translated = translate(exc, what)
            if translated is exc:
                raise
            raise translated from exc
