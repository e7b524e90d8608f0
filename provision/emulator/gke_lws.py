"""The emulated cluster's LeaderWorkerSet controller (leaderworkerset.x-k8s.io/v1): per replica a group
of `size` pods, the leader NAME-G (worker index 0) from the leader template and the workers NAME-G-W from
the worker template, placed together (a free node per pod that its nodeSelector picks, the workers on
one node pool: one slice), Running once their nodes are there; a group is Ready when its leader answers
/health. A pod of a group that fails is in CrashLoopBackOff with its server's last words and the
group's other servers are stopped (the controller's RecreateGroupOnPodRestart is not played: a
server that crashed once on a dry run's checkpoint crashes again). Deleting the LeaderWorkerSet (or its
pods' node pool) stops every server of its groups.

In a dry run the group is real: the pods whose template has a container named `server` start that
container's command and args as local processes (local_server.LocalServers), at most
DRY_RUN_PROCESSES of them per group (this machine has few cores; the group's other pods are played
without a process), with the environment the controller gives a group's pods (LWS_LEADER_ADDRESS,
LWS_GROUP_SIZE, LWS_WORKER_INDEX) and JAX_COORDINATOR_ADDRESS on a free port of the loopback, so that
the processes join one JAX program whatever else runs on this machine. The Service's proxy reaches the
leader's process. The API serves LeaderWorkerSets only on a cluster the project had before (the
controller installed); a cluster this tool created has no such API (404), as a new GKE cluster has not.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from provision.emulator.gke import POD_STARTING_S, KubeObject, PodRecord, iso
from provision.emulator.gke_serving import CRASH_REASON, SERVER_READY_S, end_pod, ready, server_key, template_hash
from trainer.outputs import Phase

if TYPE_CHECKING:
    from provision.emulator.gke_state import GkeState

LWS = "LeaderWorkerSet"
DRY_RUN_PROCESSES = 2
SERVER_CONTAINER = "server"
NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
GROUP_LABEL = "leaderworkerset.sigs.k8s.io/group-index"
WORKER_LABEL = "leaderworkerset.sigs.k8s.io/worker-index"


def served(gke: GkeState) -> bool:
    """Whether the emulated API serves LeaderWorkerSets: a cluster the project had is there (its
    controller installed)."""
    return any(c.preexisting for c in gke.clusters.values())


def check(spec: dict, invalid) -> None:
    """What the controller's webhook refuses: no size, no worker template's containers, negative replicas."""
    template = spec.get("leaderWorkerTemplate") or {}
    size = template.get("size", 1)
    if not isinstance(size, int) or size < 1:
        raise invalid("spec.leaderWorkerTemplate.size", f"Invalid value: {size!r}: must be at least 1")
    if not ((template.get("workerTemplate") or {}).get("spec") or {}).get("containers"):
        raise invalid("spec.leaderWorkerTemplate.workerTemplate.spec.containers", "Required value")
    replicas = spec.get("replicas", 1)
    if not isinstance(replicas, int) or replicas < 0:
        raise invalid("spec.replicas", f"Invalid value: {replicas!r}: must be greater than or equal to 0")


def sets(gke: GkeState) -> list[KubeObject]:
    return [o for _, o in sorted(gke.objects.items()) if o.kind == LWS]


def template(lws: KubeObject, worker: int) -> dict:
    spec = lws.manifest["spec"]["leaderWorkerTemplate"]
    return (spec.get("leaderTemplate") if worker == 0 else None) or spec["workerTemplate"]


def group_pods(gke: GkeState, lws: KubeObject, now: float) -> dict[int, list[PodRecord]]:
    """The LeaderWorkerSet's live pods by group, each group's leader first."""
    groups: dict[int, list[PodRecord]] = {}
    for pod in sorted(gke.pods.values(), key=lambda p: (p.job_index, p.pod_index)):
        if pod.namespace == lws.namespace and pod.lws == lws.name and (pod.ended_at is None or pod.ended_at > now):
            groups.setdefault(pod.job_index, []).append(pod)
    return groups


def reconcile(gke: GkeState, now: float) -> None:
    """Bring every LeaderWorkerSet's groups up to `now`: a group from an old template or beyond the
    replicas goes, a missing one is placed where its slice is free, running groups' servers are watched."""
    for pod in [p for p in gke.pods.values() if p.lws and p.ended_at is not None and p.ended_at <= now]:
        end_pod(gke, pod, now, pod.message or "its node is gone")
    for lws in sets(gke):
        wanted, replicas = template_hash(_group_template(lws)), int(lws.manifest["spec"].get("replicas", 1))
        for group, pods in group_pods(gke, lws, now).items():
            if group >= replicas or any(p.template_hash != wanted for p in pods):
                for pod in pods:
                    end_pod(gke, pod, now, "the LeaderWorkerSet's group is replaced or scaled down")
        live = group_pods(gke, lws, now)
        for group in range(replicas):
            if group not in live and _new_group(gke, lws, group, wanted, now) is None:
                break
        for pods in group_pods(gke, lws, now).values():
            _watch_group(gke, lws, pods, now)


