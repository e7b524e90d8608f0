"""A Kubernetes API server on 127.0.0.1 for the subset a run uses, over HTTPS with its own CA.

JobSets (jobset.x-k8s.io/v1alpha2: create, get, list, delete, with 409 and 404 as `Status`
objects), pods (list, get, watch, log), events and nodes (with GKE's TPU labels); a service's
Deployment, Service (and its proxy), PodMonitoring and HorizontalPodAutoscaler (kube_objects.py). The official
`kubernetes` client talks to it exactly as to a GKE control plane: the endpoint and the CA
certificate come from GetCluster. Objects live in the emulated world (gke.py, gke_world.py); every
request is one transaction, after the JobSet controller has brought the world up to now.

The HTTPS server that answers with `handle` is kube_server.py.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from provision.emulator import kube_objects
from provision.emulator.kube_base import KubeError, field_matches, list_of, not_found, selector_matches
from provision.emulator.gke import (
    JOBSET_LABELS,
    TPU_RESOURCE,
    JobSetRecord,
    PodRecord,
    iso,
    tpu_accelerator,
)
from provision.emulator.gke_world import GkeWorld

if TYPE_CHECKING:
    from provision.emulator.world import World

# fn(world, now) as one transaction (Emulator.world_call).
WorldCall = Callable[[Callable[["World", float], Any]], Any]

GROUP, VERSION, PLURAL = "jobset.x-k8s.io", "v1alpha2", "jobsets"
_JOBSETS = re.compile(rf"^/apis/{GROUP}/{VERSION}(?:/namespaces/([^/]+))?/{PLURAL}(?:/([^/]+))?$")
_PODS = re.compile(r"^/api/v1/namespaces/([^/]+)/pods(?:/([^/]+))?(/log)?$")
_EVENTS = re.compile(r"^/api/v1/namespaces/([^/]+)/events$")
_NODES = re.compile(r"^/api/v1/nodes(?:/([^/]+))?$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
MAX_JOBSET_NAME = 40  # so that pod names and the DNS names JobSet makes for them stay within 63


# --- views ------------------------------------------------------------------------------------

def jobset_view(gke: GkeWorld, rec: JobSetRecord, now: float) -> dict:
    body = json.loads(json.dumps(rec.manifest))
    meta = body.setdefault("metadata", {})
    meta.update(uid=rec.uid, creationTimestamp=iso(rec.create_time), resourceVersion=str(gke.counter),
                generation=1)
    statuses = []
    pods = [p for p in gke.pods.values() if p.namespace == rec.namespace and p.jobset == rec.name
            and p.attempt == rec.restarts]
    for job in rec.jobs():
        mine = [p for p in pods if p.replicated_job == job["name"]]
        phases = [p.phase(now) for p in mine]
        statuses.append({"name": job["name"], "ready": phases.count("Running"), "succeeded": phases.count("Succeeded"),
                         "failed": phases.count("Failed"), "active": phases.count("Running") + phases.count("Pending"),
                         "suspended": 0})
    status: dict[str, Any] = {"restarts": rec.restarts, "replicatedJobsStatus": statuses, "conditions": []}
    if rec.terminal is not None:
        status["terminalState"] = rec.terminal
        status["conditions"].append({"type": rec.terminal, "status": "True", "reason": rec.reason,
                                     "message": rec.message, "lastTransitionTime": iso(rec.terminal_at)})
    body["status"] = status
    return body


def _pod_labels(rec: JobSetRecord, pod: PodRecord, job: dict) -> tuple[dict, dict]:
    template = job["template"]["spec"]["template"].get("metadata", {})
    ids = {f"{JOBSET_LABELS}jobset-name": rec.name, f"{JOBSET_LABELS}replicatedjob-name": pod.replicated_job,
           f"{JOBSET_LABELS}replicatedjob-replicas": str(job.get("replicas", 1)),
           f"{JOBSET_LABELS}job-index": str(pod.job_index), f"{JOBSET_LABELS}restart-attempt": str(pod.attempt),
           "batch.kubernetes.io/job-completion-index": str(pod.pod_index),
           "batch.kubernetes.io/job-name": f"{rec.name}-{pod.replicated_job}-{pod.job_index}"}
    if rec.coordinator():
        ids[f"{JOBSET_LABELS}coordinator"] = rec.coordinator()
    labels = {**template.get("labels", {}), **ids}
    annotations = {**template.get("annotations", {}), **ids}
    return labels, annotations


def _container_status(name: str, pod: PodRecord, now: float) -> dict:
    phase = pod.phase(now)
    if phase == "Pending":
        state = {"waiting": {"reason": "ContainerCreating"}}
    elif phase == "Running":
        state = {"running": {"startedAt": iso(pod.running_at)}}
    else:
        state = {"terminated": {"exitCode": pod.exit_code, "reason": pod.reason or "", "message": pod.message or "",
                                "startedAt": iso(min(pod.running_at, pod.ended_at)), "finishedAt": iso(pod.ended_at)}}
    return {"name": name, "ready": phase == "Running", "restartCount": 0, "image": "", "imageID": "",
            "state": state}


def pod_view(gke: GkeWorld, pod: PodRecord, now: float) -> dict:
    if pod.deployment:
        return kube_objects.deployment_pod_view(gke, pod, now)
    if pod.lws:
        return kube_objects.lws_pod_view(gke, pod, now)
    rec = gke.jobsets.get(f"{pod.namespace}/{pod.jobset}")
    job = next((j for j in rec.jobs() if j["name"] == pod.replicated_job), None) if rec else None
    spec = json.loads(json.dumps(job["template"]["spec"]["template"]["spec"])) if job else {"containers": []}
    labels, annotations = _pod_labels(rec, pod, job) if job else ({}, {})
    spec["nodeName"] = pod.node
    spec["hostname"] = f"{pod.jobset}-{pod.replicated_job}-{pod.job_index}-{pod.pod_index}"
    spec["subdomain"] = pod.jobset
    phase = pod.phase(now)
    status: dict[str, Any] = {"phase": phase, "startTime": iso(pod.created_at),
                              "containerStatuses": [_container_status(c["name"], pod, now) for c in spec["containers"]]}
    if phase == "Failed" and pod.reason:
        status.update(reason=pod.reason, message=pod.message or "")
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod.name, "namespace": pod.namespace, "uid": f"pod-{pod.name}",
                         "labels": labels, "annotations": annotations, "creationTimestamp": iso(pod.created_at)},
            "spec": spec, "status": status}


def node_view(node: str, pool, now: float) -> dict:
    labels = pool.node_labels(node)
    capacity = {"cpu": "64", "memory": "256Gi", "pods": "110"}
    acc = tpu_accelerator(pool.request)
    if acc is not None:
        capacity.update(cpu="112", memory="192Gi", **{TPU_RESOURCE: str(acc.chips_per_vm)})
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": node, "labels": labels, "creationTimestamp": iso(pool.ready_at)},
            "status": {"capacity": capacity, "allocatable": capacity,
                       "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]}}


# --- requests ---------------------------------------------------------------------------------

def check_jobset(body: Any, namespace: str) -> JobSetRecord:
    """What the API server and JobSet's webhook refuse in a new JobSet (422 Invalid, 400 BadRequest)."""
    if not isinstance(body, dict) or body.get("kind") != "JobSet" or body.get("apiVersion") != f"{GROUP}/{VERSION}":
        raise KubeError(400, "BadRequest", f"the body must be a {GROUP}/{VERSION} JobSet")
    meta = body.get("metadata") or {}
    name = meta.get("name", "")
    if meta.get("namespace", namespace) != namespace:
        raise KubeError(400, "BadRequest", "the namespace of the provided object does not match the namespace sent "
                                           "on the request")

    def invalid(field: str, message: str) -> KubeError:
        return KubeError(422, "Invalid", f'JobSet.{GROUP} "{name}" is invalid: {field}: {message}',
                         {"name": name, "group": GROUP, "kind": "JobSet", "causes": [{"field": field,
                                                                                       "message": message}]})

    if not _DNS_LABEL.match(name) or len(name) > MAX_JOBSET_NAME:
        raise invalid("metadata.name", f"Invalid value: {name!r}: must be a DNS label of at most "
                                       f"{MAX_JOBSET_NAME} characters")
    spec = body.get("spec") or {}
    jobs = spec.get("replicatedJobs") or []
    names = [j.get("name") for j in jobs]
    if not jobs:
        raise invalid("spec.replicatedJobs", "Required value")
    if len(set(names)) != len(names):
        raise invalid("spec.replicatedJobs", "Duplicate value: replicated job names must be unique")
    for i, job in enumerate(jobs):
        pod = (((job.get("template") or {}).get("spec") or {}).get("template") or {}).get("spec") or {}
        if not pod.get("containers"):
            raise invalid(f"spec.replicatedJobs[{i}].template.spec.template.spec.containers", "Required value")
    coordinator = (spec.get("coordinator") or {}).get("replicatedJob")
    if coordinator is not None and coordinator not in names:
        raise invalid("spec.coordinator", f"replicatedJob {coordinator!r} does not exist")
    for target in (spec.get("successPolicy") or {}).get("targetReplicatedJobs") or []:
        if target not in names:
            raise invalid("spec.successPolicy.targetReplicatedJobs", f"{target!r} is not a replicated job")
    return JobSetRecord(name=name, namespace=namespace, manifest=body, uid="", create_time=0.0)


