"""Pure rendering of a replica over several hosts on target: gke (a serve section whose topology is a
multi-host v5e slice, 4x4 and up): the serving node pools (one whole slice per group), the server as a
LeaderWorkerSet (leaderworkerset.x-k8s.io/v1: one group of pods per replica, a pod per host, the leader
taking the traffic), the leader's Service, its PodMonitoring and an HPA on the LeaderWorkerSet's scale
subresource (replicas of groups).

Every pod of a group runs the server argv the single-host Deployment runs (provision.container's
server_container, the serve mesh of `plan --serve` in it); the LeaderWorkerSet controller gives each
pod LWS_LEADER_ADDRESS, LWS_GROUP_SIZE and LWS_WORKER_INDEX, from which trainer.serve joins one JAX
program. With gke.runtime: pathways the group is the
layout of Google's Pathways serving recipe: the leader (on a CPU node) holds the Pathways resource
manager, the proxy and the server (JAX_PLATFORMS=proxy, one controller), the workers are the slice's
hosts running the Pathways worker.

The Service, the PodMonitoring and the HPA reuse the single-host templates (gke_serve_render); their
selector picks the leaders only (the workers serve no HTTP). The LeaderWorkerSet's pod templates are
checked against the `kubernetes` client's V1PodTemplateSpec; the tests hold the whole object to the
CRD's OpenAPI schema.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from provision import catalogue
from provision.cloud import CLOUD_PLATFORM_SCOPE
from provision.cloud.messages import proto_dict
from provision.container import SERVER_PORT
from provision.errors import UsageError
from provision.kinds.gke import gke_render, gke_serve_render
from provision.kinds.gke.gke_render import NodePoolSpec, create_node_pool_request, node_pool_body
from provision.kinds.gke.gke_sections import CPU_POOL_SUFFIX, GROUP_POOL_SUFFIX, GkeConfig
from provision.rendering import RenderContext, Renderer
from provision.resources import resolve_project
from provision.templates import render

if TYPE_CHECKING:
    from provision.config_sections import ServeConfig
    from provision.kinds.slice_section import SliceConfig

LWS_KIND = "LeaderWorkerSet"
LWS_API_VERSION = "leaderworkerset.x-k8s.io/v1"
LWS_TEMPLATE = "gke/leaderworkerset.yaml.j2"
HPA_TEMPLATE = "gke/lws_hpa.yaml.j2"
# Object -> (its template, the file `render` writes): applied in this order, deleted in the reverse one.
OBJECTS: dict[str, tuple[str, str]] = {
    LWS_KIND: (LWS_TEMPLATE, "leaderworkerset.yaml"),
    "Service": (gke_serve_render.OBJECTS["Service"][0], "service.yaml"),
    "PodMonitoring": (gke_serve_render.OBJECTS["PodMonitoring"][0], "podmonitoring.yaml"),
    "HorizontalPodAutoscaler": (HPA_TEMPLATE, "hpa.yaml"),
}
# The release of the LeaderWorkerSet controller the manifests are written for (its CRD's schema is the
# tests' oracle), and how a cluster gets it.
LWS_RELEASE = "v0.9.0"
LWS_INSTALL = ("kubectl apply --server-side -f https://github.com/kubernetes-sigs/lws/releases/download/"
               f"{LWS_RELEASE}/manifests.yaml")
WORKER_ROLE = "server-worker"  # the workers' app.kubernetes.io/component (the leaders': gke_serve_render's)


@dataclass(frozen=True)
class GroupSpec:
    """What the LeaderWorkerSet and its HPA need beyond a single-host ServingSpec: the group's size and
    the workers' labels; with Pathways, the head's images, ports and pool."""

    serving: gke_serve_render.ServingSpec
    size: int
    hosts: int
    worker_labels: dict[str, str]
    runtime: str
    cpu_pool: str = ""
    server_image: str = ""
    proxy_image: str = ""
    gcs_scratch: str = ""
    instance_type: str = ""
    rm_port: int = gke_render.RM_PORT
    proxy_port: int = gke_render.PROXY_PORT
    worker_port: int = gke_render.WORKER_PORT
    api_version: str = LWS_API_VERSION


# --- what the serve section asks for -----------------------------------------------------------------

def group_accelerator(serve: ServeConfig | None) -> catalogue.AcceleratorType | None:
    """The multi-host v5e slice one replica holds, or None (no serve section, or a single-host one)."""
    if serve is None:
        return None
    acc = catalogue.accelerator_for_topology(serve.replica_topology)
    return acc if acc is not None and acc.multi_host else None


def multi_host(serve: ServeConfig | None) -> bool:
    """Whether the serve section serves each replica over several hosts (a LeaderWorkerSet, not a Deployment)."""
    return group_accelerator(serve) is not None


def _group_accelerator(serve: ServeConfig) -> catalogue.AcceleratorType:
    acc = group_accelerator(serve)
    if acc is None or acc.vertex_machine_type != serve.machine_type:
        raise UsageError(f"serve.topology {serve.replica_topology} is not a multi-host slice of "
                         f"{serve.machine_type}", hint="multi-host v5e slices are hosts of ct5lp-hightpu-4t")
    return acc


def pathways(gke: GkeConfig | None) -> bool:
    return gke is not None and gke.runtime == "pathways"


def group_pool_ids(run: str, gke: GkeConfig | None, serve: ServeConfig) -> list[str]:
    """One node pool per group, up to serve.max_replicas (GKE makes a multi-host TPU pool whole: the
    HPA's groups each have their slice), then the Pathways leaders' CPU pool."""
    pools = [f"{run}{GROUP_POOL_SUFFIX}{i}" for i in range(serve.max_replicas)]
    return pools + ([f"{run}{CPU_POOL_SUFFIX}"] if pathways(gke) else [])


def group_pool_specs(gke: GkeConfig, serve: ServeConfig, slice: SliceConfig, ctx: RenderContext,
                     zone: str) -> list[NodePoolSpec]:
    acc = _group_accelerator(serve)
    common = dict(zone=zone, service_account=slice.service_account, oauth_scopes=(CLOUD_PLATFORM_SCOPE,),
                  labels=ctx.labels, reservation=None)
    specs = [NodePoolSpec(name=name, machine_type=serve.machine_type, node_count=acc.vms, topology=acc.topology,
                          spot=serve.spot, **common)
             for name in group_pool_ids(ctx.run, gke, serve) if not name.endswith("-cpu")]
    if pathways(gke):
        specs.append(NodePoolSpec(name=f"{ctx.run}{CPU_POOL_SUFFIX}", node_count=serve.max_replicas, topology=None,
                                  machine_type=gke.pathways_settings().cpu_machine_type, spot=False, **common))
    return specs


def chips(serve: ServeConfig) -> int:
    """The chips the groups' pools hold (billed while the service is up)."""
    return _group_accelerator(serve).chips * serve.max_replicas


def leader_selector(labels: dict[str, str]) -> dict[str, str]:
    """The labels of the run's leader pods (the run's `labels` and the server's role): the Service, the
    PodMonitoring and `status` pick them."""
    return gke_serve_render.selector(labels)


# --- specs --------------------------------------------------------------------------------------

def group_spec(gke: GkeConfig, serve: ServeConfig, ctx: RenderContext, startup_s: float) -> GroupSpec:
    """`ctx`: a serving workload's (its container the server's, on the run's checkpoint)."""
    acc = _group_accelerator(serve)
    serving = gke_serve_render.ServingSpec(**{**_serving_fields(gke, serve, ctx, acc),
                                              "startup_failures": gke_serve_render.startup_failures(startup_s)})
    workers = {**ctx.labels, gke_serve_render.ROLE_LABEL[0]: WORKER_ROLE}
    if not pathways(gke):
        return GroupSpec(serving=serving, size=acc.vms, hosts=acc.vms, worker_labels=workers, runtime="jax")
    settings = gke.pathways_settings()
    scratch = gke_render.gcs_scratch(gke, ctx.output_dir)
    return GroupSpec(serving=serving, size=acc.vms + 1, hosts=acc.vms, worker_labels=workers, runtime="pathways",
                     cpu_pool=f"{ctx.run}{CPU_POOL_SUFFIX}", server_image=settings.server_image,
                     proxy_image=settings.proxy_image, gcs_scratch=scratch,
                     instance_type=f"{gke_render.PATHWAYS_V5E}:{acc.topology}")


def _serving_fields(gke: GkeConfig, serve: ServeConfig, ctx: RenderContext,
                    acc: catalogue.AcceleratorType) -> dict[str, Any]:
    """The single-host ServingSpec's fields for a group's pods: the same container, a host's chips."""
    container = ctx.container
    return dict(name=gke_serve_render.server_name(ctx.run), namespace=gke.namespace, labels=ctx.labels,
                selector=leader_selector(ctx.labels), pod_labels=leader_selector(ctx.labels),
                image_uri=container.image, command=container.command, args=container.args, env=container.env,
                container_port=container.ports[0] if container.ports else SERVER_PORT,
                chips_per_host=acc.chips_per_vm, topology=acc.topology,
                accelerator_label=catalogue.GKE_V5E_ACCELERATOR, min_replicas=serve.min_replicas,
                max_replicas=serve.max_replicas, autoscale_target=serve.autoscale_target)


# --- manifests ------------------------------------------------------------------------------------

def manifest_text(kind: str, spec: GroupSpec, renderer: Renderer | None = None) -> str:
    where = renderer.templates_dir if renderer else None
    if kind in (LWS_KIND, "HorizontalPodAutoscaler"):
        return render(OBJECTS[kind][0], spec, where)
    return render(OBJECTS[kind][0], spec.serving, where)  # the single-host template, the leaders selected


def manifests(gke: GkeConfig, serve: ServeConfig, ctx: RenderContext, renderer: Renderer,
              startup_s: float) -> dict[str, dict[str, Any]]:
    """The four objects by kind, in the order they are applied, each checked."""
    import yaml

    spec = group_spec(gke, serve, ctx, startup_s)
    found = {}
    for kind, (template, _) in OBJECTS.items():
        try:
            manifest = yaml.safe_load(manifest_text(kind, spec, renderer))
        except yaml.YAMLError as exc:
            raise UsageError(f"template {template} does not render valid YAML: {exc}") from None
        check_manifest(kind, manifest, template)
        found[kind] = manifest
    return found


def check_manifest(kind: str, manifest: Any, template: str) -> None:
    """The Service and the PodMonitoring as the single-host ones are checked; the LeaderWorkerSet's pod
    templates against the client's V1PodTemplateSpec; the HPA against V2HorizontalPodAutoscaler."""
    from provision.cloud.kube import model_problem

    def bad(where: str, message: str) -> UsageError:
        return UsageError(f"template {template}: {where}: {message}")

    if kind in ("Service", "PodMonitoring"):
        return gke_serve_render.check_manifest(kind, manifest)
    if not isinstance(manifest, dict) or manifest.get("kind") != kind:
        raise bad("the manifest", f"must be a {kind}")
    if kind == "HorizontalPodAutoscaler":
        problem = model_problem(manifest, "V2HorizontalPodAutoscaler", kind)
    else:
        template_of = ((manifest.get("spec") or {}).get("leaderWorkerTemplate") or {})
        problem = model_problem(manifest.get("metadata"), "V1ObjectMeta", f"{kind}.metadata")
        for role in ("leaderTemplate", "workerTemplate"):
            where = f"{kind}.spec.leaderWorkerTemplate.{role}"
            problem = problem or model_problem(template_of.get(role), "V1PodTemplateSpec", where)
    if problem is not None:
        raise bad(*problem)


# --- every rendered file ------------------------------------------------------------------------------

def group_files(gke: GkeConfig, serve: ServeConfig, slice: SliceConfig, ctx: RenderContext, renderer: Renderer,
                startup_s: float) -> dict[str, str]:
    """What `render` writes for a gke config serving over several hosts: the groups' pools per zone (body
    and request) and the four manifests, each checked before it is written (`ctx` a serving workload's,
    made with the project placeholder where the config names none)."""
    project = resolve_project(ctx)
    files: dict[str, str] = {}
    for zone in ctx.zones:
        for spec in group_pool_specs(gke, serve, slice, ctx, zone):
            files[f"node_pool.{spec.name}.{zone}.yaml"] = node_pool_body(spec, renderer)
            request = create_node_pool_request(gke, spec, project, renderer)
            files[f"create_node_pool.{spec.name}.{zone}.json"] = json.dumps(proto_dict(request), indent=2,
                                                                             sort_keys=True) + "\n"
    manifests(gke, serve, ctx, renderer, startup_s)
    spec = group_spec(gke, serve, ctx, startup_s)
    for kind, (_, name) in OBJECTS.items():
        files[name] = manifest_text(kind, spec, renderer)
    return files

