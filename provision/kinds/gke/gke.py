"""The GKE lifecycle: the cluster (only with gke.create_cluster), one TPU v5e node pool per slice and
RUN-cpu for a Pathways head (zone by zone on stockout), the serving node pool, the run's JobSet and its
service's objects (gke_serve.py), status, down, list.

Everything here talks to `session.container` and `session.kube(cluster)` and waits on
`session.clock`; it does not know whether the other end is Google Cloud or the emulator. A cluster
this tool did not create (no run label on it) is never deleted.
"""

from __future__ import annotations

from provision import catalogue
from provision.errors import CloudError, StockoutError, UsageError, WaitTimeout
from provision.kinds.gke import gke_render, gke_serve, gke_serve_render
from provision.kinds.gke.gke_pools import cluster_kept, other_runs, pool_labels, user_pools
from provision.rendering import trainer_context
from provision.resources import (
    MANAGED_BY,
    RUN_LABEL,
    Resource,
    is_managed,
    location_path,
    project_of,
    short,
    verify_deleted,
)
from provision.waiting import format_duration, poll

CLUSTER_WAIT_S = 3600.0
SERVING_KINDS = set(gke_serve.RESOURCE_KIND.values())
JOBSET_GONE_WAIT_S = 600.0


# --- reading resources -----------------------------------------------------------------------

def cluster_of(cfg, session, project: str | None = None):
    """The run's cluster (a container_v1.Cluster), None when it does not exist."""
    project = project or project_of(cfg, session)
    return session.container.get_cluster(gke_render.cluster_path(cfg.gke, project))


def pool_resource(pool, zone_default: str, cluster: str) -> Resource:
    acc = gke_render.accelerator_of_pool(pool)
    spot = bool(pool.config.spot)
    return Resource(kind="node_pool", name=f"{cluster}/nodePools/{pool.name}", state=pool.status.name,
                    zone=(list(pool.locations) or [zone_default])[0], run=pool_labels(pool).get(RUN_LABEL),
                    accelerator=acc.name if acc else pool.config.machine_type,
                    chips=acc.chips if acc else 0,
                    price_per_chip_hour=catalogue.price_per_chip_hour("spot" if spot else "on-demand"),
                    error=pool.status_message or None)


def _cluster_resource(cluster, path: str) -> Resource:
    return Resource(kind="gke_cluster", name=path, state=cluster.status.name, zone=cluster.location,
                    run=dict(cluster.resource_labels).get(RUN_LABEL))


def jobset_resource(body: dict, cfg) -> Resource:
    status = body.get("status") or {}
    state = status.get("terminalState") or ("Restarting" if status.get("restarts") else "Active")
    meta = body.get("metadata", {})
    return Resource(kind="jobset", name=f"{meta.get('namespace')}/{meta.get('name')}", state=state,
                    zone=cfg.gke.location, run=meta.get("labels", {}).get(RUN_LABEL))


def managed_gke(cfg, session, run: str | None = None, project: str | None = None) -> list[Resource]:
    """What this tool made on the config's cluster (by label): the JobSets in gke.namespace, the node
    pools, and the cluster itself when this tool created it; [] when there is no such cluster."""
    project = project or project_of(cfg, session)
    path = gke_render.cluster_path(cfg.gke, project)
    cluster = session.container.get_cluster(path)
    if cluster is None:
        return []
    found: list[Resource] = []
    if cluster.status.name == "RUNNING" and cluster.endpoint:
        selector = f"{MANAGED_BY[0]}={MANAGED_BY[1]}" + (f",{RUN_LABEL}={run}" if run else "")
        kube = session.kube(cluster)
        found += [jobset_resource(j, cfg) for j in kube.list_jobsets(cfg.gke.namespace, selector)]
        found += gke_serve.managed_objects(kube, cfg, run)
    pools = session.container.list_node_pools(path)
    found += [pool_resource(p, cfg.gke.location, path) for p in pools if is_managed(pool_labels(p), run)]
    # A cluster made for one run is the run's only while no other run, nor a user, has pools on it (see gke_down).
    if is_managed(dict(cluster.resource_labels), run) and not (run and (other_runs(pools, run) or user_pools(pools))):
        found.append(_cluster_resource(cluster, path))
    return found


# --- up --------------------------------------------------------------------------------------------

