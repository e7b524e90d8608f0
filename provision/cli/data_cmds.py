"""`moe-tpu data prepare` and `moe-tpu sample`: the trainer's own commands, run in this process
(the same as `python -m trainer.prepare` and `python -m trainer.sample`)."""

from __future__ import annotations

import click

PASS_THROUGH = {"add_help_option": False,
                "context_settings": {"ignore_unknown_options": True, "allow_extra_args": True}}


def trainer_main(module: str, args: tuple[str, ...], prog_name: str) -> None:
    import importlib

    try:
        main = importlib.import_module(module).main
    except ImportError as exc:
        from provision.errors import MissingDependency

        raise MissingDependency(exc.name or "jax", "trainer") from exc
    main(list(args), prog_name=prog_name)


@click.group("data")
def data_group() -> None:
    """Datasets for the trainer."""


@data_group.command("prepare", **PASS_THROUGH)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def prepare(args: tuple[str, ...]) -> None:
    """Tokenize text, JSON lines or Parquet into ArrayRecord shards and a manifest (see `--help`).

    \b
    Examples:
      moe-tpu data prepare 'corpus/*.txt' -o gs://BUCKET/datasets/corpus --vocab-size 32768
      moe-tpu data prepare docs.jsonl --tokenizer tokenizer.json -o data/docs
    """
    trainer_main("trainer.prepare", args, "moe-tpu data prepare")


@click.command("sample", **PASS_THROUGH)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.pass_obj
def sample(app, args: tuple[str, ...]) -> None:
    """Continue a prompt with a run's latest checkpoint; every option is the trainer's (see `--help`).
    `moe-tpu --output json sample` prints its JSON (the prompt's and the new token ids, the text).

    \b
    Examples:
      moe-tpu sample --checkpoint gs://BUCKET/runs/demo --prompt "The cat" --tokens 40
      moe-tpu --output json sample --checkpoint runs/demo --prompt "The cat" --temperature 0 --weights int4
    """
    given = any(a == "--output" or a.startswith("--output=") for a in args)
    if app is not None and app.console.json_mode and not given:
        args = (*args, "--output", "json")
    trainer_main("trainer.sample", args, "moe-tpu sample")