def _group_template(lws: KubeObject) -> KubeObject:
    """The object template_hash reads (`spec.template`): the group's templates."""
    return KubeObject(kind=LWS, name=lws.name, namespace=lws.namespace, uid="", create_time=0.0,
                      manifest={"spec": {"template": lws.manifest["spec"]["leaderWorkerTemplate"]}})


def _free(gke: GkeState, selector: dict, now: float, taken: set[str]) -> list[tuple[str, Any]]:
    return [(node, pool) for node, pool in gke.nodes(now) if node not in taken
            and all(pool.node_labels(node).get(k) == v for k, v in selector.items())]


def _placement(gke: GkeState, lws: KubeObject, now: float) -> list[str] | None:
    """The nodes of a new group, the leader's first: the workers on one pool's free nodes; None: no room."""
    size = int(lws.manifest["spec"]["leaderWorkerTemplate"].get("size", 1))
    taken = {p.node for p in gke.pods.values() if p.ended_at is None or p.ended_at > now}
    leaders = _free(gke, (template(lws, 0).get("spec") or {}).get("nodeSelector") or {}, now, taken)
    workers = _free(gke, (template(lws, 1).get("spec") or {}).get("nodeSelector") or {}, now, taken)
    for short in sorted({pool.short for _, pool in workers}):
        leader = next((n for n, p in leaders if p.short == short), leaders[0][0] if leaders else None)
        mine = [n for n, p in workers if p.short == short and n != leader]
        if leader is not None and len(mine) >= size - 1:
            return [leader, *mine[:size - 1]]
    if size == 1 and leaders:
        return [leaders[0][0]]
    return None


def _new_group(gke: GkeState, lws: KubeObject, group: int, wanted: str, now: float) -> list[PodRecord] | None:
    nodes = _placement(gke, lws, now)
    if nodes is None:
        return None
    pods = []
    for worker, node in enumerate(nodes):
        name = f"{lws.name}-{group}" + (f"-{worker}" if worker else "")
        pod = PodRecord(name=name, namespace=lws.namespace, jobset="", replicated_job="", job_index=group,
                        pod_index=worker, attempt=0, node=node, created_at=now, running_at=now + POD_STARTING_S,
                        lws=lws.name, template_hash=wanted)
        if gke.servers is None:
            pod.ready_at = pod.running_at + SERVER_READY_S
        gke.pods[f"{pod.namespace}/{pod.name}"] = pod
        gke.event(pod.namespace, "Pod", name, "Scheduled", f"Successfully assigned {pod.namespace}/{name} to {node}",
                  now)
        pods.append(pod)
    return pods


def _server(lws: KubeObject, pod: PodRecord) -> dict | None:
    containers = (template(lws, pod.pod_index).get("spec") or {}).get("containers") or []
    return next((c for c in containers if c.get("name") == SERVER_CONTAINER), None)


