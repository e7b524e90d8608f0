"""`moe-tpu plan`: memory per chip, step-time bounds, MFU ceiling and cost, before anything is created."""

from __future__ import annotations

import click

from provision import catalogue
from provision.cli.options import config_option
from provision.errors import UsageError


@click.command("plan")
@config_option
@click.option("--model", default=None, metavar="NAME|PATH",
              help="A named trainer config or a YAML file [the config's trainer.config].")
@click.option("--accelerator", type=click.Choice(list(catalogue.ACCELERATORS)), default=None,
              help="Plan for this v5e slice type instead of the config's.")
@click.option("--slices", type=click.IntRange(min=1), default=None,
              help="Plan for this many slices (multislice) instead of the config's.")
@click.option("--mesh", "mesh_text", default=None, metavar="data=D,expert=E,model=T",
              help="The trainer's mesh [the largest expert axis that fits]; with --serve, one serving "
                   "replica's mesh [serve.mesh, else the fastest that fits] (the training plan keeps the "
                   "config's).")
@click.option("--serve", is_flag=True,
              help="Also serving: weights and KV cache per chip at bf16, int8 and int4, the decode step's HBM, "
                   "compute and ICI bounds, the largest batch, tokens/s per chip and the cost per million tokens, "
                   "for one replica of the serve section [else the plan's target].")
@click.option("--decode-step-ms", "claim_ms", type=click.FloatRange(min=0, min_open=True), default=None,
              metavar="MS", help="With --serve: check a decode step time (a claim, a latency target) against "
                                 "the bounds.")
@click.pass_obj
def plan(app, config_path: str, model: str | None, accelerator: str | None, slices: int | None,
         mesh_text: str | None, serve: bool, claim_ms: float | None) -> None:
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
      moe-tpu plan -c examples/moe-1.2t.yaml --serve --decode-step-ms 22
    """
    from provision import planner

    app.command = "plan"
    cfg = app.load_config(config_path)
    if claim_ms is not None and not serve:
        raise UsageError("--decode-step-ms checks a serving decode step", hint="add --serve")
    # With --serve, --mesh is the serving replica's: the training plan keeps trainer.mesh (or its choice).
    result = planner.plan_for(cfg, model=model, accelerator=accelerator, slices=slices,
                              mesh_text=None if serve else mesh_text)
    served = (planner.serve_plan_for(cfg, result, accelerator=accelerator, mesh_text=mesh_text, claim_ms=claim_ms)
              if serve else None)
    if app.console.json_mode:
        app.console.info(planner.verdict_line(result))
        if served is not None:
            app.console.info(planner.serve_verdict(served))
    else:
        for line in planner.plan_lines(result) + (planner.serve_lines(served) if served is not None else []):
            app.console.text(line)
    extra = planner.serve_document(served) if served is not None else {}
    app.console.emit(app.document("ok", config=str(cfg.source), **planner.plan_document(result), **extra))
