"""Pure rendering of what serves a checkpoint on target: gke: the serving node pool (single-host TPU v5e,
from the config's `serve:` section), the server's Deployment, its Service, its PodMonitoring and its
HorizontalPodAutoscaler.

Typed specs go into Jinja templates, as in gke_render.py. The Deployment, the Service and
the HorizontalPodAutoscaler are checked against the `kubernetes` client's models (V1Deployment,
V1Service, V2HorizontalPodAutoscaler) through provision.cloud.kube.model_problem; the PodMonitoring is
a custom resource of Google Cloud Managed Service for Prometheus that the client has no model of, so
its keys are checked here against the CRD's schema (monitoring.googleapis.com/v1), by hand.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from provision import catalogue
from provision.cloud import CLOUD_PLATFORM_SCOPE
from provision.cloud.messages import proto_dict
from provision.container import SERVER_PORT
from provision.errors import UsageError
from provision.kinds.gke.gke_render import NodePoolSpec, create_node_pool_request, node_pool_body
from provision.kinds.gke.gke_sections import SERVE_POOL_SUFFIX, GkeConfig
from provision.rendering import RenderContext, Renderer
from provision.resources import resolve_project
from provision.templates import render

if TYPE_CHECKING:
    from provision.config_sections import ServeConfig
    from provision.kinds.slice_section import SliceConfig

# Object -> (its template, the file `render` writes, the kubernetes client's model; None: a CRD).
OBJECTS: dict[str, tuple[str, str, str | None]] = {
    "Deployment": ("gke_deployment.yaml.j2", "deployment.yaml", "V1Deployment"),
    "Service": ("gke_service.yaml.j2", "service.yaml", "V1Service"),
    "PodMonitoring": ("gke_podmonitoring.yaml.j2", "podmonitoring.yaml", None),
    "HorizontalPodAutoscaler": ("gke_hpa.yaml.j2", "hpa.yaml", "V2HorizontalPodAutoscaler"),
}
SERVICE_PORT = 8000  # the Service's port, in front of the container's SERVER_PORT
HEALTH_PATH = "/health"
# The server's liveness route: 503 once its engine has completed no step for --step-timeout seconds while it
# had work (trainer/serve/loop.py), or its multi-host group failed; the probe restarts it (a group: every pod).
LIVENESS_PATH = "/livez"
LIVENESS_PERIOD_S = 10
LIVENESS_FAILURES = 3
METRICS_PATH = "/metrics"
SCRAPE_INTERVAL = "15s"
# The HPA's metric, spelled as Google's recipe for vLLM on GKE TPUs spells it: Managed Service for
# Prometheus's name for the server's gauge, as the custom metrics adapter offers it
# (https://cloud.google.com/kubernetes-engine/docs/tutorials/serve-vllm-tpu).
HPA_METRIC = "prometheus.googleapis.com|vllm:num_requests_waiting|gauge"
ROLE_LABEL = ("app.kubernetes.io/component", "server")
STARTUP_PERIOD_S = 10
# Longer than the server's own --grace-seconds (30 s by default): the pod is killed only after it.
TERMINATION_GRACE_S = 60


@dataclass(frozen=True)
class ServingSpec:
    """What the four manifests need: the names, the server's container, the replicas and probes."""

    name: str
    namespace: str
    labels: dict[str, str]
    selector: dict[str, str]
    pod_labels: dict[str, str]
    image_uri: str
    command: tuple[str, ...]
    args: tuple[str, ...]
    env: dict[str, str]
    container_port: int
    chips_per_host: int
    topology: str
    accelerator_label: str
    min_replicas: int
    max_replicas: int
    autoscale_target: int
    startup_failures: int
    startup_period_s: int = STARTUP_PERIOD_S
    termination_grace_s: int = TERMINATION_GRACE_S
    service_port: int = SERVICE_PORT
    health_path: str = HEALTH_PATH
    liveness_path: str = LIVENESS_PATH
    liveness_period_s: int = LIVENESS_PERIOD_S
    liveness_failures: int = LIVENESS_FAILURES
    metrics_path: str = METRICS_PATH
    scrape_interval: str = SCRAPE_INTERVAL
    hpa_metric: str = HPA_METRIC


# --- names --------------------------------------------------------------------------------------

def serving_pool_id(run: str) -> str:
    return f"{run}{SERVE_POOL_SUFFIX}"


