"""The emulated Kubernetes API's serving objects: Deployments (apps/v1), Services (v1), PodMonitorings
(monitoring.googleapis.com/v1, Managed Service for Prometheus's custom resource) and
HorizontalPodAutoscalers (autoscaling/v2): create (409 AlreadyExists), get, list by label selector,
replace (409 Conflict on a stale resourceVersion), delete (404 NotFound), as `Status` objects like the
JobSets of kube.py; their views with the status the controllers give them (gke_serving.py); a
Deployment's pods; and the Service's proxy path (`/api/v1/namespaces/NS/services/NAME[:PORT]/proxy/...`),
resolved here to a Ready pod behind the Service and forwarded by kube.py to its local server.

Validation follows the API server's for what a serving workload sends (names, a selector that matches
the template's labels, ports, the HPA's replica bounds and metric targets); messages are shaped like the
API server's `<Kind>.<group> "<name>" is invalid: <field>: <what>`.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from provision.emulator import gke_lws, gke_serving
from provision.emulator.gke import KubeObject, PodRecord, iso, object_key, short_hash
from provision.emulator.kube_base import KubeError, list_of, not_found, selector_matches

if TYPE_CHECKING:
    from provision.emulator.gke_world import GkeWorld


@dataclass(frozen=True)
class ObjectKind:
    kind: str
    group: str  # "" for the core group
    version: str
    plural: str

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def resource(self) -> str:
        """How the API server names the resource in its messages (deployments.apps, services)."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def prefix(self) -> str:
        return f"/apis/{self.group}/{self.version}" if self.group else f"/api/{self.version}"


KINDS = {k.plural: k for k in (
    ObjectKind("Deployment", "apps", "v1", "deployments"),
    ObjectKind("Service", "", "v1", "services"),
    ObjectKind("PodMonitoring", "monitoring.googleapis.com", "v1", "podmonitorings"),
    ObjectKind("HorizontalPodAutoscaler", "autoscaling", "v2", "horizontalpodautoscalers"),
    ObjectKind("LeaderWorkerSet", "leaderworkerset.x-k8s.io", "v1", "leaderworkersets"),
)}
_PATHS = [(re.compile(rf"^{re.escape(k.prefix)}(?:/namespaces/([^/]+))?/{k.plural}(?:/([^/]+))?$"), k)
          for k in KINDS.values()]
