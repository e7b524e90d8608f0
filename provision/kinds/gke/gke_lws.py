"""A service on GKE over several hosts per replica, the lifecycle half of gke_lws_render: the serve
section's rules for it, the groups' node pools (a whole multi-host slice each), the LeaderWorkerSet
controller required on the cluster, and the LeaderWorkerSet's groups as the replicas a ServiceReport
counts (gke_serve.service_report).

Applying, listing and deleting the objects is gke_serve's (its kinds include the LeaderWorkerSet);
the prediction goes through the leader's Service as the single-host one does.
"""

from __future__ import annotations

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
                gke.pool_in_zone(context, project, spec, existing)
        except StockoutError as exc:
            tried.append(f"{zone} ({exc.message})")
            console.warn(f"no capacity in {zone}: {exc.message}")
            for name in names:
                pool = session.container.get_node_pool(f"{path}/nodePools/{name}")
                if pool is not None and is_managed(gke.pool_labels(pool), cfg.run):
                    gke.delete_pool(context, project, f"{path}/nodePools/{name}")
            continue
        return [gke.pool_resource(p, cfg.gke.location, path) for p in session.container.list_node_pools(path)
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


def group_replicas(cfg) -> gke_serve.Replicas:
    """A multi-host service's replicas: the LeaderWorkerSet's groups, ready once a group is (its leader
    answers /health); their pods are every group's leader and workers."""
    return gke_serve.Replicas(gke_lws_render.LWS_KIND, "readyReplicas",
                              f"{gke_serve.selector(cfg.run)},{gke_serve_render.ROLE_LABEL[0]}",
                              "the nodes of a group's slice",
                              "{pods} pod(s) of {wanted} group(s) loading the checkpoint and compiling")
