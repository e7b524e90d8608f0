"""An emulator of the Cloud TPU v2 and Vertex AI JobService APIs that the real google-cloud-tpu and
google-cloud-aiplatform clients talk to over gRPC.

Dry runs and tests point the real `TpuClient` and `JobServiceClient` at it on 127.0.0.1; it
validates requests, answers with the real status codes and long-running operations, and runs
the queued resource and custom job state machines on a simulated clock. `SCENARIOS` and
`ScaledClock` import cheaply; `Emulator` loads grpc and google-cloud-tpu on first use, and
google-cloud-aiplatform on the first Vertex AI call.

Modules: server (Emulator, transactions), store (the state file and its lock), world (state and
JSON), tpu / vertex / operations (one per service: checks, views, RPCs), faults (`flaky`),
scenarios (timelines, plain data), validate (shared request checks), rpc (shared gRPC plumbing).
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
