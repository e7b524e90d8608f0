"""Whose node pools are on a cluster: runs' (this tool's labels say which) and a user's (added by hand), which
decide whether a cluster this tool created may go: deleting a cluster deletes every pool on it."""

from __future__ import annotations

from provision.resources import RUN_LABEL, is_managed


def pool_labels(pool) -> dict[str, str]:
    """A node pool's resource labels (this tool's say which run made it)."""
    return dict(pool.config.resource_labels)


def other_runs(pools, run: str) -> list[str]:
    """The runs other than `run` with node pools this tool made among `pools`, sorted."""
    return sorted({pool_labels(p).get(RUN_LABEL, "?") for p in pools
                   if is_managed(pool_labels(p)) and pool_labels(p).get(RUN_LABEL) != run})


def user_pools(pools) -> list[str]:
    """The node pools among `pools` that this tool did not make (a user added them to its cluster), sorted."""
    return sorted(p.name for p in pools if not is_managed(pool_labels(p)))


def cluster_kept(context, owner: str, pools) -> bool:
    """Whether the cluster this tool created for run `owner` stays, saying why: a run's pools are still on it
    (another run's, so the last run to end deletes it; or this run's other workload's), or a user's pools
    are, which would go with it (unless `down --delete-user-pools`: context.delete_user_pools)."""
    cfg, console = context.config, context.console
    others = other_runs(pools, cfg.run)
    own = sorted(p.name for p in pools if is_managed(pool_labels(p), cfg.run))
    if owner == cfg.run and others:
        console.info(f"  keeping cluster {cfg.gke.cluster} (this tool created it for run {owner}): run(s) "
                     f"{', '.join(others)} still have node pools on it; the last of them to end deletes it")
    elif own:
        console.info(f"  keeping cluster {cfg.gke.cluster}: run {cfg.run}'s node pool(s) {', '.join(own)} "
                     "are still on it; `moe-tpu down` deletes them and it")
    if others or own:
        return True
    users = user_pools(pools)
    if users and not context.delete_user_pools:
        console.warn(f"keeping cluster {cfg.gke.cluster} (this tool created it for run {owner}): node pool(s) "
                     f"{', '.join(users)} on it were not made by this tool and would go with it; `moe-tpu down "
                     "--delete-user-pools` deletes the cluster with them")
        return True
    return False
