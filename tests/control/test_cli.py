"""The `moe-tpu` command: exit codes, the JSON document, no tracebacks, no network. A slice's lifecycle, the
bad inputs, the audit and two commands at once run as processes of their own (from the outside); the other
commands in this process through the real entry point (cli_helpers.invoke: an interpreter each would cost
about a second of imports)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from cli_helpers import run_here, run_process

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "v5e-64.yaml"


moe = run_process

here = run_here  # in this process


@pytest.fixture
def workdir(workdir):
    """The shared working directory (tests/control/conftest.py), with the v5e-64 example as moe-tpu.yaml."""
    shutil.copy(EXAMPLE, workdir / "moe-tpu.yaml")
    return workdir


def test_dry_run_lifecycle_json_documents(workdir):
    up = moe(["--dry-run", "--output", "json", "slice", "up"], workdir)
    assert up.returncode == 0, up.stderr
    doc = json.loads(up.stdout)
    assert doc["command"] == "slice up" and doc["dry_run"] is True and doc["result"] == "ok"
    creates = [c for c in doc["calls"] if c["rpc"] == "google.cloud.tpu.v2.Tpu/CreateQueuedResource"]
    assert len(creates) == 1
    node = creates[0]["request"]["queued_resource"]["tpu"]["node_spec"][0]["node"]
    assert (node["accelerator_type"], node["runtime_version"]) == ("v5litepod-64", "v2-alpha-tpuv5-lite")
    assert node["labels"] == {"managed-by": "moe-tpu", "moe-tpu-run": "moe-demo"}
    assert node["metadata"]["startup-script"].startswith("#!")
    assert any(c["rpc"].endswith("Tpu/GetQueuedResource") for c in doc["calls"])  # polls are listed
    assert [r["kind"] for r in doc["resources"]] == ["queued_resource", "node"]
    assert doc["resources"][0]["state"] == "ACTIVE" and len(doc["resources"][1]["workers"]) == 16

    status = moe(["--dry-run", "--output", "json", "slice", "status"], workdir)
    assert status.returncode == 0, status.stderr
    assert {r["kind"]: r["state"] for r in json.loads(status.stdout)["resources"]} == {
        "queued_resource": "ACTIVE", "node": "READY"}

    down = moe(["--dry-run", "--output", "json", "down"], workdir)
    assert down.returncode == 0, down.stderr
    assert json.loads(down.stdout)["result"] == "ok"
    listed = moe(["--dry-run", "--output", "json", "list"], workdir)
    assert listed.returncode == 0 and json.loads(listed.stdout)["resources"] == []


def test_the_example_fails_over_to_its_second_zone_on_stockout(workdir):
    """The example lists two zones (in two regions: v5e has one documented zone per region), so the
    stockout scenario shows the failover it exists for."""
    zones = yaml.safe_load(EXAMPLE.read_text())["zones"]
    assert len(zones) == 2
    up = here(["--dry-run", "--scenario", "stockout", "--output", "json", "slice", "up"], workdir)
    assert up.returncode == 0, up.stderr
    assert f"no capacity in {zones[0]}" in up.stderr
    creates = [c["request"]["parent"] for c in json.loads(up.stdout)["calls"]
               if c["rpc"].endswith("Tpu/CreateQueuedResource")]
    assert creates == [f"projects/my-project/locations/{zone}" for zone in zones]
    assert here(["--dry-run", "down"], workdir).returncode == 0
    assert json.loads(here(["--dry-run", "--output", "json", "list"], workdir).stdout)["resources"] == []


def test_text_mode_reports_the_slice_and_its_workers(workdir):
    up = here(["--dry-run", "slice", "up"], workdir)
    assert up.returncode == 0, up.stderr
    lines = up.stdout.splitlines()
    assert lines[0].startswith("slice ready: ") and lines[0].endswith(" in us-west4-a")
    assert "16 workers: 10." in lines[1]
    assert "WAITING_FOR_RESOURCES" in up.stderr  # progress while it waits


def test_quota_exits_1_with_the_quota_named_and_a_json_error(workdir):
    res = here(["--dry-run", "--scenario", "quota", "--output", "json", "slice", "up"], workdir)
    assert res.returncode == 1
    assert "Traceback" not in res.stderr + res.stdout
    doc = json.loads(res.stdout)
    assert doc["result"] == "error" and "TPUV5sPreemptibleLitepodPerProjectPerZoneForTPUAPI" in doc["error"]
    assert "TPUV5sPreemptibleLitepodPerProjectPerZoneForTPUAPI" in res.stderr


@pytest.mark.parametrize("args,needle", [
    (["--dry-run", "--scenario", "nope", "slice", "up"], "nope"),
    (["--dry-run", "slice", "up", "--config", "missing.yaml"], "missing.yaml"),
    (["--output", "xml", "list"], "xml"),
    (["slice", "sideways"], "sideways"),
])
def test_bad_input_exits_2_with_a_message_and_no_traceback(workdir, args, needle):
    res = moe(args, workdir)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert needle in res.stderr
    assert "Traceback" not in res.stderr + res.stdout


AUDIT = textwrap.dedent("""
    import json, os, sys
    seen = {"connect": [], "open": []}
    def hook(event, args):
        if event == "socket.connect":
            seen["connect"].append(repr(args[1]))
        elif event == "open" and isinstance(args[0], str):
            seen["open"].append(args[0])
    sys.addaudithook(hook)
    import atexit
    atexit.register(lambda: open(os.environ["AUDIT_OUT"], "w").write(json.dumps(seen)))
    from provision.cli import main
    sys.argv = ["moe-tpu"] + sys.argv[1:]
    main()
