"""The trainer's container image: what goes in, its content-hash tag, the build context, and the
two ways to build it: local docker, or Cloud Build from a source archive in Cloud Storage.

The image is made from the project's wheel (`python -m build`) and the rendered Dockerfile. Its
tag hashes exactly the files the wheel is built from (pyproject.toml, README.md, provision/,
trainer/, templates/: sorted paths and file contents, never mtimes) together with the rendered
Dockerfile, so an unchanged tree gives the same tag on any checkout and is neither rebuilt nor
pushed again, and any change that would reach the image gives a new one. `run` and `slice up`
use that tag when the config sets none (`image_reference`).

Cloud Build and its upload live in provision/cloud/build.py and go through the command's Session
(its credentials, its Cloud Build and Cloud Storage, its calls log; the Google client libraries stay
under provision/cloud/); docker and `python -m build` run as subprocesses.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import io
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import provision
from provision import container
from provision.cloud import build as cloud_build
from provision.errors import CloudError, MissingDependency, MoeTpuError, UsageError
from provision.templates import render

DOCKERFILE_TEMPLATE = "Dockerfile.j2"
# The image's entry point: the trainer (provision.container: the image's two commands, the trainer and
# the server; a container that runs the server names its command).
TRAINER_COMMAND = container.TRAINER_COMMAND
DOCKERIGNORE_TEMPLATE = "dockerignore.j2"

# The image's base and its JAX stack, pinned: the wheel's own dependencies float (pyproject.toml),
# these do not. jax[tpu] 0.10.2 asks for libtpu 0.0.42.*.
BASE_IMAGE = "python:3.11-slim-bookworm"
JAX_VERSION = "0.10.2"
LIBTPU_VERSION = "0.0.42.1"
# The unprivileged user the trainer runs as (the startup script gives it the host directories).
TRAINER_USER = "trainer"
TRAINER_UID = 1000
VENV = "/opt/moe-tpu"
# TPU VMs are x86-64, whatever machine builds the image.
PLATFORM = "linux/amd64"

# What the wheel is built from (hatch: the packages provision and trainer, templates/ forced in as
# provision/_templates, README.md as the long description, pyproject.toml for the metadata).
WHEEL_INPUTS = ("pyproject.toml", "README.md", "provision", "trainer", "templates")
_SKIP_PARTS = {"__pycache__"}
_SKIP_SUFFIXES = (".pyc", ".pyo")

DOCKER_BUILDER = "docker"
CLOUD_BUILDER = "cloud-build"


@dataclass(frozen=True)
class DockerfileSpec:
    """What templates/Dockerfile.j2 needs."""

    base_image: str
    wheel: str
    extra: str
    jax_version: str
    libtpu_version: str
    user: str
    uid: int
    venv: str
    entrypoint: tuple[str, ...]


@dataclass(frozen=True)
class ImagePlan:
    """One image build, decided before anything runs: tags, inputs, context files, destinations."""

    root: Path
    repository: str
    tag: str
    extra_tags: tuple[str, ...]
    inputs: tuple[str, ...]
    wheel: str
    files: dict[str, str] = field(repr=False)
    staging: str | None
    build_service_account: str | None = None

    @property
    def uri(self) -> str:
        return f"{self.repository}:{self.tag}"

    @property
    def uris(self) -> list[str]:
        """Every name the image gets: the content-hash tag first, then image.tag if the config sets one."""
        return [self.uri] + [f"{self.repository}:{t}" for t in self.extra_tags]

    @property
    def docker_build_args(self) -> list[str]:
        """`docker build` for the image's platform with every tag (docker here, or Cloud Build's step)."""
        return ["build", "--platform", PLATFORM, *[arg for uri in self.uris for arg in ("--tag", uri)]]

    @property
    def archive_uri(self) -> str | None:
        """Where Cloud Build's source archive goes (None: nowhere to stage it)."""
        if self.staging is None:
            return None
        return f"{self.staging}/moe-tpu/images/{self.tag}.tar.gz"


# --- what goes in, and the tag -------------------------------------------------------------

def source_root() -> Path:
    """The source tree this moe-tpu runs from (a checkout or an editable install)."""
    root = Path(provision.__file__).resolve().parent.parent
    check_source_root(root)
    return root


