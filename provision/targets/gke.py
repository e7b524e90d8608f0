"""TPU v5e node pools on a GKE cluster with the run as a JobSet (`target: gke`).

The trainer reports through the status file in its output directory, as on Vertex AI; the JobSet
says the rest: a job that failed makes its failure policy recreate every job in place (the
`restarted` phase: the run loop records the preemption and follows on, no re-provisioning), a
JobSet out of restarts or complete ends the run.
"""

from __future__ import annotations

from provision import catalogue, gke_render
from provision.cloud import storage
from provision.resources import Resource
from provision.targets.base import ENDED, Holding, Report, last_zone_first, report_from_status


class GkeTarget(Holding):
    """TPU v5e node pools on a GKE cluster, the trainer as a JobSet (multi-controller JAX or Pathways)."""

    kind = "gke"

    def __init__(self, context, *, output_dir: str | None = None) -> None:
        super().__init__(context, output_dir=output_dir)
        cfg = context.config
        self.zone: str | None = None
        self.restarts_seen = 0
        acc = cfg.accelerator_type()
        self.chips = acc.chips * cfg.slice.count

    def describe(self) -> str:
        return (f"{self.cfg.slice.count} x {self.cfg.slice.accelerator} ({self.cfg.slice.capacity}) on GKE "
                f"{self.cfg.gke.cluster}, {self.cfg.gke.runtime}")

    def price(self) -> float:
        return self.chips * catalogue.price_per_chip_hour(self.cfg.slice.capacity)

    def provision(self, attempt: int = 0) -> list[Resource]:
        """Node pools (the zone it last ran in first), then the JobSet; waits until the trainer's pod runs."""
        from provision.gke import gke_up, submit_jobset

        zones = last_zone_first(self.cfg.zones, self.zone)
        resources = gke_up(self.context, zones)
        pools = [r for r in resources if r.kind == "node_pool" and r.chips]
        self.zone = pools[0].zone if pools else self.zone
        jobset = submit_jobset(self.context)
        self.restarts_seen = int((jobset.get("status") or {}).get("restarts", 0))
        from provision.gke import _jobset_resource

        return [_jobset_resource(jobset, self.cfg), *resources]

    def _kube(self):
        from provision.gke import cluster_of

        cluster = cluster_of(self.cfg, self.session)
        return self.session.kube(cluster) if cluster is not None and cluster.endpoint else None

    def _status(self) -> dict | None:
        return self.session.storage.read_json(storage.join(self.output_dir, "status.json"))

    def _why(self, kube, jobset: dict, attempt: int) -> str:
        """The JobSet's latest word (its Restarting or terminal event, else its condition) and the
        pods of `attempt` that failed, with their reasons."""
        name = jobset["metadata"]["name"]
        events = [e for e in kube.list_events(self.cfg.gke.namespace, name) if e.reason not in ("Created", "Deleted")]
        conditions = (jobset.get("status") or {}).get("conditions") or []
        said = events[-1].message if events else (conditions[-1].get("message", "") if conditions else "")
        selector = f"jobset.sigs.k8s.io/jobset-name={name},jobset.sigs.k8s.io/restart-attempt={attempt}"
        failed = [p for p in kube.list_pods(self.cfg.gke.namespace, selector)
                  if p.status.phase == "Failed" and p.status.reason not in (None, "Killed")]
        pods = "; ".join(f"pod {p.metadata.name}: {p.status.reason}: {p.status.message}" for p in failed[:2])
        return f"{said} ({pods})" if pods else said

    def report(self) -> Report:
        kube = self._kube()
        jobset = kube.get_jobset(self.cfg.gke.namespace, gke_render.jobset_name(self.cfg)) if kube else None
        if jobset is None:
            return Report("failed", detail="the JobSet is gone")
        status = jobset.get("status") or {}
        restarts = int(status.get("restarts", 0))
        status_file = self._status()
        trainer = report_from_status(status_file) if status_file else Report("starting")
        if restarts > self.restarts_seen:
            self.restarts_seen = restarts
            return Report(**{**trainer.__dict__, "phase": "restarted",
                             "detail": self._why(kube, jobset, restarts - 1)})
        terminal = status.get("terminalState")
        if terminal == "Completed":
            return Report(**{**trainer.__dict__, "phase": "finished"})
        if terminal == "Failed":
            phase = "preempted" if trainer.phase == "preempted" else "failed"
            detail = self._why(kube, jobset, restarts) + (f"; trainer: {trainer.detail}" if trainer.detail else "")
            return Report(**{**trainer.__dict__, "phase": phase, "detail": detail})
        if trainer.phase in ENDED or trainer.phase == "preempted":
            return Report("starting")  # a status left by the attempt before a restart: the JobSet decides
        return trainer

    def teardown(self) -> list[Resource]:
        from provision.gke import gke_down

        return gke_down(self.context)

    def left(self) -> list[Resource]:
        from provision.gke import gke_status

        return gke_status(self.context)
