"""Pure rendering for target: gke: names, the node pool and cluster requests, the JobSet manifest.

Like provision/rendering.py: typed specs go into Jinja templates; the node pool and cluster bodies
are parsed strictly into the real `google.cloud.container_v1` messages (provision.cloud.messages),
and the JobSet's pod templates are checked against the `kubernetes` client's models
(provision.cloud.kube): a field Kubernetes does not know is an error here, not at the API server.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from provision import catalogue
from provision.cloud import CLOUD_PLATFORM_SCOPE, messages
from provision.cloud.messages import proto_dict
from provision.container import Container
from provision.errors import UsageError
from provision.rendering import RenderContext, Renderer
from provision.resources import location_path, resolve_project
from provision.templates import render

if TYPE_CHECKING:
    from provision.kinds.gke.gke_sections import GkeConfig
    from provision.kinds.slice_section import SliceConfig

NODE_POOL_TEMPLATE = "gke_node_pool.yaml.j2"
CLUSTER_TEMPLATE = "gke_cluster.yaml.j2"
JOBSET_TEMPLATE = "jobset.yaml.j2"

JOBSET_GROUP = "jobset.x-k8s.io"
JOBSET_VERSION = "v1alpha2"
JOBSET_PLURAL = "jobsets"
# The CPU pool the Pathways head runs on (the name Google's tools select it by).
CPU_POOL_NODES = 1
# The Pathways resource manager's name for v5e (its --instance_type is tpuv5e:TOPOLOGY).
PATHWAYS_V5E = "tpuv5e"
HEAD_JOB = "pathways-head"
WORKER_JOB = "pathways-worker"
SLICE_JOB = "slice"
PROXY_PORT = 29000
RM_PORT = 29001
WORKER_PORT = 29005
# In-place restarts of a Pathways worker container per VM before its slice's job fails.
WORKER_RESTARTS_PER_VM = 4
QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
PROXY_TIMEOUT_ENV = "PATHWAYS_PROXY_CONNECTION_TIMEOUT_SECS"


# --- names -------------------------------------------------------------------------------

def cluster_path(gke: GkeConfig, project: str) -> str:
    return f"{location_path(project, gke.location)}/clusters/{gke.cluster}"


def tpu_pool_ids(run: str, slice: SliceConfig) -> list[str]:
    """One node pool per slice: RUN-s0, RUN-s1, ..."""
    return [f"{run}-s{i}" for i in range(slice.count)]


def cpu_pool_id(run: str) -> str:
    """A Pathways head's CPU node pool: the run's own (RUN-cpu), so that two runs on one cluster each have
    theirs and neither's teardown takes the other's head away."""
    return f"{run}-cpu"


def pool_ids(run: str, gke: GkeConfig, slice: SliceConfig) -> list[str]:
    """Every node pool the run needs: the TPU pools, then RUN-cpu for a Pathways head."""
    return tpu_pool_ids(run, slice) + ([cpu_pool_id(run)] if gke.runtime == "pathways" else [])


def jobset_name(run: str) -> str:
    return run


def topology(gke: GkeConfig, slice: SliceConfig) -> str:
    return gke.topology or catalogue.accelerator(slice.accelerator).topology


def gcs_scratch(gke: GkeConfig, output_dir: str) -> str:
    """Pathways' scratch space: gke.pathways.gcs_scratch, else trainer.output_dir/pathways."""
    return gke.pathways_settings().gcs_scratch or f"{output_dir.rstrip('/')}/pathways"


# --- specs the templates receive ------------------------------------------------------------

@dataclass(frozen=True)
class NodePoolSpec:
    """One node pool: a TPU slice (`topology` set) or the Pathways head's CPU pool."""

    name: str
    zone: str
    machine_type: str
    node_count: int
    topology: str | None
    spot: bool
    reservation: str | None
    service_account: str | None
    oauth_scopes: tuple[str, ...]
    labels: dict[str, str]
    # The cluster autoscaler's bounds on the pool's nodes (a serving pool: one node per replica); None: fixed.
    min_nodes: int | None = None
    max_nodes: int | None = None


@dataclass(frozen=True)
class ClusterSpec:
    name: str
    network: str
    subnetwork: str | None
    labels: dict[str, str]
    oauth_scopes: tuple[str, ...] = (CLOUD_PLATFORM_SCOPE,)  # the default pool's (system pods)


@dataclass(frozen=True)
class JobSetSpec:
    """What the JobSet manifest needs, for either runtime."""

    runtime: str
    name: str
    namespace: str
    labels: dict[str, str]
    container: Container  # the trainer's: image, command, args, env
    slices: int
    vms: int
    chips_per_vm: int
    topology: str
    accelerator_label: str
    max_restarts: int
    slice_job: str = SLICE_JOB
    head_job: str = HEAD_JOB
    worker_job: str = WORKER_JOB
    cpu_pool: str = ""
    server_image: str = ""
    proxy_image: str = ""
    gcs_scratch: str = ""
    instance_type: str = ""
    worker_backoff_limit: int = 0
    proxy_port: int = PROXY_PORT
    rm_port: int = RM_PORT
    worker_port: int = WORKER_PORT


