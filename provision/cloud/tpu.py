"""The Cloud TPU v2 API as the lifecycle needs it: a real TpuClient behind our retry policy and errors."""

from __future__ import annotations

from typing import Any

from provision.cloud.api import RetryingApi


class TpuApi(RetryingApi):
    """Thin, retrying wrapper over google.cloud.tpu_v2.TpuClient."""

    quota_hint = ("request more TPU v5e quota in the console (IAM & Admin > Quotas), "
                  "or try another zone or capacity type")

    # --- queued resources ------------------------------------------------
    def create_queued_resource(self, request) -> Any:
        """Send the create; ALREADY_EXISTS is returned as None so the caller adopts the resource."""
        return self._create_or_none("create queued resource",
                                    lambda: self.client.create_queued_resource(request=request))

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

    # --- what a zone offers -----------------------------------------------
    def list_accelerator_types(self, parent: str) -> list[str]:
        """The names of the accelerator types the zone `parent` (projects/P/locations/Z) offers."""
        return self._call("list accelerator types", lambda: [
            t.type_ for t in self.client.list_accelerator_types(parent=parent)])

    # --- nodes -----------------------------------------------------------
    def get_node(self, name: str):
        return self._get_or_none("get node", lambda: self.client.get_node(name=name))

    def list_nodes(self, parent: str) -> list:
        return self._call("list nodes", lambda: list(self.client.list_nodes(parent=parent)))

    def delete_node(self, name: str):
        return self._get_or_none("delete node", lambda: self.client.delete_node(name=name))

    def get_guest_attributes(self, name: str, query_path: str) -> list[dict[str, str]] | None:
        """Per worker (in worker order), the guest attributes under `query_path` as {key: value};
        None when the node is gone."""
        from google.cloud import tpu_v2

        request = tpu_v2.GetGuestAttributesRequest(name=name, query_path=query_path)
        answer = self._get_or_none("get guest attributes", lambda: self.client.get_guest_attributes(request=request))
        if answer is None:
            return None
        return [{entry.key: entry.value for entry in attrs.query_value.items}
                for attrs in answer.guest_attributes]
