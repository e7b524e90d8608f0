"""What every Google API adapter shares: our retry policy, error translation, operation waits.

The generated clients retry nothing by default, so every call goes through
`call_with_retry`. Errors that the user must act on become CloudError / QuotaError /
UsageError with a message that says what to do.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TypeVar

from provision.errors import CloudError, QuotaError, UsageError
from provision.waiting import call_with_retry, poll

T = TypeVar("T")

RATE_LIMIT_MARKERS = ("qps", "rate limit", "requests per", "/qps/", "per minute")


def is_rate_limit(exc: BaseException) -> bool:
    """RESOURCE_EXHAUSTED from a request-rate quota (worth retrying), not a chip quota."""
    text = str(exc).lower()
    return any(marker in text for marker in RATE_LIMIT_MARKERS)


def is_transient(exc: BaseException) -> bool:
    """A failure worth retrying: UNAVAILABLE, DEADLINE_EXCEEDED, INTERNAL, a gateway's, and
    RESOURCE_EXHAUSTED from a request-rate quota. A chip quota is not transient: it fails at once."""
    from google.api_core import exceptions as gexc

    if isinstance(exc, (gexc.ServiceUnavailable, gexc.DeadlineExceeded, gexc.InternalServerError,
                        gexc.GatewayTimeout, gexc.BadGateway)):
        return True
    return isinstance(exc, gexc.ResourceExhausted) and is_rate_limit(exc)

QUOTA_RE = re.compile(r"Quota limit '([^']+)'")
QUOTA_METRIC_RE = re.compile(r"exceed quota limits?: ?([\w./-]+)")


def quota_name(exc: BaseException) -> str | None:
    """The quota id from a RESOURCE_EXHAUSTED error's QuotaFailure detail, or from its message."""
    for detail in getattr(exc, "details", None) or []:
        for violation in getattr(detail, "violations", []) or []:
            subject = getattr(violation, "subject", "") or ""
            description = getattr(violation, "description", "") or ""
            match = QUOTA_RE.search(description) or QUOTA_METRIC_RE.search(description)
            if match:
                return match.group(1)
            if subject:
                return subject.rsplit("/", 1)[-1]
    text = str(exc)
    match = QUOTA_RE.search(text) or QUOTA_METRIC_RE.search(text)
    return match.group(1) if match else None


def translate(exc: BaseException, action: str, quota_hint: str) -> BaseException:
    """A google.api_core error as the error the user sees (the same exception if not an API error)."""
    from google.api_core import exceptions as gexc

    message = getattr(exc, "message", None) or str(exc)
    if isinstance(exc, gexc.ResourceExhausted) and not is_rate_limit(exc):
        quota = quota_name(exc)
        return QuotaError(f"{action}: quota exceeded{f' ({quota})' if quota else ''}: {message}", hint=quota_hint)
    if isinstance(exc, gexc.InvalidArgument):
        return UsageError(f"{action}: the API rejected the request: {message}",
                          hint="check the config against `moe-tpu validate`")
    if isinstance(exc, gexc.PermissionDenied):
        return CloudError(f"{action}: permission denied: {message}",
                          hint="check the project id, that the API is enabled, and your roles")
    if isinstance(exc, gexc.Unauthenticated):
        return CloudError(f"{action}: not authenticated: {message}",
                          hint="run `gcloud auth application-default login`")
    if isinstance(exc, gexc.GoogleAPICallError):
        code = getattr(exc, "grpc_status_code", None)
        name = code.name if code is not None else type(exc).__name__
        return CloudError(f"{action}: {name}: {message}")
    return exc


class RetryingApi:
    """A generated client behind our retry policy; subclasses add the calls a lifecycle needs."""

    quota_hint = "request more quota in the console (IAM & Admin > Quotas)"

    def __init__(self, client, clock, console) -> None:
        self.client = client
        self.clock = clock
        self.console = console

    def _raise_translated(self, exc: BaseException, action: str):
        translated = translate(exc, action, self.quota_hint)
        if translated is exc:
            raise exc
        raise translated from exc

    def _call(self, action: str, fn: Callable[[], T]) -> T:
        def on_retry(attempt: int, exc: BaseException | None) -> None:
            self.console.detail(f"{action}: transient error ({type(exc).__name__}), retry {attempt}")

        try:
            return call_with_retry(fn, self.clock, on_retry=on_retry, transient=is_transient)
        except Exception as exc:  # noqa: BLE001 - translated, original chained
            self._raise_translated(exc, action)

    def _get_or_none(self, action: str, fn: Callable[[], T]) -> T | None:
        """The call's answer, or None when the resource does not exist (NOT_FOUND)."""
        from google.api_core import exceptions as gexc

        try:
            return self._call(action, fn)
        except CloudError as exc:
            if isinstance(exc.__cause__, gexc.NotFound):
                return None
            raise

    def _create_or_none(self, action: str, fn: Callable[[], T]) -> T | None:
        """The create's answer, or None when it already exists (ALREADY_EXISTS: the caller adopts it)."""
        from google.api_core import exceptions as gexc

        try:
            return self._call(action, fn)
        except CloudError as exc:
            if isinstance(exc.__cause__, gexc.AlreadyExists):
                return None
            raise

    def wait_operation(self, operation, what: str, timeout_s: float = 3600.0):
        """Poll a long-running operation on our clock (not api_core's real-time sleep)."""
        poll(lambda: self._call(f"poll {what}", operation.done), bool, self.clock,
             timeout_s=timeout_s, what=what)
        try:
            return operation.result(timeout=0)
        except Exception as exc:  # noqa: BLE001
            self._raise_translated(exc, what)
