"""TPU v5e node pools on a GKE cluster (the placement) with the run as a JobSet (`target: gke`), or its
checkpoint served by a Deployment on a serving node pool (`deploy` with a serve section).

The trainer reports through the status file in its output directory, as on Vertex AI; the JobSet
says the rest: a job that failed makes its failure policy recreate every job in place (the
`restarted` phase: the run loop records the preemption and follows on, no re-provisioning), a
JobSet out of restarts or complete ends the run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from provision import catalogue
from provision.cloud import storage
from provision.core import (
    ENDED,
    STATUS_FILE,
    Deployment,
    Flag,
    Holding,
    Kind,
    Phase,
    Report,
    Scope,
    ServiceReport,
    Verb,
    last_zone_first,
    report_from_status,
)
from provision.errors import CloudError, UsageError
from provision.kinds.common import startup_estimate_s  # one load-and-compile estimate for every kind
from provision.kinds.gke import gke, gke_lws, gke_lws_render, gke_render, gke_serve, gke_serve_render
from provision.kinds.gke.gke_sections import GkeSections
from provision.rendering import PROJECT_PLACEHOLDER, server_context, trainer_context
from provision.resources import Resource


class NodePools(Holding):
    """The training placement: the run's TPU v5e node pools (and a Pathways head's CPU pool) on a GKE
    cluster, made with the cluster when gke.create_cluster says so. Its teardown deletes those pools, and
    the cluster only when this tool made it and no pool of any run is left on it (a service's pool of
    the same run keeps it)."""

    kind = "gke"

    def __init__(self, context) -> None:
        super().__init__(context)
        cfg = context.config
        self.zone: str | None = None
        self.chips = cfg.accelerator_type().chips * cfg.slice.count

    def describe(self) -> str:
        return (f"{self.cfg.slice.count} x {self.cfg.slice.accelerator} ({self.cfg.slice.capacity}) on GKE "
                f"{self.cfg.gke.cluster}, {self.cfg.gke.runtime}")

    def price(self) -> float:
        return self.chips * catalogue.price_per_chip_hour(self.cfg.slice.capacity)

    def provision(self, attempt: int = 0) -> list[Resource]:
        """The cluster and the node pools, the zone they last ran in first; waits until they run."""
        resources = gke.gke_up(self.context, last_zone_first(self.cfg.zones, self.zone))
        pools = [r for r in resources if r.kind == "node_pool" and r.chips]
        self.zone = pools[0].zone if pools else self.zone
        return resources

    def teardown(self) -> list[Resource]:
        return gke.pools_down(self.context, set(gke_render.pool_ids(self.cfg.run, self.cfg.gke, self.cfg.slice)))

    def left(self) -> list[Resource]:
        return gke.pools_left(self.context, set(gke_render.pool_ids(self.cfg.run, self.cfg.gke, self.cfg.slice)))


def _kube(holding: Holding):
    """The Kubernetes API of the run's cluster, or None while it has none (gone, or not yet running)."""
    cluster = gke.cluster_of(holding.cfg, holding.session)
    return holding.session.kube(cluster) if cluster is not None and cluster.endpoint else None


