"""`moe-tpu plan`: memory per chip, step-time bounds, MFU ceiling and cost, before anything is created."""

from __future__ import annotations

import click

from provision import catalogue
from provision.cli.options import config_option


@click.command("plan")
@config_option
@click.option("--model", default=None, metavar="NAME|PATH",
              help="A named trainer config or a YAML file [the config's trainer.config].")
@click.option("--accelerator", type=click.Choice(list(catalogue.ACCELERATORS)), default=None,
              help="Plan for this v5e slice type instead of the config's.")
@click.option("--slices", type=click.IntRange(min=1), default=None,
              help="Plan for this many slices (multislice) instead of the config's.")
@click.option("--mesh", "mesh_text", default=None, metavar="data=D,expert=E,model=T",
              help="The trainer's mesh [the largest expert axis that fits].")
@click.option("--serve", is_flag=True,
              help="Also the serving decode step at batch 1: the weight bytes each chip reads, on this mesh.")
@click.pass_obj
def plan(app, config_path: str, model: str | None, accelerator: str | None, slices: int | None,
         mesh_text: str | None, serve: bool) -> None:
    """Will the model fit, how fast can it go, what will it cost: before any money is spent.

    Counts the parameters the trainer instantiates, estimates memory per chip
    (parameters, gradients, AdamW state, activations) against the 16 GiB of HBM,
    bounds the step time by compute, HBM, ICI and DCN, and prices the run from
    the catalogue. Exit 0 whether or not it fits; read `fits` in --output json.

    \b
    Examples:
      moe-tpu plan -c examples/v5e-64.yaml
      moe-tpu plan -c examples/moe-1.2t.yaml --slices 16
      moe-tpu plan -c examples/v5e-64.yaml --model glam-small --accelerator v5litepod-16
      moe-tpu --output json plan -c examples/v5e-64.yaml --mesh data=8,expert=8
      moe-tpu plan -c examples/v5e-64.yaml --serve --mesh expert=8,model=4
    """
    from provision import planner

    app.command = "plan"
    cfg = app.load_config(config_path)
    result = planner.plan_for(cfg, model=model, accelerator=accelerator, slices=slices, mesh_text=mesh_text)
    if app.console.json_mode:
        app.console.info(planner.verdict_line(result))
    else:
        for line in planner.plan_lines(result, serve=serve):
            app.console.text(line)
    extra = planner.serve_document(result) if serve else {}
    app.console.emit(app.document("ok", config=str(cfg.source), **planner.plan_document(result), **extra))
