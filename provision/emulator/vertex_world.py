"""Vertex AI's custom jobs in the emulated world: their records and the service's part of the world
(`CustomJobs`, saved under "vertex"), the jobs a dry run's trainer runs in, and ending one. No gRPC
here: the RPCs are vertex.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

from provision.catalogue import VERTEX_MACHINE_TOPOLOGIES
from provision.emulator import scenarios
from provision.emulator.scenarios import JOB_DELETING_S, Timeline
from provision.emulator.world import RUN_LABEL, World, WorldError, register_part


@dataclass
class JobRecord:
    """One Vertex AI custom job as created, plus what happened to it since."""

    name: str
    request: dict  # the CustomJob as submitted (proto JSON, proto field names)
    create_time: float
    timeline: Timeline  # JobState names
    deleted_at: float | None = None

    def state_at(self, now: float) -> str | None:
        """The job's state at `now`; None once deleted."""
        if self.deleted_at is not None and now >= self.deleted_at + JOB_DELETING_S:
            return None
        return self.timeline.state_at(now - self.create_time)

    def pool(self) -> dict:
        """The (only) worker pool spec as submitted."""
        return self.request["job_spec"]["worker_pool_specs"][0]

    def to_json(self) -> dict:
        return {"name": self.name, "request": self.request, "create_time": self.create_time,
                "timeline": self.timeline.to_json(), "deleted_at": self.deleted_at}

    @classmethod
    def from_json(cls, d: dict) -> JobRecord:
        return cls(name=d["name"], request=d["request"], create_time=float(d["create_time"]),
                   timeline=Timeline.from_json(d["timeline"]), deleted_at=d.get("deleted_at"))


def vertex_hosts(machine_type: str, topology: str) -> int:
    """TPU VMs behind a Vertex worker: one for -1t and -8t, one per 4 chips for -4t."""
    if machine_type != "ct5lp-hightpu-4t":
        return 1
    rows, cols = (int(x) for x in topology.split("x"))
    return max(1, rows * cols // 4)


def job_topology(pool: dict) -> str:
    """The pool's tpu_topology, or the machine type's own when it sets none."""
    spec = pool.get("machine_spec", {})
    return spec.get("tpu_topology") or VERTEX_MACHINE_TOPOLOGIES[spec["machine_type"]][0]


@dataclass(frozen=True)
class RunningJob:
    """A Vertex AI custom job that is RUNNING now, with its container as submitted."""

    name: str
    display_name: str
    run: str | None  # the moe-tpu-run label
    labels: dict[str, str]
    image_uri: str
    command: tuple[str, ...]
    args: tuple[str, ...]
    env: dict[str, str]
    machine_type: str
    tpu_topology: str
    workers: int  # TPU VMs


@register_part
class CustomJobs:
    """Vertex AI's custom jobs in the emulated world, by name, and the region `stockout` keeps out of
    capacity."""

    KEY = "vertex"

    def __init__(self) -> None:
        self.jobs: dict[str, JobRecord] = {}
        self.first_region: str | None = None

    @classmethod
    def of(cls, world: World) -> CustomJobs:
        return world.part(cls.KEY)

    def to_json(self) -> dict:
        return {"custom_jobs": [j.to_json() for j in self.jobs.values()], "first_region": self.first_region}

    @classmethod
    def from_json(cls, d: dict | None) -> CustomJobs:
        jobs = cls()
        if d is not None:
            jobs.jobs = {j["name"]: JobRecord.from_json(j) for j in d["custom_jobs"]}
            jobs.first_region = d.get("first_region")
        return jobs

    def prune(self, now: float) -> None:
        for name in [n for n, j in self.jobs.items() if j.state_at(now) is None]:
            del self.jobs[name]

    def job_at(self, name: str, now: float) -> JobRecord | None:
        job = self.jobs.get(name)
        return job if job is not None and job.state_at(now) is not None else None

    def running(self, now: float) -> list[RunningJob]:
        """Every custom job RUNNING at `now`, by name."""
        found = []
        for job in self.jobs.values():
            if job.state_at(now) != "JOB_STATE_RUNNING":
                continue
            pool = job.pool()
            container = pool.get("container_spec", {})
            labels = dict(job.request.get("labels", {}))
            machine_type = pool["machine_spec"]["machine_type"]
            topology = job_topology(pool)
            found.append(RunningJob(
                name=job.name, display_name=job.request.get("display_name", ""), run=labels.get(RUN_LABEL),
                labels=labels, image_uri=container.get("image_uri", ""),
                command=tuple(container.get("command", ())), args=tuple(container.get("args", ())),
                env={e["name"]: e.get("value", "") for e in container.get("env", ())},
                machine_type=machine_type, tpu_topology=topology, workers=vertex_hosts(machine_type, topology)))
        return sorted(found, key=lambda j: j.name)

    def end(self, name: str, now: float, succeeded: bool,
                       error: tuple[int, str] | None = None, preempted: bool = False) -> bool:
        """End a custom job at `now`: SUCCEEDED, or FAILED with `error` (google.rpc code, message), or
        FAILED as the `preempt` scenario fails a job. Without an error a failure is a replica's
        non-zero exit. False when the job has already ended or is being cancelled; WorldError when
        there is no such job or both `succeeded` and a failure are asked for."""
        job = self.job_at(name, now)
        if job is None:
            raise WorldError(f"no custom job {name!r} in the emulated world")
        if succeeded and (error is not None or preempted):
            raise WorldError("a job that succeeded has no error and was not preempted")
        if job.state_at(now) in (*scenarios.JOB_TERMINAL, "JOB_STATE_CANCELLING"):
            return False
        if succeeded:
            final, failure = "JOB_STATE_SUCCEEDED", None
        elif preempted:
            final, failure = "JOB_STATE_FAILED", dict(scenarios.JOB_PREEMPTED_ERROR)
        else:
            final = "JOB_STATE_FAILED"
            failure = ({"code": int(error[0]), "message": str(error[1])} if error is not None
                       else scenarios.replica_exit_error(1))
        offset = now - job.create_time
        job.timeline = scenarios.ended(job.timeline, offset, ((offset, final),), failure)
        return True
