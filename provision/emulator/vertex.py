"""google.cloud.aiplatform.v1.JobService, custom jobs only: request checks, the changes they make
to the world, proto views, RPCs. The other JobService methods answer UNIMPLEMENTED.

This module imports google-cloud-aiplatform, which is slow to import: the server loads it on the
first JobService call (rpc.Service) or the first look at one of its operations, so a TPU-only dry run never pays for it.
Messages marked "unconfirmed" have no public record; they are the most plausible shape.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable

from google.cloud import aiplatform_v1 as v1
from google.longrunning import operations_pb2
from google.protobuf import empty_pb2
from google.rpc import error_details_pb2, status_pb2

from provision.catalogue import VERTEX_MACHINE_TOPOLOGIES
from provision.emulator import rpc, scenarios, validate
from provision.emulator.scenarios import JOB_CANCELLING_S, JOB_DELETING_S, JOB_TERMINAL, job_timeline
from provision.emulator.validate import ApiError, not_found
from provision.emulator.vertex_world import CustomJobs, JobRecord, vertex_hosts
from provision.emulator.world import Operation, World

SERVICE = "google.cloud.aiplatform.v1.JobService"
CustomJob = v1.CustomJob
JobState = v1.JobState
PARENT_RE = re.compile(r"^projects/([^/]+)/locations/([^/]+)$")
JOB_NAME_RE = re.compile(r"^(projects/[^/]+/locations/[^/]+)/customJobs/([0-9]+)$")
MAX_DISPLAY_NAME = 128
# Defaults the service fills in a worker pool's disk_spec (documented on DiskSpec).
DEFAULT_DISK = {"boot_disk_type": "pd-ssd", "boot_disk_size_gb": 100}
# The metric name is the one public code uses for v5e training quota; the message shape is the one
# public reports quote for other metrics. Whether a QuotaFailure detail comes with it is unconfirmed.
QUOTA_METRIC = "aiplatform.googleapis.com/custom_model_training_tpu_v5e"
QUOTA_MESSAGE = f"The following quota metrics exceed quota limits: {QUOTA_METRIC}"


def as_json(job: CustomJob) -> dict:
    return json.loads(CustomJob.to_json(job, use_integers_for_enums=False, preserving_proto_field_name=True,
                                        always_print_fields_with_no_presence=False))


# --- request checks ----------------------------------------------------------------------


def region(parent: str) -> tuple[str, str]:
    """(project, region) of "projects/P/locations/REGION" (messages unconfirmed)."""
    match = PARENT_RE.match(parent or "")
    if not match:
        raise ApiError("INVALID_ARGUMENT",
                       f"Invalid resource field value in the request: parent {parent!r} is not of the form "
                       "'projects/{project}/locations/{location}'")
    project, where = match.groups()
    if not validate.REGION_RE.match(where):
        raise ApiError("INVALID_ARGUMENT", f"Location {where!r} is not a Vertex AI region (e.g. us-west4)")
    return project, where


def job_name(name: str) -> str:
    """Check "projects/P/locations/REGION/customJobs/ID"; returns the parent."""
    match = JOB_NAME_RE.match(name or "")
    if not match:
        raise ApiError("INVALID_ARGUMENT",
                       f"Invalid resource field value in the request: name {name!r} is not of the form "
                       "'projects/{project}/locations/{location}/customJobs/{custom_job}'")
    region(match.group(1))
    return match.group(1)


def _machine(pool: v1.WorkerPoolSpec) -> str:
    """The pool's machine type and TPU topology checks; returns the topology in effect."""
    spec = pool.machine_spec
    if spec.machine_type not in VERTEX_MACHINE_TOPOLOGIES:
        raise ApiError("INVALID_ARGUMENT", f'Machine type "{spec.machine_type}" is not supported.')
    if spec.accelerator_type not in (v1.AcceleratorType.ACCELERATOR_TYPE_UNSPECIFIED,
                                     v1.AcceleratorType.TPU_V5_LITEPOD):
        raise ApiError("INVALID_ARGUMENT", f'Accelerator "{spec.accelerator_type.name}" is not supported for '
                                           f'machine type "{spec.machine_type}"')
    offered = VERTEX_MACHINE_TOPOLOGIES[spec.machine_type]
    if spec.tpu_topology and spec.tpu_topology not in offered:
        # Unconfirmed message.
        raise ApiError("INVALID_ARGUMENT", f'TPU topology "{spec.tpu_topology}" is not supported for machine type '
                                           f'"{spec.machine_type}"; supported: {", ".join(offered)}')
    return spec.tpu_topology or offered[0]