class JobSet(Holding):
    """The training workload: the trainer as a JobSet (multi-controller JAX or Pathways), which reports
    through the status file in its output directory."""

    def __init__(self, context, *, output_dir: str | None = None) -> None:
        super().__init__(context, output_dir=output_dir)
        self.restarts_seen = 0

    def start(self) -> list[Resource]:
        """The JobSet (or the one this run submitted and that still runs)."""
        jobset = gke.submit_jobset(self.context)
        self.restarts_seen = int((jobset.get("status") or {}).get("restarts", 0))
        return [gke.jobset_resource(jobset, self.cfg)]

    def teardown(self) -> list[Resource]:
        """The JobSet and its pods; nothing else of the run."""
        found = self.left()
        return found if gke.delete_jobset(self.context) else []

    def left(self) -> list[Resource]:
        kube = _kube(self)
        jobset = kube.get_jobset(self.cfg.gke.namespace, gke_render.jobset_name(self.cfg.run)) if kube else None
        return [gke.jobset_resource(jobset, self.cfg)] if jobset is not None else []

    def _status(self) -> dict | None:
        return self.session.storage.read_json(storage.join(self.output_dir, STATUS_FILE))

    def _why(self, kube, jobset: dict, attempt: int) -> str:
        """The JobSet's latest word (its Restarting or terminal event, else its condition) and the
        pods of `attempt` that failed, with their reasons."""
        name = jobset["metadata"]["name"]
        events = [e for e in kube.list_events(self.cfg.gke.namespace, name) if e.reason not in ("Created", "Deleted")]
        conditions = (jobset.get("status") or {}).get("conditions") or []
        said = events[-1].message if events else (conditions[-1].get("message", "") if conditions else "")
        selector = f"jobset.sigs.k8s.io/jobset-name={name},jobset.sigs.k8s.io/restart-attempt={attempt}"
        failed = [p for p in kube.list_pods(self.cfg.gke.namespace, selector)
                  if p.status.phase == Phase.FAILED and p.status.reason not in (None, "Killed")]
        pods = "; ".join(f"pod {p.metadata.name}: {p.status.reason}: {p.status.message}" for p in failed[:2])
        return f"{said} ({pods})" if pods else said

    def report(self) -> Report:
        kube = _kube(self)
        jobset = kube.get_jobset(self.cfg.gke.namespace, gke_render.jobset_name(self.cfg.run)) if kube else None
        if jobset is None:
            return Report(Phase.FAILED, detail="the JobSet is gone")
        status = jobset.get("status") or {}
        restarts = int(status.get("restarts", 0))
        status_file = self._status()
        trainer = report_from_status(status_file) if status_file else Report(Phase.STARTING)
        if restarts > self.restarts_seen:
            self.restarts_seen = restarts
            return Report(**{**trainer.__dict__, "phase": Phase.RESTARTED,
                             "detail": self._why(kube, jobset, restarts - 1)})
        terminal = status.get("terminalState")
        if terminal == "Completed":
            return Report(**{**trainer.__dict__, "phase": Phase.FINISHED})
        if terminal == "Failed":
            phase = Phase.PREEMPTED if trainer.phase == Phase.PREEMPTED else Phase.FAILED
            detail = self._why(kube, jobset, restarts) + (f"; trainer: {trainer.detail}" if trainer.detail else "")
            return Report(**{**trainer.__dict__, "phase": phase, "detail": detail})
        if trainer.phase in ENDED or trainer.phase == Phase.PREEMPTED:
            return Report(Phase.STARTING)  # a status left by the attempt before a restart: the JobSet decides
        return trainer


class ServingPool(Holding):
    """The serving placement: the run's serving node pool (the serve section's single-host machines) on
    the cluster, made with the cluster when gke.create_cluster says so. Its teardown deletes that pool,
    and the cluster only when this tool made it and no pool of any run is left (the run's training pools
    keep it)."""

    kind = "gke"

    def __init__(self, context) -> None:
        super().__init__(context)
        serve = self.cfg.serve
        self.zone: str | None = None
        self.group = gke_lws_render.multi_host(self.cfg.serve)  # a replica over several hosts: a slice per group
        self.chips = gke_lws_render.chips(serve) if self.group else \
            gke_serve_render.serving_accelerator(serve).chips * serve.min_replicas

    def describe(self) -> str:
        serve = self.cfg.serve
        if self.group:
            return (f"{serve.min_replicas}-{serve.max_replicas} group(s) x {serve.replica_topology} of "
                    f"{serve.machine_type} (a LeaderWorkerSet{', spot' if serve.spot else ''}) serving on GKE "
                    f"{self.cfg.gke.cluster}")
        return (f"{serve.min_replicas}-{serve.max_replicas} x {serve.machine_type} ({serve.replica_topology}"
                f"{', spot' if serve.spot else ''}) serving on GKE {self.cfg.gke.cluster}")

    def price(self) -> float:
        return self.chips * catalogue.price_per_chip_hour("spot" if self.cfg.serve.spot else "on-demand")

    def provision(self, attempt: int = 0) -> list[Resource]:
        """The cluster (made only with gke.create_cluster), then the serving pool, RUNNING."""
        gke.ensure_cluster(self.context)
        zones = last_zone_first(self.cfg.zones, self.zone)
        pools = gke_lws.group_pools_up(self.context, zones) if self.group else \
            [gke.serving_pool_up(self.context, zones)]
        self.zone = pools[0].zone
        return pools

    def _pool_ids(self) -> set[str]:
        return set(gke_lws_render.group_pool_ids(self.cfg.run, self.cfg.gke, self.cfg.serve)) if self.group else \
            {gke_serve_render.serving_pool_id(self.cfg.run)}

    def teardown(self) -> list[Resource]:
        return gke.pools_down(self.context, self._pool_ids())

    def left(self) -> list[Resource]:
        return gke.pools_left(self.context, self._pool_ids())


