"""`moe-tpu run`: the main job, end to end (a thin wrapper over provision.runs)."""

from __future__ import annotations

import click

from provision.cli.options import config_option


@click.command("run")
@config_option
@click.option("--keep", is_flag=True, help="Leave the slice or job in place when training has finished.")
@click.option("--yes", "-y", is_flag=True, help="On Ctrl-C, tear down without asking.")
@click.option("--force", is_flag=True, help="Run even when the plan says the model does not fit.")
@click.option("--restart", is_flag=True,
              help="Train a finished run again from step 0 (its old output is moved aside, kept).")
@click.pass_obj
def run(app, config_path: str, keep: bool, yes: bool, force: bool, restart: bool) -> None:
    """Provision, train, follow, recover from preemption, and tear down: the whole job.

    Validates the config (the trainer section with the trainer's own checks), provisions
    the target (a queued resource with zone fallback, or a Vertex AI custom job), follows
    training (step, loss, tokens/s, ETA), recreates the slice or job after a preemption
    (at most recovery.max_restarts times; the trainer resumes from its last checkpoint),
    and deletes everything at the end. In a dry run the trainer really runs on this
    machine, made small by the config's dry_run section.

    A re-run adopts what an earlier, killed run left (and follows its trainer); a run that
    already finished trains nothing unless --restart is given, and deletes what it left up
    (its trainer finished while no `run` followed it), unless --keep. SIGTERM and SIGHUP (a
    CI cancel, a closed terminal) tear down like Ctrl-C with --yes, unless --keep.

    \b
    Exit codes: 0 training finished (or had finished already); 1 it failed (or preemptions
    outnumbered recovery.max_restarts, or the run's resources were deleted under it); 2 a
    config error, found before anything is created, or another copy of the run is running;
    143 SIGTERM or SIGHUP.

    \b
    Examples:
      moe-tpu --dry-run run -c examples/v5e-64.yaml
      moe-tpu --dry-run --scenario preempt run -c examples/v5e-64.yaml
      moe-tpu --dry-run --output json run -c examples/vertex.yaml
      moe-tpu run -c moe-tpu.yaml --yes
    """
    from provision.kinds import for_config
    from provision.runs import Runner, finished_earlier, run_lock

    app.command = "run"
    cfg = app.load_config(config_path, check_trainer=True)
    _check_plan(app, cfg, force)
    with run_lock(app.state_dir, cfg.run):
        context = app.context(cfg)
        finished = finished_earlier(context, app.trainer_output_dir(cfg), restart=restart, dry_run=app.dry_run)
        # (a finished run's re-run starts no trainer, even on a slice it finds still up)
        output_dir = app.trainer_output_dir(cfg, train_locally=finished is None)
        if finished is None:
            app.console.info(f"run {cfg.run}: {cfg.target}, trainer {cfg.trainer.config}, image {context.image}"
                             + (f" [dry run: the trainer runs here, output in {output_dir}]" if app.dry_run else ""))
        confirm = (lambda: True) if yes else _ask_teardown(app)
        runner = Runner(context, for_config(context, output_dir=output_dir), output_dir=output_dir, keep=keep,
                        confirm_teardown=confirm)
        result = _follow(app, runner, finished)
    if finished is not None:
        _emit(app, runner, "ok", already_finished=True, step=finished["step"], output_dir=output_dir)
        return
    _print_summary(app, result.timeline.events, result.training,
                   "finished" if result.ok else f"failed: {result.error}")
    _emit(app, runner, "ok" if result.ok else "error", **({} if result.ok else {"error": result.error}))
    if not result.ok:
        from provision.runs import RunFailed

        raise RunFailed(result.error, hint="the timeline above shows what happened; `moe-tpu logs` shows "
                                           "the trainer's output")


def _follow(app, runner, finished: dict | None):
    """The run's outcome (provision.runs.Runner.run, under the signal latch), each way it can end said
    in the command's document before its error goes on."""
    from provision.errors import MoeTpuError
    from provision.runs import Interrupted, Terminated, terminate_on_signals

    try:
        with terminate_on_signals():
            return runner.run(finished)
    except Interrupted as exc:
        _emit(app, runner, "interrupted", error=exc.message)
        raise
    except Terminated as exc:
        _print_summary(app, runner.timeline.events, runner.training, f"terminated: {exc.message}")
        _emit(app, runner, "terminated", error=exc.message, exit_code=exc.exit_code)
        raise
    except MoeTpuError as exc:
        _emit(app, runner, "error", error=exc.message)
        raise


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

        hint = (f"set trainer.mesh: {verdict.fitting_mesh} (the plan's choice), or pass --force to try anyway"
                if verdict.fitting_mesh else "choose a larger slice or a smaller model, or pass --force to try anyway")
        raise UsageError("the model does not fit on this target (see `moe-tpu plan`)", hint=hint)


def _ask_teardown(app):
    def ask() -> bool:
        import sys

        if not sys.stdin.isatty():
            return True  # nobody to ask: never leave a run billing behind an unattended Ctrl-C
        return click.confirm("\ntear down everything this run created?", default=True, err=True)
    return ask


def _print_summary(app, events, training, verdict: str) -> None:
    app.console.text("timeline:")
    rows = []
    for event in events:
        extra = {k: v for k, v in event.items() if k not in ("event", "at", "elapsed_s", "cost_usd") and v is not None}
        details = ", ".join(f"{k} {v}" for k, v in extra.items())
        rows.append((event["at"], event["event"], f"${event['cost_usd']:.2f}", details))
    app.console.table(rows, right=(2,), indent=2)
    t = training
    if t.first_loss is not None:
        app.console.text(f"training: {t.steps} steps, loss {t.first_loss:.4f} -> {t.final_loss:.4f}, "
                         f"{t.restarts} restart(s)" + (f", resumed from step {t.resumed_from_step}"
                                                       if t.resumed_from_step is not None else "")
                         + (f", eval loss {t.eval_loss:.4f}" if t.eval_loss is not None else ""))
    if t.goodput is not None:
        from provision.goodput import summary_line

        app.console.text(summary_line(t.goodput))
    app.console.text(verdict)


def _emit(app, runner, result: str, **fields) -> None:
    now = runner.clock.now()
    app.console.emit(app.document(result, timeline=runner.timeline.events, training=runner.training.as_dict(),
                                  resources=[r.as_dict(now) for r in runner.resources], **fields))
