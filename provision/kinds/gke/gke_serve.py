"""A service on GKE, the Kubernetes half: the server's Deployment, Service, PodMonitoring and
HorizontalPodAutoscaler applied with the `kubernetes` client (a re-run adopts and replaces what this run
made, and refuses what it did not), found by label for `list` and `status`, deleted for `down`, the
replicas' state as a ServiceReport (the Deployment's, or gke_lws's LeaderWorkerSet's), and a prediction
through the Service's proxy.

Everything here talks to one cluster's `KubeApi` (provision.cloud.kube); the serving node pool is
provision.kinds.gke.gke's (`serving_pool_up`), like the run's other pools.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from provision.core import Phase, ServiceReport
from provision.errors import CloudError
from provision.kinds.gke import gke_serve_render
from provision.rendering import labels
from provision.resources import MANAGED_BY, RUN_LABEL, Resource, is_managed

# The objects in the order they are applied; deleted in the reverse one (the autoscaler first, so that
# it scales nothing while the Deployment goes). A replica over several hosts is a LeaderWorkerSet in the
# Deployment's place (gke_lws_render): listed and deleted with the rest.
KINDS = ("LeaderWorkerSet", *gke_serve_render.OBJECTS)
RESOURCE_KIND = {"Deployment": "deployment", "Service": "service", "PodMonitoring": "podmonitoring",
                 "HorizontalPodAutoscaler": "hpa", "LeaderWorkerSet": "leaderworkerset"}
CRASHED = ("CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "CreateContainerConfigError")


def selector(run: str | None) -> str:
    return f"{MANAGED_BY[0]}={MANAGED_BY[1]}" + (f",{RUN_LABEL}={run}" if run else "")


def _labels(body: dict) -> dict[str, str]:
    return dict((body.get("metadata") or {}).get("labels") or {})


def object_resource(kind: str, body: dict, location: str) -> Resource:
    meta = body.get("metadata") or {}
    status = body.get("status") or {}
    state = "Active"
    if kind == "Deployment":
        ready, wanted = status.get("availableReplicas") or 0, (body.get("spec") or {}).get("replicas", 1)
        state = f"{'Available' if ready else 'Unavailable'} ({ready}/{wanted} ready)"
    elif kind == "LeaderWorkerSet":
        ready, wanted = status.get("readyReplicas") or 0, (body.get("spec") or {}).get("replicas", 1)
        state = f"{'Available' if ready else 'Unavailable'} ({ready}/{wanted} groups ready)"
    return Resource(kind=RESOURCE_KIND[kind], name=f"{meta.get('namespace')}/{meta.get('name')}", state=state,
                    zone=location, run=_labels(body).get(RUN_LABEL))


def managed_objects(kube, cfg, run: str | None) -> list[Resource]:
    """The serving objects this tool made in gke.namespace (of `run`, or of every run)."""
    return [object_resource(kind, body, cfg.gke.location) for kind in KINDS
            for body in kube.list_objects(kind, cfg.gke.namespace, selector(run))]


def apply_objects(context, kube, manifests: dict[str, dict]) -> list[Resource]:
    """Create each object, or replace the one this run made before (a re-run); refuse one of the same
    name that this run did not make."""
    cfg, console = context.config, context.console
    namespace = cfg.gke.namespace
    made: list[Resource] = []
    for kind in [k for k in KINDS if k in manifests]:
        body = manifests[kind]
        name = body["metadata"]["name"]
        answer = kube.create_object(kind, namespace, body)
        if answer is None:
            existing = kube.get_object(kind, namespace, name)
            if existing is not None and not is_managed(_labels(existing), cfg.run):
                raise CloudError(f"a {kind} {namespace}/{name} exists that run {cfg.run} did not make",
                                 hint="choose another `run` name, or delete that object")
            if existing is None:  # deleted between the two calls
                answer = kube.create_object(kind, namespace, body)
            else:
                console.info(f"  adopting {kind} {name} (an earlier deploy of this run made it)")
                version = (existing.get("metadata") or {}).get("resourceVersion")
                body = {**body, "metadata": {**body["metadata"], "resourceVersion": version}}
                answer = kube.replace_object(kind, namespace, name, body)
        else:
            console.info(f"  created {kind} {namespace}/{name}")
        made.append(object_resource(kind, answer or body, cfg.gke.location))
    return made


def delete_objects(context, kube, run: str) -> list[Resource]:
    """Delete the run's serving objects (the HPA first); the ones deleted."""
    cfg = context.config
    deleted: list[Resource] = []
    for kind in reversed(KINDS):
        for body in kube.list_objects(kind, cfg.gke.namespace, selector(run)):
            name = body["metadata"]["name"]
            if kube.delete_object(kind, cfg.gke.namespace, name):
                context.console.info(f"  deleted {kind} {cfg.gke.namespace}/{name}")
                deleted.append(object_resource(kind, body, cfg.gke.location))
    return deleted


