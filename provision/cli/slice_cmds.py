"""`slice up|status|down`, `list` and `down`: thin wrappers over provision.slices."""

from __future__ import annotations

from pathlib import Path

import click

from provision.cli.common import finish, print_resources
from provision.cli.options import config_option
from provision.errors import UsageError


@click.group("slice")
def slice_group() -> None:
    """TPU v5e slices on queued resources.

    \b
    Examples:
      moe-tpu slice up -c examples/v5e-64.yaml
      moe-tpu slice status -c examples/v5e-64.yaml
      moe-tpu slice down -c examples/v5e-64.yaml
      moe-tpu --dry-run --scenario stockout slice up -c examples/v5e-64.yaml
    """


@slice_group.command("up")
@config_option
@click.option("--recreate", is_flag=True,
              help="Delete a queued resource of the run that no longer matches the config, and create it anew.")
@click.pass_obj
def up(app, config_path: str, recreate: bool) -> None:
    """Provision the slice and wait until every node is READY.

    Tries each zone of `zones:` in order when one has no capacity. A re-run after
    a crash adopts the queued resource it already made instead of making another.
    """
    from provision.slices import slice_up

    app.command = "slice up"
    cfg = app.load_config(config_path, check_trainer=True)
    if cfg.target == "gke":
        raise UsageError(f"{cfg.source}: target is 'gke': GKE node pools, not a queued-resource slice",
                         hint=f"use `moe-tpu gke up -c {cfg.source}`, or set `target: tpu-vm`")
    if cfg.target != "tpu-vm":
        raise UsageError(f"{cfg.source}: target is {cfg.target!r}: a Vertex AI job, not a slice you manage",
                         hint=f"use `moe-tpu job submit -c {cfg.source}`, or set `target: tpu-vm`")
    accel = cfg.accelerator_type()
    app.console.info(f"slice up: run {cfg.run}, {cfg.slice.count} x {accel.name} "
                     f"({accel.topology}, {accel.chips} chips, {accel.vms} VMs), {cfg.slice.capacity}"
                     + (" [dry run]" if app.dry_run else ""))
    resources = slice_up(app.context(cfg), recreate=recreate)
    qr = resources[0]
    app.console.text(f"slice ready: {qr.name.rsplit('/', 1)[-1]} in {qr.zone}")
    for node in resources[1:]:
        app.console.text(f"  node {node.name.rsplit('/', 1)[-1]} {node.state}: "
                         f"{len(node.workers)} workers: {' '.join(node.workers)}")
    finish(app, resources)


@slice_group.command("status")
@config_option
@click.pass_obj
def status(app, config_path: str) -> None:
    """Show the run's queued resource and nodes, with state, age and cost so far."""
    from provision.slices import slice_status

    app.command = "slice status"
    cfg = app.load_config(config_path)
    resources = slice_status(app.context(cfg))
    print_resources(app, resources)
    finish(app, resources)


def _down(app, config_path: str, command: str, services: tuple[str, ...] = ("tpu", "vertex", "gke")) -> None:
    from provision.jobs import jobs_down
    from provision.slices import slice_down

    app.command = command
    cfg = app.load_config(config_path)
    where = ", ".join(cfg.zones) + (f" and region {cfg.region}" if "vertex" in services else "")
    if "gke" in services and cfg.gke is not None:
        where += f" and GKE cluster {cfg.gke.cluster}"
    app.console.info(f"{command}: deleting every resource of run {cfg.run} in {where}"
                     + (" [dry run]" if app.dry_run else ""))
    deleted = slice_down(app.context(cfg)) if "tpu" in services else []
    if "vertex" in services:
        deleted += jobs_down(app.context(cfg))
    if "gke" in services and cfg.gke is not None:
        from provision.gke import gke_down

        deleted += gke_down(app.context(cfg))
    if app.dry_run:  # the trainer that a killed dry run left running on this machine
        from provision.emulator.local_trainer import stop_recorded

        pid = stop_recorded(app.state_dir, cfg.run)
        if pid is not None:
            app.console.info(f"  stopped the dry run's local trainer (pid {pid})")
    app.console.text(f"deleted {len(deleted)} resource(s); nothing of run {cfg.run} is left"
                     if deleted else f"nothing to delete; nothing of run {cfg.run} is left")
    finish(app, [], deleted=[r.as_dict(app.session().clock.now()) for r in deleted])


