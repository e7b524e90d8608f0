"""The Vertex AI custom job lifecycle: submit (exactly once), status, wait, cancel, down.

Everything here talks to `session.vertex(region)` and waits on `session.clock`; it does
not know whether the other end is Google Cloud or the emulator.
"""

from __future__ import annotations

from provision import catalogue
from provision.errors import CloudError, UsageError
from provision.kinds.vertex.vertex_render import create_custom_job_request
from provision.rendering import trainer_context
from provision.resources import RUN_LABEL, Resource, is_managed, location_path, project_of, short, verify_deleted
from provision.waiting import format_duration, poll

ACTIVE_STATES = catalogue.VERTEX_JOB_ACTIVE
TERMINAL_STATES = catalogue.VERTEX_JOB_TERMINAL


def state_name(job) -> str:
    return job.state.name


def error_of(job) -> str | None:
    error = job.error
    if error is None or (not error.code and not error.message):
        return None
    return f"code {error.code}: {error.message}"


def job_resource(job, region: str) -> Resource:
    """A custom job as a Resource; cost accrues while its machines run (start to end)."""
    pools = job.job_spec.worker_pool_specs
    topology = pools[0].machine_spec.tpu_topology if pools else ""
    accel = catalogue.accelerator_for_topology(topology) if topology else None
    strategy = job.job_spec.scheduling.strategy.name if job.job_spec.scheduling else "STANDARD"

    def seconds(ts) -> float | None:
        return ts.timestamp() if ts else None

    return Resource(
        kind="custom_job", name=job.name, state=state_name(job), zone=region, run=job.labels.get(RUN_LABEL),
        accelerator=f"{pools[0].machine_spec.machine_type} {topology}".strip() if pools else None,
        created=seconds(job.create_time), chips=accel.chips if accel and job.start_time else 0,
        price_per_chip_hour=catalogue.price_per_chip_hour(
            catalogue.CAPACITY_OF_VERTEX_STRATEGY.get(strategy, "on-demand")),
        error=error_of(job), billed_from=seconds(job.start_time), ended=seconds(job.end_time),
    )


def run_jobs(session, project: str, region: str, run: str | None = None) -> list:
    """The custom jobs this tool made in `region` (by label), oldest first.

    The API filters on the display name (the run's name); labels are checked here, which
    spares the filter any question of how label keys with hyphens are quoted."""
    server_filter = f'display_name="{run}"' if run is not None else ""
    jobs = session.vertex(region).list_custom_jobs(location_path(project, region), server_filter)
    jobs = [j for j in jobs if is_managed(dict(j.labels), run)]
    return sorted(jobs, key=lambda j: (j.create_time.timestamp() if j.create_time else 0.0, j.name))


def managed_jobs(session, project: str, region: str, run: str | None = None) -> list[Resource]:
    return [job_resource(j, region) for j in run_jobs(session, project, region, run)]


def active_job(cfg, session, project: str):
    """The run's job that is still queued or running (the newest), or None."""
    jobs = [j for j in run_jobs(session, project, cfg.region, cfg.run)
            if state_name(j) in ACTIVE_STATES and j.display_name == cfg.run]
    return jobs[-1] if jobs else None


def _job_shape(job) -> dict[str, object]:
    pools = list(job.job_spec.worker_pool_specs)
    pool = pools[0] if pools else None
    return {"machine type": pool.machine_spec.machine_type if pool else None,
            "topology": pool.machine_spec.tpu_topology if pool else None,
            "image": pool.container_spec.image_uri if pool else None,
            "scheduling": job.job_spec.scheduling.strategy.name if job.job_spec.scheduling else None}


def job_differences(wanted, existing) -> list[str]:
    """How an existing custom job differs from the one the config asks for (empty when it matches)."""
    want, have = _job_shape(wanted), _job_shape(existing)
    return [f"{key} is {have[key]} (the config asks for {want[key]})" for key in want if want[key] != have[key]]


