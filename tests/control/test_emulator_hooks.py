"""The hooks a dry run's local trainer uses (Emulator.service("tpu"), ("vertex")): what runs now,
preempting a slice, ending a job, and resources held up (external_workloads) until a hook ends them.
Read back through the real clients."""

from __future__ import annotations

import pytest
from google.cloud import aiplatform_v1 as v1
from google.cloud import tpu_v2

from provision.emulator import Emulator
from provision.emulator import scenarios as sc
from provision.emulator.vertex_world import RunningJob
from provision.emulator.world import RunningNode, WorldError

ZONE_PARENT = "projects/p/locations/us-west4-a"
REGION_PARENT = "projects/p/locations/us-west4"
QR_NAME = f"{ZONE_PARENT}/queuedResources/demo"
NODE_NAME = f"{ZONE_PARENT}/nodes/demo"
ACTIVE_SPOT_S = sc.CREATING_S + sc.ACCEPTED_S + sc.WAIT_SPOT_S + sc.PROVISIONING_S
RUNNING_AT = sc.JOB_QUEUED_S + sc.JOB_PENDING_S
DAY = 24 * 3600.0


def create_slice(emu: Emulator, accelerator: str = "v5litepod-16") -> None:
    node = tpu_v2.Node(accelerator_type=accelerator, runtime_version="v2-alpha-tpuv5-lite",
                       labels={"moe-tpu-run": "demo"}, metadata={"startup-script": "echo hi"})
    spec = tpu_v2.QueuedResource.Tpu.NodeSpec(parent=ZONE_PARENT, node_id="demo", node=node)
    qr = tpu_v2.QueuedResource(tpu=tpu_v2.QueuedResource.Tpu(node_spec=[spec]), spot=tpu_v2.QueuedResource.Spot())
    emu.client().create_queued_resource(parent=ZONE_PARENT, queued_resource_id="demo", queued_resource=qr).result()


def create_job(emu: Emulator) -> str:
    pool = v1.WorkerPoolSpec(machine_spec=v1.MachineSpec(machine_type="ct5lp-hightpu-4t", tpu_topology="4x8"),
                             replica_count=1, container_spec=v1.ContainerSpec(
                                 image_uri="img:1", command=["python", "-m", "trainer"], args=["--steps", "40"],
                                 env=[v1.EnvVar(name="A", value="1")]))
    job = v1.CustomJob(display_name="demo", labels={"moe-tpu-run": "demo"},
                       job_spec=v1.CustomJobSpec(worker_pool_specs=[pool]))
    return emu.job_client().create_custom_job(parent=REGION_PARENT, custom_job=job).name


def qr_state(emu: Emulator) -> tuple[str, str]:
    state = emu.client().get_queued_resource(name=QR_NAME).state
    return state.state.name, state.state_initiator.name


def node_states(emu: Emulator) -> list[str]:
    return [n.state.name for n in emu.client().list_nodes(parent=ZONE_PARENT)]


def job_of(emu: Emulator, name: str) -> v1.CustomJob:
    return emu.job_client().get_custom_job(name=name)


# --- what runs now ------------------------------------------------------------------------------


def test_running_lists_ready_nodes_and_running_jobs_only():
    with Emulator() as emu:
        create_slice(emu)
        name = create_job(emu)
        assert emu.service("tpu").running_nodes() == [] and emu.service("vertex").running_jobs() == []
        emu.clock.advance(ACTIVE_SPOT_S)
        assert emu.service("tpu").running_nodes() == [RunningNode(
            node=NODE_NAME, queued_resource=QR_NAME, run="demo", labels={"moe-tpu-run": "demo"},
            metadata={"startup-script": "echo hi"}, accelerator_type="v5litepod-16", workers=4)]
        assert emu.service("vertex").running_jobs() == [RunningJob(
            name=name, display_name="demo", run="demo", labels={"moe-tpu-run": "demo"}, image_uri="img:1",
            command=("python", "-m", "trainer"), args=("--steps", "40"), env={"A": "1"},
            machine_type="ct5lp-hightpu-4t", tpu_topology="4x8", workers=8)]
        emu.clock.advance(DAY)  # not held: the job succeeded on its own
        assert emu.service("vertex").running_jobs() == [] and len(emu.service("tpu").running_nodes()) == 1


# --- held resources and preemption ------------------------------------------------------------------


def test_a_held_slice_stays_active_until_preempted_now():
    with Emulator(scenario="preempt", external_workloads=True) as emu:
        create_slice(emu)
        emu.clock.advance(ACTIVE_SPOT_S + sc.PREEMPT_AFTER_ACTIVE_S + DAY)  # `preempt` would have struck
        assert qr_state(emu) == ("ACTIVE", "USER") and node_states(emu) == ["READY"]
        assert emu.service("tpu").preempt_queued_resource(QR_NAME) is True
        assert qr_state(emu) == ("SUSPENDING", "SERVICE") and node_states(emu) == ["PREEMPTED"]
        assert emu.service("tpu").running_nodes() == []
        assert emu.service("tpu").preempt_queued_resource(QR_NAME) is False  # already going
        emu.clock.advance(sc.SUSPENDING_S)
        assert qr_state(emu) == ("SUSPENDED", "SERVICE") and node_states(emu) == []
        with pytest.raises(WorldError, match="no queued resource"):
            emu.service("tpu").preempt_queued_resource(f"{ZONE_PARENT}/queuedResources/other")