@dataclass(frozen=True)
class Replicas:
    """Where a service's replicas are on the cluster, for its report: the object that holds them (`kind`)
    and its status field counting those ready, the selector of their pods, what a replica with no pod
    waits for, and what its pods do meanwhile (`{pods}`, `{wanted}`: the pods, the replicas asked for)."""

    kind: str
    ready_field: str
    pods: str
    waiting_for: str
    loading: str


def deployment_replicas(cfg) -> Replicas:
    """A single-host service's replicas: the Deployment's pods, one a replica."""
    pod_selector = gke_serve_render.selector(labels(cfg))
    return Replicas("Deployment", "availableReplicas", ",".join(f"{k}={v}" for k, v in pod_selector.items()),
                    "a node of the serving pool", "{pods} pod(s) loading the checkpoint and compiling")


def service_report(cfg, kube, url: str, replicas: Replicas) -> ServiceReport:
    """The state of the object holding the replicas: ready once a replica is; failed when a pod's server
    crashed (with its last words) or the object is gone; starting otherwise (with what it waits for)."""
    name = gke_serve_render.server_name(cfg.run)
    held = kube.get_object(replicas.kind, cfg.gke.namespace, name)
    if held is None:
        return ServiceReport(Phase.DELETED, detail=f"the {replicas.kind} {cfg.gke.namespace}/{name} is gone")
    wanted = (held.get("spec") or {}).get("replicas", 1)
    ready = (held.get("status") or {}).get(replicas.ready_field) or 0
    pods = kube.list_pods(cfg.gke.namespace, replicas.pods)
    crashed = [why for pod in pods if (why := _crash(pod))]
    if crashed and not ready:
        return ServiceReport(Phase.FAILED, replicas=wanted, detail=crashed[0])
    if ready:
        return ServiceReport(Phase.READY, url=url, replicas_ready=ready, replicas=wanted)
    waiting = f"no pod yet (waiting for {replicas.waiting_for})" if not pods else \
        replicas.loading.format(pods=len(pods), wanted=wanted)
    return ServiceReport(Phase.STARTING, replicas=wanted, detail=waiting)


def _crash(pod) -> str | None:
    """Why a pod's server is down for good (its container's back-off, with its last words), or None."""
    for status in pod.status.container_statuses or []:
        waiting = status.state.waiting if status.state else None
        if waiting is not None and waiting.reason in CRASHED:
            last = status.last_state.terminated if status.last_state else None
            words = (last.message or "").strip() if last is not None else ""
            code = f" (exit code {last.exit_code})" if last is not None and last.exit_code is not None else ""
            return (f"pod {pod.metadata.name}: {waiting.reason}: the server exited{code}"
                    + (f"; its last words:\n{words}" if words else f": {waiting.message or ''}"))
    return None


def predict(cfg, kube, request: dict, stream: bool = False) -> Iterator[dict]:
    """One OpenAI completions request through the Service, by the API server's service proxy."""
    path = gke_serve_render.proxy_path(cfg.gke, cfg.run, "/v1/completions")
    answer = kube.proxy(path, {**request, "stream": stream}, stream=stream)
    if stream:
        yield from answer
    else:
        yield answer
