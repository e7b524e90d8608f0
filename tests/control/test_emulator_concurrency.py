"""One world on disk shared by concurrent processes: every RPC locks the state file, reloads what
others saved, applies and saves, so no process's resources go missing. And the state file's
version and shape are checked with a clear error."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from google.cloud import aiplatform_v1 as v1
from google.cloud import tpu_v2

from provision.emulator import Emulator
from provision.emulator import scenarios as sc
from provision.errors import UsageError

ZONE_PARENT = "projects/p/locations/us-west4-a"
REGION_PARENT = "projects/p/locations/us-west4"
CREATES = 8

# One process's work: wait for the go file, then create CREATES queued resources and as many custom
# jobs, interleaved, each labelled with the process's run name.
WORKER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from google.cloud import aiplatform_v1 as v1, tpu_v2
    from provision.emulator import Emulator

    state, run, go, n = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
    zone, region = "projects/p/locations/us-west4-a", "projects/p/locations/us-west4"
    with Emulator(state_path=state) as emu:
        tpu, jobs = emu.client(), emu.job_client()
        print("ready", flush=True)
        while not go.exists():
            time.sleep(0.005)
        for i in range(n):
            node = tpu_v2.Node(accelerator_type="v5litepod-8", runtime_version="v2-alpha-tpuv5-lite",
                               labels={"moe-tpu-run": run})
            spec = tpu_v2.QueuedResource.Tpu.NodeSpec(parent=zone, node_id=f"{run}-{i}", node=node)
            tpu.create_queued_resource(parent=zone, queued_resource_id=f"{run}-{i}",
                                       queued_resource=tpu_v2.QueuedResource(tpu={"node_spec": [spec]}))
            pool = v1.WorkerPoolSpec(machine_spec=v1.MachineSpec(machine_type="ct5lp-hightpu-1t"), replica_count=1,
                                     container_spec=v1.ContainerSpec(image_uri="img"))
            jobs.create_custom_job(parent=region, custom_job=v1.CustomJob(
                display_name=f"{run}-{i}", labels={"moe-tpu-run": run},
                job_spec=v1.CustomJobSpec(worker_pool_specs=[pool])))
    print("done", flush=True)
""")


def test_two_processes_creating_at_once_lose_nothing(tmp_path: Path):
    state, go = tmp_path / ".moe-tpu" / "emulator.json", tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(state), run, str(go), str(CREATES)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for run in ("run-a", "run-b")]
    try:
        for proc in procs:  # both serving before either starts creating
            assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        go.touch()
        for proc in procs:
            out, err = proc.communicate(timeout=60)
            assert proc.returncode == 0 and out.strip() == "done", err
    finally:
        for proc in procs:
            proc.kill()
    with Emulator(state_path=state) as emu:
        queued = [q.name.rsplit("/", 1)[1] for q in emu.client().list_queued_resources(parent=ZONE_PARENT)]
        jobs = emu.job_client()
        by_run = {run: sorted(j.display_name for j in jobs.list_custom_jobs(request=v1.ListCustomJobsRequest(
            parent=REGION_PARENT, filter=f'labels.moe-tpu-run="{run}"'))) for run in ("run-a", "run-b")}
    expected = {run: sorted(f"{run}-{i}" for i in range(CREATES)) for run in ("run-a", "run-b")}
    assert sorted(queued) == sorted(expected["run-a"] + expected["run-b"])
    assert by_run == expected
    assert not list(state.parent.glob(".emulator-*"))  # no temp file left behind


