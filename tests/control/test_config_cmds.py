"""`init`, `validate` and `render`: exact output and exit codes."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from cli_helpers import invoke as moe

from provision.config import starter_config

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "v5e-64.yaml"
GOLDENS = Path(__file__).resolve().parent / "goldens"


def test_init_writes_the_starter(workdir):
    assert moe("init") == (0, "wrote moe-tpu.yaml\n",
                           "next: set project, zones, image and trainer in it, then run `moe-tpu validate`\n")
    assert (workdir / "moe-tpu.yaml").read_text() == starter_config()


def test_the_starter_is_its_golden(workdir):
    """The file `init` writes, reviewed as a whole (regenerate with MOE_TPU_UPDATE_GOLDENS=1)."""
    golden = GOLDENS / "moe-tpu.yaml.golden"
    assert moe("init")[0] == 0
    if os.environ.get("MOE_TPU_UPDATE_GOLDENS") == "1":
        golden.write_text((workdir / "moe-tpu.yaml").read_text())
    assert (workdir / "moe-tpu.yaml").read_text() == golden.read_text()


def test_the_starter_takes_values_in_place_and_keeps_its_comments():
    values = {"project": "acme-ml", "slice.subnetwork": "tpu-net",
              "vertex.service_account": "a@b.iam.gserviceaccount.com", "trainer.steps": 5, "dry_run.steps": 3,
              "zones": ["us-west4-b"]}
    text = starter_config(values)
    assert 'project: "acme-ml"            # Google Cloud project id\n' in text
    assert '  subnetwork: "tpu-net"\n' in text and "# subnetwork:" not in text and "  # service_account: " in text
    assert "\n  steps: 5\n" in text and "# steps: 1000" not in text
    raw = yaml.safe_load(text)
    assert raw["vertex"]["service_account"] == "a@b.iam.gserviceaccount.com" and raw["dry_run"] == {"steps": 3}
    assert raw["zones"] == ["us-west4-b"] and raw["slice"]["accelerator"] == "v5litepod-64"
    assert starter_config({}) == starter_config() == (GOLDENS / "moe-tpu.yaml.golden").read_text()


def uncommented(text: str) -> str:
    """Every commented example of a key (an indented `# key: value` line) made real."""
    return re.sub(r"(?m)^( +)# ", r"\1", text)


@pytest.mark.parametrize("examples", ["as written", "every example uncommented"])
def test_the_starter_validates_and_plans_without_a_refused_mesh(workdir, examples):
    assert moe("init")[0] == 0
    path = workdir / "moe-tpu.yaml"
    if examples != "as written":
        text = uncommented(path.read_text())
        assert "moe.num_experts: " in text and "\n  steps: " in text and "\n  subnetwork: " in text
        path.write_text(text)
    code, out, err = moe("validate")
    assert (code, err) == (0, ""), out
    code, out, err = moe("--output", "json", "plan")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["fits"] and not [w for w in doc["warnings"] if "refuses" in w or "not set" in w], doc["warnings"]


def test_init_refuses_to_overwrite(workdir):
    (workdir / "moe-tpu.yaml").write_text("mine\n")
    assert moe("init") == (2, "", "error: moe-tpu.yaml already exists; not overwriting it\n"
                                  "hint: pass --force to replace it\n")
    assert (workdir / "moe-tpu.yaml").read_text() == "mine\n"
    assert moe("init", "--force")[0] == 0
    assert (workdir / "moe-tpu.yaml").read_text() == starter_config()


def test_init_elsewhere_in_json(workdir):
    code, out, _ = moe("--output", "json", "init", "-c", "runs/a.yaml")
    assert code == 0
    assert json.loads(out) == {"command": "init", "dry_run": False, "calls": [], "config": "runs/a.yaml",
                               "result": "ok"}
    assert (workdir / "runs" / "a.yaml").is_file()


def test_validate_ok(workdir):
    shutil.copy(EXAMPLE, workdir / "moe-tpu.yaml")
    assert moe("validate") == (0, (
        "config OK: moe-tpu.yaml\n"
        "  run moe-demo: 1 x v5litepod-64 (8x8, 64 chips, 16 VMs), spot, zones us-west4-a, us-central1-a\n"
        "  rendered 5 files: startup.sh, queued_resource.us-west4-a.yaml, "
        "create_queued_resource.us-west4-a.json, queued_resource.us-central1-a.yaml, "
        "create_queued_resource.us-central1-a.json\n"
    ), "")


def test_validate_vertex_example(workdir):
    code, out, _ = moe("validate", "-c", str(ROOT / "examples" / "vertex.yaml"))
    assert code == 0
    assert out.splitlines()[1] == ("  run moe-vertex: Vertex AI job on ct5lp-hightpu-4t, topology 8x8 "
                                   "(64 chips), STANDARD, region us-west4")


def test_validate_json(workdir):
    shutil.copy(EXAMPLE, workdir / "moe-tpu.yaml")
    code, out, err = moe("--output", "json", "validate")
    assert (code, err) == (0, "config OK: moe-tpu.yaml\n"
                              "  run moe-demo: 1 x v5litepod-64 (8x8, 64 chips, 16 VMs), spot, "
                              "zones us-west4-a, us-central1-a\n"
                              "  rendered 5 files: startup.sh, queued_resource.us-west4-a.yaml, "
                              "create_queued_resource.us-west4-a.json, queued_resource.us-central1-a.yaml, "
                              "create_queued_resource.us-central1-a.json\n")
    assert json.loads(out) == {"command": "validate", "dry_run": False, "calls": [], "config": "moe-tpu.yaml",
                               "files": ["startup.sh", "queued_resource.us-west4-a.yaml",
                                         "create_queued_resource.us-west4-a.json",
                                         "queued_resource.us-central1-a.yaml",
                                         "create_queued_resource.us-central1-a.json"], "result": "ok"}


def zone_config(workdir, region: str, zone: str) -> None:
    text = EXAMPLE.read_text().replace("region: us-west4", f"region: {region}")
    (workdir / "moe-tpu.yaml").write_text(re.sub(r"(?m)^zones: .*$", f"zones: [{zone}]", text))


def test_a_zone_google_does_not_document_for_v5e_is_a_warning(workdir):
    zone_config(workdir, "us-east5", "us-east5-a")
    code, out, err = moe("validate")
    assert code == 0 and out.startswith("config OK")
    assert err == ("warning: zone 'us-east5-a' is not one of the zones Google documents for TPU v5e "
                   "(us-central1-a, us-south1-a, us-west1-c, us-west4-a, europe-west4-b, asia-southeast1-b); "
                   "the API's list of accelerator types in that zone decides\n")


def test_in_a_dry_run_the_emulators_accelerator_types_decide(workdir):
    zone_config(workdir, "us-east5", "us-east5-a")  # the emulated API lists v5e there
    code, out, err = moe("--dry-run", "--output", "json", "validate")
    assert code == 0, err
    assert [c["rpc"].rsplit("/", 1)[1] for c in json.loads(out)["calls"]] == ["ListAcceleratorTypes"]
    zone_config(workdir, "us-west4", "us-west4-b")  # and not there
    code, out, err = moe("--dry-run", "validate")
    assert code == 2 and out == ""
    assert err.endswith("error: zone us-west4-b does not offer v5litepod-64: the API lists no TPU v5e type there\n"
                        "hint: use a zone Google documents for v5e: us-central1-a, us-south1-a, us-west1-c, "
                        "us-west4-a, europe-west4-b, asia-southeast1-b\n")
    code, out, err = moe("--dry-run", "slice", "up")  # slice up asks before it creates anything
    assert code == 2 and "zone us-west4-b does not offer v5litepod-64" in err and "CreateQueuedResource" not in err


BAD = """\
project: my-project
region: us-west4
zones: [uswest]
run: Moe_Demo
slice:
  acelerator: v5litepod-64
  max_wait: soon
