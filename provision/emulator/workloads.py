"""What an emulated service runs for a run, as the dry run's local workload runner asks it.

Each service says it with one `Play`: where a workload of the run is up now (`placed`), with the
container it carries, and what the service does when the workload starts, reports and ends. The
three live here, beside the emulated world they read (world.py, gke_world.py, vertex_world.py), not in the services'
gRPC modules: a dry run's runner needs them for every target, and the Vertex AI and TPU client
libraries those modules import take a second of CPU to load that a run of another target never needs.
The runner (local_trainer.py) starts the container it is given and names no service.

Each Play also brings its service's `Hooks`: what runs on it now and what ends or preempts it, each
one emulator transaction, for tests and tools (`Emulator.service(name)`, by the Play's name).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from provision import guest_attributes
from provision.emulator.gke_world import GkeWorld
from provision.emulator.vertex_world import CustomJobs

if TYPE_CHECKING:
    from provision.emulator.gke import TrainerPod
    from provision.emulator.vertex_world import RunningJob
    from provision.emulator.world import RunningNode, World

T = TypeVar("T")
WorldCall = Callable[[Callable[[Any, float], T]], T]  # fn(world, now) as one transaction (Emulator.world_call)


@dataclass(frozen=True)
class Placed:
    """Where a workload of the run is up: the resource's key, the container's argv it carries (None: the
    config's trainer container, as a TPU VM's startup script runs it), and for a slice its nodes (name,
    workers)."""

    key: str
    argv: tuple[str, ...] | None = None
    nodes: tuple[tuple[str, int], ...] = ()


class Hooks:
    """One service's hooks: each method is one transaction on the emulated world (`world_call`)."""

    def __init__(self, world_call: WorldCall) -> None:
        self._call = world_call


class Play(Protocol):
    """One service's part in a dry run. Every method runs inside one emulator transaction (world, now).

    name: the service's; publishes: whether `publish` writes anything (a transaction is spared if not);
    hooks: its Hooks.
    """

    name: str
    publishes: bool
    hooks: type[Hooks]

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


class TpuHooks(Hooks):
    """Cloud TPU: the READY nodes, a queued resource's preemption, and what a worker's guest writes."""

    def running_nodes(self) -> list[RunningNode]:
        return self._call(lambda world, now: world.running_nodes(now))

    def preempt_queued_resource(self, name: str) -> bool:
        return self._call(lambda world, now: world.preempt_queued_resource(name, now))

    def set_guest_attributes(self, node_name: str, worker_id: int, namespace: str,
                             values: Mapping[str, str | int | float]) -> None:
        self._call(lambda world, now: world.set_guest_attributes(node_name, worker_id, namespace, values, now))


class TpuPlay:
    """A queued resource's slice: the trainer runs on its READY nodes (the startup script's container);
    its status reaches the guest attributes every worker's watcher writes; a preemption suspends the
    queued resource."""

    name = "tpu"
    publishes = True
    hooks = TpuHooks

    def placed(self, world: World, now: float, run: str) -> list[Placed]:
        nodes = [n for n in world.running_nodes(now) if n.run == run]
        slices = dict.fromkeys(n.queued_resource for n in nodes)
        return [Placed(key=qr, nodes=tuple((n.node, n.workers) for n in nodes if n.queued_resource == qr))
                for qr in slices]

    def started(self, world: World, now: float, placed: Placed, log_path: str) -> None:
        pass

    def publish(self, world: World, now: float, placed: Placed, status: dict) -> None:
        values = {key: _text(status.get(field)) for field, key in guest_attributes.pairs()
                  if status.get(field) is not None}
        values["updated"] = _text(status.get("time") or time.time())
        for node, workers in placed.nodes:
            if world.node_at(node, now) is None:
                continue
            for worker in range(workers):
                world.set_guest_attributes(node, worker, guest_attributes.NAMESPACE, values, now)

    def ended(self, world: World, now: float, placed: Placed, code: int, final: dict, preempted: bool,
              log_path: str) -> None:
        if preempted:
            world.preempt_queued_resource(placed.key, now)


def _text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