# --- submit -----------------------------------------------------------------------------
def job_submit(context) -> Resource:
    """Submit the run's custom job (provision.context.RunContext: its config, session, console and
    renderer), or adopt the one an earlier attempt submitted."""
    cfg, session, console = context.config, context.session, context.console
    project = project_of(cfg, session)
    request = create_custom_job_request(cfg.vertex, trainer_context(cfg, context.image, project), context.renderer)
    existing = active_job(cfg, session, project)
    if existing is not None:
        if differences := job_differences(request.custom_job, existing):
            raise CloudError(f"custom job {short(existing.name)} ({state_name(existing)}) of run {cfg.run} is still "
                             f"active but no longer matches the config: {'; '.join(differences)}",
                             hint=f"run `moe-tpu job cancel -c {cfg.source}` (or `moe-tpu down`) first, then submit")
        console.info(f"  following job {short(existing.name)} that an earlier attempt submitted "
                     f"({state_name(existing)})")
        return job_resource(existing, cfg.region)
    console.info(f"  submitting custom job {cfg.run} in {cfg.region}: {cfg.vertex.machine_type}, "
                 f"topology {cfg.vertex.topology}, {cfg.vertex.scheduling}")
    job = session.vertex(cfg.region).create_custom_job(request, lambda: active_job(cfg, session, project))
    console.info(f"  submitted {short(job.name)} ({state_name(job)})")
    return job_resource(job, cfg.region)


# --- wait -------------------------------------------------------------------------------
def _fetch(session, region: str, name: str):
    job = session.vertex(region).get_custom_job(name)
    if job is None:
        raise CloudError(f"custom job {name} disappeared while waiting for it",
                         hint="someone deleted it; run `moe-tpu job submit` again")
    return job


def wait_job(context, name: str, timeout_s: float | None = None):
    """Poll the job until it ends; returns the last CustomJob read."""
    cfg, session = context.config, context.session
    timeout = timeout_s if timeout_s is not None else cfg.vertex.timeout.total_seconds() + 86400
    if cfg.vertex.max_wait is not None:
        timeout += cfg.vertex.max_wait.total_seconds()

    def describe(job, elapsed: float) -> str:
        return f"  job {short(job.name)}: {state_name(job)} (waited {format_duration(elapsed)})"

    with context.console.progress(f"  waiting for job {short(name)}") as bar:
        return poll(lambda: _fetch(session, cfg.region, name), lambda j: state_name(j) in TERMINAL_STATES,
                    session.clock, timeout_s=timeout, describe=describe, progress=bar,
                    what=f"custom job {short(name)}")


def job_wait(context, name: str | None = None) -> Resource:
    """Wait for the run's job (or `name`) to end: the Resource when it SUCCEEDED, CloudError otherwise."""
    cfg, session = context.config, context.session
    project = project_of(cfg, session)
    if name is None:
        job = active_job(cfg, session, project)
        if job is None:
            jobs = run_jobs(session, project, cfg.region, cfg.run)
            if not jobs:
                raise UsageError(f"run {cfg.run} has no custom job in {cfg.region}",
                                 hint="submit one with `moe-tpu job submit`")
            job = jobs[-1]
        name = job.name
    job = wait_job(context, name)
    resource = job_resource(job, cfg.region)
    if state_name(job) != "JOB_STATE_SUCCEEDED":
        raise CloudError(f"custom job {short(job.name)} ended {state_name(job)}"
                         + (f" ({resource.error})" if resource.error else ""),
                         hint="see its logs in the console (Vertex AI > Training > Custom jobs); "
                              "`moe-tpu down` deletes it")
    return resource


# --- cancel and down --------------------------------------------------------------------
def _cancel_and_wait(context, job):
    """Cancel a queued or running job (unless it is already cancelling); the job once it has ended."""
    if state_name(job) != "JOB_STATE_CANCELLING":
        context.console.info(f"  cancelling job {short(job.name)} ({state_name(job)})")
        context.session.vertex(context.config.region).cancel_custom_job(job.name)
    return wait_job(context, job.name, timeout_s=3600)


def job_cancel(context) -> list[Resource]:
    """Cancel every queued or running job of the run and wait until each has ended."""
    cfg, session = context.config, context.session
    project = project_of(cfg, session)
    return [job_resource(_cancel_and_wait(context, job), cfg.region)
            for job in run_jobs(session, project, cfg.region, cfg.run) if state_name(job) in ACTIVE_STATES]


def jobs_down(context) -> list[Resource]:
    """Cancel the run's active jobs, delete all of them, and verify none is left."""
    cfg, session, console = context.config, context.session, context.console
    project = project_of(cfg, session)
    vertex = session.vertex(cfg.region)
    deleted = []
    for job in run_jobs(session, project, cfg.region, cfg.run):
        if state_name(job) in ACTIVE_STATES:
            job = _cancel_and_wait(context, job)
        operation = vertex.delete_custom_job(job.name)
        if operation is not None:
            console.info(f"  deleting job {short(job.name)} ({state_name(job)})")
            vertex.wait_operation(operation, f"delete {short(job.name)}", timeout_s=3600)
            deleted.append(job_resource(job, cfg.region))
    verify_deleted(managed_jobs(session, project, cfg.region, cfg.run))
    return deleted