def test_preempting_a_slice_overrides_its_timeline_and_waiting_ones_are_left_alone():
    with Emulator(scenario="happy") as emu:
        create_slice(emu)
        assert emu.service("tpu").preempt_queued_resource(QR_NAME) is False  # CREATING: nothing to preempt
        emu.clock.advance(ACTIVE_SPOT_S + 60)
        assert emu.world_call(lambda world, now: world.preempt_queued_resource(QR_NAME, now)) is True
        emu.clock.advance(sc.SUSPENDING_S)
        assert qr_state(emu) == ("SUSPENDED", "SERVICE")
        emu.clock.advance(DAY)
        assert qr_state(emu) == ("SUSPENDED", "SERVICE")


def test_a_held_job_runs_until_ended_then_succeeds_now():
    with Emulator(external_workloads=True) as emu:
        name = create_job(emu)
        emu.clock.advance(RUNNING_AT + DAY)
        assert job_of(emu, name).state == v1.JobState.JOB_STATE_RUNNING
        assert [j.name for j in emu.service("vertex").running_jobs()] == [name]
        assert emu.service("vertex").end_custom_job(name, succeeded=True) is True
        done = job_of(emu, name)
        assert done.state == v1.JobState.JOB_STATE_SUCCEEDED and "error" not in done
        assert done.end_time.timestamp() == emu.clock.now()
        assert emu.service("vertex").end_custom_job(name, succeeded=False) is False  # already ended
        assert emu.service("vertex").running_jobs() == []


@pytest.mark.parametrize("kwargs, error", [
    ({"error": (13, "trainer crashed")}, (13, "trainer crashed")),
    ({}, (3, "The replica workerpool0-0 exited with a non-zero status of 1. Termination reason: Error.")),
    ({"preempted": True}, (sc.JOB_PREEMPTED_ERROR["code"], sc.JOB_PREEMPTED_ERROR["message"])),
])
def test_ending_a_job_as_failed(kwargs, error):
    with Emulator(scenario="preempt", external_workloads=True) as emu:
        name = create_job(emu)
        emu.clock.advance(RUNNING_AT + sc.PREEMPT_AFTER_ACTIVE_S + 60)
        assert job_of(emu, name).state == v1.JobState.JOB_STATE_RUNNING  # held: `preempt` does not strike
        assert emu.service("vertex").end_custom_job(name, succeeded=False, **kwargs) is True
        failed = job_of(emu, name)
        assert failed.state == v1.JobState.JOB_STATE_FAILED
        assert (failed.error.code, failed.error.message) == error
        assert failed.end_time.timestamp() == emu.clock.now()
        assert failed.start_time.timestamp() == failed.create_time.timestamp() + RUNNING_AT


def test_ending_a_job_that_is_being_cancelled_or_missing():
    with Emulator(external_workloads=True) as emu:
        name = create_job(emu)
        emu.clock.advance(RUNNING_AT)
        emu.job_client().cancel_custom_job(name=name)
        assert emu.service("vertex").end_custom_job(name, succeeded=True) is False
        emu.clock.advance(sc.JOB_CANCELLING_S)
        assert job_of(emu, name).state == v1.JobState.JOB_STATE_CANCELLED
        with pytest.raises(WorldError, match="no custom job"):
            emu.service("vertex").end_custom_job(f"{REGION_PARENT}/customJobs/1", succeeded=True)
        other = create_job(emu)
        with pytest.raises(WorldError, match="no error"):
            emu.service("vertex").end_custom_job(other, succeeded=True, error=(13, "x"))


def test_hooks_persist_in_the_state_file(tmp_path):
    path = tmp_path / "emulator.json"
    with Emulator(state_path=path, external_workloads=True) as emu:
        name = create_job(emu)
        create_slice(emu)
        emu.clock.advance(ACTIVE_SPOT_S + RUNNING_AT)
    hook = Emulator(state_path=path)  # not serving: the hooks work on the file alone
    tpu, vertex = hook.service("tpu"), hook.service("vertex")
    with pytest.raises(ValueError, match="no emulated service 'tpu-vm': the services are gke, tpu, vertex"):
        hook.service("tpu-vm")  # a kind of target, not a service
    assert [j.name for j in vertex.running_jobs()] == [name] and len(tpu.running_nodes()) == 1
    assert vertex.end_custom_job(name, succeeded=True) and tpu.preempt_queued_resource(QR_NAME)
    with Emulator(state_path=path) as emu:
        assert job_of(emu, name).state == v1.JobState.JOB_STATE_SUCCEEDED
        assert qr_state(emu) == ("SUSPENDING", "SERVICE")
