"""`image build`: the content-hash tag, the dry-run plan and context (hadolint on its Dockerfile),
the builders' requests, the clear error without docker or credentials, the wheel, and what the
container runs.

Docker is not here: its path is tested as far as detection and the error; the dry run fully.
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import site
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest
import yaml
from cli_helpers import SMALL
from cli_helpers import invoke as moe

from provision import image
from provision.cloud import build as cloud_build
from provision.config import config_from_dict, load_config
from provision.console import Console
from provision.errors import UsageError

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "v5e-64.yaml"
REPOSITORY = "us-west4-docker.pkg.dev/my-project/moe/trainer"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
TAG = re.compile(rf"^{re.escape(VERSION)}-[0-9a-f]{{16}}$")


def tool(name: str) -> str:
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.is_file() else shutil.which(name)
    assert found, f"{name} is missing: pip install -e '.[test]' installs it"
    return found


def copy_tree(dest: Path) -> Path:
    """What the image is made from, copied elsewhere (new mtimes), plus things that are not."""
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, dest / name)
    for name in ("provision", "trainer", "templates", "examples"):
        shutil.copytree(ROOT / name, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
    return dest


def config(**image_changes):
    raw = yaml.safe_load(EXAMPLE.read_text())
    raw["image"].update(image_changes)
    return config_from_dict(raw)


# --- the dry run -----------------------------------------------------------------------------------

def test_dry_run_writes_the_context_and_prints_the_plan(workdir):
    code, out, err = moe("--dry-run", "--output", "json", "image", "build", "--config", str(EXAMPLE))
    assert code == 0, err
    doc = json.loads(out)
    tag = doc["tag"]
    assert TAG.match(tag)
    assert doc["image"] == f"{REPOSITORY}:{tag}"
    assert doc["images"] == [f"{REPOSITORY}:{tag}", f"{REPOSITORY}:v1"]  # image.tag: v1 is applied too
    assert doc["context"] == str(workdir / ".moe-tpu" / "image")
    assert (doc["command"], doc["dry_run"], doc["calls"], doc["resources"], doc["result"]) == (
        "image build", True, [], [], "ok")
    assert (doc["builder"], doc["built"], doc["pushed"], doc["push"]) == ("auto", False, [], False)
    assert doc["files"] == ["Dockerfile", ".dockerignore"]
    assert doc["wheel"] == f"dist/moe_tpu-{VERSION}-py3-none-any.whl"
    assert doc["upload"] == {"to": f"gs://my-bucket/staging/moe-tpu/images/{tag}.tar.gz",
                             "files": [".dockerignore", "Dockerfile", doc["wheel"]]}
    assert doc["inputs"] == image.image_inputs(ROOT)
    assert {"pyproject.toml", "README.md", "trainer/cli.py", "trainer/configs/tiny.yaml",
            "templates/Dockerfile.j2", "provision/image.py"} <= set(doc["inputs"])
    assert not [p for p in doc["inputs"] if p.startswith(("tests/", "examples/", "terraform/")) or ".pyc" in p]
    context = Path(doc["context"])
    assert sorted(p.name for p in context.iterdir()) == [".dockerignore", "Dockerfile"]
    assert (context / "Dockerfile").read_text() == image.context_files(ROOT)["Dockerfile"]
    assert "dry run: nothing is built or uploaded" in err

    # Unchanged sources: the same tag.
    again = json.loads(moe("--dry-run", "--output", "json", "image", "build", "-c", str(EXAMPLE))[1])
    assert again["tag"] == tag


def test_dry_run_text(workdir):
    code, out, err = moe("--dry-run", "image", "build", "-c", str(EXAMPLE), "--context", "ctx", "--push")
    tag = image.content_tag()
    assert code == 0
    assert err == f"image build: {REPOSITORY}:{tag} [dry run: nothing is built or uploaded]\n"
    lines = out.splitlines()
    assert lines[0] == f"image    {REPOSITORY}:{tag}"
    assert lines[1] == f"also     {REPOSITORY}:v1 (image.tag)"
    assert lines[3].startswith(f"context  {workdir / 'ctx'}: Dockerfile, .dockerignore; dist/moe_tpu-")
    assert lines[4].startswith(f"docker   docker build --platform linux/amd64 --tag {REPOSITORY}:{tag} ")
    assert lines[4].endswith("; docker push of every tag the registry lacks")
    assert lines[5].startswith(f"cloud    upload the context to gs://my-bucket/staging/moe-tpu/images/{tag}.tar.gz")


def test_the_dockerfile_passes_hadolint(workdir):
    assert moe("--dry-run", "image", "build", "-c", str(EXAMPLE))[0] == 0
    dockerfile = workdir / ".moe-tpu" / "image" / "Dockerfile"
    result = subprocess.run([tool("hadolint"), "--no-color", "--failure-threshold", "style", "--disable-ignore-pragma",
                             str(dockerfile)], capture_output=True, text=True)
    assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
    # and hadolint does complain about a Dockerfile that breaks its rules
    (workdir / "Bad").write_text("FROM python\nRUN pip install jax\n")
    bad = subprocess.run([tool("hadolint"), "--no-color", str(workdir / "Bad")], capture_output=True, text=True)
    assert bad.returncode == 1 and "DL3006" in bad.stdout and "DL3013" in bad.stdout


def test_dockerfile_contents():
    text = image.context_files(ROOT)["Dockerfile"]
    wheel = f"moe_tpu-{VERSION}-py3-none-any.whl"
    stages = [line for line in text.splitlines() if line.startswith("FROM ")]
    assert stages == [f"FROM {image.BASE_IMAGE} AS build", f"FROM {image.BASE_IMAGE}"]
    final = text[text.rindex(stages[1]):]
    # The build stage installs the wheel with the pinned JAX stack; the final one only copies the venv.
    assert f'"/tmp/dist/{wheel}[trainer]"' in text and '"jax[tpu]==0.10.2"' in text
    assert '"libtpu==0.0.42.1"' in text and "--no-cache-dir" in text
    assert "pip install" not in final and "dist/" not in final
    assert "COPY --from=build /opt/moe-tpu /opt/moe-tpu" in final
    assert "USER 1000:1000" in final.splitlines()
    assert final.splitlines()[-2:] == ['ENTRYPOINT ["python", "-m", "trainer"]', 'CMD ["--help"]']
    assert image.context_files(ROOT)[".dockerignore"].splitlines()[-3:] == ["*", "!Dockerfile", f"!dist/{wheel}"]


# --- the tag ----------------------------------------------------------------------------------------

def test_the_tag_follows_what_goes_in_and_nothing_else(tmp_path):
    (tmp_path / "copy").mkdir()
    copy = copy_tree(tmp_path / "copy")
    tag = image.content_tag(copy)
    assert tag == image.content_tag(ROOT)  # another checkout, other mtimes: the same tag
    os.utime(copy / "trainer" / "cli.py", (0, 0))
    (copy / "examples" / "new.yaml").write_text("x: 1\n")
    (copy / "trainer" / "__pycache__").mkdir(exist_ok=True)
    (copy / "trainer" / "__pycache__" / "cli.cpython-311.pyc").write_bytes(b"\0")
    (copy / "tests").mkdir()
    (copy / "tests" / "test_x.py").write_text("")
    assert image.content_tag(copy) == tag
    with (copy / "trainer" / "cli.py").open("a") as f:
        f.write("# a change under trainer/\n")
    changed = image.content_tag(copy)
    assert TAG.match(changed) and changed != tag
    (copy / "trainer" / "cli.py").write_text((ROOT / "trainer" / "cli.py").read_text())
    assert image.content_tag(copy) == tag
    (copy / "trainer" / "configs" / "extra.yaml").write_text("model: {}\n")  # a new file counts
    assert image.content_tag(copy) not in (tag, changed)


def test_pyproject_and_the_dockerfile_count(tmp_path):
    copy = tmp_path
    copy_tree(copy)
    tag = image.content_tag(copy)
    (copy / "pyproject.toml").write_text((copy / "pyproject.toml").read_text() + "\n# pinned something\n")
    assert image.content_tag(copy) != tag
    own = tmp_path / "own-templates"
    own.mkdir()
    (own / "Dockerfile.j2").write_text((ROOT / "templates" / "Dockerfile.j2").read_text() + "LABEL a=b\n")
    assert image.content_tag(ROOT, own) != image.content_tag(ROOT)


def test_cli_source_option_builds_another_tree(workdir, tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    copy_tree(copy)
    (copy / "trainer" / "cli.py").write_text((copy / "trainer" / "cli.py").read_text() + "# changed\n")
    doc = json.loads(moe("--dry-run", "--output", "json", "image", "build", "-c", str(EXAMPLE),
                         "--source", str(copy))[1])
    assert doc["tag"] == image.content_tag(copy) != image.content_tag(ROOT)


def test_not_a_source_tree_is_a_usage_error(workdir, tmp_path):
    code, _, err = moe("--dry-run", "image", "build", "-c", str(EXAMPLE), "--source", str(tmp_path))
    assert code == 2
    assert f"error: {tmp_path} is not a moe-tpu source tree (it needs pyproject.toml and trainer/)" in err


# --- slice up and run use it ------------------------------------------------------------------------

def test_without_image_tag_the_slice_gets_the_content_tag(workdir):
    raw = yaml.safe_load(EXAMPLE.read_text())
    del raw["image"]["tag"]
    (workdir / "c.yaml").write_text(yaml.safe_dump(raw))
    built = json.loads(moe("--dry-run", "--output", "json", "image", "build", "-c", "c.yaml")[1])
    assert built["images"] == [built["image"]]  # no image.tag: only the content-hash tag
    code, out, err = moe("--dry-run", "--output", "json", "slice", "up", "-c", "c.yaml")
    assert code == 0, err
    creates = [c for c in json.loads(out)["calls"] if c["rpc"].endswith("/CreateQueuedResource")]
    script = creates[0]["request"]["queued_resource"]["tpu"]["node_spec"][0]["node"]["metadata"]["startup-script"]
    assert f"IMAGE={built['image']}\n" in script
    assert image.image_reference(load_config(workdir / "c.yaml")) == built["image"]


def test_own_dockerfile_template_gives_its_own_tag_everywhere(workdir):
    raw = yaml.safe_load(EXAMPLE.read_text())
    del raw["image"]["tag"]
    (workdir / "c.yaml").write_text(yaml.safe_dump(raw))
    # An absolute path: the rendering environment is cached by the --templates text.
    own = workdir / "own-dockerfile"
    own.mkdir()
    (own / "Dockerfile.j2").write_text(
        (ROOT / "templates" / "Dockerfile.j2").read_text().replace("PYTHONUNBUFFERED=1", "PYTHONUNBUFFERED=1 A=1"))
    built = json.loads(moe("--dry-run", "--output", "json", "--templates", str(own), "image", "build",
                           "-c", "c.yaml")[1])
    assert built["tag"] != image.content_tag()
    code, _, _ = moe("--templates", str(own), "render", "-c", "c.yaml", "--out", "out")
    assert code == 0
    assert f"IMAGE={built['image']}\n" in (workdir / "out" / "startup.sh").read_text()
    # `run` names the same image it runs (no capacity here: it stops before any training)
    code, _, err = moe("--dry-run", "--scenario", "quota", "--templates", str(own), "run", "-c", "c.yaml")
    assert code == 1 and f"image {built['image']}" in err


# --- no docker, no credentials ----------------------------------------------------------------------

def no_cloud_env(tmp_path: Path, path: str) -> dict[str, str]:
    return {"PATH": path, "HOME": str(tmp_path), "GOOGLE_APPLICATION_CREDENTIALS": str(tmp_path / "none.json"),
            "NO_GCE_CHECK": "True", "DOCKER_HOST": None, "CLOUDSDK_CONFIG": str(tmp_path / "gcloud")}


def test_without_docker_and_credentials_it_says_both_ways(workdir, tmp_path):
    empty = tmp_path / "bin"
    empty.mkdir()
    code, out, err = moe("image", "build", "-c", str(EXAMPLE), env=no_cloud_env(tmp_path, str(empty)))
    assert (code, out) == (1, "")
    assert err.splitlines()[1:] == [
        "error: cannot build the image: neither docker nor Google Cloud credentials are available here:",
        "  docker: docker is not installed (no `docker` on PATH)",
        f"  Cloud Build: no Google Cloud credentials (File {tmp_path / 'none.json'} was not found.)",
        "hint: either start docker (the image is built locally), or log in with `gcloud auth application-default "
        "login` (the image is built by Cloud Build); `moe-tpu --dry-run image build` shows the plan without either"]
    assert not (workdir / ".moe-tpu" / "image").exists()


def fake_docker(tmp_path: Path) -> Path:
    """A `docker` whose daemon does not answer, as the real CLI says it."""
    bin_dir = tmp_path / "fakebin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text("#!/bin/sh\necho 'Cannot connect to the Docker daemon at "
                                    "unix:///var/run/docker.sock. Is the docker daemon running?' >&2\nexit 1\n")
    (bin_dir / "docker").chmod(0o755)
    return bin_dir


def test_docker_without_its_daemon(workdir, tmp_path):
    env = no_cloud_env(tmp_path, str(fake_docker(tmp_path)))
    code, _, err = moe("image", "build", "-c", str(EXAMPLE), env=env)
    assert code == 1
    assert ("  docker: the docker daemon is not reachable (Cannot connect to the Docker daemon at "
            "unix:///var/run/docker.sock. Is the docker daemon running?)") in err.splitlines()
    code, _, err = moe("image", "build", "--builder", "docker", "-c", str(EXAMPLE), env=env)
    assert code == 1
    assert err.splitlines()[1:] == [
        "error: cannot build with docker: the docker daemon is not reachable (Cannot connect to the Docker daemon "
        "at unix:///var/run/docker.sock. Is the docker daemon running?)",
        "hint: start the docker daemon, or build with Cloud Build: --builder cloud-build"]
    code, _, err = moe("image", "build", "--builder", "cloud-build", "-c", str(EXAMPLE), env=env)
    assert code == 1 and "error: cannot submit a Cloud Build: no Google Cloud credentials" in err


# --- Cloud Build --------------------------------------------------------------------------------------

def test_cloud_build_request():
    from google.cloud.devtools import cloudbuild_v1

    plan = image.plan_image(config(build_service_account="moe-tpu-builder@my-project.iam.gserviceaccount.com"))
    request = cloud_build.build_request(plan, "my-project")
    assert isinstance(request, cloudbuild_v1.CreateBuildRequest) and request.project_id == "my-project"
    build = request.build
    assert (build.source.storage_source.bucket, build.source.storage_source.object_) == (
        "my-bucket", f"staging/moe-tpu/images/{plan.tag}.tar.gz")
    assert [(s.name, list(s.args)) for s in build.steps] == [(
        "gcr.io/cloud-builders/docker",
        ["build", "--platform", "linux/amd64", "--tag", plan.uri, "--tag", f"{REPOSITORY}:v1", "."])]
    assert list(build.images) == [plan.uri, f"{REPOSITORY}:v1"]
    assert build.logs_bucket == "gs://my-bucket/staging/cloud-build-logs"
    assert build.service_account == ("projects/my-project/serviceAccounts/"
                                     "moe-tpu-builder@my-project.iam.gserviceaccount.com")
    assert build.timeout.total_seconds() == 3600
    staged = image.plan_image(config(staging="gs://other/builds/"))
    assert staged.archive_uri == f"gs://other/builds/moe-tpu/images/{staged.tag}.tar.gz"


def test_cloud_build_needs_a_staging_location():
    plan = image.plan_image(load_config(ROOT / "examples" / "local.yaml"))  # output_dir runs/moe-local
    assert plan.archive_uri is None
    with pytest.raises(UsageError, match="Cloud Build needs a Cloud Storage location") as info:
        cloud_build.build_request(plan, "my-project")
    assert info.value.hint == "set image.staging: gs://YOUR-BUCKET/staging"


def test_source_archive_is_the_same_bytes_for_the_same_files(tmp_path):
    plan = image.plan_image(config())
    wheel = tmp_path / "w.whl"
    wheel.write_bytes(b"PK wheel bytes")
    first, second = tmp_path / "a", tmp_path / "b"
    names = image.write_context(plan, first, wheel)
    os.utime(wheel, (1, 1))
    assert image.write_context(plan, second, wheel) == names == ["Dockerfile", ".dockerignore",
                                                                  f"dist/{plan.wheel}"]
    os.utime(first / "Dockerfile", (5, 5))
    data = image.source_archive(first, names)
    assert data == image.source_archive(second, names)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = tar.getmembers()
        assert [m.name for m in members] == sorted(names)
        assert {(m.mtime, m.uid, m.mode) for m in members} == {(0, 0, 0o644)}
        assert tar.extractfile(f"dist/{plan.wheel}").read() == b"PK wheel bytes"


# --- the wheel and what the container runs ------------------------------------------------------------

def test_the_wheel_holds_the_templates_and_the_named_configs(tmp_path):
    wheel = image.build_wheel(ROOT, tmp_path, Console(output="json"), isolation=False)
    assert wheel.name == image.wheel_name(ROOT)
    names = set(zipfile.ZipFile(wheel).namelist())
    for template in ("Dockerfile.j2", "dockerignore.j2", "startup.sh.j2", "queued_resource.yaml.j2"):
        assert f"provision/_templates/{template}" in names
    for named in ("tiny", "switch-base-8", "glam-small", "v5e-64", "moe-1b"):
        assert f"trainer/configs/{named}.yaml" in names
    assert "trainer/__main__.py" in names and "provision/image.py" in names


def isolated_python(code: str, blocked: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Python without site's start-up (so nothing pre-imports importlib.util, as in a fresh venv),
    with the packages of the control extra made unimportable."""
    paths = [str(ROOT), *site.getsitepackages()]
    prelude = (
        "import sys\n"
        f"sys.path[:0] = {paths!r}\n"
        "class Block:\n"
        f"    names = {blocked!r}\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if any(name == b or name.startswith(b + '.') for b in self.names):\n"
        "            raise ImportError(f'{name} is not installed (blocked)')\n"
        "sys.meta_path.insert(0, Block())\n")
    # XLA_FLAGS kept: the suite's compiler flags (tests/conftest.py), which the compilation cache's keys hold
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    return subprocess.run([sys.executable, "-S", "-c", prelude + code], capture_output=True, text=True,
                          env=env, timeout=300)


