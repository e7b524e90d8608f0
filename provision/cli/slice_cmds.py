"""`slice up|status|down`: the generic `up | status | down` (cli/lifecycle_cmds.py) under the name of a
TPU VM slice, with `--recreate`."""

from __future__ import annotations

import click

from provision.cli.common import finish, print_resources
from provision.cli.options import config_option

GROUP = "slice"  # a kind's own name for `up | status | down` (provision.kinds.Kind.group)


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
    from provision.kinds import require

    app.command = "slice up"
    cfg = app.load_config(config_path, check_trainer=True)
    kind = require(cfg, GROUP)
    app.console.info(f"slice up: {kind.up_line(cfg)}" + (" [dry run]" if app.dry_run else ""))
    resources = kind.up(app.context(cfg), recreate=recreate)
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
    from provision.kinds.tpu_vm.slices import slice_status

    app.command = "slice status"
    cfg = app.load_config(config_path)
    resources = slice_status(app.context(cfg))
    print_resources(app, resources)
    finish(app, resources)


@slice_group.command("down")
@config_option
@click.pass_obj
def slice_down_cmd(app, config_path: str) -> None:
    """Delete the slice (force: its nodes go with it) and wait until it is gone."""
    from provision.cli.lifecycle_cmds import delete_run
    from provision.kinds import by_group

    delete_run(app, config_path, "slice down", kinds=(by_group(GROUP).name,))
