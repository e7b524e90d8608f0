"""`moe-tpu serve`: the serving engine and its OpenAI-compatible server, run in this process (the same as
`python -m trainer.serve`, the serving container's entry point); `moe-tpu eval`: lm-evaluation-harness
against that engine (`python -m trainer.serve.evaluate`)."""

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
    _trainer_side("trainer.serve.cli").main(list(args), prog_name="moe-tpu serve")


@click.command("eval", **PASS_THROUGH)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def evaluate(args: tuple[str, ...]) -> None:
    """Evaluate a run's latest checkpoint with lm-evaluation-harness, served by the engine on 127.0.0.1;
    every option is the trainer's (see `--help`).

    \b
    Examples:
      moe-tpu eval --checkpoint runs/demo --tasks arc_easy --limit 20
      moe-tpu eval --checkpoint runs/demo --tasks my_task --include-path tasks/
    """
    _trainer_side("trainer.serve.evaluate").main(list(args), prog_name="moe-tpu eval")


def _trainer_side(module: str):
    """The trainer's module, imported only when the command runs (jax is heavy); a missing extra named."""
    import importlib

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        from provision.errors import MissingDependency

        raise (MissingDependency.of(exc) or MissingDependency(exc.name or "jax", "serve")) from exc