def server_name(run: str) -> str:
    """The Deployment's, the Service's, the PodMonitoring's and the HPA's name: the run's."""
    return run


def selector(labels: dict[str, str]) -> dict[str, str]:
    """The labels that pick the run's server pods: the run's `labels` (provision.rendering.labels) and the
    server's role (not its JobSet's pods, which carry the run label too)."""
    return {**labels, ROLE_LABEL[0]: ROLE_LABEL[1]}


def checkpoint(serve: ServeConfig, output_dir: str) -> str:
    """What the server serves: serve.checkpoint, else the run's trainer.output_dir."""
    return serve.checkpoint or output_dir


def serving_accelerator(serve: ServeConfig) -> catalogue.AcceleratorType:
    """The v5e slice one replica holds: the serve section's machine type (and topology) on one host."""
    acc = catalogue.accelerator_for_machine(serve.machine_type, "")
    if acc is None or acc.topology != serve.replica_topology:
        raise UsageError(f"serve.topology {serve.replica_topology} is not the one host of "
                         f"{serve.machine_type}", hint="leave serve.topology unset")
    return acc


def serve_url(gke: GkeConfig, run: str) -> str:
    """Where the Service answers inside the cluster."""
    return f"http://{server_name(run)}.{gke.namespace}.svc.cluster.local:{SERVICE_PORT}"


def proxy_path(gke: GkeConfig, run: str, path: str) -> str:
    """`path` on the Service, through the API server's service proxy (how a client outside reaches it)."""
    return f"/api/v1/namespaces/{gke.namespace}/services/{server_name(run)}:{SERVICE_PORT}/proxy{path}"


# --- specs --------------------------------------------------------------------------------------

def serving_pool_spec(serve: ServeConfig, slice: SliceConfig, ctx: RenderContext, zone: str) -> NodePoolSpec:
    """One node per replica, autoscaled between the serve section's replicas (the HPA adds pods, the
    cluster autoscaler the hosts they need)."""
    serving_accelerator(serve)
    return NodePoolSpec(name=serving_pool_id(ctx.run), zone=zone, machine_type=serve.machine_type,
                        node_count=serve.min_replicas, topology=None, spot=serve.spot, reservation=None,
                        service_account=slice.service_account, oauth_scopes=(CLOUD_PLATFORM_SCOPE,),
                        labels=ctx.labels, min_nodes=serve.min_replicas, max_nodes=serve.max_replicas)


def startup_failures(startup_s: float) -> int:
    """The startup probe's failureThreshold: the load-and-compile estimate in probe periods."""
    return max(1, math.ceil(startup_s / STARTUP_PERIOD_S))


def serving_spec(gke: GkeConfig, serve: ServeConfig, ctx: RenderContext, startup_s: float) -> ServingSpec:
    """`ctx`: a serving workload's (its container the server's, on the run's checkpoint)."""
    acc = serving_accelerator(serve)
    container = ctx.container
    port = container.ports[0] if container.ports else SERVER_PORT
    return ServingSpec(
        name=server_name(ctx.run), namespace=gke.namespace, labels=ctx.labels, selector=selector(ctx.labels),
        pod_labels=selector(ctx.labels), image_uri=container.image, command=container.command,
        args=container.args, env=container.env, container_port=port, chips_per_host=acc.chips_per_vm,
        topology=acc.topology, accelerator_label=catalogue.GKE_V5E_ACCELERATOR, min_replicas=serve.min_replicas,
        max_replicas=serve.max_replicas, autoscale_target=serve.autoscale_target,
        startup_failures=startup_failures(startup_s))


# --- manifests ------------------------------------------------------------------------------------

def manifest_text(kind: str, spec: ServingSpec, renderer: Renderer | None = None) -> str:
    return render(OBJECTS[kind][0], spec, renderer.templates_dir if renderer else None)


def manifests(gke: GkeConfig, serve: ServeConfig, ctx: RenderContext, renderer: Renderer,
              startup_s: float) -> dict[str, dict[str, Any]]:
    """The four objects by kind, in the order they are applied, each checked."""
    import yaml

    spec = serving_spec(gke, serve, ctx, startup_s)
    found = {}
    for kind, (template, _, _) in OBJECTS.items():
        try:
            manifest = yaml.safe_load(manifest_text(kind, spec, renderer))
        except yaml.YAMLError as exc:
            raise UsageError(f"template {template} does not render valid YAML: {exc}") from None
        check_manifest(kind, manifest)
        found[kind] = manifest
    return found


