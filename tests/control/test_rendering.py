"""Rendering: golden files, shell quoting, the strict QueuedResource message, ids and labels.

The goldens in tests/control/goldens/ are the files `render_all` makes for examples/v5e-64.yaml.
After a deliberate change to a template, regenerate them with

    MOE_TPU_UPDATE_GOLDENS=1 python -m pytest tests/control/test_rendering.py

and review the diff before committing.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from provision import image, rendering, templates
from provision.config import config_from_dict, load_config
from provision.context import renderer_for
from provision.errors import UsageError
from provision.kinds.tpu_vm import slice_render
from provision.kinds.vertex import vertex_render
from tests.control import render_calls as calls

ROOT = Path(__file__).resolve().parents[2]
GOLDENS = Path(__file__).resolve().parent / "goldens"
EXAMPLE = ROOT / "examples" / "v5e-64.yaml"
VERTEX = ROOT / "examples" / "vertex.yaml"
UPDATE = os.environ.get("MOE_TPU_UPDATE_GOLDENS") == "1"


def example_raw() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


def cfg_with(zones=None, **slice_changes):
    raw = example_raw()
    raw["slice"].update(slice_changes)
    if zones is not None:
        raw["zones"] = zones
    return config_from_dict(raw)


EXAMPLE_FILES = ["startup.sh", "queued_resource.us-west4-a.yaml", "create_queued_resource.us-west4-a.json",
                 "queued_resource.us-central1-a.yaml", "create_queued_resource.us-central1-a.json"]


@pytest.mark.parametrize("name", EXAMPLE_FILES)
def test_golden(name):
    loaded = load_config(EXAMPLE)
    files = rendering.render_all(loaded, renderer_for(loaded))
    assert list(files) == EXAMPLE_FILES  # the example's two zones, each with its queued resource
    golden = GOLDENS / f"{name}.golden"
    if UPDATE:
        golden.parent.mkdir(exist_ok=True)
        golden.write_text(files[name])
    assert files[name] == golden.read_text(), f"{name} differs from its golden; see this file's docstring"


@pytest.mark.parametrize("name", ["custom_job.yaml", "create_custom_job.json"])
def test_vertex_golden(name):
    loaded = load_config(VERTEX)
    files = rendering.render_all(loaded, renderer_for(loaded))
    assert list(files) == ["custom_job.yaml", "create_custom_job.json"]
    golden = GOLDENS / f"{name}.golden"
    if UPDATE:
        golden.write_text(files[name])
    assert files[name] == golden.read_text(), f"{name} differs from its golden; see this file's docstring"


def test_custom_job_request_is_the_real_message_with_the_trainer_argv():
    cfg = load_config(VERTEX)
    request = calls.custom_job_request(cfg, renderer_for(cfg))
    assert request.parent == "projects/my-project/locations/us-west4"
    pool = request.custom_job.job_spec.worker_pool_specs[0]
    assert (pool.machine_spec.machine_type, pool.machine_spec.tpu_topology, pool.replica_count) == (
        "ct5lp-hightpu-4t", "8x8", 1)
    assert [*pool.container_spec.command, *pool.container_spec.args] == rendering.trainer_argv(cfg)
    assert request.custom_job.job_spec.base_output_directory.output_uri_prefix == cfg.trainer.output_dir
    assert request.custom_job.job_spec.scheduling.strategy.name == "STANDARD"
    assert dict(request.custom_job.labels) == rendering.labels(cfg)


def test_a_vertex_tensorboard_is_the_jobs_tensorboard(tmp_path):
    doc = yaml.safe_load(VERTEX.read_text())
    board = "projects/my-project/locations/us-west4/tensorboards/123"
    doc["vertex"].update(tensorboard=board, service_account="trainer@my-project.iam.gserviceaccount.com")
    path = tmp_path / "moe-tpu.yaml"
    path.write_text(yaml.safe_dump(doc))
    loaded = load_config(path)
    spec = calls.custom_job_request(loaded, renderer_for(loaded)).custom_job.job_spec
    assert (spec.tensorboard, spec.service_account) == (board, "trainer@my-project.iam.gserviceaccount.com")
    loaded = load_config(VERTEX)
    assert calls.custom_job_request(loaded, renderer_for(loaded)).custom_job.job_spec.tensorboard == ""


def test_a_template_field_the_custom_job_does_not_know_is_an_error(tmp_path):
    (tmp_path / vertex_render.CUSTOM_JOB_TEMPLATE).write_text("display_name: x\nno_such_field: 1\n")
    with pytest.raises(UsageError, match="google.cloud.aiplatform.v1.CustomJob"):
        calls.custom_job_request(load_config(VERTEX), rendering.Renderer("img:v1", tmp_path))


def test_rendering_is_deterministic():
    cfg = load_config(EXAMPLE)
    assert rendering.render_all(cfg, renderer_for(cfg)) == rendering.render_all(cfg, renderer_for(cfg))


def test_ids_and_labels():
    cfg = load_config(EXAMPLE)
    assert rendering.labels(cfg) == {"managed-by": "moe-tpu", "moe-tpu-run": "moe-demo"}
    assert (slice_render.queued_resource_id(cfg.run), slice_render.node_id(cfg.run)) == ("moe-demo", "moe-demo-tpu")
    ctx = calls.slice_context(cfg, "img:v1")
    rid = slice_render.request_id(cfg.slice, ctx, "us-west4-a")
    assert uuid.UUID(rid).version == 5 and rid == slice_render.request_id(cfg.slice, ctx, "us-west4-a")
    assert rid != slice_render.request_id(cfg.slice, ctx, "us-central1-a")
    assert rid != slice_render.request_id(cfg.slice, ctx, "us-west4-a", attempt=1)


def test_request_id_changes_with_the_request_body_and_only_with_it():
    """A changed capacity, label or startup script is a different request: it must not reuse the id an
    earlier body was sent under (the API could answer with that earlier operation)."""
    loaded = load_config(EXAMPLE)
    same = calls.queued_resource_request(loaded, "us-west4-a", renderer_for(loaded)).request_id
    loaded = load_config(EXAMPLE)
    assert same == calls.queued_resource_request(loaded, "us-west4-a", renderer_for(loaded)).request_id
    for change in ({"capacity": "on-demand"}, {"runtime_version": "v2-alpha-tpuv5-lite", "count": 2}):
        loaded = cfg_with(**change)
        changed = calls.queued_resource_request(loaded, "us-west4-a", renderer_for(loaded)).request_id
        assert changed != same, change


def test_longest_run_keeps_ids_within_63():
    raw = example_raw()
    raw["run"] = "r" * 50
    cfg = config_from_dict(raw)
    assert max(len(slice_render.node_id(cfg.run)) + len("-99"), len(slice_render.queued_resource_id(cfg.run))) <= 63


def test_request_is_the_real_message():
    from google.cloud import tpu_v2

    loaded = load_config(EXAMPLE)
    req = calls.queued_resource_request(loaded, "us-west4-a", renderer_for(loaded))
    assert isinstance(req, tpu_v2.CreateQueuedResourceRequest)
    assert (req.parent, req.queued_resource_id) == ("projects/my-project/locations/us-west4-a", "moe-demo")
    qr = req.queued_resource
    spec = qr.tpu.node_spec[0]
    assert (spec.parent, spec.node_id) == ("projects/my-project/locations/us-west4-a", "moe-demo-tpu")
    assert (spec.node.accelerator_type, spec.node.runtime_version) == ("v5litepod-64", "v2-alpha-tpuv5-lite")
    assert dict(spec.node.labels) == {"managed-by": "moe-tpu", "moe-tpu-run": "moe-demo"}
    loaded = load_config(EXAMPLE)
    assert spec.node.metadata["startup-script"] == calls.startup_script(loaded, renderer_for(loaded))
    assert "spot" in qr and "guaranteed" not in qr
    assert qr.queueing_policy.valid_until_duration.total_seconds() == 6 * 3600  # slice.max_wait: 6h


def test_multislice_reserved_with_service_account():
    cfg = cfg_with(zones=["us-west4-a"], count=4, capacity="reserved", reservation="my-res", subnetwork="tpu-subnet",
                   service_account="trainer@my-project.iam.gserviceaccount.com", max_wait="1h30m")
    qr = calls.queued_resource_request(cfg, "us-west4-a", renderer_for(cfg)).queued_resource
    spec = qr.tpu.node_spec[0]
    assert (spec.node_id, spec.multislice_params.node_count, spec.multislice_params.node_id_prefix) == (
        "", 4, "moe-demo-tpu")
    assert "guaranteed" in qr and "spot" not in qr
    assert qr.reservation_name == "projects/my-project/locations/us-west4-a/reservations/my-res"
    assert (spec.node.network_config.subnetwork, spec.node.service_account.email,
            list(spec.node.service_account.scope)) == (
        "tpu-subnet", "trainer@my-project.iam.gserviceaccount.com", ["https://www.googleapis.com/auth/cloud-platform"])
    assert qr.queueing_policy.valid_until_duration.total_seconds() == 5400


def test_on_demand_is_guaranteed_without_reservation():
    loaded = cfg_with(capacity="on-demand")
    request = calls.queued_resource_request(loaded, "us-west4-a", renderer_for(loaded))
    qr = request.queued_resource
    assert "guaranteed" in qr and "spot" not in qr and qr.reservation_name == ""


def test_no_project_is_a_usage_error():
    raw = example_raw()
    del raw["project"]
    with pytest.raises(UsageError, match="names no project"):
        loaded = config_from_dict(raw)
        calls.queued_resource_request(loaded, "us-west4-a", renderer_for(loaded))


def test_project_from_elsewhere_when_the_config_names_none():
    raw = example_raw()
    del raw["project"]
    cfg = config_from_dict(raw)
    req = calls.queued_resource_request(cfg, "us-west4-a", renderer_for(cfg), project="adc-project")
    assert req.parent == "projects/adc-project/locations/us-west4-a"
    assert req.queued_resource.tpu.node_spec[0].parent == req.parent
    renderer = renderer_for(cfg)
    assert req.request_id == calls.queued_resource_request(cfg, "us-west4-a", renderer,
                                                           project="adc-project").request_id
    assert req.request_id != calls.queued_resource_request(cfg, "us-west4-a", renderer,
                                                           project="other-one").request_id
    files = rendering.render_all(cfg, renderer_for(cfg))
    request_json = files["create_queued_resource.us-west4-a.json"]
    assert '"parent": "projects/PROJECT/locations/us-west4-a"' in request_json


NASTY = "$(touch /tmp/moe-pwned) `id` 'single' \"double\" spaces;&| \\ $HOME *"


def _run_docker_args(script: str, env: dict[str, str]) -> list[str]:
    """The arguments bash really passes to `docker run` in the script, evaluated by bash."""
    start = script.index("\ndocker run ") + 1
    end = script.index("\nnohup docker logs ", start)
    command = script[start:end].replace("docker run ", "printf '%s\\0' ", 1)
    out = subprocess.run(["bash", "-c", command], env=env, capture_output=True, check=True).stdout
    return out.decode().split("\0")[:-1]


def test_config_values_reach_the_script_only_quoted(tmp_path):
    raw = example_raw()
    raw["trainer"].update(config=NASTY, output_dir=f"gs://bucket/{NASTY}", overrides={"model.note": NASTY})
    cfg = config_from_dict(raw)
    script = calls.startup_script(cfg, renderer_for(cfg))
    subprocess.run(["bash", "-n"], input=script.encode(), check=True)
    env = {"PATH": os.environ["PATH"], "CONTAINER": "c", "RUN": "moe-demo", "IMAGE": "img:v1"}
    args = _run_docker_args(script, env)
    assert args[args.index("img:v1") + 1:] == list(calls.startup_spec(cfg, "img:v1").trainer_args)
    assert args[args.index("img:v1") + 1:] == [
        "--config", NASTY, "--output-dir", f"gs://bucket/{NASTY}", "--resume", "auto", "--steps", "2000",
        "--mesh", "data=8,expert=8", "--status-file", "/var/lib/moe-tpu/status.json", "--set", f"model.note={NASTY}"]
    assert not Path("/tmp/moe-pwned").exists()
    # The variables at the top are single words for the shell too.
    for line in script.splitlines():
        if line.split("=", 1)[0] in ("RUN", "IMAGE", "REGISTRY", "CONTAINER", "LOG", "TRAINER_LOG"):
            assert len(shlex.split(line)) == 1


def test_startup_script_shape():
    loaded = load_config(EXAMPLE)
    script = calls.startup_script(loaded, renderer_for(loaded))
    assert script.startswith("#!/bin/bash\n")
    for needle in ["set -euo pipefail", 'exec >>"$LOG" 2>&1', "flock -n 9",
                   'gcloud auth configure-docker "$REGISTRY" --quiet', 'docker pull "$IMAGE"',
                   "--net=host --privileged", "--resume auto"]:
        assert needle in script


def test_own_templates_override_the_builtin_ones(tmp_path):
    (tmp_path / "startup.sh.j2").write_text("#!/bin/sh\necho {{ spec.run | shquote }}\n")
    cfg = load_config(EXAMPLE)
    assert calls.startup_script(cfg, rendering.Renderer("img:v1", tmp_path)) == "#!/bin/sh\necho moe-demo\n"
    # queued_resource.yaml.j2 is not there: the builtin one is used, with the user's script inside.
    req = calls.queued_resource_request(cfg, "us-west4-a", rendering.Renderer("img:v1", tmp_path))
    node = req.queued_resource.tpu.node_spec[0].node
    assert node.metadata["startup-script"] == "#!/bin/sh\necho moe-demo\n"


@pytest.mark.parametrize("template, text, message", [
    ("startup.sh.j2", "{{ spec.nope }}",
     "template startup.sh.j2: 'provision.kinds.tpu_vm.slice_render.StartupSpec object' has no attribute 'nope'"),
    ("startup.sh.j2", "{% if %}",
     "template startup.sh.j2, line 1: Expected an expression, got 'end of statement block'"),
    ("queued_resource.yaml.j2", "tpu: {}\ncolour: blue\n",
     'template queued_resource.yaml.j2 does not render a valid google.cloud.tpu.v2.QueuedResource: '
     'Message type "google.cloud.tpu.v2.QueuedResource" has no field named "colour" at "QueuedResource".'
     '\n Available Fields'),
    ("queued_resource.yaml.j2", "tpu: [", "template queued_resource.yaml.j2 does not render valid YAML"),
])
def test_template_problems_are_usage_errors(tmp_path, template, text, message):
    (tmp_path / template).write_text(text)
    with pytest.raises(UsageError) as info:
        calls.queued_resource_request(load_config(EXAMPLE), "us-west4-a", rendering.Renderer("img:v1", tmp_path))
    assert info.value.message.startswith(message)
    assert info.value.exit_code == 2


def test_missing_templates_dir_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="does not exist"):
        calls.startup_script(load_config(EXAMPLE), rendering.Renderer("img:v1", tmp_path / "nope"))


def test_rendering_takes_the_image_it_is_given_and_never_hashes_the_tree(monkeypatch):
    raw = example_raw()
    del raw["image"]["tag"]  # the content-hash tag: the source tree must be hashed to know it
    cfg = config_from_dict(raw)
    hashed = []
    monkeypatch.setattr(image, "content_tag", lambda **kw: hashed.append(kw) or "0.1.0-feedface")
    files = rendering.render_all(cfg, rendering.Renderer("registry.example/trainer:given"))
    assert hashed == [] and "IMAGE=registry.example/trainer:given\n" in files["startup.sh"]
    assert all("trainer:given" in text for text in files.values())
    renderer = renderer_for(cfg)  # what a command does at its boundary: the one hash
    files = rendering.render_all(cfg, renderer)
    assert len(hashed) == 1 and "IMAGE=us-west4-docker.pkg.dev/my-project/moe/trainer:0.1.0-feedface\n" in files[
        "startup.sh"]


def test_builtin_templates_are_found():
    assert (templates.builtin_templates_dir() / slice_render.STARTUP_TEMPLATE).is_file()
    assert (templates.builtin_templates_dir() / slice_render.QUEUED_RESOURCE_TEMPLATE).is_file()



# Printable text (the config refuses control characters in any value), spaces and shell syntax included.
_shell_text = st.text(st.characters(blacklist_categories=("Cs", "Cc", "Cf", "Co", "Cn", "Zl", "Zp", "Zs"),
                                    whitelist_characters=" "), min_size=1, max_size=30).filter(lambda s: s.strip())


@settings(max_examples=25, deadline=None)
@given(_shell_text, _shell_text)
def test_any_value_comes_back_intact(output_dir, note):
    assume(not output_dir.startswith(("/", "gs:")) and "://" not in output_dir)  # a local relative directory
    raw = example_raw()
    raw["slice"]["accelerator"] = "v5litepod-8"  # one VM: a local output_dir is allowed there
    raw["trainer"].update(output_dir=output_dir, overrides={"model.note": note})
    cfg = config_from_dict(raw)
    env = {"PATH": os.environ["PATH"], "CONTAINER": "c", "RUN": "r", "IMAGE": "img:v1"}
    args = _run_docker_args(calls.startup_script(cfg, renderer_for(cfg)), env)
    assert args[args.index("img:v1") + 1:] == list(calls.startup_spec(cfg, "img:v1").trainer_args)