def node_pool_specs(gke: GkeConfig, slice: SliceConfig, ctx: RenderContext, zone: str) -> list[NodePoolSpec]:
    """The run's node pools in `zone`, in creation order."""
    acc = catalogue.accelerator(slice.accelerator)
    reservation = slice.reservation if slice.capacity == "reserved" else None
    if reservation and "/" in reservation:
        reservation = reservation.rsplit("/", 1)[-1]
    common = dict(zone=zone, service_account=slice.service_account, oauth_scopes=(CLOUD_PLATFORM_SCOPE,),
                  labels=ctx.labels)
    specs = [NodePoolSpec(name=name, machine_type=acc.vertex_machine_type, node_count=acc.vms,
                          topology=topology(gke, slice) if acc.multi_host else None,
                          spot=slice.capacity == "spot", reservation=reservation, **common)
             for name in tpu_pool_ids(ctx.run, slice)]
    if gke.runtime == "pathways":
        specs.append(NodePoolSpec(name=cpu_pool_id(ctx.run), machine_type=gke.pathways_settings().cpu_machine_type,
                                  node_count=CPU_POOL_NODES, topology=None, spot=False, reservation=None,
                                  **common))
    return specs


def jobset_spec(gke: GkeConfig, slice: SliceConfig, ctx: RenderContext) -> JobSetSpec:
    """`ctx`: a training workload's (its container the trainer's)."""
    acc = catalogue.accelerator(slice.accelerator)
    container = ctx.container
    job_labels = ctx.labels
    if gke.queue:
        job_labels = {**job_labels, QUEUE_LABEL: gke.queue}
    pathways: dict[str, Any] = {}
    if gke.runtime == "pathways":
        settings = gke.pathways_settings()
        container = container.with_env(**{PROXY_TIMEOUT_ENV: str(int(settings.proxy_timeout.total_seconds()))})
        pathways = dict(server_image=settings.server_image, proxy_image=settings.proxy_image,
                        cpu_pool=cpu_pool_id(ctx.run), gcs_scratch=gcs_scratch(gke, ctx.output_dir),
                        instance_type=f"{PATHWAYS_V5E}:{topology(gke, slice)}",
                        worker_backoff_limit=acc.vms * WORKER_RESTARTS_PER_VM)
    return JobSetSpec(
        runtime=gke.runtime, name=jobset_name(ctx.run), namespace=gke.namespace,
        labels=job_labels, container=container, slices=slice.count, vms=acc.vms, chips_per_vm=acc.chips_per_vm,
        topology=topology(gke, slice),
        accelerator_label=catalogue.GKE_V5E_ACCELERATOR, max_restarts=ctx.max_restarts, **pathways)


# --- node pools and the cluster ---------------------------------------------------------------

def node_pool_body(spec: NodePoolSpec, renderer: Renderer | None = None) -> str:
    return render(NODE_POOL_TEMPLATE, spec, renderer.templates_dir if renderer else None)


def node_pool_message(spec: NodePoolSpec, renderer: Renderer | None = None):
    """The NodePool parsed strictly into google.cloud.container_v1.NodePool."""
    return messages.node_pool(node_pool_body(spec, renderer), NODE_POOL_TEMPLATE)


def create_node_pool_request(gke: GkeConfig, spec: NodePoolSpec, project: str, renderer: Renderer | None = None):
    return messages.create_node_pool_request(cluster_path(gke, project), node_pool_message(spec, renderer))


def cluster_spec(gke: GkeConfig, slice: SliceConfig, ctx: RenderContext) -> ClusterSpec:
    return ClusterSpec(name=gke.cluster, network=slice.network, subnetwork=slice.subnetwork, labels=ctx.labels)


def cluster_body(gke: GkeConfig, slice: SliceConfig, ctx: RenderContext, renderer: Renderer | None = None) -> str:
    return render(CLUSTER_TEMPLATE, cluster_spec(gke, slice, ctx), renderer.templates_dir if renderer else None)


def create_cluster_request(gke: GkeConfig, slice: SliceConfig, ctx: RenderContext, renderer: Renderer | None = None):
    """The CreateClusterRequest in the context's project (a UsageError where it has none)."""
    return messages.create_cluster_request(location_path(resolve_project(ctx), gke.location),
                                           cluster_body(gke, slice, ctx, renderer), CLUSTER_TEMPLATE)


# --- the JobSet ------------------------------------------------------------------------------

