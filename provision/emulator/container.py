"""google.container.v1.ClusterManager, the part a TPU node pool lifecycle uses: clusters, node pools,
and the Container API's own operations (GetOperation; not google.longrunning). The other methods
answer UNIMPLEMENTED. Records live in gke.py, the JobSet controller in gke_world.py.

The server imports this module on the first ClusterManager call (rpc.Service).
Messages marked "unconfirmed" have no public record; they are the most plausible shape.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from google.cloud import container_v1 as v1
from google.rpc import error_details_pb2, status_pb2

from provision import catalogue
from provision.emulator import offerings, rpc
from provision.emulator.gke import (
    CLUSTER_CREATING_S,
    CLUSTER_DELETING_S,
    CPU_POOL_CREATING_S,
    KUBE_VERSION,
    LONG_QUEUE_POOL_S,
    POOL_CREATING_S,
    POOL_DELETING_S,
    STOCKOUT_CODE,
    STOCKOUT_MESSAGE,
    ClusterRecord,
    ContainerOperation,
    PoolRecord,
    iso,
    preexisting_clusters,
    tpu_accelerator,
)
from provision.emulator.gke_world import GkeWorld
from provision.emulator.scenarios import STOCKOUT_WAIT_S
from provision.emulator.validate import ApiError

SERVICE = "google.container.v1.ClusterManager"
API = "https://container.googleapis.com/v1"
LOCATION_RE = re.compile(r"^projects/([^/]+)/locations/([^/]+)$")
CLUSTER_RE = re.compile(r"^(projects/[^/]+/locations/[^/]+)/clusters/([^/]+)$")
POOL_RE = re.compile(r"^(projects/[^/]+/locations/[^/]+/clusters/[^/]+)/nodePools/([^/]+)$")
OPERATION_RE = re.compile(r"^(projects/[^/]+/locations/[^/]+)/operations/([^/]+)$")
# GKE's rule for cluster and node pool names (the message is unconfirmed).
NAME_RE = re.compile(r"^[a-z](?:[-a-z0-9]{0,38}[a-z0-9])?$")
TPU_MACHINE_TYPES = {acc.vertex_machine_type for acc in catalogue.ACCELERATORS.values()}
# The Compute Engine quotas behind GKE TPU v5e node pools (GKE docs: "TPU v5 Lite PodSlice chips");
# the message is shaped like Compute Engine's quota errors, unconfirmed for node pools.
QUOTA_IDS = {True: "PREEMPTIBLE_TPU_LITE_PODSLICE_V5", False: "TPU_LITE_PODSLICE_V5"}
QUOTA_MESSAGE = "Insufficient quota to satisfy the request: Quota '{quota}' exceeded. Limit: 0.0 in region {region}."


def as_json(message) -> dict:
    return json.loads(type(message).to_json(message, use_integers_for_enums=False, preserving_proto_field_name=True,
                                            always_print_fields_with_no_presence=False))


def _gke(call: rpc.Call) -> GkeWorld:
    gke = GkeWorld.of(call.world)
    gke.held = call.held
    return gke


# --- request checks ---------------------------------------------------------------------------

def _match(pattern: re.Pattern, value: str, what: str, form: str) -> re.Match:
    match = pattern.match(value or "")
    if not match:
        raise ApiError("INVALID_ARGUMENT", f"Invalid {what} {value!r}: it must look like {form}")
    return match


def _location(parent: str) -> tuple[str, str]:
    project, location = _match(LOCATION_RE, parent, "parent", "projects/PROJECT/locations/LOCATION").groups()
    if not re.match(r"^[a-z]+-[a-z]+[0-9]+(-[a-z])?$", location) and location != "-":
        raise ApiError("INVALID_ARGUMENT", f"Location {location!r} is not a GCP region or zone")
    return project, location


def _name(value: str, what: str) -> None:
    if not NAME_RE.match(value or ""):
        raise ApiError("INVALID_ARGUMENT", f"Invalid {what} name {value!r}: it must be 1 to 40 lowercase letters, "
                                           "digits or hyphens, start with a letter and end with a letter or digit")


def live_cluster(gke: GkeWorld, name: str, now: float) -> ClusterRecord:
    _match(CLUSTER_RE, name, "cluster name", "projects/PROJECT/locations/LOCATION/clusters/CLUSTER")
    gke.ensure_preexisting(name, now)
    rec = gke.clusters.get(name)
    if rec is None or rec.status(now) is None:
        raise ApiError("NOT_FOUND", f"Not found: {name}.")
    return rec


def live_pool(gke: GkeWorld, name: str, now: float) -> PoolRecord:
    cluster = _match(POOL_RE, name, "node pool name",
                     "projects/PROJECT/locations/LOCATION/clusters/CLUSTER/nodePools/POOL").group(1)
    live_cluster(gke, cluster, now)
    pool = gke.pools.get(name)
    if pool is None or pool.status(now) is None:
        raise ApiError("NOT_FOUND", f"Not found: {name}.")
    return pool


def _check_pool(pool: v1.NodePool, cluster: ClusterRecord) -> tuple[catalogue.AcceleratorType | None, str]:
    """What GKE refuses in a NodePool; returns its slice (None for a CPU pool) and its zone."""
    _name(pool.name, "node pool")
    region = cluster.location.rsplit("-", 1)[0] if cluster.location.count("-") == 2 else cluster.location
    if len(pool.locations) > 1 and pool.config.machine_type in TPU_MACHINE_TYPES:
        raise ApiError("INVALID_ARGUMENT", "A TPU node pool must be in exactly one zone; got "
                                           f"{', '.join(pool.locations)}")  # unconfirmed message
    zone = pool.locations[0] if pool.locations else f"{region}-a"
    if not zone.startswith(region + "-"):
        raise ApiError("INVALID_ARGUMENT", f"Location {zone!r} is not in the cluster's region {region!r}")
    if pool.initial_node_count < 1:
        raise ApiError("INVALID_ARGUMENT", "node_pool.initial_node_count must be greater than zero.")
    if not pool.config.machine_type:
        raise ApiError("INVALID_ARGUMENT", "node_pool.config.machine_type is required")
    if pool.config.spot and pool.config.reservation_affinity.consume_reservation_type.name == "SPECIFIC_RESERVATION":
        raise ApiError("INVALID_ARGUMENT", "Spot VMs cannot consume a specific reservation")  # unconfirmed
    if pool.config.machine_type not in TPU_MACHINE_TYPES:
        return None, zone
    if zone not in offerings.V5E_SERVED_ZONES:
        raise ApiError("INVALID_ARGUMENT", f"Machine type {pool.config.machine_type!r} is not available in zone "
                                           f"{zone!r}")  # unconfirmed message
    acc = tpu_accelerator(as_json(pool))
    topology = pool.placement_policy.tpu_topology
    if acc is None:
        offered = [a.topology for a in catalogue.ACCELERATORS.values()
                   if a.vertex_machine_type == pool.config.machine_type]
        raise ApiError("INVALID_ARGUMENT", f"Invalid TPU topology {topology!r} for machine type "
                                           f"{pool.config.machine_type!r}; supported: {', '.join(offered)}")
    if acc.multi_host and pool.placement_policy.type_.name != "COMPACT":
        raise ApiError("INVALID_ARGUMENT", "A multi-host TPU node pool needs placement_policy.type COMPACT")
    if pool.initial_node_count != acc.vms:
        raise ApiError("INVALID_ARGUMENT", f"TPU topology {acc.topology} of machine type "
                                           f"{pool.config.machine_type} needs exactly {acc.vms} nodes, got "
                                           f"initial_node_count {pool.initial_node_count}")  # unconfirmed
    return acc, zone


def quota_error(project: str, region: str, spot: bool) -> ApiError:
    quota = QUOTA_IDS[spot]
    message = QUOTA_MESSAGE.format(quota=quota, region=region)
    failure = error_details_pb2.QuotaFailure(violations=[error_details_pb2.QuotaFailure.Violation(
        subject=f"project:{project}", description=message, api_service="compute.googleapis.com",
        quota_id=quota, quota_dimensions={"region": region}, quota_value=0)])
    return ApiError("RESOURCE_EXHAUSTED", message, [failure])


# --- views ------------------------------------------------------------------------------------

def operation_view(op: ContainerOperation, now: float) -> v1.Operation:
    done = now >= op.done_at
    view = v1.Operation(name=op.name, location=op.location.rsplit("/", 1)[-1],
                        zone=op.location.rsplit("/", 1)[-1], operation_type=v1.Operation.Type[op.operation_type],
                        status=v1.Operation.Status.DONE if done else v1.Operation.Status.RUNNING,
                        self_link=f"{API}/{op.location}/operations/{op.name}", target_link=f"{API}/{op.target}",
                        start_time=iso(op.create_time))
    if done:
        view.end_time = iso(op.done_at)
        if op.error:
            view.error = status_pb2.Status(code=op.error["code"], message=op.error["message"])
            view.status_message = op.error["message"]
    return view


def pool_view(pool: PoolRecord, now: float) -> v1.NodePool:
    view = v1.NodePool.from_json(json.dumps(pool.request), ignore_unknown_fields=True)
    status = pool.status(now) or "STOPPING"
    view.status = v1.NodePool.Status[status]
    view.self_link = f"{API}/{pool.name}"
    view.version = KUBE_VERSION
    if status == "ERROR" and pool.error:
        view.status_message = pool.error["message"]
    return view


def cluster_view(gke: GkeWorld, rec: ClusterRecord, now: float,
                 kube_endpoint: Callable[[], tuple[str, str]] | None = None) -> v1.Cluster:
    """The cluster at `now`; once RUNNING, with the endpoint and CA of `kube_endpoint()` (rpc.Call's)."""
    view = v1.Cluster.from_json(json.dumps(rec.request), ignore_unknown_fields=True)
    view.name = rec.name.rsplit("/", 1)[-1]
    view.location = view.zone = rec.location
    view.self_link = f"{API}/{rec.name}"
    view.status = v1.Cluster.Status[rec.status(now) or "STOPPING"]
    view.create_time = iso(rec.create_time)
    view.current_master_version = view.current_node_version = KUBE_VERSION
    if view.status.name == "RUNNING" and kube_endpoint is not None:
        endpoint, ca_pem = kube_endpoint()
        view.endpoint = endpoint
        view.master_auth = v1.MasterAuth(cluster_ca_certificate=ca_pem)
    pools = [pool_view(p, now) for p in sorted(gke.pools.values(), key=lambda p: p.create_time)
             if p.cluster == rec.name and p.status(now) is not None]
    defaults = [p for p in view.node_pools if p.name not in {q.name for q in pools}]
    for pool in defaults:
        pool.status = v1.NodePool.Status.RUNNING
    view.node_pools = defaults + pools
    return view


# --- changes to the world ---------------------------------------------------------------------

def _operation(gke: GkeWorld, location: str, kind: str, target: str, now: float, done_at: float,
               error: dict | None = None) -> ContainerOperation:
    tag = gke.token()
    op = ContainerOperation(name=f"operation-{int(now * 1000)}-{tag[:8]}-{tag[8:12]}", location=location,
                            operation_type=kind, target=target, create_time=now, done_at=done_at, error=error)
    gke.operations[f"{location}/operations/{op.name}"] = op
    return op


def create_cluster(call: rpc.Call, req: v1.CreateClusterRequest) -> ContainerOperation:
    gke = _gke(call)
    _location(req.parent)
    cluster = req.cluster
    _name(cluster.name, "cluster")
    name = f"{req.parent}/clusters/{cluster.name}"
    gke.ensure_preexisting(name, call.now)
    if name in gke.clusters and gke.clusters[name].status(call.now) is not None:
        raise ApiError("ALREADY_EXISTS", f"Already exists: {name}.")
    if not cluster.node_pools and not cluster.initial_node_count:
        raise ApiError("INVALID_ARGUMENT", "Cluster.initial_node_count must be greater than zero.")
    for field in ("status", "endpoint", "self_link", "create_time", "location", "zone"):
        v1.Cluster.pb(cluster).ClearField(field)
    ready = call.now + CLUSTER_CREATING_S
    gke.clusters[name] = ClusterRecord(name=name, request=as_json(cluster), create_time=call.now, ready_at=ready)
    return _operation(gke, req.parent, "CREATE_CLUSTER", name, call.now, ready)


def delete_cluster(call: rpc.Call, name: str) -> ContainerOperation:
    gke = _gke(call)
    rec = live_cluster(gke, name, call.now)
    if rec.status(call.now) == "STOPPING":
        raise ApiError("FAILED_PRECONDITION", f"Cluster {name.rsplit('/', 1)[-1]} is already being deleted.")
    rec.deleted_at = call.now
    for pool in gke.pools.values():
        if pool.cluster == name and pool.deleted_at is None:
            _delete_pool_now(gke, pool, call.now)
    return _operation(gke, name.rsplit("/clusters/", 1)[0], "DELETE_CLUSTER", name, call.now,
                      call.now + CLUSTER_DELETING_S)


def create_node_pool(call: rpc.Call, req: v1.CreateNodePoolRequest) -> ContainerOperation:
    gke = _gke(call)
    cluster = live_cluster(gke, req.parent, call.now)
    if cluster.status(call.now) != "RUNNING":
        raise ApiError("FAILED_PRECONDITION", f"Cluster is not running (status {cluster.status(call.now)}); "
                                              "node pools can be created once it is RUNNING")  # unconfirmed
    pool = req.node_pool
    acc, zone = _check_pool(pool, cluster)
    name = f"{req.parent}/nodePools/{pool.name}"
    if name in gke.pools and gke.pools[name].status(call.now) is not None:
        raise ApiError("ALREADY_EXISTS", f"Already exists: {name}.")
    project = req.parent.split("/")[1]
    error = None
    wait = CPU_POOL_CREATING_S if acc is None else POOL_CREATING_S
    if acc is not None:
        if call.scenario == "quota":
            raise quota_error(project, zone.rsplit("-", 1)[0], bool(pool.config.spot))
        if gke.first_zone is None:
            gke.first_zone = zone
        if call.scenario == "stockout" and zone == gke.first_zone:
            wait, error = STOCKOUT_WAIT_S, {"code": STOCKOUT_CODE, "message": STOCKOUT_MESSAGE.format(zone=zone)}
        elif call.scenario == "long-queue":
            wait = LONG_QUEUE_POOL_S
    pool.locations = [zone]
    for field in ("status", "status_message", "self_link", "version", "instance_group_urls"):
        v1.NodePool.pb(pool).ClearField(field)
    gke.pools[name] = PoolRecord(name=name, request=as_json(pool), create_time=call.now,
                                 ready_at=call.now + wait, error=error)
    return _operation(gke, req.parent.rsplit("/clusters/", 1)[0], "CREATE_NODE_POOL", name, call.now,
                      call.now + wait, error)


def _delete_pool_now(gke: GkeWorld, pool: PoolRecord, now: float) -> None:
    pool.deleted_at = now
    nodes = set(pool.node_names())
    for pod in gke.pods.values():
        if pod.node in nodes and (pod.ended_at is None or pod.ended_at > now):
            pod.ended_at, pod.exit_code, pod.reason = now, 143, "NodeDeleted"
            pod.message = f"the node pool {pool.short} was deleted"


def delete_node_pool(call: rpc.Call, name: str) -> ContainerOperation:
    gke = _gke(call)
    pool = live_pool(gke, name, call.now)
    if pool.status(call.now) == "STOPPING":
        raise ApiError("FAILED_PRECONDITION", f"Node pool {pool.short} is already being deleted.")  # unconfirmed
    _delete_pool_now(gke, pool, call.now)
    return _operation(gke, name.rsplit("/clusters/", 1)[0], "DELETE_NODE_POOL", name, call.now,
                      call.now + POOL_DELETING_S)


# --- RPCs -----------------------------------------------------------------------------------------

def CreateCluster(call: rpc.Call, req: v1.CreateClusterRequest):
    return operation_view(create_cluster(call, req), call.now)


def GetCluster(call: rpc.Call, req: v1.GetClusterRequest):
    gke = _gke(call)
    return cluster_view(gke, live_cluster(gke, req.name, call.now), call.now, call.kube_endpoint)


def ListClusters(call: rpc.Call, req: v1.ListClustersRequest):
    gke = _gke(call)
    project, location = _location(req.parent)
    for entry in preexisting_clusters():
        where, name = entry.split("/")
        if location in ("-", where):
            gke.ensure_preexisting(f"projects/{project}/locations/{where}/clusters/{name}", call.now)
    found = [c for c in sorted(gke.clusters.values(), key=lambda c: c.name)
             if c.name.startswith(f"projects/{project}/locations/") and c.status(call.now) is not None
             and location in ("-", c.location)]
    return v1.ListClustersResponse(clusters=[cluster_view(gke, c, call.now, call.kube_endpoint) for c in found])


def DeleteCluster(call: rpc.Call, req: v1.DeleteClusterRequest):
    return operation_view(delete_cluster(call, req.name), call.now)


def CreateNodePool(call: rpc.Call, req: v1.CreateNodePoolRequest):
    return operation_view(create_node_pool(call, req), call.now)


def GetNodePool(call: rpc.Call, req: v1.GetNodePoolRequest):
    return pool_view(live_pool(_gke(call), req.name, call.now), call.now)


def ListNodePools(call: rpc.Call, req: v1.ListNodePoolsRequest):
    gke = _gke(call)
    cluster = live_cluster(gke, req.parent, call.now)
    pools = [p for p in sorted(gke.pools.values(), key=lambda p: p.create_time)
             if p.cluster == cluster.name and p.status(call.now) is not None]
    return v1.ListNodePoolsResponse(node_pools=[pool_view(p, call.now) for p in pools])


def DeleteNodePool(call: rpc.Call, req: v1.DeleteNodePoolRequest):
    return operation_view(delete_node_pool(call, req.name), call.now)


def GetOperation(call: rpc.Call, req: v1.GetOperationRequest):
    gke = _gke(call)
    _match(OPERATION_RE, req.name, "operation name", "projects/PROJECT/locations/LOCATION/operations/OPERATION")
    op = gke.operations.get(req.name)
    if op is None:
        raise ApiError("NOT_FOUND", f"Not found: {req.name}.")
    return operation_view(op, call.now)


def ListOperations(call: rpc.Call, req: v1.ListOperationsRequest):
    gke = _gke(call)
    _location(req.parent)
    ops = [op for key, op in sorted(gke.operations.items()) if key.startswith(req.parent + "/")]
    return v1.ListOperationsResponse(operations=[operation_view(op, call.now) for op in ops])


def _methods() -> dict[str, tuple[Callable, Callable, Callable]]:
    pairs = {
        "CreateCluster": (CreateCluster, v1.CreateClusterRequest, v1.Operation),
        "GetCluster": (GetCluster, v1.GetClusterRequest, v1.Cluster),
        "ListClusters": (ListClusters, v1.ListClustersRequest, v1.ListClustersResponse),
        "DeleteCluster": (DeleteCluster, v1.DeleteClusterRequest, v1.Operation),
        "CreateNodePool": (CreateNodePool, v1.CreateNodePoolRequest, v1.Operation),
        "GetNodePool": (GetNodePool, v1.GetNodePoolRequest, v1.NodePool),
        "ListNodePools": (ListNodePools, v1.ListNodePoolsRequest, v1.ListNodePoolsResponse),
        "DeleteNodePool": (DeleteNodePool, v1.DeleteNodePoolRequest, v1.Operation),
        "GetOperation": (GetOperation, v1.GetOperationRequest, v1.Operation),
        "ListOperations": (ListOperations, v1.ListOperationsRequest, v1.ListOperationsResponse),
    }
    return {name: (impl, request.deserialize, response.serialize) for name, (impl, request, response) in pairs.items()}


METHODS = _methods()