CONTROL_ONLY = ("jinja2", "grpc", "tenacity", "google.cloud.tpu_v2", "google.cloud.aiplatform_v1",
                "google.cloud.devtools")


def test_help_works_without_the_control_extra():
    result = isolated_python("from provision.cli import main\nmain(['--help'])", CONTROL_ONLY)
    assert result.returncode == 0, result.stderr
    assert "image     The trainer's container image" in result.stdout


def test_the_container_command_runs_without_the_control_extra(tmp_path):
    # The trainer the dry runs start (cli_helpers.SMALL with the tpu-vm example's overrides): its programs
    # are then in the run's compilation cache (tests/conftest.py) and this run compiles nothing; which
    # model it trains does not matter here, only that the container's command runs without the extra.
    args = ["--config", "tiny", "--steps", str(SMALL["steps"]), "--devices", str(SMALL["devices"]), "--mesh",
            SMALL["mesh"], "--set", "dtype=bfloat16", "--set", "moe.capacity_factor=1.25", "--metrics",
            str(tmp_path / "m.jsonl")]
    code = ("import runpy, sys\n"
            f"sys.argv = ['trainer', *{args!r}]\n"
            "runpy.run_module('trainer', run_name='__main__')\n")
    result = isolated_python(code, CONTROL_ONLY)
    assert result.returncode == 0, result.stderr[-2000:]
    steps = [json.loads(line)["step"] for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert steps == list(range(1, SMALL["steps"] + 1))


def test_cloud_build_is_followed_on_the_injected_clock_and_its_log_printed_once(capsys):
    from google.api_core import exceptions as gexc
    from google.cloud.devtools import cloudbuild_v1

    from provision.clock import SimClock

    status = cloudbuild_v1.Build.Status
    answers = [gexc.ServiceUnavailable("blip"), status.QUEUED, status.WORKING, status.WORKING, status.SUCCESS]
    log = b"step 1\nstep 2\npushed\n"
    asked = []

    class Client:  # Cloud Build as it answers: a transient error first (retried), then the build's states
        def get_build(self, project_id: str, id: str):  # noqa: A002 - the client's own name
            asked.append((project_id, id))
            answer = answers.pop(0)
            if isinstance(answer, Exception):
                raise answer
            return cloudbuild_v1.Build(id=id, status=answer)

    def read_after(url: str, offset: int) -> bytes:  # the log grows by a line per look
        assert url == "gs://b/log-42.txt"
        return log[offset:log.index(b"\n", offset) + 1] if offset < len(log) else b""

    clock = SimClock()
    start = clock.now()
    api = cloud_build.CloudBuildApi(Client(), clock, Console(output="text", verbose=0))
    build = api.follow("my-project", "42", "gs://b/log-42.txt", read_after)
    assert build.status.name == "SUCCESS" and answers == [] and asked == [("my-project", "42")] * 5
    printed = [line for line in capsys.readouterr().err.splitlines() if line.startswith("  | ")]
    assert printed == ["  | step 1", "  | step 2", "  | pushed"]
    assert clock.now() - start >= 3 * cloud_build.LOG_POLL.initial_s  # it waited on the clock it was given
