"""The emulated GKE world's records: clusters, node pools and Container operations (what was asked
and when; their states are read off the clock, like world.py's), and the Kubernetes objects a run
uses (JobSets, their pods, events). Plain data; what holds them is gke_state.py's GkeState, and the
JobSet controller over it gke_world.py's GkeWorld.
"""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass, field

from provision import catalogue
from provision.emulator.offerings import V5E_SERVED_ZONES

# --- timings (simulated seconds; plausible, not measured) ----------------------------------
CLUSTER_CREATING_S = 300.0
CLUSTER_DELETING_S = 180.0
POOL_CREATING_S = 240.0
CPU_POOL_CREATING_S = 90.0
POOL_DELETING_S = 120.0
LONG_QUEUE_POOL_S = 3 * 3600.0
POD_STARTING_S = 30.0
NODE_RECREATE_S = 180.0
POD_RUN_S = 3600.0  # how long a trainer pod runs before it succeeds, when nothing drives it

# The emulated project's existing Standard clusters ("LOCATION/NAME,..."); unset: one cluster
# `moe-cluster` in every region with TPU v5e (what examples/gke-pathways.yaml names).
CLUSTERS_ENV = "MOE_TPU_EMULATOR_CLUSTERS"
DEFAULT_CLUSTER = "moe-cluster"
KUBE_VERSION = "1.32.2-gke.1182003"

# Node pool stockout: the operation fails. The message is the one GKE users quote for
# GCE_STOCKOUT; the code is unconfirmed.
STOCKOUT_CODE = 8
STOCKOUT_MESSAGE = ("Google Compute Engine: Not enough resources available to fulfill the request. "
                    "Try a different zone, or try again later. (GCE_STOCKOUT in zone {zone})")
# A pod on a spot node that is reclaimed: GKE's graceful node shutdown ends it with these.
PREEMPTED_REASON = "Terminated"
PREEMPTED_MESSAGE = "Pod was terminated in response to imminent node shutdown."
# JobSet's own condition reasons and messages (jobset pkg/constants; the Restarting event's
# message is the controller's "restarting jobset, attempt N").
REACHED_MAX_RESTARTS = ("ReachedMaxRestarts", "jobset failed due to reaching max number of restarts")
ALL_JOBS_COMPLETED = ("AllJobsCompleted", "jobset completed successfully")

JOBSET_LABELS = "jobset.sigs.k8s.io/"
TPU_RESOURCE = "google.com/tpu"