def test_each_rpc_sees_what_another_emulator_saved_and_time_only_moves_forward(tmp_path: Path):
    path = tmp_path / "emulator.json"
    with Emulator(state_path=path) as first, Emulator(state_path=path) as second:
        node = tpu_v2.Node(accelerator_type="v5litepod-8", runtime_version="v2-alpha-tpuv5-lite")
        spec = tpu_v2.QueuedResource.Tpu.NodeSpec(parent=ZONE_PARENT, node_id="n", node=node)
        first.client().create_queued_resource(parent=ZONE_PARENT, queued_resource_id="q",
                                              queued_resource=tpu_v2.QueuedResource(tpu={"node_spec": [spec]}))
        first.clock.advance(3600)
        first.world_call(lambda world, now: None)  # saves the world with first's time
        assert second.clock.now() < first.clock.now()
        found = second.client().get_queued_resource(name=f"{ZONE_PARENT}/queuedResources/q")
        assert found.state.state.name == "ACTIVE"  # second's clock jumped to the saved time
        assert second.clock.now() == first.clock.now()
        second.clock.advance(600)
        pool = v1.WorkerPoolSpec(machine_spec=v1.MachineSpec(machine_type="ct5lp-hightpu-1t"), replica_count=1,
                                 container_spec=v1.ContainerSpec(image_uri="img"))
        job = second.job_client().create_custom_job(parent=REGION_PARENT, custom_job=v1.CustomJob(
            display_name="j", job_spec=v1.CustomJobSpec(worker_pool_specs=[pool])))
        assert [j.name for j in first.job_client().list_custom_jobs(parent=REGION_PARENT)] == [job.name]
        assert first.clock.now() == second.clock.now()


# --- the state file's version and shape ----------------------------------------------------------


@pytest.mark.parametrize("content, fragment", [
    ('{"version": 1, "now": 0, "queued_resources": [], "operations": []}',
     "it holds emulator state version 1; this moe-tpu reads version 2"),
    ("[]", "version None"),
    ('{"version": 2, "now": 0}', "'tpu'"),
    ("{not json", "Expecting property name"),
])
def test_an_old_or_malformed_state_file_is_a_usage_error_naming_it(tmp_path: Path, content: str, fragment: str):
    path = tmp_path / "emulator.json"
    path.write_text(content)
    with pytest.raises(UsageError) as info:
        Emulator(state_path=path).start()
    assert info.value.message.startswith(f"cannot read the emulator state {path}: ")
    assert fragment in info.value.message
    assert info.value.hint == f"delete {path} to start a fresh emulated world"
    assert info.value.exit_code == 2


def test_serve_on_an_old_state_file_exits_2_without_a_traceback(tmp_path: Path):
    path = tmp_path / "world.json"
    path.write_text(json.dumps({"version": 1, "now": 0}))
    done = subprocess.run([sys.executable, "-m", "provision", "emulator", "serve", "--state", str(path)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"cannot read the emulator state {path}" in done.stderr and f"delete {path}" in done.stderr


def test_a_state_file_removed_while_serving_starts_a_fresh_world(tmp_path: Path):
    path = tmp_path / "emulator.json"
    with Emulator(state_path=path) as emu:
        pool = v1.WorkerPoolSpec(machine_spec=v1.MachineSpec(machine_type="ct5lp-hightpu-1t"), replica_count=1,
                                 container_spec=v1.ContainerSpec(image_uri="img"))
        emu.job_client().create_custom_job(parent=REGION_PARENT, custom_job=v1.CustomJob(
            display_name="j", job_spec=v1.CustomJobSpec(worker_pool_specs=[pool])))
        path.unlink()
        assert list(emu.job_client().list_custom_jobs(parent=REGION_PARENT)) == []
        emu.clock.advance(sc.JOB_RUN_S)
    assert json.loads(path.read_text())["vertex"]["custom_jobs"] == []


def test_a_state_file_corrupted_under_a_running_server_is_an_internal_error_naming_it(tmp_path: Path):
    from google.api_core import exceptions as gexc

    path = tmp_path / "emulator.json"
    with Emulator(state_path=path) as emu:
        client = emu.client()
        assert list(client.list_queued_resources(parent=ZONE_PARENT)) == []
        path.write_text("{not json")
        with pytest.raises(gexc.InternalServerError) as info:
            list(client.list_queued_resources(parent=ZONE_PARENT))
        assert f"cannot read the emulator state {path}" in info.value.message
        path.unlink()