class Server(Holding):
    """The serving workload: the run's server as a Deployment (one pod per single-host replica) behind a
    Service, scraped by a PodMonitoring and scaled by an HPA; ready once a replica answers /health,
    reached through the Service by the API server's proxy."""

    def start(self) -> list[Resource]:
        """The four objects, applied (a re-run adopts and replaces what this run made before)."""
        cluster = gke.cluster_of(self.cfg, self.session)
        kube = self.session.kube(cluster)
        cfg, serving = self.cfg, server_context(self.cfg, self.context.image)
        if gke_lws_render.multi_host(cfg.serve):  # a LeaderWorkerSet: its controller must be there
            gke_lws.require_controller(cfg, kube)
            manifests = gke_lws_render.manifests(cfg.gke, cfg.serve, serving, self.context.renderer,
                                                 startup_estimate_s(cfg))
        else:
            manifests = gke_serve_render.manifests(cfg.gke, cfg.serve, serving, self.context.renderer,
                                                   startup_estimate_s(cfg))
        return gke_serve.apply_objects(self.context, kube, manifests)

    def teardown(self) -> list[Resource]:
        """The serving objects; nothing else of the run."""
        kube = _kube(self)
        return gke_serve.delete_objects(self.context, kube, self.cfg.run) if kube is not None else []

    def left(self) -> list[Resource]:
        kube = _kube(self)
        return gke_serve.managed_objects(kube, self.cfg, self.cfg.run) if kube is not None else []

    def report(self) -> ServiceReport:
        cluster = gke.cluster_of(self.cfg, self.session)
        if cluster is None or not cluster.endpoint:
            return ServiceReport(Phase.DELETED, detail=f"the cluster {self.cfg.gke.cluster} is gone")
        url = f"https://{cluster.endpoint}{gke_serve_render.proxy_path(self.cfg.gke, self.cfg.run, '')}"
        replicas = (gke_lws.group_replicas if gke_lws_render.multi_host(self.cfg.serve)
                    else gke_serve.deployment_replicas)(self.cfg)
        return gke_serve.service_report(self.cfg, self.session.kube(cluster), url, replicas)

    def examples(self, url: str, body: str) -> list[str]:
        """How to call it: the Service forwarded to this machine, or through the API server's proxy."""
        name, namespace = gke_serve_render.server_name(self.cfg.run), self.cfg.gke.namespace
        port = gke_serve_render.SERVICE_PORT
        return [f"  kubectl -n {namespace} port-forward service/{name} {port}:{port} &",
                f"  curl -X POST http://127.0.0.1:{port}/v1/completions -H 'content-type: application/json' "
                f"-d '{body}'",
                f"  curl -X POST {url}/v1/completions -H \"authorization: Bearer $(gcloud auth print-access-token)\" "
                f"-H 'content-type: application/json' -d '{body}'"]

    def predict(self, request: dict, stream: bool = False) -> Iterator[dict]:
        """Through the Service; with nothing deployed (no cluster, no Service) a UsageError, as Vertex AI's
        endpoint without a model: the user's to deploy, not a failure of the platform."""
        kube = _kube(self)
        if kube is None:
            raise self._nothing_deployed(f"the cluster {self.cfg.gke.cluster} is gone")
        try:
            yield from gke_serve.predict(self.cfg, kube, request, stream)
        except CloudError:  # the proxy's refusal: looked into only then, so a request costs no call more
            name = gke_serve_render.server_name(self.cfg.run)
            if kube.get_object("Service", self.cfg.gke.namespace, name) is None:
                raise self._nothing_deployed(f"there is no Service {self.cfg.gke.namespace}/{name}") from None
            raise

    def _nothing_deployed(self, why: str) -> UsageError:
        return UsageError(f"run {self.cfg.run} has nothing deployed on GKE cluster {self.cfg.gke.cluster}: {why}",
                          hint=f"deploy it first: `moe-tpu deploy -c {self.cfg.source}`")