def handle(gke: GkeWorld, now: float, method: str, path: str, query: dict[str, str], body: Any):
    """One request: (status code, JSON body or text). Raises KubeError for a Status answer."""
    gke.reconcile(now)
    if match := _JOBSETS.match(path):
        return _jobsets(gke, now, method, match.group(1), match.group(2), query, body)
    if match := _PODS.match(path):
        namespace, name, log = match.groups()
        if method != "GET":
            raise KubeError(405, "MethodNotAllowed", f"the server does not allow this method on pods: {method}")
        if name is None:
            pods = [pod_view(gke, p, now) for p in sorted(gke.pods.values(), key=lambda p: p.created_at)
                    if p.namespace == namespace]
            pods = [p for p in pods if selector_matches(query.get("labelSelector", ""), p["metadata"]["labels"])]
            if query.get("watch", "").lower() in ("true", "1"):
                return 200, [{"type": "ADDED", "object": p} for p in pods]
            return 200, list_of("PodList", pods, gke)
        pod = gke.pods.get(f"{namespace}/{name}")
        if pod is None:
            raise not_found("pods", name)
        return (200, _log(gke, pod, now, query)) if log else (200, pod_view(gke, pod, now))
    if match := _EVENTS.match(path):
        namespace = match.group(1)
        items = [{"apiVersion": "v1", "kind": "Event",
                  "metadata": {"name": f"{e.name}.{i:x}", "namespace": e.namespace},
                  "involvedObject": {"kind": e.kind, "name": e.name, "namespace": e.namespace},
                  "reason": e.reason, "message": e.message, "type": e.type, "count": 1,
                  "firstTimestamp": iso(e.at), "lastTimestamp": iso(e.at)}
                 for i, e in enumerate(gke.events) if e.namespace == namespace and e.at <= now]
        selector = query.get("fieldSelector", "")
        items = [e for e in items if field_matches(selector, {"involvedObject.name": e["involvedObject"]["name"],
                                                               "involvedObject.kind": e["involvedObject"]["kind"]})]
        return 200, list_of("EventList", items, gke)
    if match := _NODES.match(path):
        nodes = [node_view(n, pool, now) for n, pool in gke.nodes(now)]
        if match.group(1):
            found = [n for n in nodes if n["metadata"]["name"] == match.group(1)]
            if not found:
                raise not_found("nodes", match.group(1))
            return 200, found[0]
        return 200, list_of("NodeList", [n for n in nodes if selector_matches(query.get("labelSelector", ""),
                                                                            n["metadata"]["labels"])], gke)
    answer = kube_objects.handle(gke, now, method, path, query, body)
    if answer is not None:
        return answer
    raise KubeError(404, "NotFound", "the server could not find the requested resource")


