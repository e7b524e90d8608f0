"""Vertex AI custom jobs through the real google.cloud.aiplatform_v1 JobServiceClient (no mocks):
every state path, listing, cancel, delete, validation, and each scenario."""

from __future__ import annotations

import pytest
from google.api_core import exceptions as gexc
from google.cloud import aiplatform_v1 as v1
from google.rpc import error_details_pb2

from provision.catalogue import VERTEX_MACHINE_TOPOLOGIES
from provision.emulator import Emulator
from provision.emulator import scenarios as sc

REGION = "us-west4"
PARENT = f"projects/my-project/locations/{REGION}"
S = v1.JobState
RUNNING_AT = sc.JOB_QUEUED_S + sc.JOB_PENDING_S


def custom_job(display_name: str = "moe-demo", labels: dict[str, str] | None = None,
               machine_type: str = "ct5lp-hightpu-4t", topology: str = "4x4", image: str = "img:1",
               args: tuple[str, ...] = ("--steps", "40"), pools: int = 1, spot: bool = False) -> v1.CustomJob:
    pool = v1.WorkerPoolSpec(machine_spec=v1.MachineSpec(machine_type=machine_type, tpu_topology=topology),
                             replica_count=1, container_spec=v1.ContainerSpec(image_uri=image, args=list(args)))
    spec = v1.CustomJobSpec(worker_pool_specs=[pool] * pools)
    if spot:
        spec.scheduling = v1.Scheduling(strategy=v1.Scheduling.Strategy.SPOT)
    return v1.CustomJob(display_name=display_name, labels=labels if labels is not None else {"moe-tpu-run": "demo"},
                        job_spec=spec)


@pytest.fixture
def emu():
    with Emulator() as emulator:
        yield emulator


@pytest.fixture
def jobs(emu):
    return emu.job_client()


def create(jobs, parent: str = PARENT, **kwargs) -> v1.CustomJob:
    return jobs.create_custom_job(parent=parent, custom_job=custom_job(**kwargs))


def state(jobs, name: str) -> str:
    return jobs.get_custom_job(name=name).state.name


def at(emu, start: float, t: float) -> None:
    emu.clock.advance(start + t - emu.clock.now())


# --- the happy path --------------------------------------------------------------------------


def test_a_job_goes_queued_pending_running_succeeded_with_its_times(emu, jobs):
    start = emu.clock.now()
    job = create(jobs)
    assert job.name.startswith(f"{PARENT}/customJobs/") and job.name.rsplit("/", 1)[1].isdigit()
    assert job.state == S.JOB_STATE_QUEUED
    assert job.create_time.timestamp() == start and job.update_time.timestamp() == start
    assert "start_time" not in job and "end_time" not in job and "error" not in job
    pool = job.job_spec.worker_pool_specs[0]
    assert list(pool.container_spec.args) == ["--steps", "40"] and dict(job.labels) == {"moe-tpu-run": "demo"}
    assert (pool.disk_spec.boot_disk_type, pool.disk_spec.boot_disk_size_gb) == ("pd-ssd", 100)

    seen = []
    for t in (sc.JOB_QUEUED_S - 1, sc.JOB_QUEUED_S, RUNNING_AT - 1, RUNNING_AT, RUNNING_AT + sc.JOB_RUN_S - 1):
        at(emu, start, t)
        seen.append(state(jobs, job.name))
    assert seen == ["JOB_STATE_QUEUED", "JOB_STATE_PENDING", "JOB_STATE_PENDING", "JOB_STATE_RUNNING",
                    "JOB_STATE_RUNNING"]
    running = jobs.get_custom_job(name=job.name)
    assert running.start_time.timestamp() == start + RUNNING_AT
    assert running.update_time.timestamp() == start + RUNNING_AT and "end_time" not in running
    at(emu, start, RUNNING_AT + sc.JOB_RUN_S)
    done = jobs.get_custom_job(name=job.name)
    assert done.state == S.JOB_STATE_SUCCEEDED and "error" not in done
    assert done.end_time.timestamp() == done.update_time.timestamp() == start + RUNNING_AT + sc.JOB_RUN_S
    assert done.start_time.timestamp() == start + RUNNING_AT


def test_get_missing_and_malformed_names(jobs):
    with pytest.raises(gexc.NotFound) as info:
        jobs.get_custom_job(name=f"{PARENT}/customJobs/123")
    assert info.value.message == f"Resource '{PARENT}/customJobs/123' was not found"
    with pytest.raises(gexc.InvalidArgument):
        jobs.get_custom_job(name=f"{PARENT}/customJobs/not-a-number")