class GkeKind(Kind):
    """`target: gke`: the slice and gke sections, rendered as node pools (and a cluster) and a JobSet."""

    name = "gke"
    noun = "GKE node pools"
    group = "gke"
    group_help = """GKE node pools for target: gke (and the cluster, with gke.create_cluster: true).

    \b
    Examples:
      moe-tpu gke up -c examples/gke-pathways.yaml
      moe-tpu gke status -c examples/gke-pathways.yaml
      moe-tpu gke down -c examples/gke-pathways.yaml
      moe-tpu --dry-run --scenario stockout gke up -c examples/gke-pathways.yaml
    """
    verbs = (
        Verb("up", "up", "Create the node pools (one per slice, and RUN-cpu for a Pathways head) and wait until "
                         "they run.\n\nTries each zone of `zones:` in order when one has no capacity. A re-run "
                         "adopts the pools it already made; a pool of the run that no longer matches the config "
                         "is refused.", trainer=True),
        Verb("status", "status", "Show the run's JobSet, node pools and (when this tool made it) cluster, with state "
                                 "and cost."),
        Verb("down", "down", "Delete the run's JobSet and node pools, and the cluster only when this tool created it "
                             "(and no node pool a user added is on it, unless --delete-user-pools).",
             flags=(Flag("delete-user-pools", "Delete the cluster this tool created with the node pools a user added "
                                              "on it."),)),
    )
    up_command = "gke up"
    sections = GkeSections
    serve_platform = "GKE TPU node pool"
    serves_multi_host = True  # a LeaderWorkerSet (gke_lws_render)
    serve_price_basis = ("the catalogue's Cloud TPU v5e chip-hour price, which GKE's TPU nodes are billed at (the "
                         "cluster's own fee aside)")

    def summary(self, cfg) -> str:
        acc = cfg.accelerator_type()
        line = (f"GKE cluster {cfg.gke.cluster} ({cfg.gke.location}), runtime {cfg.gke.runtime}: "
                f"{cfg.slice.count} x {acc.name} ({acc.topology}, {acc.vms} VM{'' if acc.vms == 1 else 's'}) as "
                f"node pools, {cfg.slice.capacity}, zones {', '.join(cfg.zones)}")
        if cfg.serve is not None:
            serve = cfg.serve
            what = "a LeaderWorkerSet (a group of pods per replica)" if gke_lws_render.multi_host(serve) else \
                "a Deployment"
            checkpoint = gke_serve_render.checkpoint(serve, cfg.trainer.output_dir)
            line += (f"; serves {checkpoint} as {what} on {serve.min_replicas}-"
                     f"{serve.max_replicas} x {serve.machine_type} ({serve.replica_topology}"
                     f"{', spot' if serve.spot else ''})")
        return line

    def render(self, cfg, renderer) -> dict[str, str]:
        training = trainer_context(cfg, renderer.image, PROJECT_PLACEHOLDER)
        files = gke_render.render_files(cfg.gke, cfg.slice, training, renderer)
        if cfg.serve is not None:
            serving = server_context(cfg, renderer.image, PROJECT_PLACEHOLDER)
            group = gke_lws_render.multi_host(cfg.serve)
            render_serving = gke_lws_render.group_files if group else gke_serve_render.serving_files
            files.update(render_serving(cfg.gke, cfg.serve, cfg.slice, serving, renderer, startup_estimate_s(cfg)))
        return files

    def hardware(self, cfg):
        return cfg.accelerator_type(), cfg.slice.count, cfg.slice.capacity

    def target(self, context, *, output_dir: str | None = None) -> Deployment:
        return Deployment(NodePools(context), JobSet(context, output_dir=output_dir))

    def service(self, context) -> Deployment:
        if context.config.serve is None:
            raise UsageError(f"{context.config.source}: serve: a GKE Deployment needs a serve section (at least "
                             "its machine_type)", hint="see examples/serve-gke.yaml")
        return Deployment(ServingPool(context), Server(context))

    def up_line(self, cfg) -> str:
        acc = cfg.accelerator_type()
        return (f"run {cfg.run}, cluster {cfg.gke.cluster} ({cfg.gke.location}), {cfg.slice.count} x "
                f"{acc.name} ({acc.topology}, {acc.vms} VMs), {cfg.slice.capacity}, runtime {cfg.gke.runtime}")

    def up(self, context) -> list[Resource]:
        return gke.gke_up(context)

    def status(self, context) -> list[Resource]:
        return gke.gke_status(context)

    def managed(self, session, scope: Scope) -> list[Resource]:
        cfg = scope.config.as_kind(self) if scope.config is not None else None
        if cfg is None or cfg.gke is None:  # a cluster is found through a config's gke section only
            return []
        return gke.managed_gke(cfg, session, run=scope.run, project=scope.project)

    def where(self, cfg) -> str | None:
        section = cfg.section("gke")  # the file's gke section, whatever the config's target
        return f"GKE cluster {section.cluster}" if section is not None else None

    def teardown(self, context) -> list[Resource]:
        cfg = context.config.as_kind(self)  # the file's gke section, whatever the config's target
        if cfg.gke is None:
            return []
        return gke.gke_down(context if cfg is context.config else dataclasses.replace(context, config=cfg))

    def log_source(self, context):
        return lambda: gke.trainer_log(context.config, context.session)


KIND = GkeKind()