def _wait_cluster(context, path: str):
    session = context.session

    def fetch():
        cluster = session.container.get_cluster(path)
        if cluster is None:
            raise CloudError(f"cluster {short(path)} disappeared while waiting for it")
        return cluster

    with context.console.progress(f"  waiting for cluster {short(path)}") as bar:
        return poll(fetch, lambda c: c.status.name in ("RUNNING", "ERROR", "DEGRADED"), session.clock,
                    timeout_s=CLUSTER_WAIT_S, progress=bar, what=f"cluster {short(path)}",
                    describe=lambda c, t: f"  cluster {short(path)}: {c.status.name} ({format_duration(t)})")


def ensure_cluster(context) -> tuple[object, bool]:
    """The run's cluster, RUNNING: the existing one, or (gke.create_cluster) one made now.
    Returns (cluster, made_now)."""
    cfg, session, console = context.config, context.session, context.console
    project = project_of(cfg, session)
    path = gke_render.cluster_path(cfg.gke, project)
    cluster = session.container.get_cluster(path)
    made = False
    if cluster is None:
        if not cfg.gke.create_cluster:
            raise UsageError(f"{cfg.source}: gke.cluster: there is no cluster {cfg.gke.cluster} in "
                             f"{cfg.gke.location} (project {project})",
                             hint="name an existing GKE Standard cluster, or set `gke.create_cluster: true`")
        console.info(f"  creating cluster {cfg.gke.cluster} in {cfg.gke.location}")
        training = trainer_context(cfg, context.image, project)
        request = gke_render.create_cluster_request(cfg.gke, cfg.slice, training, context.renderer)
        operation = session.container.create_cluster(request)
        if operation is not None:
            with console.progress(f"  creating cluster {cfg.gke.cluster}") as bar:
                session.container.wait(operation, location_path(project, cfg.gke.location),
                                       f"create cluster {cfg.gke.cluster}", progress=bar)
        made = True
    cluster = _wait_cluster(context, path)
    if cluster.status.name != "RUNNING":
        raise CloudError(f"cluster {cfg.gke.cluster} is {cluster.status.name}: {cluster.status_message}",
                         hint="check the cluster in the console (Kubernetes Engine > Clusters)")
    return cluster, made


def pool_differences(wanted, existing) -> list[str]:
    """How an existing node pool differs from the one the config asks for ([] when it matches)."""
    def shape(pool) -> dict[str, object]:
        return {"machine type": pool.config.machine_type, "node count": pool.initial_node_count,
                "topology": pool.placement_policy.tpu_topology or None, "spot": bool(pool.config.spot),
                "zone": (list(pool.locations) or [None])[0],
                "reservation": tuple(pool.config.reservation_affinity.values) or None}
    want, have = shape(wanted), shape(existing)
    return [f"{key} is {have[key]} (the config asks for {want[key]})" for key in want if want[key] != have[key]]


def delete_pool(context, project: str, name: str) -> bool:
    session = context.session
    operation = session.container.delete_node_pool(name)
    if operation is None:
        return False
    context.console.info(f"  deleting node pool {short(name)}")
    session.container.wait(operation, location_path(project, context.config.gke.location),
                           f"delete node pool {short(name)}")
    return True


def _wait_pool(context, name: str):
    """Poll a pool (one adopted while it is still being made) until it is no longer PROVISIONING."""
    session = context.session
    with context.console.progress(f"  waiting for node pool {short(name)}") as bar:
        return poll(lambda: session.container.get_node_pool(name),
                    lambda p: p is None or p.status.name != "PROVISIONING", session.clock,
                    timeout_s=6 * 3600, progress=bar, what=f"node pool {short(name)}",
                    describe=lambda p, t: f"  node pool {short(name)}: {p.status.name if p else 'gone'}")