image:
  repository: us-west4-docker.pkg.dev/my-project/moe/trainer
trainer:
  output_dir: gs://bucket/x
"""


def test_validate_lists_every_problem(workdir):
    (workdir / "moe-tpu.yaml").write_text(BAD)
    assert moe("validate") == (2, "", (
        "error: 4 problems in the config:\n"
        "  moe-tpu.yaml: zones[0]: zone 'uswest' is not a zone name like us-west4-a\n"
        "  moe-tpu.yaml: run: run name 'Moe_Demo' must be lowercase letters, digits and hyphens, "
        "start with a letter and not end with a hyphen (it becomes resource ids: RFC 1035)\n"
        "  moe-tpu.yaml: slice.acelerator: unknown key 'acelerator'; did you mean 'accelerator'?\n"
        "  moe-tpu.yaml: slice.max_wait: duration 'soon' must look like 2h, 30m, 90s or 1h30m\n"))


def test_validate_problems_in_json(workdir):
    (workdir / "moe-tpu.yaml").write_text(BAD)
    code, out, _ = moe("--output", "json", "validate")
    doc = json.loads(out)
    assert (code, doc["result"], doc["exit_code"]) == (2, "error", 2)
    assert doc["problems"][2] == {"file": "moe-tpu.yaml", "key": "slice.acelerator",
                                  "message": "unknown key 'acelerator'; did you mean 'accelerator'?"}


def test_validate_missing_config(workdir):
    assert moe("validate") == (2, "", (
        "error: 1 problem in the config:\n"
        "  moe-tpu.yaml: file not found (write a starter config with `moe-tpu init`)\n"))


def test_validate_a_broken_template(workdir):
    shutil.copy(EXAMPLE, workdir / "moe-tpu.yaml")
    (workdir / "tpl").mkdir()
    (workdir / "tpl" / "startup.sh.j2").write_text("{{ spec.image }}\n")
    code, out, err = moe("--templates", "tpl", "validate")
    assert (code, out) == (2, "")
    assert err.startswith("error: template startup.sh.j2: 'provision.kinds.tpu_vm.slice_render.StartupSpec object' "
                          "has no attribute 'image'\nhint: templates are read from tpl, then ")


def test_render_writes_the_goldens(workdir):
    shutil.copy(EXAMPLE, workdir / "moe-tpu.yaml")
    assert moe("render", "--out", "out/r") == (0, "out/r/startup.sh\nout/r/queued_resource.us-west4-a.yaml\n"
                                                  "out/r/create_queued_resource.us-west4-a.json\n"
                                                  "out/r/queued_resource.us-central1-a.yaml\n"
                                                  "out/r/create_queued_resource.us-central1-a.json\n", "")
    for path in (workdir / "out" / "r").iterdir():
        assert path.read_text() == (GOLDENS / f"{path.name}.golden").read_text()


def test_render_needs_out(workdir):
    code, out, err = moe("render")
    assert (code, out) == (2, "")
    assert "Missing option '--out'" in err


def test_render_into_a_file_is_a_usage_error(workdir):
    shutil.copy(EXAMPLE, workdir / "moe-tpu.yaml")
    (workdir / "f").write_text("")
    code, out, err = moe("render", "--out", "f")
    assert (code, out) == (2, "")
    assert "Traceback" not in err


def test_help_shows_examples():
    code, out, _ = moe("validate", "--help")
    assert code == 0 and "moe-tpu validate -c examples/v5e-64.yaml" in out and "MOE_TPU_CONFIG" not in out


def test_bad_config_from_the_outside_has_no_traceback(tmp_path):
    (tmp_path / "moe-tpu.yaml").write_text("run: [unclosed\n")
    proc = subprocess.run([sys.executable, "-m", "provision", "validate"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, NO_COLOR="1", PYTHONPATH=str(ROOT)))
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == ("error: 1 problem in the config:\n"
                           "  moe-tpu.yaml: YAML syntax error at line 2, column 1: expected ',' or ']', "
                           "but got '<stream end>'\n")