def _code(pool: v1.WorkerPoolSpec) -> None:
    """The pool runs a container or a Python package (messages unconfirmed)."""
    where = "job_spec.worker_pool_specs[0]"
    if "python_package_spec" in pool:
        package = pool.python_package_spec
        if not (package.executor_image_uri and package.package_uris and package.python_module):
            raise ApiError("INVALID_ARGUMENT", f"{where}.python_package_spec needs executor_image_uri, "
                                               "package_uris and python_module")
    elif not pool.container_spec.image_uri:
        raise ApiError("INVALID_ARGUMENT", f"{where}.container_spec.image_uri is required")


def check_job(job: CustomJob) -> None:
    """What the API refuses in a CustomJob (messages unconfirmed unless docs/api-facts.md lists them)."""
    if not job.display_name:
        raise ApiError("INVALID_ARGUMENT", "custom_job.display_name is required")
    if len(job.display_name) > MAX_DISPLAY_NAME:
        raise ApiError("INVALID_ARGUMENT", f"custom_job.display_name is longer than {MAX_DISPLAY_NAME} characters")
    pools = job.job_spec.worker_pool_specs
    if len(pools) != 1:
        # The API takes up to 4 pools (chief, workers, servers, evaluators); the emulator models one.
        raise ApiError("INVALID_ARGUMENT", f"custom_job.job_spec.worker_pool_specs has {len(pools)} pools; the "
                                           "emulator models exactly one")
    pool = pools[0]
    topology = _machine(pool)
    if pool.replica_count < 1:
        raise ApiError("INVALID_ARGUMENT", "job_spec.worker_pool_specs[0].replica_count must be at least 1")
    _code(pool)
    validate.labels(dict(job.labels))
    hosts = vertex_hosts(pool.machine_spec.machine_type, topology)
    if job.job_spec.scheduling.strategy == v1.Scheduling.Strategy.SPOT and hosts > 1:
        # The docs: "Using Spot VMs with TPU Pods isn't supported." The message is unconfirmed.
        raise ApiError("INVALID_ARGUMENT", f'Spot VMs are not supported with TPU Pods (machine type '
                                           f'"{pool.machine_spec.machine_type}", topology {topology})')


def quota_error(project: str, where: str) -> ApiError:
    failure = error_details_pb2.QuotaFailure(violations=[error_details_pb2.QuotaFailure.Violation(
        subject=f"project:{project}", description=QUOTA_MESSAGE, api_service="aiplatform.googleapis.com",
        quota_metric=QUOTA_METRIC, quota_dimensions={"region": where}, quota_value=0)])
    return ApiError("RESOURCE_EXHAUSTED", QUOTA_MESSAGE, [failure])


# --- filters (AIP-160, the subset a control plane needs) -----------------------------------

_TERM = re.compile(r'^(?:labels\.(?P<label>[a-z][a-z0-9_-]*)\s*(?:(?P<has>:\s*\*)|=\s*(?P<lv>"[^"]*"|[\w-]+))'
                   r'|(?P<field>display_name|state)\s*=\s*(?P<fv>"[^"]*"|[\w-]+))$')


def parse_filter(text: str) -> list[Callable[[dict, str], bool]]:
    """`labels.KEY="VALUE"`, `labels.KEY:*`, `display_name="X"`, `state=JOB_STATE_X`, joined by AND.
    Each test takes (the job's request JSON, its state now)."""
    tests: list[Callable[[dict, str], bool]] = []
    for term in (t.strip() for t in re.split(r"\s+AND\s+", text.strip())) if text.strip() else ():
        match = _TERM.match(term)
        if not match:
            raise ApiError("INVALID_ARGUMENT",
                           f"Unsupported filter term {term!r}: the emulator reads labels.KEY=\"VALUE\", "
                           'labels.KEY:*, display_name="NAME" and state=JOB_STATE_..., joined by AND')
        tests.append(_test(match))
    return tests