def iso(t: float) -> str:
    import datetime as dt

    return dt.datetime.fromtimestamp(t, dt.UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def short_hash(text: str, n: int = 8) -> str:
    """The first `n` hex digits of the text's SHA-256: a stable name suffix."""
    return hashlib.sha256(text.encode()).hexdigest()[:n]


# --- Container API records --------------------------------------------------------------------

@dataclass
class ClusterRecord:
    name: str  # projects/P/locations/L/clusters/C
    request: dict  # the Cluster as created (proto JSON)
    create_time: float
    ready_at: float
    deleted_at: float | None = None
    preexisting: bool = False  # the project had it before any run (never created through the API)

    def status(self, now: float) -> str | None:
        if self.deleted_at is not None:
            return None if now >= self.deleted_at + CLUSTER_DELETING_S else "STOPPING"
        return "RUNNING" if now >= self.ready_at else "PROVISIONING"

    @property
    def location(self) -> str:
        return self.name.split("/")[3]


@dataclass
class PoolRecord:
    name: str  # CLUSTER/nodePools/N
    request: dict  # the NodePool as created (proto JSON)
    create_time: float
    ready_at: float
    error: dict | None = None  # {"code", "message"}: creation failed at ready_at (status ERROR)
    deleted_at: float | None = None
    preempted: dict[str, float] = field(default_factory=dict)  # node name -> when it was reclaimed

    @property
    def cluster(self) -> str:
        return self.name.rsplit("/nodePools/", 1)[0]

    @property
    def short(self) -> str:
        return self.name.rsplit("/", 1)[-1]

    def status(self, now: float) -> str | None:
        if self.deleted_at is not None:
            return None if now >= self.deleted_at + POOL_DELETING_S else "STOPPING"
        if now < self.ready_at:
            return "PROVISIONING"
        return "ERROR" if self.error else "RUNNING"

    @property
    def zone(self) -> str:
        return (self.request.get("locations") or [""])[0]

    def node_names(self) -> list[str]:
        cluster = self.cluster.rsplit("/", 1)[-1]
        tag = short_hash(self.name)
        return [f"gke-{cluster[:20]}-{self.short[:20]}-{tag}-{i:04x}"
                for i in range(int(self.request.get("initial_node_count", 0)))]

    def node_up(self, node: str, now: float) -> bool:
        gone = self.preempted.get(node)
        return self.status(now) == "RUNNING" and not (gone is not None and gone <= now < gone + NODE_RECREATE_S)

    def node_labels(self, node: str) -> dict[str, str]:
        config = self.request.get("config", {})
        labels = {**config.get("labels", {}), "cloud.google.com/gke-nodepool": self.short,
                  "kubernetes.io/hostname": node, "topology.kubernetes.io/zone": self.zone,
                  "node.kubernetes.io/instance-type": config.get("machine_type", "")}
        if config.get("spot"):
            labels["cloud.google.com/gke-spot"] = "true"
        acc = tpu_accelerator(self.request)
        if acc is not None:
            labels["cloud.google.com/gke-tpu-accelerator"] = catalogue.GKE_V5E_ACCELERATOR
            labels["cloud.google.com/gke-tpu-topology"] = acc.topology
        return labels


def tpu_accelerator(pool_request: dict) -> catalogue.AcceleratorType | None:
    """The v5e slice a node pool request (proto JSON) holds, or None."""
    return catalogue.accelerator_for_machine(pool_request.get("config", {}).get("machine_type", ""),
                                             pool_request.get("placement_policy", {}).get("tpu_topology", ""))


@dataclass
class ContainerOperation:
    """A google.container.v1.Operation: done at `done_at`, with `error` if it failed."""

    name: str  # operation-...
    location: str  # projects/P/locations/L
    operation_type: str
    target: str  # the cluster or node pool path
    create_time: float
    done_at: float
    error: dict | None = None


# --- Kubernetes records ---------------------------------------------------------------------------

@dataclass
class PodRecord:
    name: str
    namespace: str
    jobset: str
    replicated_job: str
    job_index: int
    pod_index: int
    attempt: int  # the JobSet's restart count when the pod was made
    node: str
    created_at: float
    running_at: float
    ended_at: float | None = None
    exit_code: int | None = None
    reason: str | None = None
    message: str | None = None
    log_path: str | None = None  # a dry run's trainer output, served as the pod's log
    trainer: bool = False  # the pod whose container `trainer` runs the run's trainer (the local one)
    # A Deployment's pod (gke_serving.py): its Deployment, the hash of the template it was made from,
    # when its server first answered /health (None: not yet), and its container's restarts.
    deployment: str | None = None
    template_hash: str = ""
    ready_at: float | None = None
    restarts: int = 0
    # A LeaderWorkerSet's pod (gke_lws.py): its LeaderWorkerSet; job_index is its group, pod_index its
    # worker index (0: the leader).
    lws: str | None = None

    def phase(self, now: float) -> str:
        if self.ended_at is not None and now >= self.ended_at:
            return "Succeeded" if self.exit_code == 0 else "Failed"
        return "Running" if now >= self.running_at else "Pending"


@dataclass
class JobSetRecord:
    name: str
    namespace: str
    manifest: dict
    uid: str
    create_time: float
    restarts: int = 0
    attempt_start: float = 0.0
    terminal: str | None = None  # Completed or Failed
    terminal_at: float | None = None
    reason: str | None = None
    message: str | None = None

    def jobs(self) -> list[dict]:
        return list(self.manifest.get("spec", {}).get("replicatedJobs", []))

    def max_restarts(self) -> int:
        return int(self.manifest.get("spec", {}).get("failurePolicy", {}).get("maxRestarts", 0))

    def in_order(self) -> bool:
        policy = self.manifest.get("spec", {}).get("startupPolicy", {})
        return policy.get("startupPolicyOrder") == "InOrder"

    def coordinator(self) -> str:
        coord = self.manifest.get("spec", {}).get("coordinator")
        if not coord:
            return ""
        return (f"{self.name}-{coord['replicatedJob']}-{coord.get('jobIndex', 0)}-{coord.get('podIndex', 0)}"
                f".{self.name}")

    def success_targets(self) -> list[str]:
        policy = self.manifest.get("spec", {}).get("successPolicy") or {}
        return list(policy.get("targetReplicatedJobs") or [j["name"] for j in self.jobs()])


@dataclass
class KubeObject:
    """A Deployment, LeaderWorkerSet, Service, PodMonitoring or HPA as created (or last replaced)."""

    kind: str
    name: str
    namespace: str
    manifest: dict
    uid: str
    create_time: float
    generation: int = 1
    resource_version: int = 1

    @property
    def key(self) -> str:
        return object_key(self.kind, self.namespace, self.name)

    @property
    def labels(self) -> dict[str, str]:
        return dict(self.manifest.get("metadata", {}).get("labels") or {})


def object_key(kind: str, namespace: str, name: str) -> str:
    return f"{kind}/{namespace}/{name}"


@dataclass
class Event:
    namespace: str
    kind: str
    name: str
    reason: str
    message: str
    at: float
    type: str = "Normal"


@dataclass(frozen=True)
class TrainerPod:
    """A pod running the run's trainer now: where a dry run's local trainer runs."""

    name: str
    namespace: str
    jobset: str
    run: str | None
    attempt: int
    command: tuple[str, ...]
    args: tuple[str, ...]
    env: dict[str, str]
    node: str


def preexisting_clusters() -> set[str]:
    """"LOCATION/NAME" of every cluster the emulated project has before any run (CLUSTERS_ENV)."""
    text = os.environ.get(CLUSTERS_ENV)
    if text is None:
        regions = sorted({catalogue.zone_region(z) for z in V5E_SERVED_ZONES})
        return {f"{region}/{DEFAULT_CLUSTER}" for region in regions}
    entries = {e.strip() for e in text.split(",") if e.strip()}
    bad = [e for e in entries if not re.match(r"^[a-z]+-[a-z]+[0-9]+(-[a-z])?/[a-z][-a-z0-9]{0,38}[a-z0-9]$", e)]
    if bad:
        raise ValueError(f"{CLUSTERS_ENV}: {bad[0]!r} is not LOCATION/NAME (for example us-west4/moe-cluster)")
    return entries