def test_other_job_service_methods_are_unimplemented(jobs):
    with pytest.raises(gexc.MethodNotImplemented):
        jobs.get_hyperparameter_tuning_job(name=f"{PARENT}/hyperparameterTuningJobs/1")


# --- listing ------------------------------------------------------------------------------------


def names(found) -> list[str]:
    return [j.display_name for j in found]


def test_list_filters_on_labels_state_and_name_and_pages(emu, jobs):
    for i in range(5):
        create(jobs, display_name=f"job-{i}", labels={"moe-tpu-run": "a" if i % 2 == 0 else "b", "n": str(i)})
    create(jobs, parent="projects/my-project/locations/us-central1", display_name="elsewhere")

    def listed(text: str = "", page_size: int = 0) -> list[str]:
        request = v1.ListCustomJobsRequest(parent=PARENT, filter=text, page_size=page_size)
        return names(jobs.list_custom_jobs(request=request))

    assert listed() == [f"job-{i}" for i in range(5)]
    assert listed('labels.moe-tpu-run="a"') == ["job-0", "job-2", "job-4"]
    assert listed('labels.moe-tpu-run="a" AND labels.n="2"') == ["job-2"]
    assert listed("labels.moe-tpu-run=b AND labels.n:*") == ["job-1", "job-3"]
    assert listed('labels.missing:*') == [] and listed('labels.moe-tpu-run="c"') == []
    assert listed('display_name="job-3"') == ["job-3"]
    assert listed("state=JOB_STATE_QUEUED") == listed()
    emu.clock.advance(RUNNING_AT)
    assert listed('state="JOB_STATE_RUNNING" AND labels.moe-tpu-run="b"') == ["job-1", "job-3"]
    pages = list(jobs.list_custom_jobs(request=v1.ListCustomJobsRequest(parent=PARENT, page_size=2)).pages)
    assert [len(p.custom_jobs) for p in pages] == [2, 2, 1]
    assert listed(page_size=2) == [f"job-{i}" for i in range(5)]
    for bad in ('labels.a="x" OR labels.b="y"', "labels.a", "state=JOB_STATE_SLEEPING"):
        with pytest.raises(gexc.InvalidArgument):
            listed(bad)


# --- cancel and delete --------------------------------------------------------------------------


def test_cancel_a_running_job_ends_cancelled_with_code_1(emu, jobs):
    job = create(jobs)
    emu.clock.advance(RUNNING_AT + 60)
    assert jobs.cancel_custom_job(name=job.name) is None
    assert state(jobs, job.name) == "JOB_STATE_CANCELLING"
    jobs.cancel_custom_job(name=job.name)  # again while cancelling: fine
    emu.clock.advance(sc.JOB_CANCELLING_S)
    cancelled = jobs.get_custom_job(name=job.name)
    assert cancelled.state == S.JOB_STATE_CANCELLED
    assert (cancelled.error.code, cancelled.error.message) == (1, sc.JOB_CANCELLED_ERROR["message"])
    assert cancelled.end_time.timestamp() == emu.clock.now()
    with pytest.raises(gexc.FailedPrecondition):
        jobs.cancel_custom_job(name=job.name)
    emu.clock.advance(10 * 3600)
    assert state(jobs, job.name) == "JOB_STATE_CANCELLED"  # it never succeeds after all


def test_cancel_a_queued_job(emu, jobs):
    job = create(jobs)
    jobs.cancel_custom_job(name=job.name)
    emu.clock.advance(sc.JOB_CANCELLING_S)
    cancelled = jobs.get_custom_job(name=job.name)
    assert cancelled.state == S.JOB_STATE_CANCELLED and "start_time" not in cancelled


def test_delete_only_an_ended_job_as_an_operation(emu, jobs):
    job = create(jobs)
    with pytest.raises(gexc.FailedPrecondition, match="cancel it first"):
        jobs.delete_custom_job(name=job.name)
    emu.clock.advance(RUNNING_AT)
    with pytest.raises(gexc.FailedPrecondition):
        jobs.delete_custom_job(name=job.name)
    jobs.cancel_custom_job(name=job.name)
    emu.clock.advance(sc.JOB_CANCELLING_S)
    operation = jobs.delete_custom_job(name=job.name)
    assert not operation.done()
    assert operation.operation.name.startswith(f"{PARENT}/operations/")
    assert operation.metadata.generic_metadata.create_time.timestamp() == emu.clock.now()
    again = jobs.delete_custom_job(name=job.name)  # while deleting: the same end
    emu.clock.advance(sc.JOB_DELETING_S)
    assert operation.done() and again.done()
    operation.result()  # google.protobuf.Empty
    ops = jobs.transport.operations_client
    assert ops.get_operation(operation.operation.name).done
    with pytest.raises(gexc.NotFound):
        jobs.get_custom_job(name=job.name)
    assert list(jobs.list_custom_jobs(parent=PARENT)) == []
    with pytest.raises(gexc.NotFound):
        jobs.delete_custom_job(name=job.name)


