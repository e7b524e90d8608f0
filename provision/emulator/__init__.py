"""An emulator of the Cloud TPU v2 API that the real google-cloud-tpu client talks to over gRPC.

Dry runs and tests point the real `TpuClient` at it on 127.0.0.1; it validates requests,
answers with the real status codes and long-running operations, and runs the queued
resource state machines on a simulated clock. `SCENARIOS` and `ScaledClock` import
cheaply; `Emulator` loads grpc and google-cloud-tpu on first use.
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
