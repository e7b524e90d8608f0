"""What GKE keeps in the emulated world: clusters, node pools, Container operations, and the Kubernetes objects
a run uses (JobSets, Deployments, LeaderWorkerSets, their pods, nodes, events), with their JSON form. The
ground the cluster's controllers share: the Deployment's (gke_serving.py) and the LeaderWorkerSet's
(gke_lws.py) read and change it; the GKE world over them (gke_world.py: this, its JobSet controller, and
every controller reconciled together) is the part the shared world holds.
"""

from __future__ import annotations

from dataclasses import asdict

from provision.emulator.gke import (
    ClusterRecord,
    ContainerOperation,
    Event,
    JobSetRecord,
    KubeObject,
    PodRecord,
    PoolRecord,
    preexisting_clusters,
    short_hash,
)


class GkeState:
    """GKE's records in the emulated world; changed only inside an Emulator transaction."""

    def __init__(self) -> None:
        self.clusters: dict[str, ClusterRecord] = {}
        self.pools: dict[str, PoolRecord] = {}
        self.operations: dict[str, ContainerOperation] = {}
        self.first_zone: str | None = None  # the zone `stockout` keeps out of TPU capacity
        self.jobsets: dict[str, JobSetRecord] = {}  # "NAMESPACE/NAME"
        self.pods: dict[str, PodRecord] = {}  # "NAMESPACE/NAME"
        self.events: list[Event] = []
        self.objects: dict[str, KubeObject] = {}  # Deployments, LeaderWorkerSets, Services, PodMonitorings, HPAs
        self.counter = 0
        # Set by the emulator for each transaction, not saved: whether a dry run's local trainer drives
        # the trainer pods, and the dry run's local servers (local_server.LocalServers) that play a
        # Deployment's pods (None: a pod's server answers after gke_serving.SERVER_READY_S).
        self.held = False
        self.servers = None

    # --- persistence -------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"clusters": [asdict(c) for c in self.clusters.values()],
                "pools": [asdict(p) for p in self.pools.values()],
                "operations": [asdict(o) for o in self.operations.values()], "first_zone": self.first_zone,
                "jobsets": [asdict(j) for j in self.jobsets.values()],
                "pods": [asdict(p) for p in self.pods.values()],
                "events": [asdict(e) for e in self.events[-500:]], "counter": self.counter,
                "objects": [asdict(o) for o in self.objects.values()]}

    @classmethod
    def from_json(cls, d: dict | None) -> GkeState:
        world = cls()
        if not d:
            return world
        world.clusters = {c["name"]: ClusterRecord(**c) for c in d["clusters"]}
        world.pools = {p["name"]: PoolRecord(**p) for p in d["pools"]}
        # keyed as container._operation keys them (GetOperation's full name): a world reloaded from the
        # file, as every transaction after another process's does, must still find them
        world.operations = {f"{o['location']}/operations/{o['name']}": ContainerOperation(**o) for o in d["operations"]}
        world.first_zone = d.get("first_zone")
        world.jobsets = {f"{j['namespace']}/{j['name']}": JobSetRecord(**j) for j in d["jobsets"]}
        world.pods = {f"{p['namespace']}/{p['name']}": PodRecord(**p) for p in d["pods"]}
        world.events = [Event(**e) for e in d["events"]]
        world.counter = int(d["counter"])
        world.objects = {o.key: o for o in (KubeObject(**o) for o in d.get("objects", []))}
        return world

    def prune(self, now: float) -> None:
        for name in [n for n, c in self.clusters.items() if c.status(now) is None]:
            del self.clusters[name]
        for name in [n for n, p in self.pools.items() if p.status(now) is None or p.cluster not in self.clusters]:
            del self.pools[name]

    def token(self) -> str:
        self.counter += 1
        return short_hash(f"gke/{self.counter}", 16)

    # --- clusters the project already has -----------------------------------------------------
    def ensure_preexisting(self, name: str, now: float) -> None:
        """Materialise a cluster the emulated project is configured to have (CLUSTERS_ENV)."""
        if name in self.clusters:
            return
        parts = name.split("/")
        if len(parts) != 6 or f"{parts[3]}/{parts[5]}" not in preexisting_clusters():
            return
        created = now - 30 * 86400
        self.clusters[name] = ClusterRecord(
            name=name, request={"name": parts[5], "network": "default", "node_pools": [
                {"name": "default-pool", "initial_node_count": 3, "config": {"machine_type": "e2-standard-4"}}]},
            create_time=created, ready_at=created, preexisting=True)

    # --- nodes ---------------------------------------------------------------------------------
    def nodes(self, now: float) -> list[tuple[str, PoolRecord]]:
        """Every node that exists now (of RUNNING pools, not reclaimed), with its pool."""
        found = []
        for pool in sorted(self.pools.values(), key=lambda p: p.name):
            for node in pool.node_names():
                if pool.node_up(node, now):
                    found.append((node, pool))
        return found

    def event(self, namespace: str, kind: str, name: str, reason: str, message: str, now: float,
              type_: str = "Normal") -> None:
        self.events.append(Event(namespace, kind, name, reason, message, now, type_))