def test_delete_a_succeeded_job(emu, jobs):
    job = create(jobs)
    emu.clock.advance(RUNNING_AT + sc.JOB_RUN_S)
    operation = jobs.delete_custom_job(name=job.name)
    emu.clock.advance(sc.JOB_DELETING_S)
    assert operation.done()


# --- validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, error, message", [
    ({"machine_type": "n1-standard-4"}, gexc.InvalidArgument, 'Machine type "n1-standard-4" is not supported.'),
    ({"machine_type": "ct5lp-hightpu-8t", "topology": "4x4"}, gexc.InvalidArgument,
     'TPU topology "4x4" is not supported for machine type "ct5lp-hightpu-8t"'),
    ({"machine_type": "ct5lp-hightpu-1t", "topology": "2x2"}, gexc.InvalidArgument, 'TPU topology "2x2"'),
    ({"machine_type": "ct5lp-hightpu-4t", "topology": "1x1"}, gexc.InvalidArgument, 'TPU topology "1x1"'),
    ({"display_name": ""}, gexc.InvalidArgument, "display_name is required"),
    ({"display_name": "x" * 129}, gexc.InvalidArgument, "longer than 128"),
    ({"pools": 0}, gexc.InvalidArgument, "has 0 pools"),
    ({"pools": 2}, gexc.InvalidArgument, "has 2 pools"),
    ({"image": ""}, gexc.InvalidArgument, "container_spec.image_uri is required"),
    ({"labels": {"run": "moe.demo"}}, gexc.InvalidArgument,
     "resource labels are invalid: value \"moe.demo\" contains invalid character '.' at index 3 for key \"run\""),
    ({"spot": True}, gexc.InvalidArgument, "Spot VMs are not supported with TPU Pods"),
    ({"parent": "projects/p/locations/us-west4-a"}, gexc.InvalidArgument, "is not a Vertex AI region"),
    ({"parent": "projects/p/regions/us-west4"}, gexc.InvalidArgument, "is not of the form"),
])
def test_invalid_jobs_are_refused_with_the_real_codes(jobs, kwargs, error, message):
    parent = kwargs.pop("parent", PARENT)
    with pytest.raises(error) as info:
        create(jobs, parent=parent, **kwargs)
    assert message in info.value.message
    assert list(jobs.list_custom_jobs(parent=PARENT)) == []


def test_accelerator_type_must_fit_the_machine(jobs):
    job = custom_job()
    job.job_spec.worker_pool_specs[0].machine_spec.accelerator_type = v1.AcceleratorType.NVIDIA_TESLA_T4
    with pytest.raises(gexc.InvalidArgument) as info:
        jobs.create_custom_job(parent=PARENT, custom_job=job)
    assert info.value.message == 'Accelerator "NVIDIA_TESLA_T4" is not supported for machine type "ct5lp-hightpu-4t"'
    job.job_spec.worker_pool_specs[0].machine_spec.accelerator_type = v1.AcceleratorType.TPU_V5_LITEPOD
    jobs.create_custom_job(parent=PARENT, custom_job=job)


def test_every_catalogue_topology_is_accepted_and_spot_on_one_host(emu, jobs):
    for machine_type, topologies in VERTEX_MACHINE_TOPOLOGIES.items():
        for topology in topologies:
            create(jobs, machine_type=machine_type, topology=topology, display_name=f"{machine_type}-{topology}")
    create(jobs, machine_type="ct5lp-hightpu-8t", topology="2x4", spot=True)
    assert len(list(jobs.list_custom_jobs(parent=PARENT))) == sum(map(len, VERTEX_MACHINE_TOPOLOGIES.values())) + 1


# --- scenarios ----------------------------------------------------------------------------------


def test_long_queue_waits_hours_queued_then_pending():
    with Emulator(scenario="long-queue") as emu:
        jobs = emu.job_client()
        job = create(jobs)
        emu.clock.advance(sc.LONG_QUEUE_JOB_QUEUED_S - 1)
        assert state(jobs, job.name) == "JOB_STATE_QUEUED"
        emu.clock.advance(1 + sc.LONG_QUEUE_JOB_PENDING_S - 1)
        assert state(jobs, job.name) == "JOB_STATE_PENDING"
        emu.clock.advance(1)
        assert state(jobs, job.name) == "JOB_STATE_RUNNING"


