"""The Emulator: a loopback gRPC server over the emulated world, one transaction per RPC.

Services: google.cloud.tpu.v2.Tpu (tpu.py), google.cloud.aiplatform.v1.JobService (vertex.py,
loaded on its first call), google.container.v1.ClusterManager (container.py, also loaded on its
first call) and google.longrunning.Operations (operations.py), behind the `flaky` fault injector
(faults.py); GKE clusters' Kubernetes API on its own HTTPS port (kube.py, started when GetCluster
first names its endpoint). With a state file every transaction locks it, reloads what other
processes saved, applies, and saves (store.py), so concurrent commands share one world. The
services get that transaction (`call`, `world_call`) and the clock's `sleep`, never the Emulator.
"""

from __future__ import annotations

import ipaddress
import os
import re
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path
from typing import Self, TypeVar

import grpc

from provision.clock import SimClock
from provision.emulator import operations, rpc, scenarios, workloads
from provision.emulator.faults import FaultInjector
from provision.emulator.gke_world import GkeWorld
from provision.emulator.scenarios import check_scenario
from provision.emulator.store import Store
from provision.emulator.validate import ApiError
from provision.emulator.world import World

T = TypeVar("T")


class Emulator:
    """Cloud TPU v2, Vertex AI custom jobs and their Operations on 127.0.0.1, on a given clock.

    >>> with Emulator(scenario="happy") as emu:
    ...     client = emu.client()       # a real google.cloud.tpu_v2.TpuClient
    ...     jobs = emu.job_client()     # a real google.cloud.aiplatform_v1.JobServiceClient
    ...     emu.clock.advance(600)      # simulated time moves only when someone waits

    `external_workloads=True`: queued resources, custom jobs and a JobSet's trainer pods created through
    this emulator stay ACTIVE / RUNNING once they get there, until their service's hook (`service(name)`)
    or the user's own delete or cancel ends them: a dry run's local trainer plays the workload.
    """

    def __init__(self, state_path: Path | None = None, scenario: str = "happy", clock=None, seed: int = 0,
                 external_workloads: bool = False, reservations: dict[str, int] | None = None,
                 lock_notice: Callable[[str], None] | None = None, servers=None) -> None:
        self.scenario = check_scenario(scenario)
        # The project's TPU reservations, "ZONE/NAME" -> chips; by default from the environment
        # (MOE_TPU_EMULATOR_RESERVATIONS); none when unset, as in a project without one.
        self.reservations = (parse_reservations(os.environ.get(RESERVATIONS_ENV, "")) if reservations is None
                             else dict(reservations))
        self.state_path = Path(state_path) if state_path is not None else None
        self.clock = clock if clock is not None else SimClock()
        self.seed = seed
        self.external_workloads = external_workloads
        self.world = World(seed=seed)
        self.port: int | None = None
        self._host = "127.0.0.1"
        self._server: grpc.Server | None = None
        self._store = Store(self.state_path, notice=lock_notice)
        self._lock = threading.RLock()
        self._now: float | None = None  # set while a transaction runs
        self._channels: list[grpc.Channel] = []
        self._kube = None  # the Kubernetes API server (kube.py), started on first use
        # The model servers a deployed model runs (local_server.LocalServers): by default under the state
        # file's directory; none without one (deploys then end on the clock, predictions are refused).
        # They play Vertex AI's deployed models and a GKE Deployment's pods.
        if servers is None and self.state_path is not None:
            from provision.emulator.local_server import LocalServers

            servers = LocalServers(self.state_path.parent)
        self.servers = servers

    # --- lifecycle -------------------------------------------------------------
    def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Load the saved world (if any), bind to a loopback address and serve; returns the port."""
        if self._server is not None:
            raise RuntimeError(f"the emulator is already serving on {self.address}")
        if not ipaddress.ip_address(host).is_loopback:
            raise ValueError(f"the emulator binds to loopback only, not {host!r}")
        with self._lock, self._store.locked():
            self._reload()
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="emulator"),
                             handlers=self._handlers(),
                             interceptors=[FaultInjector(self.world_call, self.seed, self.scenario == "flaky")],
                             options=[("grpc.so_reuseport", 0)])
        bind = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            self.port = server.add_insecure_port(bind)
        except RuntimeError as exc:
            raise OSError(f"cannot bind the emulator to {bind}: {exc}") from exc
        if not self.port:
            raise OSError(f"cannot bind the emulator to {bind}")
        self._host = host
        server.start()
        self._server = server
        return self.port

    def _handlers(self) -> list[grpc.GenericRpcHandler]:
        """Each service's handler, given the transaction it runs in (never the Emulator itself)."""
        return [rpc.Service(self.call, "google.cloud.tpu.v2.Tpu", _tpu_methods),
                rpc.Service(self.call, "google.cloud.aiplatform.v1.JobService", _vertex_methods),
                rpc.Service(self.call, "google.container.v1.ClusterManager", _container_methods),
                *(rpc.Service(self.call, f"google.cloud.aiplatform.v1.{name}", methods)
                  for name, methods in _SERVING_SERVICES.items()),
                operations.handler(self.call, self.clock.sleep)]

    def stop(self) -> None:
        """Save the world (with the clock's time) and stop serving. Safe to call twice."""
        for channel in self._channels:
            channel.close()
        self._channels.clear()
        if self._kube is not None:
            self._kube.stop()
            self._kube = None
        if self._server is not None:
            self._server.stop(grace=None).wait()
            self._server = None
            self.world_call(lambda world, now: None)

    def __enter__(self) -> Self:
        if self._server is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def address(self) -> str:
        if self.port is None:
            raise RuntimeError("the emulator is not started")
        host = self._host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def _channel(self) -> grpc.Channel:
        channel = grpc.insecure_channel(self.address)
        self._channels.append(channel)
        return channel

    def client(self):
        """A real google.cloud.tpu_v2.TpuClient on an insecure channel to this emulator."""
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import tpu_v2
        from google.cloud.tpu_v2.services.tpu.transports import TpuGrpcTransport

        transport = TpuGrpcTransport(channel=self._channel(), credentials=AnonymousCredentials())
        return tpu_v2.TpuClient(transport=transport)

    def job_client(self):
        """A real google.cloud.aiplatform_v1.JobServiceClient on an insecure channel to this emulator.
        The emulator serves every region on its one address (the real API: one endpoint per region)."""
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import aiplatform_v1
        from google.cloud.aiplatform_v1.services.job_service.transports import JobServiceGrpcTransport

        transport = JobServiceGrpcTransport(channel=self._channel(), credentials=AnonymousCredentials())
        return aiplatform_v1.JobServiceClient(transport=transport)

    def container_client(self):
        """A real google.cloud.container_v1.ClusterManagerClient on an insecure channel to this emulator."""
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import container_v1
        from google.cloud.container_v1.services.cluster_manager.transports import ClusterManagerGrpcTransport

        transport = ClusterManagerGrpcTransport(channel=self._channel(), credentials=AnonymousCredentials())
        return container_v1.ClusterManagerClient(transport=transport)

    def kube_endpoint(self) -> tuple[str, str]:
        """(host:port, base64 of the CA certificate PEM) of the emulator's Kubernetes API server, as
        GetCluster gives a cluster's endpoint and master_auth.cluster_ca_certificate."""
        import base64

        with self._lock:
            if self._kube is None:
                from provision.emulator.kube_server import KubeServer

                self._kube = KubeServer(self.world_call)
        return self._kube.endpoint, base64.b64encode(self._kube.ca_pem).decode()

    # --- transactions ----------------------------------------------------------
    @contextmanager
    def _transaction(self) -> Iterator[tuple[World, float]]:
        """The world under the lock at a fixed `now`: reloaded if another process saved it, pruned
        and saved afterwards. Reentrant: a nested transaction joins the outer one."""
        with self._lock:
            if self._now is not None:
                yield self.world, self._now
                return
            with self._store.locked():
                self._reload()
                self.world.reservations = self.reservations
                gke = GkeWorld.of(self.world)
                gke.held, gke.servers = self.external_workloads, self.servers
                now = self._now = self.clock.now()
                try:
                    yield self.world, now
                except ApiError:
                    self._save(now)
                    raise
                except BaseException:
                    self._store.forget()  # half-applied: the saved world is the truth
                    raise
                else:
                    self._save(now)
                finally:
                    self._now = None

    def _reload(self) -> None:
        if not self._store.changed():
            return
        saved: list[float] = []

        def parse(data: dict) -> World:
            world = World.from_json(data)
            saved.append(float(data["now"]))
            return world

        world = self._store.load(parse)
        self.world = world if world is not None else World(seed=self.seed)
        if saved and hasattr(self.clock, "set"):
            self.clock.set(max(self.clock.now(), saved[0]))

    def _save(self, now: float) -> None:
        self.world.prune(now)
        self._store.save(self.world.to_json(max(now, self.clock.now())))

    def world_call(self, fn: Callable[[World, float], T]) -> T:
        """fn(world, now) as one transaction: under the lock, on the freshest world, saved after."""
        with self._transaction() as (world, now):
            return fn(world, now)

    def call(self, fn: Callable[[rpc.Call], T]) -> T:
        """fn(call) as one transaction, with what an RPC needs to know (see rpc.Call)."""
        with self._transaction() as (world, now):
            return fn(rpc.Call(world=world, now=now, scenario=self.scenario, held=self.external_workloads,
                               kube_endpoint=self.kube_endpoint, servers=self.servers))

    # --- each service's hooks (workloads.py) ----------------------------------------
    def service(self, name: str) -> workloads.Hooks:
        """The hooks of the emulated service whose Play is `name` (workloads.PLAYS): each of its methods
        one transaction here. They work without serving, on the state file alone."""
        return workloads.hooks(name, self.world_call)