def _test(match: re.Match) -> Callable[[dict, str], bool]:
    if match["label"]:
        key = match["label"]
        if match["has"]:
            return lambda req, state: key in req.get("labels", {})
        value = match["lv"].strip('"')
        return lambda req, state: req.get("labels", {}).get(key) == value
    value = match["fv"].strip('"')
    if match["field"] == "state":
        if value not in JobState.__members__:
            raise ApiError("INVALID_ARGUMENT", f"Unknown job state {value!r} in filter")
        return lambda req, state: state == value
    return lambda req, state: req.get("display_name") == value


# --- views -------------------------------------------------------------------------------


def job_view(job: JobRecord, now: float) -> CustomJob:
    view_ = CustomJob.from_json(json.dumps(job.request), ignore_unknown_fields=True)
    view_.name = job.name
    offset = now - job.create_time
    state = job.timeline.state_at(offset)
    view_.state = JobState[state]
    view_.create_time = rpc.timestamp(job.create_time)
    view_.update_time = rpc.timestamp(job.create_time + job.timeline.entered_at(offset))
    started_at = job.timeline.first("JOB_STATE_RUNNING", offset)
    if started_at is not None:
        view_.start_time = rpc.timestamp(job.create_time + started_at)
    if state in ("JOB_STATE_SUCCEEDED", "JOB_STATE_FAILED", "JOB_STATE_CANCELLED"):
        view_.end_time = rpc.timestamp(job.create_time + job.timeline.entered_at(offset))
    if state in ("JOB_STATE_FAILED", "JOB_STATE_CANCELLED"):
        failure = job.timeline.failure or {"code": 13, "message": "Internal error occurred."}
        view_.error = status_pb2.Status(code=failure["code"], message=failure["message"])
    return view_


def operation_metadata(op: Operation, now: float):
    updated = op.done_at if op.done(now) else op.create_time
    return v1.DeleteOperationMetadata.pb(v1.DeleteOperationMetadata(generic_metadata=v1.GenericOperationMetadata(
        create_time=rpc.timestamp(op.create_time), update_time=rpc.timestamp(updated))))


def operation_response(op: Operation):
    return empty_pb2.Empty()  # a delete's response; no other Vertex operation is modelled


def operation_view(op: Operation, now: float) -> operations_pb2.Operation:
    """A Vertex AI operation as google.longrunning.Operation at `now`."""
    return rpc.longrunning(op, now, operation_metadata, operation_response)


# --- changes to the world --------------------------------------------------------------


def numeric_id(world: World) -> str:
    """A 19-digit id, as the service gives its resources (deterministic for the world's seed)."""
    return str(10**18 + int(world.next_token()[:16], 16) % (9 * 10**18))


def live_job(world: World, name: str, now: float) -> JobRecord:
    job_name(name)
    job = CustomJobs.of(world).job_at(name, now)
    if job is None:
        raise not_found(name)
    return job


def create_custom_job(world: World, req: v1.CreateCustomJobRequest, now: float, scenario: str,
                      held: bool = False) -> JobRecord:
    project, where = region(req.parent)
    job = CustomJob(req.custom_job)
    check_job(job)
    if scenario == "quota":
        raise quota_error(project, where)
    jobs = CustomJobs.of(world)
    if jobs.first_region is None:
        jobs.first_region = where
    for field in ("name", "state", "create_time", "start_time", "end_time", "update_time", "error"):
        CustomJob.pb(job).ClearField(field)
    pool = job.job_spec.worker_pool_specs[0]
    for key, value in DEFAULT_DISK.items():
        if not getattr(pool.disk_spec, key):
            setattr(pool.disk_spec, key, value)
    name = f"{req.parent}/customJobs/{numeric_id(world)}"
    tl = job_timeline(scenario, region=where, held=held,
                      stocked_out=scenario == "stockout" and where == jobs.first_region)
    record = JobRecord(name=name, request=as_json(job), create_time=now, timeline=tl)
    jobs.jobs[name] = record
    return record


