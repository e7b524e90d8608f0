"""`moe-tpu run`: the main job, end to end (a thin wrapper over provision.runs)."""

from __future__ import annotations

import click

from provision.cli.options import config_option


@click.command("run")
@config_option
@click.option("--keep", is_flag=True, help="Leave the slice or job in place when training has finished.")
@click.option("--yes", "-y", is_flag=True, help="On Ctrl-C, tear down without asking.")
@click.option("--force", is_flag=True, help="Run even when the plan says the model does not fit.")
@click.pass_obj
def run(app, config_path: str, keep: bool, yes: bool, force: bool) -> None:
    """Provision, train, follow, recover from preemption, and tear down: the whole job.

    Validates the config (the trainer section with the trainer's own checks), provisions
    the target (a queued resource with zone fallback, or a Vertex AI custom job), follows
    training (step, loss, tokens/s, ETA), recreates the slice or job after a preemption
    (at most recovery.max_restarts times; the trainer resumes from its last checkpoint),
    and deletes everything at the end. In a dry run the trainer really runs on this
    machine, made small by the config's dry_run section.

    \b
    Exit codes: 0 training finished; 1 it failed (or preemptions outnumbered
    recovery.max_restarts); 2 a config error, found before anything is created.

    \b
    Examples:
      moe-tpu --dry-run run -c examples/v5e-64.yaml
      moe-tpu --dry-run --scenario preempt run -c examples/v5e-64.yaml
      moe-tpu --dry-run --output json run -c examples/vertex.yaml
      moe-tpu run -c moe-tpu.yaml --yes
    """
    from provision.errors import MoeTpuError
    from provision.runs import Interrupted, RunFailed, Runner
    from provision.targets import for_config

    app.command = "run"
    cfg = app.load_config(config_path, check_trainer=True)
    _check_plan(app, cfg, force)
    output_dir = app.trainer_output_dir(cfg, train_locally=True)
    renderer = app.renderer(cfg)
    app.console.info(f"run {cfg.run}: {cfg.target}, trainer {cfg.trainer.config}, image {renderer.image}"
                     + (f" [dry run: the trainer runs here, output in {output_dir}]" if app.dry_run else ""))
    session = app.session()
    target = for_config(cfg, session, app.console, renderer=renderer, output_dir=output_dir)
    confirm = (lambda: True) if yes else _ask_teardown(app)
    runner = Runner(cfg, target, session, app.console, output_dir=output_dir, keep=keep, confirm_teardown=confirm)
    try:
        result = runner.run()
    except Interrupted as exc:
        _emit(app, runner, "interrupted", error=exc.message)
        raise
    except MoeTpuError as exc:
        _emit(app, runner, "error", error=exc.message)
        raise
    _print_summary(app, result)
    _emit(app, runner, "ok" if result.ok else "error", **({} if result.ok else {"error": result.error}))
    if not result.ok:
        raise RunFailed(result.error, hint="the timeline above shows what happened; `moe-tpu logs` shows "
                                           "the trainer's output")


def _check_plan(app, cfg, force: bool) -> None:
    """The planner's one-line verdict before anything is created; refuse a model that cannot fit."""
    from provision import planner
    from provision.errors import MissingDependency

    try:
        verdict = planner.verdict(cfg)
    except MissingDependency:
        app.console.warn("no plan: checking that the model fits needs the trainer's packages "
                         "(pip install 'moe-tpu[trainer]')")
        return
    app.console.info(f"plan: {verdict.line}")
    if not verdict.fits and not force:
        from provision.errors import UsageError

        raise UsageError("the model does not fit on this target (see `moe-tpu plan`)",
                         hint="choose a larger slice or a smaller model, or pass --force to try anyway")


def _ask_teardown(app):
    def ask() -> bool:
        import sys

        if not sys.stdin.isatty():
            return True  # nobody to ask: never leave a run billing behind an unattended Ctrl-C
        return click.confirm("\ntear down everything this run created?", default=True, err=True)
    return ask


def _print_summary(app, result) -> None:
    app.console.text("timeline:")
    for event in result.timeline.events:
        extra = {k: v for k, v in event.items() if k not in ("event", "at", "elapsed_s", "cost_usd") and v is not None}
        details = "  " + ", ".join(f"{k} {v}" for k, v in extra.items()) if extra else ""
        app.console.text(f"  {event['at']}  {event['event']:<18} ${event['cost_usd']:>8.2f}{details}")
    t = result.training
    if t.first_loss is not None:
        app.console.text(f"training: {t.steps} steps, loss {t.first_loss:.4f} -> {t.final_loss:.4f}, "
                         f"{t.restarts} restart(s)" + (f", resumed from step {t.resumed_from_step}"
                                                       if t.resumed_from_step is not None else ""))
    app.console.text("finished" if result.ok else f"failed: {result.error}")


def _emit(app, runner, result: str, **fields) -> None:
    now = runner.clock.now()
    app.console.emit(app.document(result, timeline=runner.timeline.events, training=runner.training.as_dict(),
                                  resources=[r.as_dict(now) for r in runner.resources], **fields))
