"""Vertex AI's JobService as the job lifecycle needs it: a real JobServiceClient (aiplatform_v1 only)
behind our retry policy and errors."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from provision.cloud.api import RetryingApi


class VertexApi(RetryingApi):
    """Thin, retrying wrapper over google.cloud.aiplatform_v1.JobServiceClient."""

    quota_hint = ("request more Vertex AI TPU v5e training quota in the console (IAM & Admin > Quotas), "
                  "or try another region")

    def create_custom_job(self, request, find_existing: Callable[[], Any | None]) -> Any:
        """Submit the job exactly once. A create has no request id, and a retried create whose
        first answer was lost would make a second job: every retry first looks for the job
        the lost attempt may have made (`find_existing`) and returns that one if it exists."""
        attempts = 0

        def once():
            nonlocal attempts
            attempts += 1
            if attempts > 1 and (found := find_existing()) is not None:
                return found
            return self.client.create_custom_job(request=request)

        return self._call("create custom job", once)

    def get_custom_job(self, name: str):
        return self._get_or_none("get custom job", lambda: self.client.get_custom_job(name=name))

    def list_custom_jobs(self, parent: str, server_filter: str = "") -> list:
        """Every custom job under `parent` that matches the API filter expression (all pages)."""
        request = {"parent": parent, "filter": server_filter}
        return self._call("list custom jobs", lambda: list(self.client.list_custom_jobs(request=request)))

    def cancel_custom_job(self, name: str) -> bool:
        """Ask for the cancel; False when the job is already gone."""
        return self._get_or_none("cancel custom job", lambda: self.client.cancel_custom_job(name=name) or True) is True

    def delete_custom_job(self, name: str):
        """Start the delete (a long-running operation); None when the job is already gone."""
        return self._get_or_none("delete custom job", lambda: self.client.delete_custom_job(name=name))