def _jobsets(gke: GkeWorld, now: float, method: str, namespace: str | None, name: str | None, query, body):
    if method == "POST" and namespace and not name:
        rec = check_jobset(body, namespace)
        key = f"{namespace}/{rec.name}"
        if key in gke.jobsets:
            raise KubeError(409, "AlreadyExists", f'{PLURAL}.{GROUP} "{rec.name}" already exists',
                            {"name": rec.name, "group": GROUP, "kind": PLURAL})
        rec.manifest.setdefault("metadata", {})["namespace"] = namespace
        rec.uid, rec.create_time, rec.attempt_start = f"jobset-{gke.token()}", now, now
        gke.jobsets[key] = rec
        gke.event(namespace, "JobSet", rec.name, "Created", f"JobSet {rec.name} created", now)
        gke.reconcile(now)
        return 201, jobset_view(gke, rec, now)
    if method == "GET" and not name:
        found = [j for k, j in sorted(gke.jobsets.items()) if namespace in (None, j.namespace)]
        items = [jobset_view(gke, j, now) for j in found
                 if selector_matches(query.get("labelSelector", ""), j.manifest.get("metadata", {}).get("labels", {}))]
        return 200, list_of("JobSetList", items, gke, f"{GROUP}/{VERSION}")
    rec = gke.jobsets.get(f"{namespace}/{name}") if namespace and name else None
    if rec is None:
        raise not_found(PLURAL, name or "", GROUP)
    if method == "GET":
        return 200, jobset_view(gke, rec, now)
    if method == "DELETE":
        for key in [k for k, p in gke.pods.items() if p.namespace == namespace and p.jobset == name]:
            del gke.pods[key]
        del gke.jobsets[f"{namespace}/{name}"]
        gke.event(namespace, "JobSet", name, "Deleted", f"JobSet {name} deleted", now)
        return 200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                     "details": {"name": name, "group": GROUP, "kind": PLURAL, "uid": rec.uid}}
    raise KubeError(405, "MethodNotAllowed", f"the server does not allow this method on {PLURAL}: {method}")