def jobset_text(gke: GkeConfig, slice: SliceConfig, ctx: RenderContext, renderer: Renderer) -> str:
    return render(JOBSET_TEMPLATE, jobset_spec(gke, slice, ctx), renderer.templates_dir)


def jobset_manifest(gke: GkeConfig, slice: SliceConfig, ctx: RenderContext, renderer: Renderer) -> dict[str, Any]:
    """The JobSet as a dict, its pod templates checked against the Kubernetes models and every
    $(VAR) a container uses defined in that container's env."""
    import yaml

    try:
        manifest = yaml.safe_load(jobset_text(gke, slice, ctx, renderer))
    except yaml.YAMLError as exc:
        raise UsageError(f"template {JOBSET_TEMPLATE} does not render valid YAML: {exc}") from None
    check_jobset(manifest)
    return manifest


_JOBSET_KEYS = {
    "": {"apiVersion", "kind", "metadata", "spec"},
    "spec": {"replicatedJobs", "failurePolicy", "successPolicy", "startupPolicy", "coordinator", "network",
             "suspend", "managedBy", "ttlSecondsAfterFinished"},
    "replicatedJob": {"name", "replicas", "template", "dependsOn", "groupName"},
}
_VAR = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def check_jobset(manifest: Any) -> None:
    """Refuse a JobSet with a field its schema does not have (JobSet's own keys here; the pod
    templates against the kubernetes client's models), or a container using an undefined $(VAR)."""
    from provision.cloud.kube import model_problem

    def bad(where: str, message: str) -> UsageError:
        return UsageError(f"template {JOBSET_TEMPLATE}: {where}: {message}")

    if not isinstance(manifest, dict):
        raise bad("the manifest", "must be a mapping (a JobSet)")
    _known_keys(manifest, _JOBSET_KEYS[""], "", bad)
    _known_keys(manifest.get("spec") or {}, _JOBSET_KEYS["spec"], "spec", bad)
    for i, job in enumerate(manifest["spec"].get("replicatedJobs") or []):
        where = f"spec.replicatedJobs[{i}]"
        _known_keys(job, _JOBSET_KEYS["replicatedJob"], where, bad)
        problem = model_problem(job.get("template"), "V1JobTemplateSpec", f"{where}.template")
        if problem is not None:
            raise bad(*problem)
        pod = ((job.get("template") or {}).get("spec") or {}).get("template", {}).get("spec") or {}
        for kind in ("initContainers", "containers"):
            for container in pod.get(kind) or []:
                _check_vars(container, f"{where} container {container.get('name')}", bad)


def _known_keys(node: Any, keys: set[str], where: str, bad) -> None:
    if not isinstance(node, dict):
        raise bad(where or "the manifest", "must be a mapping")
    unknown = sorted(set(node) - keys)
    if unknown:
        raise bad(where or "the manifest", f"unknown field {unknown[0]!r}")


def _check_vars(container: dict, where: str, bad) -> None:
    defined = {env.get("name") for env in container.get("env") or []}
    texts = [*(container.get("args") or []), *(container.get("command") or []),
             *(env.get("value", "") for env in container.get("env") or [])]
    for text in texts:
        for name in _VAR.findall(str(text)):
            if name not in defined:
                raise bad(where, f"uses $({name}) but its env does not define {name}")


# --- every rendered file -----------------------------------------------------------------------

def render_files(gke: GkeConfig, slice: SliceConfig, ctx: RenderContext, renderer: Renderer) -> dict[str, str]:
    """The files `render` writes for target: gke: per zone each node pool body and request, the
    cluster (with create_cluster), the JobSet manifest (`ctx` a training workload's, made with the project
    placeholder where the config names none)."""
    project = resolve_project(ctx)
    files: dict[str, str] = {}
    if gke.create_cluster:
        files["cluster.yaml"] = cluster_body(gke, slice, ctx, renderer)
        request = create_cluster_request(gke, slice, ctx, renderer)
        files["create_cluster.json"] = json.dumps(proto_dict(request), indent=2, sort_keys=True) + "\n"
    for zone in ctx.zones:
        for spec in node_pool_specs(gke, slice, ctx, zone):
            files[f"node_pool.{spec.name}.{zone}.yaml"] = node_pool_body(spec, renderer)
            request = create_node_pool_request(gke, spec, project, renderer)
            files[f"create_node_pool.{spec.name}.{zone}.json"] = json.dumps(proto_dict(request), indent=2,
                                                                             sort_keys=True) + "\n"
    jobset_manifest(gke, slice, ctx, renderer)  # checked before it is written
    files["jobset.yaml"] = jobset_text(gke, slice, ctx, renderer)
    return files


def accelerator_of_pool(pool) -> catalogue.AcceleratorType | None:
    """The v5e accelerator type a node pool (container_v1.NodePool) holds; None for a CPU pool."""
    return catalogue.accelerator_for_machine(pool.config.machine_type, pool.placement_policy.tpu_topology)