PROXY = re.compile(r"^/api/v1/namespaces/([^/]+)/services/([^/]+)/proxy(/.*)?$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


class Invalid(Exception):
    """One field the API server refuses (422)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field, self.message = field, message


# --- requests ---------------------------------------------------------------------------------

def handle(gke: GkeWorld, now: float, method: str, path: str, query: dict[str, str], body: Any):
    """(status code, answer) for a request on one of the four kinds; None when the path is none of theirs."""
    for pattern, kind in _PATHS:
        if match := pattern.match(path):
            namespace, name = match.groups()
            break
    else:
        return None
    if kind.kind == gke_lws.LWS and not gke_lws.served(gke):  # no controller, no CRD: the API has no such path
        raise KubeError(404, "NotFound", "the server could not find the requested resource")
    if method == "POST" and namespace and not name:
        obj = _checked(kind, body, namespace, KubeError)
        if obj.key in gke.objects:
            raise KubeError(409, "AlreadyExists", f'{kind.resource} "{obj.name}" already exists',
                            {"name": obj.name, "group": kind.group, "kind": kind.plural})
        obj.uid, obj.create_time = f"{kind.plural[:-1]}-{gke.token()}", now
        obj.resource_version = gke.counter
        gke.objects[obj.key] = obj
        gke.event(namespace, kind.kind, obj.name, "Created", f"{kind.kind} {obj.name} created", now)
        gke.reconcile(now)
        return 201, view(gke, obj, now)
    if method == "GET" and not name:
        found = [o for _, o in sorted(gke.objects.items()) if o.kind == kind.kind and namespace in (None, o.namespace)
                 and selector_matches(query.get("labelSelector", ""), o.labels)]
        return 200, list_of(f"{kind.kind}List", [view(gke, o, now) for o in found], gke, kind.api_version)
    obj = gke.objects.get(object_key(kind.kind, namespace or "", name or ""))
    if obj is None:
        raise not_found(kind.plural, name or "", kind.group)
    if method == "GET":
        return 200, view(gke, obj, now)
    if method == "PUT":
        return 200, _replace(gke, kind, obj, body, now, KubeError)
    if method == "DELETE":
        del gke.objects[obj.key]
        if kind.kind == gke_serving.DEPLOYMENT:
            gke_serving.delete_deployment(gke, obj, now)
        if kind.kind == gke_lws.LWS:
            gke_lws.delete(gke, obj, now)
        gke.event(obj.namespace, kind.kind, obj.name, "Deleted", f"{kind.kind} {obj.name} deleted", now)
        if kind.kind == "Service":  # the core API answers a Service's delete with the object
            return 200, view(gke, obj, now)
        return 200, {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                     "details": {"name": obj.name, "group": kind.group, "kind": kind.plural, "uid": obj.uid}}
    raise KubeError(405, "MethodNotAllowed", f"the server does not allow this method on {kind.plural}: {method}")


def _checked(kind: ObjectKind, body: Any, namespace: str, error) -> KubeObject:
    """The object of a create or replace, as the API server admits it (400 BadRequest, 422 Invalid)."""
    if not isinstance(body, dict) or body.get("kind") != kind.kind or body.get("apiVersion") != kind.api_version:
        raise error(400, "BadRequest", f"the body must be a {kind.api_version} {kind.kind}")
    meta = body.get("metadata") or {}
    name = meta.get("name", "")
    if meta.get("namespace", namespace) != namespace:
        raise error(400, "BadRequest", "the namespace of the provided object does not match the namespace sent on "
                                       "the request")
    try:
        pattern, limit = (_DNS_1035, 63) if kind.kind == "Service" else (_DNS_LABEL, 253)
        letter = ", starting with a letter" if kind.kind == "Service" else ""
        if not pattern.match(name) or len(name) > limit:
            raise Invalid("metadata.name", f"Invalid value: {name!r}: a lowercase RFC 1123 name of at most {limit} "
                                           f"characters{letter}")
        CHECKS[kind.kind](body.get("spec") or {})
    except Invalid as bad:
        message = f'{kind.kind}.{kind.group or "core"} "{name}" is invalid: {bad.field}: {bad.message}'
        raise error(422, "Invalid", message, {"name": name, "group": kind.group, "kind": kind.kind,
                                              "causes": [{"field": bad.field, "message": bad.message}]}) from None
    manifest = copy.deepcopy(body)
    manifest.setdefault("metadata", {})["namespace"] = namespace
    manifest.pop("status", None)
    return KubeObject(kind=kind.kind, name=name, namespace=namespace, manifest=manifest, uid="", create_time=0.0)


def _replace(gke: GkeWorld, kind: ObjectKind, obj: KubeObject, body: Any, now: float, error) -> dict:
    new = _checked(kind, body, obj.namespace, error)
    if new.name != obj.name:
        raise error(400, "BadRequest", f"the name of the object ({new.name}) does not match the name on the URL "
                                       f"({obj.name})")
    sent = str((body.get("metadata") or {}).get("resourceVersion") or "")
    if sent and sent != str(obj.resource_version):
        raise error(409, "Conflict", f'Operation cannot be fulfilled on {kind.resource} "{obj.name}": the object has '
                                     "been modified; please apply your changes to the latest version and try again",
                    {"name": obj.name, "group": kind.group, "kind": kind.plural})
    if new.manifest.get("spec") != obj.manifest.get("spec"):
        obj.generation += 1
    obj.manifest = new.manifest
    gke.token()
    obj.resource_version = gke.counter
    gke.reconcile(now)
    return view(gke, obj, now)


# --- what the API server refuses, per kind ----------------------------------------------------------

def _check_deployment(spec: dict) -> None:
    selector = (spec.get("selector") or {}).get("matchLabels")
    if not selector:
        raise Invalid("spec.selector", "Required value")
    template = spec.get("template") or {}
    labels = (template.get("metadata") or {}).get("labels") or {}
    if any(labels.get(k) != v for k, v in selector.items()):
        raise Invalid("spec.template.metadata.labels", f"Invalid value: {labels}: `selector` does not match "
                                                       "template `labels`")
    if not (template.get("spec") or {}).get("containers"):
        raise Invalid("spec.template.spec.containers", "Required value")
    replicas = spec.get("replicas", 1)
    if not isinstance(replicas, int) or replicas < 0:
        raise Invalid("spec.replicas", f"Invalid value: {replicas!r}: must be greater than or equal to 0")


def _check_service(spec: dict) -> None:
    ports = spec.get("ports") or []
    if not ports:
        raise Invalid("spec.ports", "Required value")
    for i, port in enumerate(ports):
        if not isinstance(port.get("port"), int) or not 1 <= port["port"] <= 65535:
            raise Invalid(f"spec.ports[{i}].port", f"Invalid value: {port.get('port')!r}: must be between 1 and "
                                                   "65535, inclusive")
    if spec.get("type", "ClusterIP") not in ("ClusterIP", "NodePort", "LoadBalancer", "ExternalName"):
        raise Invalid("spec.type", f'Unsupported value: "{spec.get("type")}": supported values: "ClusterIP", '
                                   '"ExternalName", "LoadBalancer", "NodePort"')


def _check_pod_monitoring(spec: dict) -> None:
    if not spec.get("endpoints"):
        raise Invalid("spec.endpoints", "Required value")
    for i, endpoint in enumerate(spec["endpoints"]):
        if "port" not in endpoint:
            raise Invalid(f"spec.endpoints[{i}].port", "Required value")


def _check_hpa(spec: dict) -> None:
    target = spec.get("scaleTargetRef") or {}
    if not target.get("kind") or not target.get("name"):
        raise Invalid("spec.scaleTargetRef", "Required value")
    low, high = spec.get("minReplicas", 1), spec.get("maxReplicas")
    if not isinstance(high, int) or high < 1:
        raise Invalid("spec.maxReplicas", f"Invalid value: {high!r}: must be greater than 0")
    if not isinstance(low, int) or low < 1:
        raise Invalid("spec.minReplicas", f"Invalid value: {low!r}: must be greater than or equal to 1")
    if high < low:
        raise Invalid("spec.maxReplicas", f"Invalid value: {high}: must be greater than or equal to `minReplicas`")
    for i, metric in enumerate(spec.get("metrics") or []):
        if metric.get("type") == "Pods":
            pods = metric.get("pods") or {}
            if not (pods.get("metric") or {}).get("name"):
                raise Invalid(f"spec.metrics[{i}].pods.metric.name", "Required value: must specify a metric name")
            if (pods.get("target") or {}).get("type") != "AverageValue" or "averageValue" not in pods["target"]:
                raise Invalid(f"spec.metrics[{i}].pods.target.averageValue", "Required value: must set either a "
                                                                              "target value for metric")


CHECKS = {"Deployment": _check_deployment, "Service": _check_service, "PodMonitoring": _check_pod_monitoring,
          "HorizontalPodAutoscaler": _check_hpa, "LeaderWorkerSet": lambda spec: gke_lws.check(spec, Invalid)}


# --- views --------------------------------------------------------------------------------------

def view(gke: GkeWorld, obj: KubeObject, now: float) -> dict:
    body = copy.deepcopy(obj.manifest)
    body.setdefault("metadata", {}).update(uid=obj.uid, creationTimestamp=iso(obj.create_time),
                                           resourceVersion=str(obj.resource_version), generation=obj.generation)
    if obj.kind == "Service":
        number = int(short_hash(obj.uid, 4), 16)
        ip = f"10.96.{number >> 8}.{number & 255 or 1}"
        body["spec"].update(clusterIP=ip, clusterIPs=[ip], sessionAffinity="None")
        body["status"] = {"loadBalancer": {}}
    else:
        body["status"] = STATUS[obj.kind](gke, obj, now)
    return body


def _condition(type_: str, ok: bool, reason: str, message: str, at: float) -> dict:
    return {"type": type_, "status": "True" if ok else "False", "reason": reason, "message": message,
            "lastTransitionTime": iso(at), "lastUpdateTime": iso(at)}


def _deployment_status(gke: GkeWorld, dep: KubeObject, now: float) -> dict:
    pods = gke_serving.pods_of(gke, dep, now)
    wanted = int(dep.manifest["spec"].get("replicas", 1))
    ready = sum(1 for p in pods if gke_serving.ready(p, now))
    status: dict[str, Any] = {"observedGeneration": dep.generation, "replicas": len(pods),
                              "updatedReplicas": len(pods)}
    if ready:
        status["readyReplicas"] = status["availableReplicas"] = ready
    if wanted > ready:
        status["unavailableReplicas"] = wanted - ready
    replica_set = f"{dep.name}-{gke_serving.template_hash(dep)}"
    status["conditions"] = [
        _condition("Available", ready >= wanted, "MinimumReplicasAvailable" if ready >= wanted
                   else "MinimumReplicasUnavailable", "Deployment has minimum availability." if ready >= wanted
                   else "Deployment does not have minimum availability.", dep.create_time),
        _condition("Progressing", True, "NewReplicaSetAvailable" if ready >= wanted else "ReplicaSetUpdated",
                   f'ReplicaSet "{replica_set}" has successfully progressed.' if ready >= wanted
                   else f'ReplicaSet "{replica_set}" is progressing.', dep.create_time)]
    return status


def _hpa_status(gke: GkeWorld, hpa: KubeObject, now: float) -> dict:
    spec = hpa.manifest["spec"]
    target = spec.get("scaleTargetRef") or {}
    dep = gke.objects.get(object_key(target.get("kind", ""), hpa.namespace, target.get("name", "")))
    replicas = int(dep.manifest["spec"].get("replicas", 1)) if dep is not None else 0
    metric = next((m["pods"]["metric"]["name"] for m in spec.get("metrics") or [] if m.get("type") == "Pods"), "")
    # The emulator serves no custom metrics API: the autoscaler holds the replicas where they are, and says
    # why as GKE's does when the adapter answers nothing.
    return {"currentReplicas": replicas, "desiredReplicas": replicas, "conditions": [
        _condition("AbleToScale", dep is not None, "SucceededGetScale" if dep is not None else "FailedGetScale",
                   "the HPA controller was able to get the target's current scale" if dep is not None else
                   f'deployments/scale.apps "{target.get("name")}" not found', hpa.create_time),
        _condition("ScalingActive", False, "FailedGetPodsMetric",
                   f"the HPA was unable to compute the replica count: unable to get metric {metric}: no metrics "
                   "returned from custom metrics API", hpa.create_time)]}


def _pod_monitoring_status(gke: GkeWorld, obj: KubeObject, now: float) -> dict:
    return {"observedGeneration": obj.generation, "conditions": [
        _condition("ConfigurationCreateSuccess", True, "", "", obj.create_time)]}


STATUS = {"Deployment": _deployment_status, "HorizontalPodAutoscaler": _hpa_status,
          "PodMonitoring": _pod_monitoring_status, "LeaderWorkerSet": gke_lws.status}


def deployment_pod_view(gke: GkeWorld, pod: PodRecord, now: float) -> dict:
    """A Deployment's pod: its template's spec and labels (with pod-template-hash), its node, and the
    server container's state: waiting to start, running (ready or not), or CrashLoopBackOff with the
    server's last words."""
    dep = gke.objects.get(object_key(gke_serving.DEPLOYMENT, pod.namespace, pod.deployment or ""))
    template = dep.manifest["spec"]["template"] if dep is not None else {"spec": {"containers": []}}
    spec = copy.deepcopy(template.get("spec") or {})
    spec["nodeName"] = pod.node
    labels = {**(template.get("metadata") or {}).get("labels", {}), "pod-template-hash": pod.template_hash}
    phase = pod.phase(now)
    is_ready = gke_serving.ready(pod, now)
    statuses = [_server_status(c["name"], pod, phase, is_ready, now) for c in spec.get("containers", [])]
    status: dict[str, Any] = {"phase": phase, "startTime": iso(pod.created_at), "containerStatuses": statuses,
                              "conditions": [_condition("Ready", is_ready, "" if is_ready else "ContainersNotReady",
                                                        "", pod.created_at)]}
    if phase == "Failed" and pod.reason:
        status.update(reason=pod.reason, message=pod.message or "")
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod.name, "namespace": pod.namespace, "uid": f"pod-{pod.name}", "labels": labels,
                         "creationTimestamp": iso(pod.created_at),
                         "ownerReferences": [{"apiVersion": "apps/v1", "kind": "ReplicaSet", "controller": True,
                                              "name": f"{pod.deployment}-{pod.template_hash}",
                                              "uid": f"replicaset-{pod.deployment}-{pod.template_hash}"}]},
            "spec": spec, "status": status}


