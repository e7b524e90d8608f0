"""The emulated cluster's Deployment controller: a Deployment's pods, one per replica, each on a node its
nodeSelector picks and no other pod holds (a pod asking for TPU chips takes its host's chips), Running
once the node is there, Ready once its server answers /health.

In a dry run the server is real: when a pod's container starts, the dry run's local servers
(local_server.LocalServers, `GkeState.servers`) start `python -m trainer.serve` from the container's own
command and args, keyed by the pod; the pod is Ready while it answers /health, and when it exits the
pod's container is in CrashLoopBackOff with the server's last words as its last state's message (the
emulator does not restart it: a server that crashed once on a dry run's checkpoint crashes again).
Without local servers (a bare emulator) a pod is Ready SERVER_READY_S after its container starts.
Deleting the Deployment (or its pod's node pool) stops the pod's server.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from provision.emulator.gke import POD_STARTING_S, KubeObject, PodRecord, short_hash
from trainer.outputs import Phase

if TYPE_CHECKING:
    from provision.emulator.gke_state import GkeState

DEPLOYMENT = "Deployment"
# A server's load and compile when no local server plays it (simulated seconds; plausible, not measured).
SERVER_READY_S = 120.0
CRASH_REASON = "CrashLoopBackOff"


def server_key(pod: PodRecord) -> str:
    """The local server's key for a serving pod (a Deployment's or a LeaderWorkerSet's)."""
    return f"pod/{pod.namespace}/{pod.name}"


def template_hash(dep: KubeObject) -> str:
    """What ReplicaSets call the pod-template-hash: a stable name for the template the pods come from."""
    template = dep.manifest.get("spec", {}).get("template", {})
    return short_hash(json.dumps(template, sort_keys=True), 10)


def deployments(gke: GkeState) -> list[KubeObject]:
    return [o for _, o in sorted(gke.objects.items()) if o.kind == DEPLOYMENT]


def pods_of(gke: GkeState, dep: KubeObject, now: float) -> list[PodRecord]:
    """The Deployment's pods that have not ended, oldest first."""
    return sorted((p for p in gke.pods.values() if p.namespace == dep.namespace and p.deployment == dep.name
                   and (p.ended_at is None or p.ended_at > now)), key=lambda p: (p.created_at, p.name))


def container(dep: KubeObject) -> dict:
    """The Deployment's (first) container, as its pod template gives it."""
    return (dep.manifest["spec"]["template"]["spec"].get("containers") or [{}])[0]


def reconcile(gke: GkeState, now: float) -> None:
    """Bring every Deployment's pods up to `now`: a pod from an old template goes, missing replicas are
    placed where there is a node for them, running pods' servers are started and watched."""
    for pod in [p for p in gke.pods.values() if p.deployment and p.ended_at is not None and p.ended_at <= now]:
        end_pod(gke, pod, now, pod.message or "its node is gone")  # its node pool was deleted under it
    for dep in deployments(gke):
        wanted = template_hash(dep)
        for pod in pods_of(gke, dep, now):
            if pod.template_hash != wanted:
                end_pod(gke, pod, now, "the Deployment's pod template changed")
        live = pods_of(gke, dep, now)
        for _ in range(int(dep.manifest["spec"].get("replicas", 1)) - len(live)):
            if _new_pod(gke, dep, wanted, now) is None:
                break
        for pod in pods_of(gke, dep, now)[int(dep.manifest["spec"].get("replicas", 1)):]:
            end_pod(gke, pod, now, "the Deployment was scaled down")
        for pod in pods_of(gke, dep, now):
            _watch_server(gke, dep, pod, now)


def _new_pod(gke: GkeState, dep: KubeObject, wanted: str, now: float) -> PodRecord | None:
    """A pod of `dep` on a free node its nodeSelector picks; None when no node is free (it waits)."""
    spec = dep.manifest["spec"]["template"]["spec"]
    selector = spec.get("nodeSelector") or {}
    taken = {p.node for p in gke.pods.values() if p.ended_at is None or p.ended_at > now}
    free = [node for node, pool in gke.nodes(now) if node not in taken
            and all(pool.node_labels(node).get(k) == v for k, v in selector.items())]
    if not free:
        return None
    name = f"{dep.name}-{wanted}-{gke.token()[:5]}"
    pod = PodRecord(name=name, namespace=dep.namespace, jobset="", replicated_job="", job_index=0, pod_index=0,
                    attempt=0, node=free[0], created_at=now, running_at=now + POD_STARTING_S,
                    deployment=dep.name, template_hash=wanted)
    if gke.servers is None:
        pod.ready_at = pod.running_at + SERVER_READY_S
    gke.pods[f"{pod.namespace}/{pod.name}"] = pod
    gke.event(pod.namespace, "Pod", name, "Scheduled", f"Successfully assigned {pod.namespace}/{name} to {free[0]}",
              now)
    return pod


def _watch_server(gke: GkeState, dep: KubeObject, pod: PodRecord, now: float) -> None:
    """A running pod's server: started from the container's command when the container starts; Ready
    when it answers; crashed (the pod's container in CrashLoopBackOff) when it exits."""
    servers = gke.servers
    if servers is None or now < pod.running_at or pod.restarts:
        return
    key = server_key(pod)
    if pod.log_path is None:
        main = container(dep)
        env = {e["name"]: str(e.get("value", "")) for e in main.get("env") or [] if "value" in e}
        pod.log_path = str(Path(servers.dir) / f"{pod.namespace}.{pod.name}.log")
        servers.start(key, [*main.get("command", ()), *main.get("args", ())], env, pod.log_path)
        gke.event(pod.namespace, "Pod", pod.name, "Started", "Started container server", now)
    state = servers.state(key)
    if state.phase == Phase.READY and pod.ready_at is None:
        pod.ready_at = now
    elif state.phase in (Phase.FAILED, Phase.STOPPED):
        pod.restarts, pod.exit_code, pod.reason = 1, 1, CRASH_REASON
        pod.message = state.last_words or "the server exited"
        pod.ready_at = None
        servers.stop(key)
        gke.event(pod.namespace, "Pod", pod.name, "BackOff", "Back-off restarting failed container server in pod "
                                                             f"{pod.name}", now, "Warning")


def end_pod(gke: GkeState, pod: PodRecord, now: float, message: str) -> None:
    """The pod is deleted now (its server stopped, a Deployment's or a LeaderWorkerSet's); it is gone from the API."""
    if gke.servers is not None and (pod.deployment or pod.lws):
        gke.servers.stop(server_key(pod))
    gke.pods.pop(f"{pod.namespace}/{pod.name}", None)
    gke.event(pod.namespace, "Pod", pod.name, "Killing", f"Stopping container server: {message}", now)


def delete_deployment(gke: GkeState, dep: KubeObject, now: float) -> None:
    for pod in [p for p in gke.pods.values() if p.namespace == dep.namespace and p.deployment == dep.name]:
        end_pod(gke, pod, now, "the Deployment was deleted")


def ready(pod: PodRecord, now: float) -> bool:
    return pod.ready_at is not None and pod.ready_at <= now and not pod.restarts and pod.phase(now) == "Running"
