"""`up`, `status`, `down` and `list` for any kind of target: each asks the config's kind
(provision.kinds) and names none. A kind's own group (`slice`, `job`, `gke`: kind_cmds.py) runs them
under its names, with its own flags and actions."""

from __future__ import annotations

from pathlib import Path

import click

from provision.cli.common import finish, print_resources
from provision.cli.options import config_option
from provision.errors import UsageError


DELETE_USER_POOLS = ("target: gke: delete a cluster this tool created even when node pools a user added are on it "
                     "(they go with it; without the flag the cluster is kept, naming them)")


def kind_flags(function):
    """The flags that a kind's `up` takes (Kind.up_flags), offered by the generic `up` for the kinds
    that declare them."""
    from provision.kinds import KINDS

    declared: dict[str, tuple] = {}
    for kind in KINDS.values():
        for flag in kind.up_flags:
            declared.setdefault(flag.name, (flag, []))[1].append(kind.name)
    for name, (flag, kinds) in reversed(declared.items()):
        function = click.option(f"--{name}", is_flag=True, help=f"{flag.help} (target: {', '.join(kinds)})")(function)
    return function


@click.command("up")
@config_option
@kind_flags
@click.pass_obj
def up(app, config_path: str, **flags: bool) -> None:
    """Make what the config's target asks for and wait until it is up (a slice, a job, node pools).

    \b
    Examples:
      moe-tpu up -c examples/v5e-64.yaml
      moe-tpu --dry-run up -c examples/gke-pathways.yaml
    """
    from provision.kinds import kind_of

    app.command = "up"
    cfg = app.load_config(config_path, check_trainer=True)
    kind = kind_of(cfg)
    given = sorted(name for name, on in flags.items() if on)
    foreign = [name for name in given if name not in {flag.name for flag in kind.up_flags}]
    if foreign:
        raise UsageError(f"--{foreign[0]} does not apply to target {kind.name!r} ({kind.noun})",
                         hint=f"drop --{foreign[0]}, or see `moe-tpu up --help` for the targets it applies to")
    bring_up(app, cfg, kind, f"up ({kind.name})", dict.fromkeys(given, True))


def bring_up(app, cfg, kind, said: str, flags: dict[str, bool]) -> None:
    """`up` and a kind's own `up` (`slice up`, `job submit`): the kind makes what the config asks for,
    with the flags of its own that were given, and says what it made."""
    app.console.info(f"{said}: {kind.up_line(cfg)}" + (" [dry run]" if app.dry_run else ""))
    resources = kind.up(app.context(cfg), **flags)
    for line in kind.up_lines(resources):
        app.console.text(line)
    finish(app, resources)


@click.command("status")
@config_option
@click.pass_obj
def status(app, config_path: str) -> None:
    """Show what of the run exists on its target, with state, age and cost so far."""
    from provision.kinds import kind_of

    app.command = "status"
    cfg = app.load_config(config_path)
    show_status(app, cfg, kind_of(cfg))


def show_status(app, cfg, kind) -> None:
    """`status` and a kind's own (`slice status`): what of the run exists, by its kind."""
    resources = kind.status(app.context(cfg))
    print_resources(app, resources)
    finish(app, resources)


def delete_run(app, config_path: str, command: str, kinds: tuple[str, ...] | None = None,
               delete_user_pools: bool = False) -> None:
    """Delete the run's resources of `kinds` (None: of every kind, whatever the config's target) and
    stop a dry run's local trainer; says what went. `delete_user_pools`: a GKE cluster this tool made goes
    even with node pools a user added on it."""
    import dataclasses

    from provision.kinds import KINDS

    app.command = command
    cfg = app.load_config(config_path)
    chosen = [kind for name, kind in KINDS.items() if kinds is None or name in kinds]
    where = " and ".join([", ".join(cfg.zones), *filter(None, (kind.where(cfg) for kind in chosen))])
    app.console.info(f"{command}: deleting every resource of run {cfg.run} in {where}"
                     + (" [dry run]" if app.dry_run else ""))
    context = dataclasses.replace(app.context(cfg), delete_user_pools=delete_user_pools)
    deleted = [res for kind in chosen for res in kind.teardown(context)]
    if app.dry_run:  # the trainer that a killed dry run left running on this machine
        from provision.emulator.local_trainer import stop_recorded

        pid = stop_recorded(app.state_dir, cfg.run)
        if pid is not None:
            app.console.info(f"  stopped the dry run's local trainer (pid {pid})")
    app.console.text(f"deleted {len(deleted)} resource(s); nothing of run {cfg.run} is left"
                     if deleted else f"nothing to delete; nothing of run {cfg.run} is left")
    finish(app, [], deleted=[r.as_dict(app.session().clock.now()) for r in deleted])


@click.command("down")
@config_option
@click.option("--delete-user-pools", is_flag=True, help=DELETE_USER_POOLS)
@click.pass_obj
def down(app, config_path: str, delete_user_pools: bool) -> None:
    """Delete every resource of the run, also after a crash, and verify nothing is left.

    \b
    Examples:
      moe-tpu down -c examples/v5e-64.yaml
      moe-tpu --dry-run down
    """
    delete_run(app, config_path, "down", delete_user_pools=delete_user_pools)


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
    from provision.core import Scope
    from provision.kinds import KINDS

    app.command = "list"
    cfg = _config_if_any(app, config_path, project, zones_option or all_zones)
    for zone in zones_option:
        if zone not in catalogue.V5E_ZONES:
            raise UsageError(f"--zone {zone}: not a zone that offers TPU v5e",
                             hint=f"v5e zones: {', '.join(catalogue.V5E_ZONES)}")
    zones = (list(catalogue.V5E_ZONES) if all_zones else list(dict.fromkeys(zones_option))
             or list(cfg.zones))
    regions = sorted({catalogue.zone_region(z) for z in zones} | ({cfg.region} if cfg and not zones_option else set()))
    scope = Scope(project=_list_project(app, cfg, project), zones=tuple(zones), regions=tuple(regions),
                  run=run_filter, config=cfg)
    resources = [res for kind in KINDS.values() for res in kind.managed(app.session(), scope)]
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
        from provision.config import PROJECT

        if not PROJECT.match(project):
            raise UsageError(f"--project {project}: not a project id",
                             hint="6 to 30 lowercase letters, digits or hyphens, starting with a letter")
        return project
    return project_of(cfg, app.session())