def pool_in_zone(context, project: str, spec, existing: dict) -> None:
    """Create one node pool in its zone and wait until it runs (or adopt the one that matches).
    StockoutError when the zone has no capacity for it."""
    cfg, session, console = context.config, context.session, context.console
    path = gke_render.cluster_path(cfg.gke, project)
    name = f"{path}/nodePools/{spec.name}"
    request = gke_render.create_node_pool_request(cfg.gke, spec, project, context.renderer)
    pool = existing.get(spec.name)
    if pool is not None and pool.status.name == "ERROR" and is_managed(pool_labels(pool), cfg.run):
        console.info(f"  node pool {spec.name} is ERROR from an earlier attempt; deleting it first")
        delete_pool(context, project, name)
        pool = None
    if pool is not None:
        differences = pool_differences(request.node_pool, pool)
        if differences:
            raise CloudError(f"node pool {spec.name} exists but does not match the config: {'; '.join(differences)}",
                             hint=f"run `moe-tpu down -c {cfg.source}` to delete the run's node pools, then try again")
        console.info(f"  adopting existing node pool {spec.name} ({pool.status.name})")
        pool = _wait_pool(context, name) if pool.status.name == "PROVISIONING" else pool
    else:
        what = f"{spec.node_count} x {spec.machine_type}" + (f", topology {spec.topology}" if spec.topology else "")
        console.info(f"  creating node pool {spec.name} in {spec.zone}: {what}")
        operation = session.container.create_node_pool(request)
        if operation is None:  # made by an earlier attempt whose answer was lost
            console.info(f"  {spec.name} already exists (an earlier attempt created it); adopting it")
            pool = _wait_pool(context, name)
        else:
            # A TPU pool that is not made within slice.max_wait counts as no capacity in this zone.
            wait = cfg.slice.max_wait.total_seconds() if spec.name != gke_render.cpu_pool_id(cfg.run) else 3600.0
            with console.progress(f"  creating node pool {spec.name}") as bar:
                try:
                    session.container.wait(operation, location_path(project, cfg.gke.location),
                                           f"create node pool {spec.name}", progress=bar, timeout_s=wait)
                except StockoutError:
                    raise
                except WaitTimeout as exc:
                    raise StockoutError(f"node pool {spec.name} was not made within slice.max_wait "
                                        f"({format_duration(cfg.slice.max_wait, exact=True)})") from exc
                except CloudError:
                    pool = session.container.get_node_pool(name)
                    if pool is None or pool.status.name != "ERROR":
                        raise
            pool = session.container.get_node_pool(name)
    if pool is None or pool.status.name != "RUNNING":
        message = pool.status_message if pool is not None else "it disappeared"
        error = StockoutError if pool is not None and "stockout" in message.lower() else CloudError
        raise error(f"node pool {spec.name} in {spec.zone} is {pool.status.name if pool else 'gone'}: {message}")


def pools_up(context, zones: list[str] | None = None) -> tuple[str, list]:
    """The run's node pools, zone by zone on stockout (every slice in one zone, for DCN). Returns the
    zone and the pools. A zone that had no capacity loses the run's pools again before the next."""
    cfg, session, console = context.config, context.session, context.console
    project = project_of(cfg, session)
    path = gke_render.cluster_path(cfg.gke, project)
    tpu_ids, own_ids = gke_render.tpu_pool_ids(cfg.run, cfg.slice), gke_render.pool_ids(cfg.run, cfg.gke, cfg.slice)
    tried: list[str] = []
    for zone in zones or list(cfg.zones):
        existing = {p.name: p for p in session.container.list_node_pools(path)}
        placed = {p.locations[0] for n, p in existing.items() if n in tpu_ids and p.locations}
        if placed and zone not in placed:
            continue  # the run's pools are already in another zone: that zone comes first
        try:
            for spec in gke_render.node_pool_specs(cfg.gke, cfg.slice, trainer_context(cfg, context.image), zone):
                pool_in_zone(context, project, spec, existing)
        except StockoutError as exc:
            tried.append(f"{zone} ({exc.message})")
            console.warn(f"no capacity in {zone}: {exc.message}")
            for pool_id in own_ids:
                pool = session.container.get_node_pool(f"{path}/nodePools/{pool_id}")
                if pool is not None and is_managed(pool_labels(pool), cfg.run):
                    delete_pool(context, project, f"{path}/nodePools/{pool_id}")
            continue
        pools = [p for p in session.container.list_node_pools(path) if p.name in own_ids]
        return zone, pools
    raise StockoutError(f"no capacity for {cfg.slice.count} x {cfg.slice.accelerator} ({cfg.slice.capacity}) "
                        f"node pools in any zone tried: {'; '.join(tried)}",
                        hint="add zones to `zones:`, try another capacity type, or use a reservation")