class VertexHooks(Hooks):
    """Vertex AI custom jobs: those RUNNING, and ending one (vertex_world.CustomJobs.end)."""

    def running_jobs(self) -> list[RunningJob]:
        return self._call(lambda world, now: CustomJobs.of(world).running(now))

    def end_custom_job(self, name: str, succeeded: bool, error: tuple[int, str] | None = None,
                       preempted: bool = False) -> bool:
        return self._call(lambda world, now: CustomJobs.of(world).end(name, now, succeeded, error, preempted))


class VertexPlay:
    """A custom job: the trainer runs while it is RUNNING, with the container it was submitted with; its
    exit ends the job (SUCCEEDED, FAILED with the replica's exit status, or FAILED as a preemption)."""

    name = "vertex"
    publishes = False
    hooks = VertexHooks

    def placed(self, world: World, now: float, run: str) -> list[Placed]:
        return [Placed(key=j.name, argv=(*j.command, *j.args)) for j in CustomJobs.of(world).running(now)
                if j.run == run]

    def started(self, world: World, now: float, placed: Placed, log_path: str) -> None:
        pass

    def publish(self, world: World, now: float, placed: Placed, status: dict) -> None:
        pass

    def ended(self, world: World, now: float, placed: Placed, code: int, final: dict, preempted: bool,
              log_path: str) -> None:
        if preempted:
            CustomJobs.of(world).end(placed.key, now, succeeded=False, preempted=True)
        elif code == 0:
            CustomJobs.of(world).end(placed.key, now, succeeded=True)
        else:
            CustomJobs.of(world).end(placed.key, now, succeeded=False,
                                 error=(13, f"The replica workerpool0-0 exited with a non-zero status of {code}. "
                                            f"{final.get('error') or ''}".strip()))


class GkeHooks(Hooks):
    """GKE: the trainer pods Running, ending one (the JobSet follows), and reclaiming a spot node."""

    def trainer_pods(self) -> list[TrainerPod]:
        return self._call(lambda world, now: GkeWorld.of(world).trainer_pods(now))

    def end_trainer_pod(self, namespace: str, name: str, code: int, message: str = "",
                        log_path: str | None = None) -> None:
        self._call(lambda world, now: GkeWorld.of(world).end_trainer(namespace, name, code, now, message, log_path))

    def preempt_node(self, node: str) -> bool:
        return self._call(lambda world, now: GkeWorld.of(world).preempt_node(node, now))


class GkePlay:
    """A JobSet's trainer pod (the Pathways head's trainer, or slice 0's pod 0): the trainer runs while
    the pod is Running, with the pod's container; its log is the pod's; its exit ends the pod (the
    JobSet follows), and a preemption takes a spot node of the JobSet's pools."""

    name = "gke"
    publishes = False
    hooks = GkeHooks

    def placed(self, world, now: float, run: str) -> list[Placed]:
        return [Placed(key=f"pod/{p.namespace}/{p.name}", argv=(*p.command, *p.args))
                for p in GkeWorld.of(world).trainer_pods(now) if p.run == run]

    def started(self, world, now: float, placed: Placed, log_path: str) -> None:
        GkeWorld.of(world).set_log(*_pod_of(placed), log_path)

    def publish(self, world, now: float, placed: Placed, status: dict) -> None:
        pass

    def ended(self, world, now: float, placed: Placed, code: int, final: dict, preempted: bool,
              log_path: str) -> None:
        namespace, name = _pod_of(placed)
        if preempted:  # the spot node under the run goes; the trainer's pod fails with it
            GkeWorld.of(world).preempt_trainer(namespace, name, code, now)
        else:
            GkeWorld.of(world).end_trainer(namespace, name, code, now, final.get("error") or "", log_path)


def _pod_of(placed: Placed) -> tuple[str, str]:
    """A trainer pod's (namespace, name) from its key pod/NAMESPACE/NAME."""
    namespace, name = placed.key.split("/", 2)[1:]
    return namespace, name


# The services that run a workload for a run, in the order the runner asks them which to start.
PLAYS: tuple[Play, ...] = (GkePlay(), TpuPlay(), VertexPlay())


def hooks(name: str, world_call: WorldCall) -> Hooks:
    """The hooks of the service whose Play is `name`, on `world_call`; ValueError naming the services
    there are for any other name."""
    play = next((p for p in PLAYS if p.name == name), None)
    if play is None:
        known = ", ".join(sorted(p.name for p in PLAYS))
        raise ValueError(f"no emulated service {name!r}: the services are {known}")
    return play.hooks(world_call)