def _log(gke: GkeWorld, pod: PodRecord, now: float, query: dict[str, str]) -> str:
    view = pod_view(gke, pod, now)
    names = [c["name"] for c in view["spec"].get("containers", [])]
    container = query.get("container") or (names[0] if len(names) == 1 else None)
    if container is None:
        raise KubeError(400, "BadRequest", f"a container name must be specified for pod {pod.name}, choose one of: "
                                           f"[{' '.join(names)}]")
    init = [c["name"] for c in view["spec"].get("initContainers", [])]
    if container not in names + init:
        raise KubeError(400, "BadRequest", f"container {container} is not valid for pod {pod.name}")
    if pod.phase(now) == "Pending":
        raise KubeError(400, "BadRequest", f'container "{container}" in pod "{pod.name}" is waiting to start: '
                                           "ContainerCreating")
    if (container == "trainer" or pod.deployment or pod.lws) and pod.log_path:
        try:
            lines = Path(pod.log_path).read_text(errors="replace").splitlines()
        except OSError:
            lines = []
    else:
        lines = [f"[emulator] container {container} of pod {pod.name} runs nothing in a dry run "
                 "(the Pathways runtime and the other processes of a multi-controller run are not emulated)"]
    tail = query.get("tailLines")
    if tail and tail.isdigit():
        lines = lines[-int(tail):] if int(tail) else []
    return "".join(line + "\n" for line in lines)
