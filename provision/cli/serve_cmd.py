"""`moe-tpu serve`: the serving engine and its OpenAI-compatible server, run in this process (the same as
`python -m trainer.serve`, the serving container's entry point); `moe-tpu eval`: lm-evaluation-harness
against that engine (`python -m trainer.serve.evaluate`), or with --endpoint against the config's deployed model."""

from __future__ import annotations

import click

from provision.cli.data_cmds import PASS_THROUGH
from provision.cli.options import config_option


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
@click.option("--endpoint", is_flag=True,
              help="Evaluate the config's deployed model (`moe-tpu deploy`) through the platform's prediction API.")
@config_option
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.pass_obj
def evaluate(app, endpoint: bool, config_path: str, args: tuple[str, ...]) -> None:
    """Evaluate a run's latest checkpoint with lm-evaluation-harness, served by the engine on 127.0.0.1, or with
    --endpoint the config's deployed model through the platform's prediction API (Vertex AI's RawPredict, the GKE
    Service's proxy); every other option is the trainer's (see `--help`).

    \b
    Examples:
      moe-tpu eval --checkpoint runs/demo --tasks arc_easy --limit 20
      moe-tpu eval --checkpoint runs/demo --tasks my_task --include-path tasks/
      moe-tpu eval --endpoint -c examples/serve-vertex.yaml --tasks arc_easy --limit 20
    """
    module = _trainer_side("trainer.serve.evaluate")
    if not endpoint or "--help" in args or "-h" in args:  # the trainer's options (the same with --endpoint)
        module.main(list(args), prog_name="moe-tpu eval")
        return
    from provision.errors import UsageError
    from provision.kinds import kind_of

    if "--checkpoint" in args or any(a.startswith("--checkpoint=") for a in args):
        raise UsageError("--endpoint evaluates the config's deployed model: leave --checkpoint out",
                         hint="the run's tokenizer is read from the checkpoint the config serves")
    app.command = "eval"
    cfg = app.load_config(config_path)
    service = kind_of(cfg).service(app.context(cfg))
    extra = ["--max-len", str(cfg.serve.max_len)] if cfg.serve is not None and not _given(args, "--max-len") else []
    module.main(["--checkpoint", _served_run(app, cfg), *extra, *args], prog_name="moe-tpu eval --endpoint",
                forward=lambda body: next(iter(service.predict(body))))


def _given(args, flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _served_run(app, cfg) -> str:
    """The run whose checkpoint the config's service serves (serve.checkpoint, else trainer.output_dir): its
    tokenizer is the endpoint's. In a dry run the one this machine trained, as the dry run's server finds it."""
    where = (cfg.serve.checkpoint if cfg.serve is not None else None) or cfg.trainer.output_dir
    if not app.dry_run:
        return where
    from provision.emulator.local_server import dry_run_adapter, flag_value

    argv, _ = dry_run_adapter(cfg, app.state_dir)(["--checkpoint", where], {})
    return flag_value(argv, "--checkpoint")


def _trainer_side(module: str):
    """The trainer's module, imported only when the command runs (jax is heavy); a missing extra named."""
    import importlib

    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        from provision.errors import MissingDependency

        raise (MissingDependency.of(exc) or MissingDependency(exc.name or "jax", "serve")) from exc
