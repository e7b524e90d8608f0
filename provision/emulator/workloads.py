"""What an emulated service runs for a run, as the dry run's local workload runner asks it.

Each service module says it with one `Play` (tpu.py: a queued resource's slice, vertex.py: a custom
job, gke_world.py: a JobSet's trainer pod): where a workload of the run is up now (`placed`), with the
container it carries, and what the service does when the workload starts, reports and ends. The runner
(local_trainer.py) starts the container it is given and names no service.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Placed:
    """Where a workload of the run is up: the resource's key, the container's argv it carries (None: the
    config's trainer container, as a TPU VM's startup script runs it), and for a slice its nodes (name,
    workers)."""

    key: str
    argv: tuple[str, ...] | None = None
    nodes: tuple[tuple[str, int], ...] = ()


class Play(Protocol):
    """One service's part in a dry run. Every method runs inside one emulator transaction (world, now).

    name: the service's; publishes: whether `publish` writes anything (a transaction is spared if not).
    """

    name: str
    publishes: bool

    def placed(self, world: Any, now: float, run: str) -> list[Placed]:
        """Where a workload of `run` is up now, first the one to start."""

    def started(self, world: Any, now: float, placed: Placed, log_path: str) -> None:
        """The workload started; its console output goes to `log_path`."""

    def publish(self, world: Any, now: float, placed: Placed, status: dict) -> None:
        """The workload's status changed (the trainer's status file): show it where the service does."""

    def ended(self, world: Any, now: float, placed: Placed, code: int, final: dict, preempted: bool,
              log_path: str) -> None:
        """The workload exited with `code` (`final`: its last status): the resource follows; `preempted`:
        the dry run preempted it (`--scenario preempt`), as the capacity going away would."""