def serving_pool_up(context, zones: list[str] | None = None) -> Resource:
    """The run's serving node pool (the serve section's single-host machines), RUNNING: adopted, or made in
    the first zone with capacity (a zone without is left without the pool before the next)."""
    cfg, session, console = context.config, context.session, context.console
    project = project_of(cfg, session)
    path = gke_render.cluster_path(cfg.gke, project)
    name = gke_serve_render.serving_pool_id(cfg.run)
    tried: list[str] = []
    for zone in zones or list(cfg.zones):
        existing = {p.name: p for p in session.container.list_node_pools(path)}
        if name in existing and existing[name].locations and existing[name].locations[0] != zone:
            continue  # the pool is in another zone already: that zone comes first
        try:
            spec = gke_serve_render.serving_pool_spec(cfg.serve, cfg.slice, trainer_context(cfg, context.image), zone)
            pool_in_zone(context, project, spec, existing)
        except StockoutError as exc:
            tried.append(f"{zone} ({exc.message})")
            console.warn(f"no capacity in {zone}: {exc.message}")
            pool = session.container.get_node_pool(f"{path}/nodePools/{name}")
            if pool is not None and is_managed(pool_labels(pool), cfg.run):
                delete_pool(context, project, f"{path}/nodePools/{name}")
            continue
        return pool_resource(session.container.get_node_pool(f"{path}/nodePools/{name}"), cfg.gke.location, path)
    raise StockoutError(f"no capacity for the serving node pool ({cfg.serve.min_replicas} x "
                        f"{cfg.serve.machine_type}) in any zone tried: {'; '.join(tried)}",
                        hint="add zones to `zones:`, or try again later")


def gke_up(context, zones: list[str] | None = None) -> list[Resource]:
    """The cluster (created only with gke.create_cluster) and the run's node pools, all RUNNING
    (provision.context.RunContext: the config, session, console and renderer)."""
    cfg, session = context.config, context.session
    cluster, _ = ensure_cluster(context)
    project = project_of(cfg, session)
    path = gke_render.cluster_path(cfg.gke, project)
    _, pools = pools_up(context, zones)
    resources = [pool_resource(p, cfg.gke.location, path) for p in pools]
    if is_managed(dict(cluster.resource_labels), cfg.run):
        resources.insert(0, _cluster_resource(cluster, path))
    return resources


# --- the JobSet --------------------------------------------------------------------------------------

def submit_jobset(context) -> dict:
    """Create the run's JobSet (or adopt the one this run already submitted and that still runs)."""
    cfg, session, console = context.config, context.session, context.console
    cluster = cluster_of(cfg, session)
    if cluster is None:
        raise CloudError(f"cluster {cfg.gke.cluster} is gone", hint="run `moe-tpu gke up` first")
    kube = session.kube(cluster)
    manifest = gke_render.jobset_manifest(cfg.gke, cfg.slice, trainer_context(cfg, context.image), context.renderer)
    name, namespace = manifest["metadata"]["name"], cfg.gke.namespace
    existing = kube.get_jobset(namespace, name)
    if existing is not None:
        labels = existing.get("metadata", {}).get("labels", {})
        if not is_managed(labels, cfg.run):
            raise CloudError(f"a JobSet {namespace}/{name} exists that this run did not make",
                             hint="choose another `run` name, or delete that JobSet")
        if (existing.get("status") or {}).get("terminalState"):
            console.info(f"  JobSet {name} ended ({existing['status']['terminalState']}) in an earlier run; "
                         "deleting it first")
            delete_jobset(context)
        else:
            console.info(f"  adopting the run's JobSet {namespace}/{name}")
            return existing
    console.info(f"  submitting JobSet {namespace}/{name} ({cfg.gke.runtime})")
    created = kube.create_jobset(namespace, manifest)
    return created if created is not None else kube.get_jobset(namespace, name)


def delete_jobset(context) -> bool:
    """Delete the run's JobSet and wait until it (and its pods) are gone; False when there was none."""
    cfg, session = context.config, context.session
    cluster = cluster_of(cfg, session)
    if cluster is None or not cluster.endpoint:
        return False
    kube = session.kube(cluster)
    name = gke_render.jobset_name(cfg.run)
    if not kube.delete_jobset(cfg.gke.namespace, name):
        return False
    context.console.info(f"  deleting JobSet {cfg.gke.namespace}/{name}")
    poll(lambda: kube.get_jobset(cfg.gke.namespace, name), lambda j: j is None, session.clock,
         timeout_s=JOBSET_GONE_WAIT_S, what=f"JobSet {name} to go")
    return True


def trainer_log(cfg, session, tail: int | None = None) -> str | None:
    """The trainer container's log from the run's trainer pod (the latest attempt's: the Pathways
    head, or slice 0's pod 0); None when there is no such pod."""
    cluster = cluster_of(cfg, session)
    if cluster is None or not cluster.endpoint:
        return None
    kube = session.kube(cluster)
    job = gke_render.HEAD_JOB if cfg.gke.runtime == "pathways" else gke_render.SLICE_JOB
    selector = (f"jobset.sigs.k8s.io/jobset-name={gke_render.jobset_name(cfg.run)},"
                f"jobset.sigs.k8s.io/replicatedjob-name={job},jobset.sigs.k8s.io/job-index=0,"
                "batch.kubernetes.io/job-completion-index=0")
    pods = [p for p in kube.list_pods(cfg.gke.namespace, selector) if p.status.phase != "Pending"]
    if not pods:
        return None
    latest = max(pods, key=lambda p: int(p.metadata.labels.get("jobset.sigs.k8s.io/restart-attempt", "0")))
    return kube.pod_log(cfg.gke.namespace, latest.metadata.name, "trainer", tail)


