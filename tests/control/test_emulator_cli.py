"""`moe-tpu emulator serve`: a real process serving the real TpuClient and JobServiceClient on loopback;
Ctrl-C exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from google.cloud import aiplatform_v1 as v1
from google.cloud import tpu_v2

from provision.cli import main
from provision.emulator import ScaledClock

PARENT = "projects/p/locations/us-west4-a"


def _read_document(stream) -> dict:
    """The one JSON document the command prints on stdout when it starts serving."""
    lines = []
    while True:
        line = stream.readline()
        if not line:
            raise AssertionError("serve exited before printing its address: " + "".join(lines))
        lines.append(line)
        if line.rstrip() == "}":
            return json.loads("".join(lines))


def _client(address: str):
    from google.auth.credentials import AnonymousCredentials
    from google.cloud.tpu_v2.services.tpu.transports import TpuGrpcTransport

    channel = grpc.insecure_channel(address)
    return tpu_v2.TpuClient(transport=TpuGrpcTransport(channel=channel, credentials=AnonymousCredentials())), channel


def _job_client(channel):
    from google.auth.credentials import AnonymousCredentials
    from google.cloud.aiplatform_v1.services.job_service.transports import JobServiceGrpcTransport

    return v1.JobServiceClient(transport=JobServiceGrpcTransport(channel=channel, credentials=AnonymousCredentials()))


def test_serve_answers_the_real_client_and_stops_cleanly_on_ctrl_c(tmp_path):
    state = tmp_path / "world.json"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "provision", "--output", "json", "--scenario", "happy", "emulator", "serve",
         "--port", "0", "--speed", "3600", "--state", str(state)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        document = _read_document(proc.stdout)
        assert document["command"] == "emulator serve" and document["result"] == "serving"
        address = document["address"]
        assert address.startswith("127.0.0.1:")
        client, channel = _client(address)
        node = tpu_v2.Node(accelerator_type="v5litepod-8", runtime_version="v2-alpha-tpuv5-lite")
        spec = tpu_v2.QueuedResource.Tpu.NodeSpec(parent=PARENT, node_id="n", node=node)
        client.create_queued_resource(request=tpu_v2.CreateQueuedResourceRequest(
            parent=PARENT, queued_resource_id="q",
            queued_resource=tpu_v2.QueuedResource(tpu=tpu_v2.QueuedResource.Tpu(node_spec=[spec]))))
        deadline = time.monotonic() + 300
        while client.get_queued_resource(name=f"{PARENT}/queuedResources/q").state.state.name != "ACTIVE":
            assert time.monotonic() < deadline, "an hour of simulated time per second should be plenty"
            time.sleep(0.05)
        jobs = _job_client(channel)
        pool = v1.WorkerPoolSpec(machine_spec=v1.MachineSpec(machine_type="ct5lp-hightpu-1t"), replica_count=1,
                                 container_spec=v1.ContainerSpec(image_uri="img"))
        job = jobs.create_custom_job(parent="projects/p/locations/us-west4", custom_job=v1.CustomJob(
            display_name="j", job_spec=v1.CustomJobSpec(worker_pool_specs=[pool])))
        assert jobs.get_custom_job(name=job.name).display_name == "j"
        channel.close()
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=20)
    assert proc.returncode == 0, err
    assert "emulator stopped" in err
    saved = json.loads(state.read_text())
    assert [q["name"] for q in saved["tpu"]["queued_resources"]] == [f"{PARENT}/queuedResources/q"]
    assert [j["request"]["display_name"] for j in saved["vertex"]["custom_jobs"]] == ["j"]


def test_unknown_scenario_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--scenario", "sunny", "emulator", "serve"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown emulator scenario 'sunny'" in err and "long-queue" in err


def test_help_shows_examples(capsys):
    with pytest.raises(SystemExit) as info:
        main(["emulator", "serve", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "moe-tpu emulator serve --port 8470" in out and "--speed" in out and "--state" in out


def test_scaled_clock_runs_at_its_speed():
    clock = ScaledClock(speed=1000.0, start=0.0)
    before = time.monotonic()
    clock.sleep(50.0)  # 50 simulated seconds: 0.05 real
    # It slept (not 0) and scaled (not 50 real seconds); the slack is the loaded machine's.
    assert 0.04 <= time.monotonic() - before < 25.0
    assert clock.now() >= 50.0
    clock.set(10_000.0)
    assert 10_000.0 <= clock.now() < 11_000.0
    clock.set(0.0)  # never back
    assert clock.now() >= 10_000.0
    with pytest.raises(ValueError):
        ScaledClock(speed=0)