def check_source_root(root: Path) -> None:
    if not (root / "pyproject.toml").is_file() or not (root / "trainer").is_dir():
        raise UsageError(f"{root} is not a moe-tpu source tree (it needs pyproject.toml and trainer/): the image "
                         "is built from the project's source",
                         hint="run moe-tpu from a clone of the project (pip install -e .), or set image.tag "
                              "to an image that is already built")


def image_inputs(root: Path) -> list[str]:
    """Every file the wheel is built from, as sorted POSIX paths relative to `root`."""
    found: list[str] = []
    for top in WHEEL_INPUTS:
        path = root / top
        if path.is_file():
            found.append(top)
        elif path.is_dir():
            for file in path.rglob("*"):
                rel = file.relative_to(root)
                if (file.is_file() and not file.name.endswith(_SKIP_SUFFIXES)
                        and not any(p in _SKIP_PARTS or p.startswith(".") for p in rel.parts)):
                    found.append(rel.as_posix())
    return sorted(found)


def wheel_name(root: Path) -> str:
    """The file name `python -m build --wheel` gives the project's wheel."""
    try:
        project = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]
        name, version = project["name"], project["version"]
    except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError) as exc:
        raise UsageError(f"{root / 'pyproject.toml'}: cannot read the project's name and version ({exc})") from None
    return f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}-py3-none-any.whl"


def dockerfile_spec(root: Path) -> DockerfileSpec:
    return DockerfileSpec(
        base_image=BASE_IMAGE, wheel=wheel_name(root), extra="trainer", jax_version=JAX_VERSION,
        libtpu_version=LIBTPU_VERSION, user=TRAINER_USER, uid=TRAINER_UID, venv=VENV,
        entrypoint=TRAINER_COMMAND,
    )


def context_files(root: Path, templates_dir: Path | None = None) -> dict[str, str]:
    """The rendered files of the build context, by name (the wheel joins them under dist/)."""
    spec = dockerfile_spec(root)
    return {"Dockerfile": render(DOCKERFILE_TEMPLATE, spec, templates_dir),
            ".dockerignore": render(DOCKERIGNORE_TEMPLATE, spec, templates_dir)}


def content_hash(root: Path, inputs: list[str], files: dict[str, str]) -> str:
    """sha256 over each input's path and bytes, then each context file's name and text."""
    digest = hashlib.sha256()

    def add(name: str, data: bytes) -> None:
        digest.update(f"{name}\0{len(data)}\0".encode())
        digest.update(data)

    for rel in inputs:
        add(rel, (root / rel).read_bytes())
    for name in sorted(files):
        add(f"context/{name}", files[name].encode())
    return digest.hexdigest()


def _version(wheel: str) -> str:
    return wheel.split("-")[1]


def content_tag(root: Path | None = None, templates_dir: Path | None = None) -> str:
    """The tag `image build` gives the image of this tree: VERSION-HASH16, e.g. 0.1.0-3f9c2a...."""
    root = source_root() if root is None else root
    check_source_root(root)
    files = context_files(root, templates_dir)
    return f"{_version(wheel_name(root))}-{content_hash(root, image_inputs(root), files)[:16]}"


def image_reference(cfg: Any, templates_dir: Path | None = None) -> str:
    """The trainer image a config runs: REPOSITORY:TAG, where a config without image.tag gets the
    content-hash tag that `moe-tpu image build` gives this source tree (with these templates)."""
    if cfg.image.tag is not None:
        return f"{cfg.image.repository}:{cfg.image.tag}"
    return f"{cfg.image.repository}:{content_tag(templates_dir=templates_dir)}"


def plan_image(cfg: Any, templates_dir: Path | None = None, root: Path | None = None) -> ImagePlan:
    """Everything about the build of `cfg`'s image that needs neither docker nor the network."""
    root = source_root() if root is None else root
    check_source_root(root)
    inputs = image_inputs(root)
    files = context_files(root, templates_dir)
    wheel = wheel_name(root)
    tag = f"{_version(wheel)}-{content_hash(root, inputs, files)[:16]}"
    extra = (cfg.image.tag,) if cfg.image.tag is not None and cfg.image.tag != tag else ()
    return ImagePlan(root=root, repository=cfg.image.repository, tag=tag, extra_tags=extra, inputs=tuple(inputs),
                     wheel=wheel, files=files, staging=staging_location(cfg),
                     build_service_account=cfg.image.build_service_account)


