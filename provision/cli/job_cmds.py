"""`job submit|status|wait|cancel`: thin wrappers over provision.kinds.vertex.jobs (Vertex AI custom jobs)."""

from __future__ import annotations

import click

from provision.cli.common import finish, print_resources
from provision.cli.options import config_option


@click.group("job")
def job_group() -> None:
    """Vertex AI custom jobs on TPU v5e (for configs with `target: vertex`).

    \b
    Examples:
      moe-tpu job submit --wait -c examples/vertex.yaml
      moe-tpu job status -c examples/vertex.yaml
      moe-tpu job cancel -c examples/vertex.yaml
      moe-tpu --dry-run --scenario quota job submit -c examples/vertex.yaml
    """


def _load(app, config_path: str, command: str, check_trainer: bool = False):
    from provision.kinds import require

    app.command = command
    cfg = app.load_config(config_path, check_trainer=check_trainer)
    require(cfg, "job")  # the `job` commands act on a kind whose own group they are
    return cfg


@job_group.command("submit")
@config_option
@click.option("--wait", is_flag=True, help="Follow the job until it ends; exit 1 unless it SUCCEEDED.")
@click.pass_obj
def submit(app, config_path: str, wait: bool) -> None:
    """Submit the run's custom job (a re-run follows the job it already submitted).

    The request is rendered from templates/custom_job.yaml.j2: one worker pool on the
    configured machine type and TPU topology running the trainer image.
    """
    from provision.kinds.vertex.jobs import job_submit, job_wait

    cfg = _load(app, config_path, "job submit", check_trainer=True)
    app.console.info(f"job submit: run {cfg.run}, {cfg.vertex.machine_type} {cfg.vertex.topology}, "
                     f"{cfg.vertex.scheduling}, region {cfg.region}" + (" [dry run]" if app.dry_run else ""))
    job = job_submit(app.context(cfg))
    if wait:
        job = job_wait(app.context(cfg), job.name)
        app.console.text(f"job {job.name.rsplit('/', 1)[-1]} {job.state}")
    else:
        app.console.text(f"job {job.name.rsplit('/', 1)[-1]} {job.state}; follow it with `moe-tpu job wait`")
    finish(app, [job])


@job_group.command("status")
@config_option
@click.pass_obj
def status(app, config_path: str) -> None:
    """Show the run's custom jobs, with state, age and cost so far."""
    from provision.kinds.vertex.jobs import managed_jobs
    from provision.resources import project_of

    cfg = _load(app, config_path, "job status")
    jobs = managed_jobs(app.session(), project_of(cfg, app.session()), cfg.region, run=cfg.run)
    print_resources(app, jobs)
    finish(app, jobs)


@job_group.command("wait")
@config_option
@click.pass_obj
def wait_cmd(app, config_path: str) -> None:
    """Follow the run's job until it ends; exit 0 when it SUCCEEDED, 1 otherwise."""
    from provision.kinds.vertex.jobs import job_wait

    cfg = _load(app, config_path, "job wait")
    job = job_wait(app.context(cfg))
    app.console.text(f"job {job.name.rsplit('/', 1)[-1]} {job.state}")
    finish(app, [job])


@job_group.command("cancel")
@config_option
@click.pass_obj
def cancel(app, config_path: str) -> None:
    """Cancel the run's queued or running job and wait until it is CANCELLED."""
    from provision.kinds.vertex.jobs import job_cancel

    cfg = _load(app, config_path, "job cancel")
    jobs = job_cancel(app.context(cfg))
    for job in jobs:
        app.console.text(f"job {job.name.rsplit('/', 1)[-1]} {job.state}")
    if not jobs:
        app.console.text(f"run {cfg.run} has no queued or running job")
    finish(app, jobs)