def _start(gke: GkeState, lws: KubeObject, pods: list[PodRecord], now: float) -> None:
    """The group's servers as local processes (the first DRY_RUN_PROCESSES of its server pods)."""
    playing = [p for p in pods if _server(lws, p) is not None][:DRY_RUN_PROCESSES]
    coordinator = f"127.0.0.1:{gke.servers.free_port()}"
    for index, pod in enumerate(playing):
        main = _server(lws, pod)
        env = {e["name"]: str(e.get("value", "")) for e in main.get("env") or [] if "value" in e}
        if len(playing) > 1:  # what the controller gives a group's pods; the coordinator on the loopback
            env.update(LWS_LEADER_ADDRESS="127.0.0.1", LWS_GROUP_SIZE=str(len(playing)),
                       LWS_WORKER_INDEX=str(index), JAX_COORDINATOR_ADDRESS=coordinator)
        pod.log_path = f"{gke.servers.dir}/{pod.namespace}.{pod.name}.log"
        gke.servers.start(server_key(pod), [*main.get("command", ()), *main.get("args", ())], env, pod.log_path)
        gke.event(pod.namespace, "Pod", pod.name, "Started", "Started container server", now)
    for pod in pods:
        pod.log_path = pod.log_path or ""  # started: the ones without a process are played as running


def _watch_group(gke: GkeState, lws: KubeObject, pods: list[PodRecord], now: float) -> None:
    """A group's servers: started together once every pod runs; the group Ready when its leader answers;
    a server that exits crashes its pod (CrashLoopBackOff) and stops the group's others."""
    servers = gke.servers
    if servers is None or any(now < p.running_at for p in pods) or any(p.restarts for p in pods):
        return
    if all(p.log_path is None for p in pods):
        _start(gke, lws, pods, now)
    for pod in [p for p in pods if p.log_path]:
        state = servers.state(server_key(pod))
        if state.phase in (Phase.FAILED, Phase.STOPPED):
            pod.restarts, pod.exit_code, pod.reason = 1, 1, CRASH_REASON
            pod.message = state.last_words or "the server exited"
            for other in pods:
                other.ready_at = None
                servers.stop(server_key(other))
            gke.event(pod.namespace, "Pod", pod.name, "BackOff", "Back-off restarting failed container server in "
                                                                 f"pod {pod.name}", now, "Warning")
            return
    leader = servers.state(server_key(pods[0])) if pods[0].log_path else None
    if (leader is None or leader.phase == Phase.READY) and pods[0].ready_at is None:
        for pod in pods:
            pod.ready_at = now


def delete(gke: GkeState, lws: KubeObject, now: float) -> None:
    for pod in [p for p in gke.pods.values() if p.namespace == lws.namespace and p.lws == lws.name]:
        end_pod(gke, pod, now, "the LeaderWorkerSet was deleted")


def status(gke: GkeState, lws: KubeObject, now: float) -> dict:
    """replicas, readyReplicas (groups whose every pod is Ready), the leaders' selector for an HPA."""
    groups = group_pods(gke, lws, now)
    size = int(lws.manifest["spec"]["leaderWorkerTemplate"].get("size", 1))
    ready_groups = sum(1 for pods in groups.values() if len(pods) == size and all(ready(p, now) for p in pods))
    wanted = int(lws.manifest["spec"].get("replicas", 1))
    return {"replicas": len(groups), "readyReplicas": ready_groups, "updatedReplicas": len(groups),
            "hpaPodSelector": f"{NAME_LABEL}={lws.name},{WORKER_LABEL}=0",
            "conditions": [{"type": "Available", "status": "True" if ready_groups >= wanted else "False",
                            "reason": "AllGroupsReady" if ready_groups >= wanted else "GroupsNotReady",
                            "message": f"{ready_groups}/{wanted} groups ready",
                            "lastTransitionTime": iso(lws.create_time)}]}


def pod_labels(gke: GkeState, pod: PodRecord) -> dict[str, str] | None:
    """The labels a LeaderWorkerSet's pod carries (its template's and the controller's); None: not one."""
    lws = gke.objects.get(f"{LWS}/{pod.namespace}/{pod.lws}") if pod.lws else None
    if lws is None:
        return None
    labels = (template(lws, pod.pod_index).get("metadata") or {}).get("labels") or {}
    return {**labels, NAME_LABEL: lws.name, GROUP_LABEL: str(pod.job_index), WORKER_LABEL: str(pod.pod_index)}