def cancel_custom_job(world: World, name: str, now: float) -> None:
    job = live_job(world, name, now)
    state = job.state_at(now)
    if state == "JOB_STATE_CANCELLING":
        return
    if state in JOB_TERMINAL:
        # Unconfirmed message; the code is the natural one.
        raise ApiError("FAILED_PRECONDITION", f"Cannot cancel CustomJob '{name}' in state {state}.")
    offset = now - job.create_time
    job.timeline = scenarios.ended(job.timeline, offset, (
        (offset, "JOB_STATE_CANCELLING"), (offset + JOB_CANCELLING_S, "JOB_STATE_CANCELLED")),
        dict(scenarios.JOB_CANCELLED_ERROR))


def delete_custom_job(world: World, name: str, now: float) -> Operation:
    parent = job_name(name)
    job = live_job(world, name, now)
    state = job.state_at(now)
    if job.deleted_at is None and state not in JOB_TERMINAL:
        # Unconfirmed message; the code is the natural one.
        raise ApiError("FAILED_PRECONDITION", f"CustomJob '{name}' is in state {state}; only a job that has "
                                              "ended can be deleted: cancel it first")
    if job.deleted_at is None:
        job.deleted_at = now
    # Unconfirmed: the service names its operations projects/P/locations/R/operations/ID.
    op = Operation(name=f"{parent}/operations/{numeric_id(world)}", service="vertex", verb="delete",
                   target=name, create_time=now, done_at=job.deleted_at + JOB_DELETING_S)
    return world.add_operation(op)


# --- RPCs --------------------------------------------------------------------------------


def CreateCustomJob(call: rpc.Call, req: v1.CreateCustomJobRequest):
    return job_view(create_custom_job(call.world, req, call.now, call.scenario, call.held), call.now)


def GetCustomJob(call: rpc.Call, req: v1.GetCustomJobRequest):
    return job_view(live_job(call.world, req.name, call.now), call.now)


def ListCustomJobs(call: rpc.Call, req: v1.ListCustomJobsRequest):
    region(req.parent)
    tests = parse_filter(req.filter)
    jobs = [j for j in CustomJobs.of(call.world).jobs.values()
            if j.name.startswith(req.parent + "/") and (state := j.state_at(call.now)) is not None
            and all(test(j.request, state) for test in tests)]
    jobs.sort(key=lambda j: j.create_time)  # stable: jobs created at one moment stay in creation order
    items, token = rpc.page(jobs, req.page_size, req.page_token)
    return v1.ListCustomJobsResponse(custom_jobs=[job_view(j, call.now) for j in items], next_page_token=token)


def CancelCustomJob(call: rpc.Call, req: v1.CancelCustomJobRequest):
    cancel_custom_job(call.world, req.name, call.now)
    return empty_pb2.Empty()


def DeleteCustomJob(call: rpc.Call, req: v1.DeleteCustomJobRequest):
    return operation_view(delete_custom_job(call.world, req.name, call.now), call.now)


METHODS: dict[str, tuple[Callable, Callable, Callable]] = {
    "CreateCustomJob": (CreateCustomJob, v1.CreateCustomJobRequest.deserialize, CustomJob.serialize),
    "GetCustomJob": (GetCustomJob, v1.GetCustomJobRequest.deserialize, CustomJob.serialize),
    "ListCustomJobs": (ListCustomJobs, v1.ListCustomJobsRequest.deserialize, v1.ListCustomJobsResponse.serialize),
    "CancelCustomJob": (CancelCustomJob, v1.CancelCustomJobRequest.deserialize, empty_pb2.Empty.SerializeToString),
    "DeleteCustomJob": (DeleteCustomJob, v1.DeleteCustomJobRequest.deserialize,
                        operations_pb2.Operation.SerializeToString),
}
