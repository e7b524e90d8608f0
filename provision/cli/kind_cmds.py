"""A kind's own command group (`moe-tpu slice`, `job`, `gke`), made from what the kind declares
(provision.core.Kind: group, group_help, verbs): each command is the generic `up | status | down`
(lifecycle_cmds.py) under the kind's name, with the flags of its own, or an action of the kind's
(Kind.act: `job wait`, `job cancel`). No kind is named here: provision.cli's COMMANDS names each group
as `kind_cmds:GROUP`, which this module makes on first use."""

from __future__ import annotations

import click

from provision.cli.common import finish
from provision.cli.options import config_option


def __getattr__(name: str) -> click.Group:
    """The group of the kind whose `group` is `name` (module attributes by name, PEP 562)."""
    from provision.kinds import KINDS

    kind = next((kind for kind in KINDS.values() if kind.group == name), None)
    if kind is None:
        raise AttributeError(name)
    return group_of(kind)


def group_of(kind) -> click.Group:
    """The kind's group: one command per Verb."""
    group = click.Group(kind.group, help=kind.group_help)
    for verb in kind.verbs:
        group.add_command(_command(kind, verb))
    return group


def _command(kind, verb) -> click.Command:
    @click.pass_obj
    def callback(app, config_path: str, **flags: bool) -> None:
        from provision.cli.lifecycle_cmds import bring_up, delete_run, show_status

        command = f"{kind.group} {verb.name}"
        cfg = _config(app, config_path, kind, command, verb.trainer)
        if verb.does == "up":
            bring_up(app, cfg, kind, command, {name: True for name, on in flags.items() if on})
        elif verb.does == "status":
            show_status(app, cfg, kind)
        elif verb.does == "down":
            delete_run(app, config_path, command, kinds=(kind.name,),
                       delete_user_pools=flags.get("delete_user_pools", False))
        else:
            resources, lines = kind.act(verb.does, app.context(cfg))
            for line in lines:
                app.console.text(line)
            finish(app, resources)

    for flag in reversed(verb.flags):
        callback = click.option(f"--{flag.name}", is_flag=True, help=flag.help)(callback)
    return click.command(verb.name, help=verb.help)(config_option(callback))


def _config(app, config_path: str, kind, command: str, check_trainer: bool):
    """The config, whose target must be this kind (else a UsageError naming the commands that act on it)."""
    from provision.kinds import require

    app.command = command
    cfg = app.load_config(config_path, check_trainer=check_trainer)
    require(cfg, kind.group)
    return cfg
