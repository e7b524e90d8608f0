"""The two places a run can train: a TPU VM slice, or a Vertex AI custom job.

Each implements the same small interface (`provision`, `report`, `teardown`), so the run
loop in provision/runs.py never asks which one it holds. A target reads the trainer's state
where that target keeps it: guest attributes that each TPU VM worker publishes, or the
status file the trainer writes to its output directory on Vertex AI.
"""

from __future__ import annotations

from dataclasses import dataclass

from provision import catalogue, storage
from provision.resources import Resource, project_of, short

# Trainer states, as the status file and the guest attributes carry them (trainer/status.py).
ENDED = {"finished", "failed", "stopped"}
GUEST_NAMESPACE = "moe-tpu/"
PREEMPTION_MARKERS = ("preempt", "spot vm", "was reclaimed")


@dataclass
class Report:
    """What a target says about training right now.

    phase: waiting (no trainer yet), starting, running, finished, failed, preempted, deleted (by a
    person: a deletion or cancellation that the service did not initiate; never recovered from).
    """

    phase: str
    step: int | None = None
    total_steps: int | None = None
    start_step: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    worker: str | None = None
    detail: str | None = None


def _number(value, kind=float):
    try:
        return kind(value) if value not in (None, "", "null", "None") else None
    except (TypeError, ValueError):
        return None


def report_from_status(status: dict, worker: str | None = None) -> Report:
    """A Report from one trainer status (status.json fields, or guest attributes with dashes)."""
    get = lambda key: status.get(key, status.get(key.replace("_", "-")))  # noqa: E731
    state = str(get("state") or "starting")
    phase = {"stopped": "preempted"}.get(state, state)
    detail = get("error") or (f"exit code {get('exit_code')}" if state == "failed" else None)
    if state == "stopped" and not detail:
        detail = f"the trainer was stopped by a signal at step {get('step')} (a preemption notice)"
    return Report(phase=phase, step=_number(get("step"), int), total_steps=_number(get("total_steps"), int),
                  start_step=_number(get("start_step"), int), loss=_number(get("loss")),
                  tokens_per_s=_number(get("tokens_per_s")), worker=worker, detail=detail)


def combine(reports: list[Report]) -> Report:
    """One run's report from its workers': any failure fails it, all must finish, worker 0 speaks."""
    if not reports:
        return Report("starting")
    for phase in ("failed", "preempted"):
        bad = [r for r in reports if r.phase == phase]
        if bad:
            return bad[0]
    if all(r.phase == "finished" for r in reports):
        return reports[0]
    lead = reports[0]
    if lead.phase == "finished":  # worker 0 is done, others are still writing their last checkpoint
        lead = Report(**{**lead.__dict__, "phase": "running"})
    return lead


class SliceTarget:
    """A TPU v5e slice on a queued resource; the startup script runs the trainer on every worker."""

    kind = "tpu-vm"

    def __init__(self, cfg, session, console, templates_dir=None) -> None:
        self.cfg = cfg
        self.session = session
        self.console = console
        self.templates_dir = templates_dir
        self.zone: str | None = None
        self.queued_resource: str | None = None
        acc = cfg.accelerator_type()
        self.chips = acc.chips * cfg.slice.count
        self.usd_per_hour = self.chips * catalogue.price_per_chip_hour(cfg.slice.capacity)

    def describe(self) -> str:
        return f"{self.cfg.slice.count} x {self.cfg.slice.accelerator} ({self.cfg.slice.capacity})"

    def provision(self, attempt: int = 0) -> list[Resource]:
        """Provision the slice: the zone it last ran in first, then the others in config order."""
        from provision.slices import slice_up

        zones = list(self.cfg.zones)
        if self.zone in zones:
            zones.remove(self.zone)
            zones.insert(0, self.zone)
        resources = slice_up(self.cfg.model_copy(update={"zones": zones}), self.session, self.console,
                             self.templates_dir, attempt=attempt)
        self.zone, self.queued_resource = resources[0].zone, resources[0].name
        return resources

    def report(self) -> Report:
        from provision.slices import failure_of, nodes_of, state_name

        tpu = self.session.tpu
        qr = tpu.get_queued_resource(self.queued_resource)
        if qr is None:  # the service suspends a preempted queued resource; only a delete removes one
            return Report("deleted", detail=f"queued resource {short(self.queued_resource)} is gone")
        state = state_name(qr)
        if state == "DELETING":
            return Report("deleted", detail=f"queued resource {short(self.queued_resource)} is DELETING "
                                            f"(by {qr.state.state_initiator.name})")
        if state != "ACTIVE":
            code, message = failure_of(qr)
            initiator = qr.state.state_initiator.name
            return Report("preempted", detail=f"queued resource {state} (by {initiator})"
                                              + (f": code {code}: {message}" if message else ""))
        project = project_of(self.cfg, self.session)
        reports = []
        for node in nodes_of(self.session, project, self.zone, qr):
            if node.state.name != "READY":
                return Report("preempted", detail=f"node {short(node.name)} is {node.state.name}")
            workers = tpu.get_guest_attributes(node.name, GUEST_NAMESPACE)
            if workers is None:
                return Report("preempted", detail=f"node {short(node.name)} is gone")
            for index, attrs in enumerate(workers):
                if attrs:
                    reports.append(report_from_status(attrs, worker=f"{short(node.name)} worker {index}"))
        return combine(reports) if reports else Report("waiting")

    def teardown(self) -> list[Resource]:
        from provision.slices import slice_down

        return slice_down(self.cfg, self.session, self.console)


