"""The emulated GKE world, a layer over the shared world (world.py, which holds it as GKE's part) and over
GKE's records (gke_state.py): a small JobSet controller, and every controller of the cluster reconciled
together (the Deployment's, gke_serving.py; the LeaderWorkerSet's, gke_lws.py). No gRPC, no HTTP.

Kubernetes objects change with the controllers: `reconcile(now)` brings pods and JobSets up to `now`
(pods start once their nodes exist, InOrder startup, a failed job restarts the JobSet under its
failure policy or fails it, the success policy completes it) and runs at the start of every
Kubernetes request and every look of a dry run's local trainer. The Pathways runtime itself is not
emulated: its containers are pods that run until the JobSet ends.
"""

from __future__ import annotations

from provision.emulator import gke_lws, gke_serving
from provision.emulator.gke import (
    ALL_JOBS_COMPLETED,
    NODE_RECREATE_S,
    POD_RUN_S,
    POD_STARTING_S,
    PREEMPTED_MESSAGE,
    PREEMPTED_REASON,
    REACHED_MAX_RESTARTS,
    JobSetRecord,
    PodRecord,
    TrainerPod,
    tpu_accelerator,
)
from provision.emulator.gke_state import GkeState
from provision.emulator.world import World, register_part


@register_part
class GkeWorld(GkeState):
    """Everything GKE in the emulated world (its part, saved under "gke"): its records (GkeState), the JobSet
    controller, and the Deployment's and LeaderWorkerSet's controllers reconciled with it; changed only
    inside an Emulator transaction."""

    KEY = "gke"

    @classmethod
    def of(cls, world: World) -> GkeWorld:
        return world.part(cls.KEY)

    def preempt_node(self, node: str, now: float) -> bool:
        """Reclaim a spot node now: it is gone for NODE_RECREATE_S; the pods on it fail."""
        for pool in self.pools.values():
            if node in pool.node_names() and pool.node_up(node, now):
                pool.preempted[node] = now
                for pod in self.pods.values():
                    if pod.node == node and pod.ended_at is None:
                        self._end_pod(pod, now, 143, PREEMPTED_REASON, PREEMPTED_MESSAGE)
                self.event("default", "Node", node, "Preempted",
                           "The node was reclaimed by Compute Engine (spot VM preemption)", now, "Warning")
                return True
        return False

    # --- the JobSet controller --------------------------------------------------------------
    def reconcile(self, now: float) -> None:
        for jobset in list(self.jobsets.values()):
            if jobset.terminal is None:
                self._reconcile(jobset, now)
        gke_serving.reconcile(self, now)
        gke_lws.reconcile(self, now)

    def _pods_of(self, jobset: JobSetRecord, attempt: int | None = None) -> list[PodRecord]:
        return [p for p in self.pods.values() if p.namespace == jobset.namespace and p.jobset == jobset.name
                and (attempt is None or p.attempt == attempt)]

    def _reconcile(self, jobset: JobSetRecord, now: float) -> None:
        self._start_pods(jobset, now)
        failed = self._failed_job(jobset)
        if failed is not None:
            at, pod = failed
            if jobset.restarts < jobset.max_restarts():
                self._restart(jobset, at, pod)
                self._start_pods(jobset, now)
            else:
                self._finish(jobset, at, "Failed", *REACHED_MAX_RESTARTS)
            return
        done = self._succeeded_at(jobset)
        if done is not None and done <= now:
            self._finish(jobset, done, "Completed", *ALL_JOBS_COMPLETED)

    def _start_pods(self, jobset: JobSetRecord, now: float) -> None:
        """Make the pods of each replicated job that has none yet, once its nodes exist (InOrder: once
        the jobs before it are running)."""
        ready_after = jobset.attempt_start
        taken = {p.node for p in self.pods.values() if p.ended_at is None or p.ended_at > now}
        for job in jobset.jobs():
            pods = [p for p in self._pods_of(jobset, jobset.restarts) if p.replicated_job == job["name"]]
            spec = job["template"]["spec"]
            count, replicas = int(spec.get("completions", 1)), int(job.get("replicas", 1))
            if not pods:
                placed = self._place(jobset, job, replicas, count, taken, now)
                if placed is None:
                    return  # InOrder or not, nothing later starts before this job's nodes exist
                for job_index, pod_index, node in placed:
                    start = max(ready_after, jobset.attempt_start, self._node_ready_at(node))
                    self._new_pod(jobset, job, job_index, pod_index, node, start, now)
                    taken.add(node)
                pods = [p for p in self._pods_of(jobset, jobset.restarts) if p.replicated_job == job["name"]]
            else:
                self._replace_failed(jobset, job, pods, taken, now)
            if jobset.in_order():
                if any(p.phase(now) == "Pending" for p in pods):
                    return
                ready_after = max([ready_after] + [p.running_at for p in pods])

    def _place(self, jobset, job, replicas: int, count: int, taken: set[str], now: float):
        """(job index, pod index, node) for every pod of a replicated job, each job on its own node
        pool when it asks for exclusive placement by pool; None when the nodes are not there."""
        pod_spec = job["template"]["spec"]["template"]["spec"]
        selector = pod_spec.get("nodeSelector", {})
        by_pool: dict[str, list[str]] = {}
        for node, pool in self.nodes(now):
            labels = pool.node_labels(node)
            if node not in taken and all(labels.get(k) == v for k, v in selector.items()):
                by_pool.setdefault(pool.short, []).append(node)
        annotations = {**job["template"].get("metadata", {}).get("annotations", {}),
                       **job["template"]["spec"]["template"].get("metadata", {}).get("annotations", {})}
        exclusive = annotations.get("alpha.jobset.sigs.k8s.io/exclusive-topology")
        placed = []
        if exclusive == "cloud.google.com/gke-nodepool":
            pools = [nodes for _, nodes in sorted(by_pool.items()) if len(nodes) >= count]
            if len(pools) < replicas:
                return None
            for job_index in range(replicas):
                placed += [(job_index, i, pools[job_index][i]) for i in range(count)]
            return placed
        free = [n for _, nodes in sorted(by_pool.items()) for n in nodes]
        if len(free) < replicas * count:
            return None
        return [(j, i, free[j * count + i]) for j in range(replicas) for i in range(count)]

    def _node_ready_at(self, node: str) -> float:
        for pool in self.pools.values():
            if node in pool.node_names():
                back = pool.preempted.get(node)
                return max(pool.ready_at, back + NODE_RECREATE_S if back is not None else 0.0)
        return 0.0

    def _new_pod(self, jobset: JobSetRecord, job: dict, job_index: int, pod_index: int, node: str,
                 created: float, now: float) -> PodRecord:
        name = f"{jobset.name}-{job['name']}-{job_index}-{pod_index}-{self.token()[:5]}"
        containers = job["template"]["spec"]["template"]["spec"].get("containers", [])
        is_trainer = any(c.get("name") == "trainer" for c in containers) and job_index == 0 and pod_index == 0
        pod = PodRecord(name=name, namespace=jobset.namespace, jobset=jobset.name, replicated_job=job["name"],
                        job_index=job_index, pod_index=pod_index, attempt=jobset.restarts, node=node,
                        created_at=created, running_at=created + POD_STARTING_S, trainer=is_trainer)
        multi_controller = not jobset.manifest.get("spec", {}).get("successPolicy")
        if not self.held and (is_trainer or multi_controller):  # nothing drives it: it runs, then succeeds
            pod.ended_at, pod.exit_code, pod.reason = pod.running_at + POD_RUN_S, 0, "Completed"
        self.pods[f"{pod.namespace}/{pod.name}"] = pod
        self.event(pod.namespace, "Pod", name, "Scheduled",
                   f"Successfully assigned {pod.namespace}/{name} to {node}", created)
        return pod

    def _replace_failed(self, jobset, job, pods: list[PodRecord], taken: set[str], now: float) -> None:
        """restartPolicy OnFailure: a pod that failed (its node gone) is replaced, within backoffLimit,
        on the same node once it is back."""
        spec = job["template"]["spec"]
        if spec["template"]["spec"].get("restartPolicy") != "OnFailure":
            return
        up = {node for node, _ in self.nodes(now)}
        latest: dict[tuple[int, int], PodRecord] = {}
        for pod in sorted(pods, key=lambda p: p.created_at):
            latest[(pod.job_index, pod.pod_index)] = pod
        for (job_index, pod_index), pod in latest.items():
            failures = sum(1 for p in pods if p.job_index == job_index and p.phase(now) == "Failed")
            if pod.phase(now) == "Failed" and failures <= int(spec.get("backoffLimit", 6)) and pod.node in up:
                self._new_pod(jobset, job, job_index, pod_index, pod.node, now, now)

    def _failed_job(self, jobset: JobSetRecord) -> tuple[float, PodRecord] | None:
        """The earliest time a job of the current attempt failed (more failed pods than its backoffLimit)."""
        first: tuple[float, PodRecord] | None = None
        for job in jobset.jobs():
            limit = int(job["template"]["spec"].get("backoffLimit", 6))
            pods = [p for p in self._pods_of(jobset, jobset.restarts) if p.replicated_job == job["name"]
                    and p.ended_at is not None and p.exit_code != 0]
            for index in {p.job_index for p in pods}:
                failures = sorted((p for p in pods if p.job_index == index), key=lambda p: p.ended_at)
                if len(failures) > limit:
                    at = failures[limit].ended_at
                    if first is None or at < first[0]:
                        first = (at, failures[limit])
        return first

    def _succeeded_at(self, jobset: JobSetRecord) -> float | None:
        """When every pod of the success policy's jobs had succeeded, if they all have."""
        pods = [p for p in self._pods_of(jobset, jobset.restarts) if p.replicated_job in jobset.success_targets()]
        if not pods or any(p.exit_code != 0 or p.ended_at is None for p in pods):
            return None
        expected = sum(int(j.get("replicas", 1)) * int(j["template"]["spec"].get("completions", 1))
                       for j in jobset.jobs() if j["name"] in jobset.success_targets())
        return max(p.ended_at for p in pods) if len(pods) >= expected else None

    def _restart(self, jobset: JobSetRecord, at: float, pod: PodRecord) -> None:
        """failurePolicy restartStrategy Recreate: every job of the attempt goes, all start again."""
        for other in self._pods_of(jobset, jobset.restarts):
            if other.ended_at is None or other.ended_at > at:
                self._end_pod(other, at, 143, "Killed", "the JobSet is restarting its jobs")
        jobset.restarts += 1
        jobset.attempt_start = at
        self.event(jobset.namespace, "JobSet", jobset.name, "Restarting",
                   f"restarting jobset, attempt {jobset.restarts}", at, "Warning")

    def _finish(self, jobset: JobSetRecord, at: float, state: str, reason: str, message: str) -> None:
        jobset.terminal, jobset.terminal_at, jobset.reason, jobset.message = state, at, reason, message
        for pod in self._pods_of(jobset):
            if pod.ended_at is None or pod.ended_at > at:
                self._end_pod(pod, at, 143, "Killed", f"the JobSet is {state.lower()}")
        self.event(jobset.namespace, "JobSet", jobset.name, reason, message, at,
                   "Normal" if state == "Completed" else "Warning")

    def _end_pod(self, pod: PodRecord, at: float, code: int, reason: str, message: str) -> None:
        pod.ended_at, pod.exit_code, pod.reason, pod.message = at, code, reason, message

    # --- hooks for a dry run's local trainer -------------------------------------------------
    def trainer_pods(self, now: float) -> list[TrainerPod]:
        """Every trainer pod Running now, with its container as the JobSet gives it."""
        self.reconcile(now)
        found = []
        for pod in self.pods.values():
            if not pod.trainer or pod.phase(now) != "Running":
                continue
            jobset = self.jobsets.get(f"{pod.namespace}/{pod.jobset}")
            if jobset is None:
                continue
            job = next(j for j in jobset.jobs() if j["name"] == pod.replicated_job)
            container = next(c for c in job["template"]["spec"]["template"]["spec"]["containers"]
                             if c.get("name") == "trainer")
            env = {e["name"]: str(e.get("value", "")) for e in container.get("env", []) if "value" in e}
            found.append(TrainerPod(name=pod.name, namespace=pod.namespace, jobset=pod.jobset,
                                    run=jobset.manifest.get("metadata", {}).get("labels", {}).get("moe-tpu-run"),
                                    attempt=pod.attempt, command=tuple(container.get("command", ())),
                                    args=tuple(container.get("args", ())), env=env, node=pod.node))
        return sorted(found, key=lambda p: p.name)

    def end_trainer(self, namespace: str, name: str, code: int, now: float, message: str = "",
                    log_path: str | None = None) -> None:
        """The trainer in pod `name` exited with `code`: the pod ends; for a multi-controller JobSet
        (no Pathways head) every pod of its attempt ends with it, as one SPMD program."""
        pod = self.pods.get(f"{namespace}/{name}")
        if pod is None or pod.ended_at is not None and pod.ended_at <= now:
            return
        pod.log_path = log_path or pod.log_path
        reason = "Completed" if code == 0 else "Error"
        self._end_pod(pod, now, code, reason, message)
        jobset = self.jobsets.get(f"{namespace}/{pod.jobset}")
        if jobset is not None and not jobset.manifest.get("spec", {}).get("successPolicy"):
            for other in self._pods_of(jobset, pod.attempt):
                if other.ended_at is None and code == 0:
                    self._end_pod(other, now, 0, "Completed", "")
        self.reconcile(now)

    def preempt_trainer(self, namespace: str, name: str, code: int, now: float) -> None:
        """`preempt` under a trainer pod: a spot TPU node of its JobSet is reclaimed (the trainer's own
        node for multi-controller JAX; slice 0's first worker for Pathways, whose trainer then exits
        with `code` as it loses its workers)."""
        pod = self.pods.get(f"{namespace}/{name}")
        if pod is None:
            return
        tpu_pods = [p for p in self._pods_of(self.jobsets[f"{namespace}/{pod.jobset}"], pod.attempt)
                    if self._is_tpu_node(p.node) and p.ended_at is None]
        target = pod if self._is_tpu_node(pod.node) else min(tpu_pods, key=lambda p: (p.job_index, p.pod_index),
                                                             default=None)
        if target is not None:
            self.preempt_node(target.node, now)
        if pod.ended_at is None:
            self._end_pod(pod, now, code, "Error", f"the trainer exited with code {code} (its TPU workers "
                                                   "were lost to a spot preemption)")
        self.reconcile(now)

    def _is_tpu_node(self, node: str) -> bool:
        return any(node in p.node_names() and tpu_accelerator(p.request) is not None for p in self.pools.values())

    def set_log(self, namespace: str, name: str, path: str) -> None:
        pod = self.pods.get(f"{namespace}/{name}")
        if pod is not None:
            pod.log_path = path