def test_quota_is_resource_exhausted_at_create_with_a_quota_failure():
    with Emulator(scenario="quota") as emu:
        jobs = emu.job_client()
        with pytest.raises(gexc.ResourceExhausted) as info:
            create(jobs)
        assert info.value.message == ("The following quota metrics exceed quota limits: "
                                      "aiplatform.googleapis.com/custom_model_training_tpu_v5e")
        failures = [d for d in info.value.details if isinstance(d, error_details_pb2.QuotaFailure)]
        assert failures[0].violations[0].quota_metric == "aiplatform.googleapis.com/custom_model_training_tpu_v5e"
        assert list(jobs.list_custom_jobs(parent=PARENT)) == []
        with pytest.raises(gexc.InvalidArgument):  # still validated first
            create(jobs, machine_type="n1-standard-4")


def test_stockout_waits_pending_then_fails_with_code_8_in_the_first_region_only():
    with Emulator(scenario="stockout") as emu:
        jobs = emu.job_client()
        job = create(jobs)
        emu.clock.advance(sc.JOB_QUEUED_S + sc.STOCKOUT_WAIT_S - 1)
        assert state(jobs, job.name) == "JOB_STATE_PENDING"
        emu.clock.advance(1)
        failed = jobs.get_custom_job(name=job.name)
        assert failed.state == S.JOB_STATE_FAILED and "start_time" not in failed
        assert (failed.error.code, failed.error.message) == (
            8, f"Resources are insufficient in region: {REGION}. Please try a different region.")
        other = create(jobs, parent="projects/my-project/locations/us-central1")
        emu.clock.advance(RUNNING_AT)
        assert state(jobs, other.name) == "JOB_STATE_RUNNING"


def test_preempt_runs_then_fails_as_a_preempted_job():
    with Emulator(scenario="preempt") as emu:
        jobs = emu.job_client()
        job = create(jobs)
        emu.clock.advance(RUNNING_AT + sc.PREEMPT_AFTER_ACTIVE_S - 1)
        assert state(jobs, job.name) == "JOB_STATE_RUNNING"
        emu.clock.advance(1)
        failed = jobs.get_custom_job(name=job.name)
        assert failed.state == S.JOB_STATE_FAILED and failed.start_time.timestamp() > 0
        assert (failed.error.code, failed.error.message) == (
            sc.JOB_PREEMPTED_ERROR["code"], sc.JOB_PREEMPTED_ERROR["message"])
        assert "preempted" in failed.error.message


def retried(fn, attempts: int = sc.FLAKY_MAX_IN_A_ROW + 1):
    for _ in range(attempts - 1):
        try:
            return fn()
        except gexc.ServiceUnavailable:
            continue
    return fn()


def test_flaky_lost_create_is_found_by_its_labels_and_not_created_twice():
    with Emulator(scenario="flaky", seed=3) as emu:
        jobs = emu.job_client()
        labels = {"moe-tpu-run": "demo", "moe-tpu-attempt": "a1b2"}
        with pytest.raises(gexc.ServiceUnavailable) as info:
            create(jobs, labels=labels)  # the first create is always applied and its answer lost
        assert info.value.message == "The service is currently unavailable."
        request = v1.ListCustomJobsRequest(parent=PARENT, filter='labels.moe-tpu-attempt="a1b2"')
        found = retried(lambda: list(jobs.list_custom_jobs(request=request)))
        assert len(found) == 1 and dict(found[0].labels) == labels
        assert retried(lambda: state(jobs, found[0].name)) == "JOB_STATE_QUEUED"


def test_flaky_fails_job_service_calls_too_never_three_in_a_row():
    with Emulator(scenario="flaky", seed=5) as emu:
        jobs = emu.job_client()
        outcomes = []
        for _ in range(120):
            try:
                list(jobs.list_custom_jobs(parent=PARENT))
                outcomes.append("T")
            except gexc.ServiceUnavailable:
                outcomes.append("F")
    assert 10 <= outcomes.count("F") <= 50 and "FFF" not in "".join(outcomes)


def test_jobs_persist_across_restarts(tmp_path):
    path = tmp_path / "emulator.json"
    with Emulator(state_path=path) as emu:
        job = create(emu.job_client())
        emu.clock.advance(RUNNING_AT)
    with Emulator(state_path=path) as emu:
        jobs = emu.job_client()
        assert state(jobs, job.name) == "JOB_STATE_RUNNING"
        emu.clock.advance(sc.JOB_RUN_S)
        assert state(jobs, job.name) == "JOB_STATE_SUCCEEDED"