class JobTarget:
    """A Vertex AI custom job; the trainer reports through the status file in its output directory."""

    kind = "vertex"

    def __init__(self, cfg, session, console, templates_dir=None, output_dir: str | None = None) -> None:
        self.cfg = cfg
        self.session = session
        self.console = console
        self.templates_dir = templates_dir
        self.output_dir = output_dir or cfg.trainer.output_dir
        self.job: str | None = None
        acc = catalogue.accelerator_for_topology(cfg.vertex.topology)
        from provision.jobs import CAPACITY_OF_STRATEGY

        self.chips = acc.chips if acc else 0
        self.usd_per_hour = self.chips * catalogue.price_per_chip_hour(
            CAPACITY_OF_STRATEGY.get(cfg.vertex.scheduling, "on-demand"))

    def describe(self) -> str:
        return f"{self.cfg.vertex.machine_type} {self.cfg.vertex.topology} ({self.cfg.vertex.scheduling})"

    def provision(self, attempt: int = 0) -> list[Resource]:
        """Submit the job (or follow the one already submitted) and wait until it runs or ends."""
        from provision.jobs import TERMINAL_STATES, job_resource, job_submit
        from provision.waiting import poll

        resource = job_submit(self.cfg, self.session, self.console, self.templates_dir)
        self.job = resource.name
        vertex = self.session.vertex(self.cfg.region)
        wait = (self.cfg.vertex.max_wait.total_seconds() if self.cfg.vertex.max_wait else 0) + 7 * 86400
        with self.console.progress(f"  waiting for job {short(self.job)} to start") as bar:
            job = poll(lambda: vertex.get_custom_job(self.job),
                       lambda j: j is None or j.state.name == "JOB_STATE_RUNNING" or j.state.name in TERMINAL_STATES,
                       self.session.clock, timeout_s=wait, progress=bar,
                       describe=lambda j, t: f"  job {short(self.job)}: {j.state.name if j else 'gone'}",
                       what=f"custom job {short(self.job)} to start")
        return [job_resource(job, self.cfg.region)] if job is not None else [resource]

    def _status(self) -> dict | None:
        return storage.read_json(storage.join(self.output_dir, "status.json"),
                                 self.session.endpoint.credentials, self.cfg.project)

    def report(self) -> Report:
        from provision.jobs import error_of

        job = self.session.vertex(self.cfg.region).get_custom_job(self.job)
        if job is None:
            return Report("deleted", detail=f"custom job {short(self.job)} is gone")
        state = job.state.name
        if state in ("JOB_STATE_QUEUED", "JOB_STATE_PENDING"):
            return Report("waiting")
        status = self._status()
        trainer = report_from_status(status) if status else Report("starting")
        if state == "JOB_STATE_SUCCEEDED":
            return Report(**{**trainer.__dict__, "phase": "finished"})
        if state in ("JOB_STATE_FAILED", "JOB_STATE_CANCELLED", "JOB_STATE_EXPIRED"):
            error = error_of(job) or state
            preempted = any(marker in error.lower() for marker in PREEMPTION_MARKERS)
            if state == "JOB_STATE_CANCELLED" and not preempted:
                return Report("deleted", detail=f"custom job {short(self.job)} was cancelled")
            return Report(**{**trainer.__dict__, "phase": "preempted" if preempted else "failed",
                             "detail": error + (f"; trainer: {trainer.detail}" if trainer.detail else "")})
        if trainer.phase in ENDED or trainer.phase == "preempted":
            # An ended trainer in a running job: a status left by an earlier attempt, or a replica
            # that Vertex is restarting. Either way the job's own state decides; wait for it.
            return Report("starting")
        return trainer

    def teardown(self) -> list[Resource]:
        from provision.jobs import jobs_down

        return jobs_down(self.cfg, self.session, self.console)