@slice_group.command("down")
@config_option
@click.pass_obj
def slice_down_cmd(app, config_path: str) -> None:
    """Delete the slice (force: its nodes go with it) and wait until it is gone."""
    _down(app, config_path, "slice down", services=("tpu",))


@click.command("down")
@config_option
@click.pass_obj
def down(app, config_path: str) -> None:
    """Delete every resource of the run, also after a crash, and verify nothing is left.

    \b
    Examples:
      moe-tpu down -c examples/v5e-64.yaml
      moe-tpu --dry-run down
    """
    _down(app, config_path, "down")


@click.command("list")
@config_option
@click.option("--all-zones", is_flag=True, help="Look in every zone that offers v5e, not only the config's.")
@click.option("--run", "run_filter", default=None, help="Only this run's resources.")
@click.option("--project", default=None, help="The project to look in (default: the config's).")
@click.option("--zone", "zones_option", multiple=True,
              help="A zone to look in (repeatable; default: the config's zones). Its region's jobs are listed too.")
@click.pass_obj
def list_cmd(app, config_path: str, all_zones: bool, run_filter: str | None, project: str | None,
             zones_option: tuple[str, ...]) -> None:
    """Every resource this tool manages (found by its labels): queued resources and nodes in the
    config's zones, custom jobs in its region, and with a gke section the JobSets, node pools and
    cluster it made on that cluster; with state, age and cost so far. Without a config
    here, --project and --zone (or --all-zones) say where to look.

    \b
    Examples:
      moe-tpu list
      moe-tpu --output json list --all-zones
      moe-tpu list --project my-project --zone us-west4-a
    """
    from provision import catalogue
    from provision.jobs import managed_jobs
    from provision.slices import managed_resources

    app.command = "list"
    cfg = _config_if_any(app, config_path, project, zones_option or all_zones)
    for zone in zones_option:
        if zone not in catalogue.V5E_ZONES:
            raise UsageError(f"--zone {zone}: not a zone that offers TPU v5e",
                             hint=f"v5e zones: {', '.join(catalogue.V5E_ZONES)}")
    zones = (list(catalogue.V5E_ZONES) if all_zones else list(dict.fromkeys(zones_option))
             or list(cfg.zones))
    regions = sorted({catalogue.zone_region(z) for z in zones} | ({cfg.region} if cfg and not zones_option else set()))
    project = _list_project(app, cfg, project)
    resources = managed_resources(app.session(), project, zones, run=run_filter)
    for region in regions:
        resources += managed_jobs(app.session(), project, region, run=run_filter)
    if cfg is not None and cfg.gke is not None:
        from provision.gke import managed_gke

        resources += managed_gke(cfg, app.session(), run=run_filter, project=project)
    print_resources(app, resources)
    finish(app, resources)


def _config_if_any(app, config_path: str, project: str | None, where_given: bool):
    """The config, unless there is none here and --project/--zone say where to look."""
    from provision.config import DEFAULT_CONFIG

    has_config = (config_path != DEFAULT_CONFIG or Path(config_path).exists()
                  or app.remembered_config() is not None)
    if has_config:
        return app.load_config(config_path)
    if project is None or not where_given:
        missing = " and ".join(name for name, given in (("--project", project), ("--zone", where_given)) if not given)
        raise UsageError(f"no {DEFAULT_CONFIG} here, so `list` needs {missing} to know where to look",
                         hint="e.g. `moe-tpu list --project my-project --zone us-west4-a` (or --all-zones), "
                              "or name a config with --config")
    return None


def _list_project(app, cfg, project: str | None) -> str:
    from provision.resources import project_of

    if project is not None:
        from provision.config import _PROJECT

        if not _PROJECT.match(project):
            raise UsageError(f"--project {project}: not a project id",
                             hint="6 to 30 lowercase letters, digits or hyphens, starting with a letter")
        return project
    return project_of(cfg, app.session())