# The PodMonitoring's schema (Managed Service for Prometheus's CRD, monitoring.googleapis.com/v1): the
# keys each level may hold. The kubernetes client knows no custom resource, so this is checked here.
_POD_MONITORING_KEYS = {
    "": {"apiVersion", "kind", "metadata", "spec", "status"},
    "spec": {"selector", "endpoints", "targetLabels", "limits", "filterRunning"},
    "endpoint": {"port", "scheme", "path", "params", "proxyUrl", "interval", "timeout", "metricRelabeling",
                 "authorization", "basicAuth", "oauth2", "tls"},
    "targetLabels": {"metadata", "fromPod"},
}


def check_manifest(kind: str, manifest: Any) -> None:
    """Refuse a manifest that is not the object it should be, or has a field its schema does not have."""
    from provision.cloud.kube import model_problem

    template, _, model = OBJECTS[kind]

    def bad(where: str, message: str) -> UsageError:
        return UsageError(f"template {template}: {where}: {message}")

    if not isinstance(manifest, dict) or manifest.get("kind") != kind:
        raise bad("the manifest", f"must be a {kind}")
    if model is not None:
        problem = model_problem(manifest, model, kind)
        if problem is not None:
            raise bad(*problem)
        return
    _check_pod_monitoring(manifest, bad)


def _check_pod_monitoring(manifest: dict, bad) -> None:
    from provision.cloud.kube import model_problem

    def keys(node: Any, allowed: set[str], where: str) -> None:
        if not isinstance(node, dict):
            raise bad(where, "must be a mapping")
        unknown = sorted(set(node) - allowed)
        if unknown:
            raise bad(where, f"unknown field {unknown[0]!r}")

    keys(manifest, _POD_MONITORING_KEYS[""], "PodMonitoring")
    if manifest.get("apiVersion") != "monitoring.googleapis.com/v1":
        raise bad("PodMonitoring.apiVersion", "must be monitoring.googleapis.com/v1")
    problem = model_problem(manifest.get("metadata"), "V1ObjectMeta", "PodMonitoring.metadata")
    spec = manifest.get("spec")
    keys(spec, _POD_MONITORING_KEYS["spec"], "PodMonitoring.spec")
    problem = problem or model_problem(spec.get("selector"), "V1LabelSelector", "PodMonitoring.spec.selector")
    if problem is not None:
        raise bad(*problem)
    endpoints = spec.get("endpoints")
    if not isinstance(endpoints, list) or not endpoints:
        raise bad("PodMonitoring.spec.endpoints", "must list at least one endpoint")
    for i, endpoint in enumerate(endpoints):
        keys(endpoint, _POD_MONITORING_KEYS["endpoint"], f"PodMonitoring.spec.endpoints[{i}]")
        if "port" not in endpoint:
            raise bad(f"PodMonitoring.spec.endpoints[{i}]", "needs a port (a container port's name or number)")
    if "targetLabels" in spec:
        keys(spec["targetLabels"], _POD_MONITORING_KEYS["targetLabels"], "PodMonitoring.spec.targetLabels")


# --- every rendered file ------------------------------------------------------------------------------

def serving_files(gke: GkeConfig, serve: ServeConfig, slice: SliceConfig, ctx: RenderContext, renderer: Renderer,
                  startup_s: float) -> dict[str, str]:
    """What `render` writes for a gke config with a serve section: the serving pool per zone (body and
    request) and the four manifests, each checked before it is written (`ctx` a serving workload's, made
    with the project placeholder where the config names none)."""
    project = resolve_project(ctx)
    files: dict[str, str] = {}
    for zone in ctx.zones:
        spec = serving_pool_spec(serve, slice, ctx, zone)
        files[f"node_pool.{spec.name}.{zone}.yaml"] = node_pool_body(spec, renderer)
        request = create_node_pool_request(gke, spec, project, renderer)
        files[f"create_node_pool.{spec.name}.{zone}.json"] = json.dumps(proto_dict(request), indent=2,
                                                                         sort_keys=True) + "\n"
    manifests(gke, serve, ctx, renderer, startup_s)
    spec = serving_spec(gke, serve, ctx, startup_s)
    for kind, (_, name, _) in OBJECTS.items():
        files[name] = manifest_text(kind, spec, renderer)
    return files
