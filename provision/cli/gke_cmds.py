"""`gke up|status|down`: the generic `up | status | down` under the name of GKE node pools."""

from __future__ import annotations

import click

from provision.cli.common import finish, print_resources
from provision.cli.options import config_option

GROUP = "gke"  # a kind's own name for `up | status | down` (provision.kinds.Kind.group)


@click.group("gke")
def gke_group() -> None:
    """GKE node pools for target: gke (and the cluster, with gke.create_cluster: true).

    \b
    Examples:
      moe-tpu gke up -c examples/gke-pathways.yaml
      moe-tpu gke status -c examples/gke-pathways.yaml
      moe-tpu gke down -c examples/gke-pathways.yaml
      moe-tpu --dry-run --scenario stockout gke up -c examples/gke-pathways.yaml
    """


def _gke_config(app, config_path: str, check_trainer: bool = False):
    from provision.kinds import require

    cfg = app.load_config(config_path, check_trainer=check_trainer)
    require(cfg, GROUP)
    return cfg


@gke_group.command("up")
@config_option
@click.pass_obj
def up(app, config_path: str) -> None:
    """Create the node pools (one per slice, and RUN-cpu for a Pathways head) and wait until they run.

    Tries each zone of `zones:` in order when one has no capacity. A re-run adopts the pools it
    already made; a pool of the run that no longer matches the config is refused.
    """
    from provision.kinds import by_group

    app.command = "gke up"
    cfg = _gke_config(app, config_path, check_trainer=True)
    kind = by_group(GROUP)
    app.console.info(f"gke up: {kind.up_line(cfg)}" + (" [dry run]" if app.dry_run else ""))
    resources = kind.up(app.context(cfg))
    for res in resources:
        app.console.text(f"  {res.kind} {res.name.rsplit('/', 1)[-1]} {res.state} in {res.zone}")
    finish(app, resources)


@gke_group.command("status")
@config_option
@click.pass_obj
def status(app, config_path: str) -> None:
    """Show the run's JobSet, node pools and (when this tool made it) cluster, with state and cost."""
    from provision.kinds.gke.gke import gke_status

    app.command = "gke status"
    cfg = _gke_config(app, config_path)
    resources = gke_status(app.context(cfg))
    print_resources(app, resources)
    finish(app, resources)


@gke_group.command("down")
@config_option
@click.pass_obj
def down(app, config_path: str) -> None:
    """Delete the run's JobSet and node pools, and the cluster only when this tool created it."""
    from provision.cli.lifecycle_cmds import delete_run
    from provision.kinds import by_group

    _gke_config(app, config_path)
    delete_run(app, config_path, "gke down", kinds=(by_group(GROUP).name,))
