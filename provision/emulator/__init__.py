"""An emulator of the Cloud TPU v2, Vertex AI JobService and GKE ClusterManager APIs that the real
google-cloud-tpu, google-cloud-aiplatform and google-cloud-container clients talk to over gRPC, and
of a GKE cluster's Kubernetes API (the subset a run uses) for the official kubernetes client.

Dry runs and tests point the real `TpuClient` and `JobServiceClient` at it on 127.0.0.1; it
validates requests, answers with the real status codes and long-running operations, and runs
the queued resource and custom job state machines on a simulated clock. `SCENARIOS` and
`ScaledClock` import cheaply; `Emulator` loads grpc and google-cloud-tpu on first use, and
google-cloud-aiplatform on the first Vertex AI call.

Modules: server (Emulator, transactions), store (the state file and its lock), world (records,
operations among them, and JSON), tpu / vertex / container / operations (one per service: checks,
views, RPCs), gke (GKE's records), gke_world (GKE's state and the JobSet controller), kube (the
Kubernetes API over HTTPS), faults (`flaky`), scenarios (timelines, plain data), validate (shared
request checks), rpc (shared gRPC plumbing). Services get a transaction (Emulator.call or
Emulator.world_call), never the Emulator, and import each other by name, never by string.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from provision.emulator.clock import ScaledClock
from provision.emulator.scenarios import SCENARIOS

if TYPE_CHECKING:
    from provision.emulator.server import Emulator

__all__ = ["SCENARIOS", "Emulator", "ScaledClock"]


def __getattr__(name: str):
    if name == "Emulator":
        from provision.emulator.server import Emulator

        return Emulator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
