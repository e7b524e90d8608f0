"""A Vertex AI custom job (`target: vertex`).

The trainer reports through the status file it writes to its output directory; the job's
own state decides how the run ended.
"""

from __future__ import annotations

from provision import catalogue
from provision.cloud import storage
from provision.core import (
    ENDED,
    STATUS_FILE,
    Bundled,
    Deployment,
    Flag,
    Holding,
    Kind,
    Phase,
    Report,
    Scope,
    Verb,
    report_from_status,
)
from provision.errors import UsageError
from provision.kinds.common import startup_estimate_s
from provision.kinds.vertex import endpoints, jobs
from provision.kinds.vertex.vertex_render import render_custom_job_files, render_serving_files
from provision.kinds.vertex.vertex_sections import VertexSections
from provision.rendering import PROJECT_PLACEHOLDER, server_context, trainer_context
from provision.resources import Resource, project_of, short
from provision.waiting import poll

PREEMPTION_MARKERS = ("preempt", "spot vm", "was reclaimed")


class Machines(Bundled):
    """A placement Vertex AI makes and deletes with its workload (a custom job's or a deployed model's
    machines): it is described and priced, and this tool makes and deletes nothing of it apart."""

    kind = "vertex"

    def __init__(self, describe: str, chips: int, capacity: str) -> None:
        self._describe, self.chips, self.capacity = describe, chips, capacity

    def describe(self) -> str:
        return self._describe

    def price(self) -> float:
        return self.chips * catalogue.price_per_chip_hour(self.capacity)


def job_machines(cfg) -> Machines:
    """The custom job's machines: the vertex section's machine type and topology, billed by scheduling."""
    vertex = cfg.vertex
    acc = catalogue.accelerator_for_topology(vertex.topology)
    return Machines(f"{vertex.machine_type} {vertex.topology} ({vertex.scheduling})", acc.chips if acc else 0,
                    catalogue.CAPACITY_OF_VERTEX_STRATEGY[vertex.scheduling])


def endpoint_machines(cfg) -> Machines:
    """A deployed model's machines: the serve section's, min_replicas of them billed while it is up."""
    serve = cfg.serve
    acc = catalogue.accelerator_for_topology(serve.replica_topology)
    return Machines(f"Vertex AI endpoint on {serve.machine_type} {serve.replica_topology}, "
                    f"{serve.min_replicas}-{serve.max_replicas} replica(s){' (spot)' if serve.spot else ''}",
                    (acc.chips if acc else 0) * serve.min_replicas, "spot" if serve.spot else "on-demand")


class CustomJob(Holding):
    """The training workload: a Vertex AI custom job; the trainer reports through the status file in its
    output directory."""

    def __init__(self, context, *, output_dir: str | None = None) -> None:
        super().__init__(context, output_dir=output_dir)
        self.job: str | None = None

    def start(self) -> list[Resource]:
        """Submit the job (or follow the one already submitted) and wait until it runs or ends."""
        resource = jobs.job_submit(self.context)
        self.job = resource.name
        vertex = self.session.vertex(self.cfg.region)
        wait = (self.cfg.vertex.max_wait.total_seconds() if self.cfg.vertex.max_wait else 0) + 7 * 86400
        with self.console.progress(f"  waiting for job {short(self.job)} to start") as bar:
            job = poll(lambda: vertex.get_custom_job(self.job),
                       lambda j: j is None or j.state.name in ("JOB_STATE_RUNNING", *jobs.TERMINAL_STATES),
                       self.session.clock, timeout_s=wait, progress=bar,
                       describe=lambda j, t: f"  job {short(self.job)}: {j.state.name if j else 'gone'}",
                       what=f"custom job {short(self.job)} to start")
        return [jobs.job_resource(job, self.cfg.region)] if job is not None else [resource]

    def _status(self) -> dict | None:
        return self.session.storage.read_json(storage.join(self.output_dir, STATUS_FILE))

    def report(self) -> Report:
        job = self.session.vertex(self.cfg.region).get_custom_job(self.job)
        if job is None:
            return Report(Phase.DELETED, detail=f"custom job {short(self.job)} is gone")
        state = job.state.name
        if state in ("JOB_STATE_QUEUED", "JOB_STATE_PENDING"):
            return Report(Phase.WAITING)
        status = self._status()
        trainer = report_from_status(status) if status else Report(Phase.STARTING)
        if state == "JOB_STATE_SUCCEEDED":
            return Report(**{**trainer.__dict__, "phase": Phase.FINISHED})
        if state in ("JOB_STATE_FAILED", "JOB_STATE_CANCELLED", "JOB_STATE_EXPIRED"):
            error = jobs.error_of(job) or state
            preempted = any(marker in error.lower() for marker in PREEMPTION_MARKERS)
            if state == "JOB_STATE_CANCELLED" and not preempted:
                return Report(Phase.DELETED, detail=f"custom job {short(self.job)} was cancelled")
            return Report(**{**trainer.__dict__, "phase": Phase.PREEMPTED if preempted else Phase.FAILED,
                             "detail": error + (f"; trainer: {trainer.detail}" if trainer.detail else "")})
        if trainer.phase in ENDED or trainer.phase == Phase.PREEMPTED:
            # An ended trainer in a running job: a status left by an earlier attempt, or a replica
            # that Vertex is restarting. Either way the job's own state decides; wait for it.
            return Report(Phase.STARTING)
        return trainer

    def teardown(self) -> list[Resource]:
        """The run's custom jobs; nothing else of the run (its endpoint stays)."""
        return jobs.jobs_down(self.context)

    def left(self) -> list[Resource]:
        return jobs.managed_jobs(self.session, project_of(self.cfg, self.session), self.cfg.region, run=self.cfg.run)


