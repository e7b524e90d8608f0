"""`moe-tpu serve`: the serving engine and its OpenAI-compatible server, run in this process (the same as
`python -m trainer.serve`, the serving container's entry point)."""

from __future__ import annotations

import click

from provision.cli.data_cmds import PASS_THROUGH


@click.command("serve", **PASS_THROUGH)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def serve(args: tuple[str, ...]) -> None:
    """Serve a run's latest checkpoint over an OpenAI-compatible API; every option is the trainer's (see `--help`).

    \b
    Examples:
      moe-tpu serve --checkpoint runs/demo
      moe-tpu serve --checkpoint gs://BUCKET/runs/demo --host 0.0.0.0 --weights int8
    """
    try:
        from trainer.serve.cli import main
    except ModuleNotFoundError as exc:
        from provision.errors import MissingDependency

        raise (MissingDependency.of(exc) or MissingDependency(exc.name or "jax", "serve")) from exc
    main(list(args), prog_name="moe-tpu serve")
