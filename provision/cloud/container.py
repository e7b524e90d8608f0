"""GKE's ClusterManager as the node pool lifecycle needs it: a real ClusterManagerClient behind our
retry policy and errors, waiting on the Container API's own operations (GetOperation)."""

from __future__ import annotations

import re
from typing import Any

from provision.cloud.api import RetryingApi
from provision.errors import CloudError, StockoutError
from provision.waiting import poll

# An operation error that means "no capacity in this zone": worth the next zone.
STOCKOUT_RE = re.compile(r"GCE_STOCKOUT|Not enough resources available|ZONE_RESOURCE_POOL_EXHAUSTED", re.I)
OPERATION_TIMEOUT_S = 6 * 3600.0


class ContainerApi(RetryingApi):
    """Thin, retrying wrapper over google.cloud.container_v1.ClusterManagerClient."""

    quota_hint = ("request more TPU v5e quota for GKE in the console (IAM & Admin > Quotas: TPU v5 Lite "
                  "PodSlice chips, or the preemptible ones for spot), or try another region")

    def get_cluster(self, name: str):
        return self._get_or_none("get cluster", lambda: self.client.get_cluster(name=name))

    def create_cluster(self, request) -> Any:
        """Start the create; None when the cluster already exists."""
        return self._create_or_none("create cluster", lambda: self.client.create_cluster(request=request))

    def delete_cluster(self, name: str):
        return self._get_or_none("delete cluster", lambda: self.client.delete_cluster(name=name))

    def list_node_pools(self, parent: str) -> list:
        return list(self._call("list node pools", lambda: self.client.list_node_pools(parent=parent)).node_pools)

    def get_node_pool(self, name: str):
        return self._get_or_none("get node pool", lambda: self.client.get_node_pool(name=name))

    def create_node_pool(self, request) -> Any:
        """Start the create; None when a pool of that name exists (the caller adopts or refuses it)."""
        return self._create_or_none("create node pool", lambda: self.client.create_node_pool(request=request))

    def delete_node_pool(self, name: str):
        return self._get_or_none("delete node pool", lambda: self.client.delete_node_pool(name=name))

    def wait(self, operation, location: str, what: str, progress=None, timeout_s: float = OPERATION_TIMEOUT_S) -> Any:
        """Poll an operation (GetOperation) until DONE; its error as StockoutError or CloudError."""
        name = f"{location}/operations/{operation.name}"
        done = poll(lambda: self._call(f"poll {what}", lambda: self.client.get_operation(name=name)),
                    lambda op: op.status.name == "DONE", self.clock, timeout_s=timeout_s,
                    progress=progress, what=what,
                    describe=lambda op, t: f"  {what}: {op.status.name}")
        if done.error.code or done.error.message:
            message = done.error.message or done.status_message
            error = StockoutError if STOCKOUT_RE.search(message) else CloudError
            raise error(f"{what}: code {done.error.code}: {message}")
        return done