class VertexKind(Kind):
    """`target: vertex`: the vertex section, rendered as the CustomJob request."""

    name = "vertex"
    noun = "a Vertex AI custom job"
    group = "job"
    group_help = """Vertex AI custom jobs on TPU v5e (for configs with `target: vertex`).

    \b
    Examples:
      moe-tpu job submit --wait -c examples/vertex.yaml
      moe-tpu job status -c examples/vertex.yaml
      moe-tpu job cancel -c examples/vertex.yaml
      moe-tpu --dry-run --scenario quota job submit -c examples/vertex.yaml
    """
    up_flags = (Flag("wait", "Follow the job until it ends; exit 1 unless it SUCCEEDED."),)
    verbs = (
        Verb("submit", "up", "Submit the run's custom job (a re-run follows the job it already submitted).\n\nThe "
                             "request is rendered from templates/custom_job.yaml.j2: one worker pool on the "
                             "configured machine type and TPU topology running the trainer image.", up_flags,
             trainer=True),
        Verb("status", "status", "Show the run's custom jobs (and its endpoint), with state, age and cost so far."),
        Verb("wait", "wait", "Follow the run's job until it ends; exit 0 when it SUCCEEDED, 1 otherwise."),
        Verb("cancel", "cancel", "Cancel the run's queued or running job and wait until it is CANCELLED."),
    )
    up_command = "job submit"
    sections = VertexSections
    serve_platform = "Vertex AI prediction"
    serve_price_basis = ("the catalogue's Cloud TPU v5e chip-hour price, an estimate: Vertex AI prediction bills "
                         "its own node-hour rate, which the catalogue does not hold")

    def summary(self, cfg) -> str:
        acc = catalogue.accelerator_for_topology(cfg.vertex.topology)
        size = f" ({acc.chips} chip{'' if acc.chips == 1 else 's'})" if acc else ""
        line = (f"Vertex AI job on {cfg.vertex.machine_type}, topology {cfg.vertex.topology}{size}, "
                f"{cfg.vertex.scheduling}, region {cfg.region}")
        if cfg.serve is not None:
            serve = cfg.serve
            line += (f"; serves on a Vertex AI endpoint: {serve.machine_type} {serve.replica_topology}, "
                     f"{serve.min_replicas}-{serve.max_replicas} replica(s)")
        return line

    def render(self, cfg, renderer) -> dict[str, str]:
        """The CustomJob's files, and with a serve section the endpoint's (Model, Endpoint, DeployedModel)."""
        files = render_custom_job_files(cfg.vertex, trainer_context(cfg, renderer.image, PROJECT_PLACEHOLDER),
                                        renderer)
        if cfg.serve is not None:
            serving = server_context(cfg, renderer.image, PROJECT_PLACEHOLDER)
            files.update(render_serving_files(cfg.serve, serving, startup_estimate_s(cfg)))
        return files

    def hardware(self, cfg):
        acc = catalogue.accelerator_for_topology(cfg.vertex.topology)
        if acc is None:
            raise ValueError(f"no v5e accelerator type has topology {cfg.vertex.topology!r}")
        return acc, 1, catalogue.CAPACITY_OF_VERTEX_STRATEGY[cfg.vertex.scheduling]

    def target(self, context, *, output_dir: str | None = None) -> Deployment:
        return Deployment(job_machines(context.config), CustomJob(context, output_dir=output_dir))

    def service(self, context):
        """The serve section's model on a dedicated Vertex AI endpoint (provision.kinds.vertex.endpoints)."""
        cfg = context.config
        if cfg.serve is None:
            raise UsageError(f"{cfg.source}: no serve section: nothing says how to serve run {cfg.run}",
                             hint="add `serve:` (see examples/serve-vertex.yaml)")
        return Deployment(endpoint_machines(cfg), endpoints.Endpoint(context, startup_s=startup_estimate_s(cfg)))

    def up_line(self, cfg) -> str:
        return f"run {cfg.run}, {cfg.vertex.machine_type} {cfg.vertex.topology}, {cfg.vertex.scheduling}, " \
               f"region {cfg.region}"

    def up(self, context, wait: bool = False) -> list[Resource]:
        """The custom job, submitted (or adopted); `wait`: followed until it ends (a CloudError unless it
        SUCCEEDED)."""
        job = jobs.job_submit(context)
        return [jobs.job_wait(context, job.name) if wait else job]

    def up_lines(self, resources: list[Resource]) -> list[str]:
        return [f"job {short(job.name)} {job.state}" + ("" if job.state in jobs.TERMINAL_STATES else
                                                         "; follow it with `moe-tpu job wait`") for job in resources]

    def act(self, action: str, context) -> tuple[list[Resource], list[str]]:
        if action == "wait":
            job = jobs.job_wait(context)
            return [job], [f"job {short(job.name)} {job.state}"]
        cancelled = jobs.job_cancel(context)
        return cancelled, [f"job {short(job.name)} {job.state}" for job in cancelled] or [
            f"run {context.config.run} has no queued or running job"]

    def status(self, context) -> list[Resource]:

        cfg, session = context.config, context.session
        project = project_of(cfg, session)
        return [*jobs.managed_jobs(session, project, cfg.region, run=cfg.run),
                *endpoints.managed_serving(session, project, cfg.region, run=cfg.run)]

    def managed(self, session, scope: Scope) -> list[Resource]:

        return [res for region in scope.regions
                for res in (*jobs.managed_jobs(session, scope.project, region, run=scope.run),
                            *endpoints.managed_serving(session, scope.project, region, run=scope.run))]

    def where(self, cfg) -> str:
        return f"region {cfg.region}"

    def teardown(self, context) -> list[Resource]:

        return [*jobs.jobs_down(context), *endpoints.endpoints_down(context)]


KIND = VertexKind()