""")


def test_dry_run_touches_only_loopback_and_never_reads_credentials(workdir, tmp_path):
    # Python-level sockets (google.auth probing the metadata server, HTTP clients) raise audit
    # events; the gRPC channel itself is built on the emulator's 127.0.0.1 address by Session.open.
    creds = tmp_path / "creds.json"
    creds.write_text("{}")
    audit_out = tmp_path / "audit.json"
    env = dict(os.environ, NO_COLOR="1", AUDIT_OUT=str(audit_out), GOOGLE_APPLICATION_CREDENTIALS=str(creds),
               CLOUDSDK_CONFIG=str(tmp_path / "gcloud"))
    def audited(args):
        res = subprocess.run([sys.executable, "-c", AUDIT, *args], cwd=workdir, capture_output=True, text=True,
                             timeout=120, env=env)
        seen = json.loads(audit_out.read_text())
        reads = [p for p in seen["open"] if p == str(creds) or p.startswith(env["CLOUDSDK_CONFIG"])
                 or p.endswith("application_default_credentials.json")]
        return res, seen["connect"], reads

    for args in (["--dry-run", "slice", "up"], ["--dry-run", "down"]):
        res, connects, reads = audited(args)
        assert res.returncode == 0, res.stderr
        assert all("127.0.0.1" in addr for addr in connects), connects
        assert reads == []
    # The same harness sees a real run reach for the credentials (and fail cleanly on a bad file).
    res, _, reads = audited(["slice", "status"])
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert str(creds) in reads


def test_down_without_config_finds_the_run_that_slice_up_started(tmp_path):
    example = tmp_path / "configs" / "v5e-64.yaml"
    example.parent.mkdir()
    shutil.copy(EXAMPLE, example)
    up = here(["--dry-run", "slice", "up", "--config", str(example)], tmp_path)
    assert up.returncode == 0, up.stderr
    down = here(["--dry-run", "--output", "json", "down"], tmp_path)  # no moe-tpu.yaml here
    assert down.returncode == 0, down.stderr
    assert f"using {example} (the config last used in this directory)" in down.stderr
    assert [d["kind"] for d in json.loads(down.stdout)["deleted"]] == ["queued_resource"]
    listed = here(["--dry-run", "--output", "json", "list"], tmp_path)
    assert json.loads(listed.stdout)["resources"] == []


def test_two_runs_provisioned_at_once_in_one_directory_both_keep_their_resources(tmp_path):
    """Each command runs its own emulator on the shared world file; none may lose the other's update."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    for run in ("run-a", "run-b"):
        (tmp_path / f"{run}.yaml").write_text(yaml.safe_dump({**doc, "run": run}))
    env = {k: v for k, v in dict(os.environ, NO_COLOR="1").items() if not k.startswith("MOE_TPU_")}
    procs = [subprocess.Popen([sys.executable, "-m", "provision", "--dry-run", "slice", "up", "-c", f"{run}.yaml"],
                              cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for run in ("run-a", "run-b")]
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert "slice ready" in out
    listed = here(["--dry-run", "--output", "json", "list", "-c", "run-a.yaml"], tmp_path)
    runs = sorted({r["run"] for r in json.loads(listed.stdout)["resources"]})
    assert runs == ["run-a", "run-b"]


@pytest.mark.parametrize("missing, args, extra", [
    ("jinja2", ["validate"], "control"),
    ("grpc", ["--dry-run", "slice", "up"], "control"),
])
def test_a_command_whose_extra_is_not_installed_names_it(workdir, missing, args, extra):
    """As in an install without that extra: the package cannot be imported (None in sys.modules). (`plan`
    needs no jax: tests/control/test_arith.py.)"""
    code = (f"import sys; sys.modules[{missing!r}] = None; sys.argv = ['moe-tpu', *{args!r}]; "
            "from provision.cli import main; main()")
    out = subprocess.run([sys.executable, "-c", code], cwd=workdir, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, NO_COLOR="1"))
    assert out.returncode == 2, out.stderr
    assert f"pip install 'moe-tpu[{extra}]'" in out.stderr and "Traceback" not in out.stderr
    assert "internal error" not in out.stderr
