"""The Vertex AI custom job lifecycle through the real aiplatform_v1 JobServiceClient against the emulator.
`job submit --wait` runs as a process of its own (and one is killed); the other commands in this process through
the real entry point (cli_helpers.run_here)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from cli_helpers import loaded_config, run_here, run_process

from provision.app import App
from provision.errors import CloudError, QuotaError, UsageError
from provision.kinds.vertex.jobs import job_cancel, job_submit, job_wait, jobs_down, managed_jobs

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "vertex.yaml"
CREATE = "google.cloud.aiplatform.v1.JobService/CreateCustomJob"


def make_config(tmp_path: Path, name: str = "moe-tpu.yaml", **top):
    return loaded_config(EXAMPLE, tmp_path, name, **top)


@pytest.fixture
def session_in(tmp_path):
    apps: list[App] = []

    def open_session(scenario: str = "happy"):
        app = App(dry_run=True, scenario=scenario, output="json", workdir=tmp_path)
        apps.append(app)
        return app

    yield open_session
    for app in apps:
        app.close()


def test_submit_wait_succeeds_with_the_rendered_request(tmp_path, session_in):
    cfg = make_config(tmp_path)
    app = session_in()
    job = job_submit(app.context(cfg))
    assert job.kind == "custom_job" and job.name.startswith("projects/my-project/locations/us-west4/customJobs/")
    done = job_wait(app.context(cfg), job.name)
    assert done.state == "JOB_STATE_SUCCEEDED"
    creates = [c for c in app.calls if c["rpc"] == CREATE]
    assert len(creates) == 1
    pool = creates[0]["request"]["custom_job"]["job_spec"]["worker_pool_specs"][0]
    assert pool["machine_spec"] == {"machine_type": "ct5lp-hightpu-4t", "tpu_topology": "8x8"}
    assert pool["container_spec"]["image_uri"] == "us-west4-docker.pkg.dev/my-project/moe/trainer:v1"
    assert pool["container_spec"]["args"][:2] == ["--config", "glam-small"]
    assert creates[0]["request"]["custom_job"]["labels"] == {"managed-by": "moe-tpu", "moe-tpu-run": "moe-vertex"}


def test_a_second_submit_follows_the_running_job(tmp_path, session_in):
    cfg = make_config(tmp_path)
    before = session_in()
    first = job_submit(before.context(cfg))
    app = session_in()
    again = job_submit(app.context(cfg))
    assert again.name == first.name
    assert not [c for c in app.calls if c["rpc"] == CREATE]


def test_cancel_ends_cancelled_and_down_leaves_nothing(tmp_path, session_in):
    cfg = make_config(tmp_path)
    app = session_in()
    job_submit(app.context(cfg))
    cancelled = job_cancel(app.context(cfg))
    assert [j.state for j in cancelled] == ["JOB_STATE_CANCELLED"]
    with pytest.raises(CloudError, match="JOB_STATE_CANCELLED"):
        job_wait(app.context(cfg))
    deleted = jobs_down(app.context(cfg))
    assert [j.kind for j in deleted] == ["custom_job"]
    assert managed_jobs(app.session(), "my-project", "us-west4") == []


def test_down_cancels_a_running_job_first(tmp_path, session_in):
    cfg = make_config(tmp_path)
    app = session_in()
    job_submit(app.context(cfg))
    deleted = jobs_down(app.context(cfg))
    assert len(deleted) == 1 and deleted[0].state == "JOB_STATE_CANCELLED"
    assert any(c["rpc"].endswith("JobService/CancelCustomJob") for c in app.calls)


def test_quota_fails_at_create_naming_the_metric(tmp_path, session_in):
    cfg = make_config(tmp_path)
    app = session_in("quota")
    with pytest.raises(QuotaError, match="aiplatform.googleapis.com/"):
        job_submit(app.context(cfg))


def test_flaky_lost_create_is_not_submitted_twice(tmp_path, session_in):
    cfg = make_config(tmp_path)
    app = session_in("flaky")
    job = job_submit(app.context(cfg))
    assert job_wait(app.context(cfg), job.name).state == "JOB_STATE_SUCCEEDED"
    assert len(managed_jobs(app.session(), "my-project", "us-west4", run=cfg.run)) == 1


def test_stockout_fails_with_code_8(tmp_path, session_in):
    cfg = make_config(tmp_path)
    app = session_in("stockout")
    job_submit(app.context(cfg))
    with pytest.raises(CloudError, match="code 8"):
        job_wait(app.context(cfg))


def test_slice_commands_refuse_a_vertex_config_and_back(tmp_path):
    shutil.copy(EXAMPLE, tmp_path / "vertex.yaml")
    shutil.copy(ROOT / "examples" / "v5e-64.yaml", tmp_path / "slice.yaml")
    up = run_here(["--dry-run", "slice", "up", "-c", "vertex.yaml"], tmp_path)
    assert up.returncode == 2 and "job submit" in up.stderr and "Traceback" not in up.stderr
    submit = run_here(["--dry-run", "job", "submit", "-c", "slice.yaml"], tmp_path)
    assert submit.returncode == 2 and "slice up" in submit.stderr and "Traceback" not in submit.stderr


def test_cli_submit_wait_then_status_down_list(tmp_path):
    shutil.copy(EXAMPLE, tmp_path / "moe-tpu.yaml")
    sub = run_process(["--dry-run", "--output", "json", "job", "submit", "--wait"], tmp_path)
    assert sub.returncode == 0, sub.stderr
    doc = json.loads(sub.stdout)
    assert [c["rpc"] for c in doc["calls"]].count(CREATE) == 1
    assert doc["resources"][0]["kind"] == "custom_job" and doc["resources"][0]["state"] == "JOB_STATE_SUCCEEDED"
    status = json.loads(run_here(["--dry-run", "--output", "json", "job", "status"], tmp_path).stdout)
    assert [r["state"] for r in status["resources"]] == ["JOB_STATE_SUCCEEDED"]
    assert run_here(["--dry-run", "down"], tmp_path).returncode == 0
    listed = run_here(["--dry-run", "--output", "json", "list"], tmp_path)
    assert listed.returncode == 0 and json.loads(listed.stdout)["resources"] == []


def test_quota_exits_1_naming_the_quota(tmp_path):
    shutil.copy(EXAMPLE, tmp_path / "moe-tpu.yaml")
    out = run_here(["--dry-run", "--scenario", "quota", "job", "submit"], tmp_path)
    assert out.returncode == 1 and "quota" in out.stderr and "aiplatform.googleapis.com/" in out.stderr


@pytest.mark.parametrize("change, key", [({"machine_type": "ct5lp-hightpu-9t"}, "vertex.machine_type"),
                                         ({"topology": "2x2", "machine_type": "ct5lp-hightpu-8t"}, "vertex.topology")])
def test_validate_names_a_bad_machine_type_or_topology(tmp_path, change, key):
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["vertex"].update(change)
    (tmp_path / "moe-tpu.yaml").write_text(yaml.safe_dump(doc))
    out = run_here(["validate"], tmp_path)
    assert out.returncode == 2 and key in out.stderr and "Traceback" not in out.stderr


def test_killed_while_waiting_a_rerun_sends_no_second_create(tmp_path):
    shutil.copy(EXAMPLE, tmp_path / "moe-tpu.yaml")
    args = [sys.executable, "-m", "provision", "--dry-run", "--scenario", "long-queue", "--output", "json",
            "job", "submit", "--wait"]
    proc = subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, NO_COLOR="1"))
    deadline = time.monotonic() + 60
    state = tmp_path / ".moe-tpu" / "emulator.json"
    while time.monotonic() < deadline and not (state.exists() and "customJobs/" in state.read_text()):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    again = run_here(["--dry-run", "--output", "json", "job", "submit", "--wait"], tmp_path)
    assert again.returncode == 0, again.stderr
    assert [c["rpc"] for c in json.loads(again.stdout)["calls"]].count(CREATE) == 0


def test_job_commands_exit_2_on_a_missing_config(tmp_path):
    out = run_here(["--dry-run", "job", "status", "-c", "nope.yaml"], tmp_path)
    assert out.returncode == 2 and "nope.yaml" in out.stderr


def test_usage_error_type_for_wait_without_job(tmp_path, session_in):
    cfg = make_config(tmp_path)
    app = session_in()
    with pytest.raises(UsageError, match="no custom job"):
        job_wait(app.context(cfg))
