"""A service on GKE over several hosts per replica, the lifecycle half of gke_lws_render: the serve
section's rules for it, the groups' node pools (a whole multi-host slice each), the LeaderWorkerSet
controller required on the cluster, and the LeaderWorkerSet's state as a ServiceReport.

Applying, listing and deleting the objects is gke_serve's (its kinds include the LeaderWorkerSet);
the prediction goes through the leader's Service as the single-host one does.
"""

from __future__ import annotations

from provision.core import Phase, ServiceReport
from provision.errors import CloudError, StockoutError
from provision.kinds.gke import gke, gke_lws_render, gke_render, gke_serve, gke_serve_render
from provision.rendering import trainer_context
from provision.resources import is_managed, project_of


def group_pools_up(context, zones: list[str]) -> list:
    """The groups' node pools (and a Pathways head's CPU pool), RUNNING, all in the first zone with
    capacity for every one of them (a zone without loses the ones made there before the next)."""
    cfg, session, console = context.config, context.session, context.console
    project = project_of(cfg, session)
    path = gke_render.cluster_path(cfg.gke, project)
    names = gke_lws_render.group_pool_ids(cfg.run, cfg.gke, cfg.serve)
    training = trainer_context(cfg, context.image)  # the labels every pool carries
    tried: list[str] = []
    for zone in zones:
        existing = {p.name: p for p in session.container.list_node_pools(path)}
        if any(n in existing and existing[n].locations and existing[n].locations[0] != zone for n in names):
            continue  # the pools are in another zone already: that zone comes first
        try:
            for spec in gke_lws_render.group_pool_specs(cfg.gke, cfg.serve, cfg.slice, training, zone):
                gke._pool_in_zone(context, project, spec, existing)
        except StockoutError as exc:
            tried.append(f"{zone} ({exc.message})")
            console.warn(f"no capacity in {zone}: {exc.message}")
            for name in names:
                pool = session.container.get_node_pool(f"{path}/nodePools/{name}")
                if pool is not None and is_managed(gke._labels(pool), cfg.run):
                    gke._delete_pool(context, project, f"{path}/nodePools/{name}")
            continue
        return [gke._pool_resource(p, cfg.gke.location, path) for p in session.container.list_node_pools(path)
                if p.name in names]
    raise StockoutError(f"no capacity for the serving groups' node pools ({cfg.serve.max_replicas} x "
                        f"{cfg.serve.replica_topology} of {cfg.serve.machine_type}) in any zone tried: "
                        f"{'; '.join(tried)}", hint="add zones to `zones:`, or try again later")


def require_controller(cfg, kube) -> None:
    """A CloudError naming how to install the LeaderWorkerSet controller where the cluster lacks its CRD."""
    if not kube.serves(gke_lws_render.LWS_KIND, cfg.gke.namespace):
        raise CloudError(f"the cluster {cfg.gke.cluster} has no LeaderWorkerSet controller (the API has no "
                         f"{gke_lws_render.LWS_API_VERSION} leaderworkersets): serving over "
                         f"{cfg.serve.replica_topology} needs it",
                         hint=f"install it once per cluster: {gke_lws_render.LWS_INSTALL}")


def service_report(cfg, kube, url: str) -> ServiceReport:
    """The LeaderWorkerSet's state: ready once a group is (its leader answers /health); failed when a pod
    of a group crashed (its last words) or the object is gone; starting otherwise."""
    name = gke_serve_render.server_name(cfg.run)
    lws = kube.get_object(gke_lws_render.LWS_KIND, cfg.gke.namespace, name)
    if lws is None:
        return ServiceReport(Phase.DELETED, detail=f"the LeaderWorkerSet {cfg.gke.namespace}/{name} is gone")
    wanted = (lws.get("spec") or {}).get("replicas", 1)
    ready = (lws.get("status") or {}).get("readyReplicas") or 0
    selector = f"{gke_serve.selector(cfg.run)},{gke_serve_render.ROLE_LABEL[0]}"
    pods = kube.list_pods(cfg.gke.namespace, selector)
    crashed = [why for pod in pods if (why := gke_serve._crash(pod))]
    if crashed and not ready:
        return ServiceReport(Phase.FAILED, replicas=wanted, detail=crashed[0])
    if ready:
        return ServiceReport(Phase.READY, url=url, replicas_ready=ready, replicas=wanted)
    waiting = "no pod yet (waiting for the nodes of a group's slice)" if not pods else \
        f"{len(pods)} pod(s) of {wanted} group(s) loading the checkpoint and compiling"
    return ServiceReport(Phase.STARTING, replicas=wanted, detail=waiting)