def lws_pod_view(gke: GkeWorld, pod: PodRecord, now: float) -> dict:
    """A LeaderWorkerSet's pod: its template's spec, its labels and the controller's, its node, and its
    containers' states as a Deployment's pod has them."""
    lws = gke.objects.get(object_key(gke_lws.LWS, pod.namespace, pod.lws or ""))
    spec = copy.deepcopy(gke_lws.template(lws, pod.pod_index).get("spec") or {}) if lws else {"containers": []}
    spec["nodeName"] = pod.node
    phase, is_ready = pod.phase(now), gke_serving.ready(pod, now)
    statuses = [_server_status(c["name"], pod, phase, is_ready, now) for c in spec.get("containers", [])]
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": pod.name, "namespace": pod.namespace, "uid": f"pod-{pod.name}",
                         "labels": gke_lws.pod_labels(gke, pod) or {}, "creationTimestamp": iso(pod.created_at)},
            "spec": spec, "status": {"phase": phase, "startTime": iso(pod.created_at), "containerStatuses": statuses,
                                     "conditions": [_condition("Ready", is_ready, "", "", pod.created_at)]}}


def _server_status(name: str, pod: PodRecord, phase: str, is_ready: bool, now: float) -> dict:
    status: dict[str, Any] = {"name": name, "ready": is_ready, "started": phase == "Running", "image": "",
                              "imageID": "", "restartCount": pod.restarts}
    if pod.restarts:
        status["state"] = {"waiting": {"reason": pod.reason, "message": "back-off restarting failed container"}}
        status["lastState"] = {"terminated": {"exitCode": pod.exit_code, "reason": "Error", "message": pod.message,
                                              "startedAt": iso(pod.running_at), "finishedAt": iso(now)}}
    elif phase == "Pending":
        status["state"] = {"waiting": {"reason": "ContainerCreating"}}
    else:
        status["state"] = {"running": {"startedAt": iso(pod.running_at)}}
    return status