# --- down and status -----------------------------------------------------------------------------------

def gke_down(context) -> list[Resource]:
    """Delete everything of the run (`down`): its serving objects, its JobSet, every node pool of it and
    (only when this tool created it and no run has a pool left on it) the cluster; wait for each and
    verify nothing of the run is left."""
    cfg, session = context.config, context.session
    before = managed_gke(cfg, session, run=cfg.run)
    deleted: list[Resource] = []
    cluster_now = cluster_of(cfg, session)
    if cluster_now is not None and cluster_now.endpoint and any(r.kind in SERVING_KINDS for r in before):
        deleted += gke_serve.delete_objects(context, session.kube(cluster_now), cfg.run)
    if delete_jobset(context):
        deleted += [r for r in before if r.kind == "jobset"]
    deleted += pools_down(context, {r.name.rsplit("/", 1)[-1] for r in before if r.kind == "node_pool"})
    verify_deleted(managed_gke(cfg, session, run=cfg.run))
    return deleted


def pools_down(context, pool_ids: set[str]) -> list[Resource]:
    """Delete the run's node pools among `pool_ids` (a workload's own: its training pools, or its serving
    pool), then the cluster when it is to go (see _unused_cluster); the resources deleted."""
    cfg, session, console = context.config, context.session, context.console
    project = project_of(cfg, session)
    path = gke_render.cluster_path(cfg.gke, project)
    if session.container.get_cluster(path) is None:
        return []
    deleted: list[Resource] = []
    for pool in session.container.list_node_pools(path):
        if pool.name in pool_ids and is_managed(pool_labels(pool), cfg.run) \
                and delete_pool(context, project, f"{path}/nodePools/{pool.name}"):
            deleted.append(pool_resource(pool, cfg.gke.location, path))
    cluster = _unused_cluster(context, path)
    if cluster is not None:
        operation = session.container.delete_cluster(path)
        if operation is not None:
            with console.progress(f"  deleting cluster {cfg.gke.cluster}") as bar:
                session.container.wait(operation, location_path(project, cfg.gke.location),
                                       f"delete cluster {cfg.gke.cluster}", progress=bar)
            deleted.append(cluster)
    return deleted


def pools_left(context, pool_ids: set[str]) -> list[Resource]:
    """What pools_down(pool_ids) would delete that exists now: those of the run's node pools, and the
    cluster when this tool made it and no other pool this tool made is on it."""
    cfg, session = context.config, context.session
    path = gke_render.cluster_path(cfg.gke, project_of(cfg, session))
    cluster = session.container.get_cluster(path)
    if cluster is None:
        return []
    every = session.container.list_node_pools(path)
    pools = [p for p in every if is_managed(pool_labels(p))]
    mine = [p for p in pools if p.name in pool_ids and is_managed(pool_labels(p), cfg.run)]
    found = [pool_resource(p, cfg.gke.location, path) for p in mine]
    if is_managed(dict(cluster.resource_labels)) and len(mine) == len(pools) and \
            (context.delete_user_pools or not user_pools(every)):
        found.insert(0, _cluster_resource(cluster, path))
    return found


def _unused_cluster(context, path: str) -> Resource | None:
    """The cluster as a Resource when it is to go: this tool created it (for this run, or for one that
    has left it) and no node pool of any run, nor one a user added (unless asked), is left on it
    (gke_pools.cluster_kept says why it stays)."""
    cfg, session, console = context.config, context.session, context.console
    cluster = session.container.get_cluster(path)
    labels = dict(cluster.resource_labels) if cluster is not None else {}
    if cluster is None or not is_managed(labels):
        return None
    owner = labels.get(RUN_LABEL, "?")
    pools = session.container.list_node_pools(path)
    if cluster_kept(context, owner, pools):
        return None
    users = user_pools(pools)
    whose = "" if owner == cfg.run else ", which no run uses any more"
    whose += f", with node pool(s) {', '.join(users)} that a user added" if users else ""
    console.info(f"  deleting cluster {cfg.gke.cluster} (this tool created it for run {owner}{whose})")
    return _cluster_resource(cluster, path)


def gke_status(context) -> list[Resource]:
    return managed_gke(context.config, context.session, run=context.config.run)
