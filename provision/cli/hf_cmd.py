"""`moe-tpu hf import|export`: Hugging Face checkpoints in and out, run in this process by the trainer's own
command (the same as `python -m trainer.hf`)."""

from __future__ import annotations

import click

from provision.cli.data_cmds import PASS_THROUGH, trainer_main


@click.command("hf", **PASS_THROUGH)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def hf(args: tuple[str, ...]) -> None:
    """Hugging Face checkpoints: `hf import SRC -o DIR`, `hf export --checkpoint DIR -o OUT` (see `--help`).

    \b
    Examples:
      moe-tpu hf import ./Mixtral-8x7B-v0.1 -o runs/mixtral
      moe-tpu hf export --checkpoint runs/mixtral-finetune -o exported/mixtral
    """
    trainer_main("trainer.hf.cli", args, "moe-tpu hf")