# Each service's methods, imported on its first call (Vertex AI's and GKE's clients are slow to import).
def _tpu_methods() -> rpc.Methods:
    from provision.emulator import tpu

    return tpu.METHODS


def _vertex_methods() -> rpc.Methods:
    from provision.emulator import vertex

    return vertex.METHODS


def _serving_methods(table: str) -> Callable[[], rpc.Methods]:
    def methods() -> rpc.Methods:
        from provision.emulator import vertex_serving_rpcs

        return getattr(vertex_serving_rpcs, table)
    return methods


# Vertex AI online prediction's services (vertex_serving_rpcs.py), loaded on their first call.
_SERVING_SERVICES = {"ModelService": _serving_methods("MODEL_METHODS"),
                     "EndpointService": _serving_methods("ENDPOINT_METHODS"),
                     "PredictionService": _serving_methods("PREDICTION_METHODS")}


def _container_methods() -> rpc.Methods:
    from provision.emulator import container

    return container.METHODS


RESERVATIONS_ENV = "MOE_TPU_EMULATOR_RESERVATIONS"
_RESERVATION_ENTRY = re.compile(r"^([a-z]+-[a-z]+[0-9]+-[a-z])/([a-z](?:[-a-z0-9]{0,61}[a-z0-9])?)=([0-9]+)$")


def parse_reservations(text: str) -> dict[str, int]:
    """"ZONE/NAME=CHIPS,..." -> {"ZONE/NAME": chips}; ValueError naming the bad entry."""
    found: dict[str, int] = {}
    for entry in (e.strip() for e in text.split(",")):
        if not entry:
            continue
        match = _RESERVATION_ENTRY.match(entry)
        if not match:
            raise ValueError(f"{RESERVATIONS_ENV}: {entry!r} is not ZONE/NAME=CHIPS "
                             "(for example us-west4-a/my-res=64)")
        found[f"{match.group(1)}/{match.group(2)}"] = int(match.group(3))
    return found


__all__ = ["Emulator", "parse_reservations", "scenarios"]