def staging_location(cfg: Any) -> str | None:
    """image.staging, else the staging/ prefix of trainer.output_dir's bucket, else None."""
    if cfg.image.staging:
        return cfg.image.staging
    match = re.match(r"^gs://([^/]+)", cfg.trainer.output_dir)
    return f"gs://{match.group(1)}/staging" if match else None


# --- the context -------------------------------------------------------------------------------

def write_context(plan: ImagePlan, context: Path, wheel: Path | None = None) -> list[str]:
    """Write the context's files into `context` (and dist/WHEEL when given); returns their names.

    Only these files are the context: its .dockerignore lets nothing else through, and the
    Cloud Build archive holds only them.
    """
    try:
        context.mkdir(parents=True, exist_ok=True)
        dist = context / "dist"
        if dist.is_dir():
            shutil.rmtree(dist)
        names = []
        for name, text in plan.files.items():
            (context / name).write_text(text, encoding="utf-8")
            names.append(name)
        if wheel is not None:
            dist.mkdir()
            shutil.copyfile(wheel, dist / plan.wheel)
            names.append(f"dist/{plan.wheel}")
    except OSError as exc:
        raise UsageError(f"cannot write the build context to {context}: {exc.strerror or exc}") from None
    return names


def source_archive(context: Path, names: list[str]) -> bytes:
    """The context as a .tar.gz that is the same bytes for the same files (no mtimes, owners, modes)."""
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=0) as zipped, \
            tarfile.open(fileobj=zipped, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name in sorted(names):
            data = (context / name).read_bytes()
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o644, 0
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def build_wheel(root: Path, outdir: Path, console: Any, isolation: bool = True) -> Path:
    """`python -m build --wheel` of the tree into `outdir`; the path of the wheel."""
    if importlib.util.find_spec("build") is None:
        raise MissingDependency("build", "image")
    command = [sys.executable, "-m", "build", "--wheel", "--outdir", str(outdir), str(root)]
    if not isolation:
        command.insert(4, "--no-isolation")
    code, tail = _stream(command, console, "building the wheel")
    wheel = outdir / wheel_name(root)
    if code != 0 or not wheel.is_file():
        raise MoeTpuError("`python -m build` could not build the wheel:\n" + "\n".join(tail),
                          hint="run `python -m build --wheel` in the checkout to see the whole output")
    return wheel


def _stream(command: list[str], console: Any, label: str) -> tuple[int, list[str]]:
    """Run `command`, its output shown as progress (every line with -v); exit code and last lines."""
    tail: deque[str] = deque(maxlen=30)
    try:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace")
    except OSError as exc:
        raise MoeTpuError(f"cannot run {command[0]}: {exc.strerror or exc}") from None
    with console.progress(f"{label} ...") as bar:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            if line:
                tail.append(line)
                console.detail(line)
                bar.update(f"{label}: {line[:100]}")
        code = proc.wait()
        bar.update(f"{label}: {'done' if code == 0 else f'failed (exit {code})'}")
    return code, list(tail)


# --- which builder -------------------------------------------------------------------------------

def docker_status() -> tuple[bool, str]:
    """Whether a docker daemon answers here, and why not."""
    docker = shutil.which("docker")
    if docker is None:
        return False, "docker is not installed (no `docker` on PATH)"
    try:
        probe = subprocess.run([docker, "info", "--format", "{{.ServerVersion}}"], capture_output=True,
                               text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"`docker info` did not answer ({exc})"
    if probe.returncode != 0:
        lines = [line.strip() for line in (probe.stderr or probe.stdout).splitlines() if line.strip()]
        return False, f"the docker daemon is not reachable ({lines[-1] if lines else f'exit {probe.returncode}'})"
    return True, f"docker {probe.stdout.strip()}"


def choose_builder(requested: str) -> str:
    """The builder for --builder auto|docker|cloud-build (Cloud Build when Application Default
    Credentials are there); exit 1 when neither works."""
    docker_ok, docker_why = docker_status() if requested in ("auto", DOCKER_BUILDER) else (False, "")
    if docker_ok:
        return DOCKER_BUILDER
    if requested == DOCKER_BUILDER:
        raise MoeTpuError(f"cannot build with docker: {docker_why}",
                          hint="start the docker daemon, or build with Cloud Build: --builder cloud-build")
    credentials, _, cloud_why = cloud_build.credentials()
    if credentials is not None:
        return CLOUD_BUILDER
    if requested == CLOUD_BUILDER:
        raise MoeTpuError(f"cannot submit a Cloud Build: {cloud_why}",
                          hint="log in with `gcloud auth application-default login`")
    raise MoeTpuError(
        "cannot build the image: neither docker nor Google Cloud credentials are available here:\n"
        f"  docker: {docker_why}\n  Cloud Build: {cloud_why}",
        hint="either start docker (the image is built locally), or log in with "
             "`gcloud auth application-default login` (the image is built by Cloud Build); "
             "`moe-tpu --dry-run image build` shows the plan without either")


# --- docker ------------------------------------------------------------------------------------------

def _docker_ok(*args: str) -> bool:
    try:
        return subprocess.run(["docker", *args], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def docker_build(plan: ImagePlan, context: Path, console: Any) -> None:
    code, tail = _stream(["docker", *plan.docker_build_args, str(context)], console, "docker build")
    if code != 0:
        raise MoeTpuError(f"docker build failed (exit {code}):\n" + "\n".join(tail),
                          hint=f"rerun with -v to see the whole build, or `docker build {context}`")


def docker_push(plan: ImagePlan, console: Any) -> list[str]:
    """Push every tag the registry lacks; returns the pushed URIs."""
    pushed = []
    for uri in plan.uris:
        if _docker_ok("manifest", "inspect", uri):
            console.info(f"{uri} is already in the registry; not pushing it again")
            continue
        code, tail = _stream(["docker", "push", uri], console, f"docker push {uri}")
        if code != 0:
            raise CloudError(f"docker push {uri} failed (exit {code}):\n" + "\n".join(tail[-10:]),
                             hint=f"let docker log in to Artifact Registry: gcloud auth configure-docker "
                                  f"{plan.repository.split('/', 1)[0]}")
        pushed.append(uri)
    return pushed


def tag_existing(plan: ImagePlan) -> None:
    """Give a locally built content-hash image the config's own tag too."""
    for uri in plan.uris[1:]:
        subprocess.run(["docker", "tag", plan.uri, uri], capture_output=True, check=False)


# --- the whole build ---------------------------------------------------------------------------------

@dataclass
class BuildResult:
    builder: str
    built: bool
    pushed: list[str]
    build_id: str | None = None
    files: list[str] = field(default_factory=list)


def build_image(plan: ImagePlan, context: Path, *, push: bool, requested: str, run_context: Any) -> BuildResult:
    """Build (and push) the image unless what it would make is already there. `run_context` is the command's
    provision.context.RunContext: its console, and for Cloud Build its config's project and its session."""
    console = run_context.console
    builder = choose_builder(requested)
    if builder == DOCKER_BUILDER:
        return _build_with_docker(plan, context, push, console)
    session = run_context.session
    project = run_context.config.project or session.default_project
    if not project:
        raise UsageError("Cloud Build needs a project, and neither the config nor the credentials name one",
                         hint="set `project:` in the config")
    if all(cloud_build.registry_has(uri, session) for uri in plan.uris):
        console.info(f"{plan.uri} is already in the registry; nothing to build")
        return BuildResult(CLOUD_BUILDER, built=False, pushed=[])
    names = write_context(plan, context, _wheel(plan, context, console))
    build_id = cloud_build.submit(plan, source_archive(context, names), session, project)
    return BuildResult(CLOUD_BUILDER, built=True, pushed=plan.uris, build_id=build_id, files=names)


def _wheel(plan: ImagePlan, context: Path, console: Any) -> Path:
    outdir = context.parent / f"{context.name}-wheel"
    shutil.rmtree(outdir, ignore_errors=True)
    return build_wheel(plan.root, outdir, console)


def _build_with_docker(plan: ImagePlan, context: Path, push: bool, console: Any) -> BuildResult:
    built = False
    names = write_context(plan, context)
    if _docker_ok("image", "inspect", plan.uri):
        tag_existing(plan)
        console.info(f"{plan.uri} is already built here; not building it again")
    else:
        names = write_context(plan, context, _wheel(plan, context, console))
        docker_build(plan, context, console)
        built = True
    pushed = docker_push(plan, console) if push else []
    return BuildResult(DOCKER_BUILDER, built=built, pushed=pushed, files=names)
