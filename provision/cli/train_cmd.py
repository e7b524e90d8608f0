"""`moe-tpu train`: the trainer's own command line, run in this process (same as `python -m trainer`)."""

from __future__ import annotations

import click


@click.command("train", add_help_option=False,
               context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def train(args: tuple[str, ...]) -> None:
    """Run the MoE trainer locally; every option is the trainer's (see `moe-tpu train --help`).

    \b
    Examples:
      moe-tpu train --config tiny --steps 20
      moe-tpu train --config tiny --devices 8 --mesh data=2,expert=4 --steps 5
    """
    try:
        from trainer.cli import main
    except ImportError as exc:
        from provision.errors import MissingDependency

        raise MissingDependency(exc.name or "jax", "trainer") from exc
    main(list(args), prog_name="moe-tpu train")