# --- the Service's proxy -----------------------------------------------------------------------------

def proxy_target(gke: GkeWorld, now: float, namespace: str, service: str) -> str:
    """The local server key of a Ready pod behind the Service `service` ("NAME", "NAME:PORT" or
    "SCHEME:NAME:PORT"): KubeError 404 for no such Service, 503 when no pod is Ready behind it."""
    parts = service.split(":")
    name = parts[1] if len(parts) == 3 else parts[0]
    port = parts[-1] if len(parts) > 1 else None
    gke.reconcile(now)
    obj = gke.objects.get(object_key("Service", namespace, name))
    if obj is None:
        raise not_found("services", name)
    ports = obj.manifest["spec"].get("ports") or []
    if port is not None and not any(str(p.get("port")) == port or p.get("name") == port for p in ports):
        raise KubeError(503, "ServiceUnavailable", f'no endpoints available for service "{service}"')
    selector = ",".join(f"{k}={v}" for k, v in (obj.manifest["spec"].get("selector") or {}).items())
    for pod in sorted(gke.pods.values(), key=lambda p: p.name):
        if pod.lws and pod.namespace == namespace and gke_serving.ready(pod, now) and pod.log_path:
            if selector and selector_matches(selector, gke_lws.pod_labels(gke, pod) or {}):
                return gke_serving.server_key(pod)  # a group's leader (the selector picks leaders only)
            continue
        dep = gke.objects.get(object_key(gke_serving.DEPLOYMENT, pod.namespace, pod.deployment or ""))
        if pod.namespace != namespace or dep is None or not gke_serving.ready(pod, now):
            continue
        labels = (dep.manifest["spec"]["template"].get("metadata") or {}).get("labels") or {}
        if selector and selector_matches(selector, labels):
            return gke_serving.server_key(pod)
    raise KubeError(503, "ServiceUnavailable", f'no endpoints available for service "{service}"')
