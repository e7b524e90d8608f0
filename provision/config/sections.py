"""The config's sections as frozen pydantic models: every field's own rule, and the shapes of names,
durations and ids the rules share."""

from __future__ import annotations

import difflib
import re
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, field_validator

from provision import catalogue
from provision.waiting import format_duration
from trainer import meshspec
from trainer.schema import NonNegative, Positive, invalid

DEFAULT_CONFIG = "moe-tpu.yaml"

# The run name becomes resource ids (queued resource, node, job) and label values. Ids are
# RFC 1035 labels of at most 63 characters; suffixes such as "-node" and the "-N" that the
# service appends to multislice nodes must still fit, hence the margin.
MAX_ID_LENGTH = 63
MAX_RUN_LENGTH = 50

_RFC1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_PROJECT = re.compile(r"^[a-z][a-z0-9-]{4,28}[a-z0-9]$")
_REGION = re.compile(r"^[a-z]+-[a-z]+[0-9]+$")
_ZONE = catalogue.ZONE_NAME
_DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")
_IMAGE_REPOSITORY = re.compile(
    r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)+(:[0-9]+)?"  # host
    r"(/[a-z0-9]([a-z0-9._-]*[a-z0-9])?){3,}$"  # /project/repository/image[/...]
)
_IMAGE_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_SERVICE_ACCOUNT = re.compile(r"^[a-z][a-z0-9-]{4,28}[a-z0-9]@[a-z0-9.-]+\.iam\.gserviceaccount\.com$"
                              r"|^[0-9]+-compute@developer\.gserviceaccount\.com$")
# A Vertex AI TensorBoard instance: projects/PROJECT/locations/REGION/tensorboards/ID (IDs are numbers).
_VERTEX_TENSORBOARD = re.compile(r"^projects/[a-z0-9-]+/locations/[a-z]+-[a-z]+[0-9]+/tensorboards/[0-9]+$")
_VERTEX_NETWORK = re.compile(r"^projects/[0-9]+/global/networks/[a-z]([-a-z0-9]*[a-z0-9])?$")
# Compute Engine network and subnetwork names (RFC 1035, at most 63), or their resource names.
_NETWORK = re.compile(r"^(projects/[a-z][a-z0-9-]{4,28}[a-z0-9]/global/networks/)?[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
_SUBNETWORK = re.compile(r"^(projects/[a-z][a-z0-9-]{4,28}[a-z0-9]/regions/[a-z]+-[a-z]+[0-9]+/subnetworks/)?"
                         r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
# Cloud Storage: gs://BUCKET[/PATH]; bucket names are 3 to 63 lowercase letters, digits, '-', '_' and '.'
# (up to 222 with dots), starting and ending with a letter or digit (the path: any object name; control
# characters are refused for every value).
_GCS_URL = re.compile(r"^gs://(?=[a-z0-9._-]{3,222}(/|$))[a-z0-9]([a-z0-9_-]|\.(?!\.))*[a-z0-9](/.*)?$")
# Where a local trainer.output_dir must never be: the startup script chowns it and mounts it into
# the container.
SYSTEM_DIRS = ("/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/opt", "/proc",
               "/root", "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr", "/var")
_SYSTEM_TREES = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/proc", "/sbin", "/sys", "/usr")
_OVERRIDE_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
# Config durations stay far below what a request's Duration can hold; nobody queues or trains for longer.
MAX_DURATION = timedelta(days=30)
# Slices in one multislice queued resource; more is no quota anyone has, and no longer a valid request.
MAX_SLICE_COUNT = 256


def parse_duration(value: Any) -> timedelta:
    """"2h", "30m", "90s", "1h30m" -> timedelta (format_duration(delta, exact=True) writes it back). Bare
    numbers are refused: their unit is a guess."""
    if isinstance(value, timedelta):
        return value
    text = value.strip() if isinstance(value, str) else None
    match = _DURATION.match(text) if text else None
    if not match:
        raise ValueError(f"duration {value!r} must look like 2h, 30m, 90s or 1h30m")
    hours, minutes, seconds = (int(g or 0) for g in match.groups())
    try:
        return timedelta(hours=hours, minutes=minutes, seconds=seconds)
    except OverflowError:
        longest = format_duration(MAX_DURATION, exact=True)
        raise ValueError(f"duration {value!r} is too long (at most {longest})") from None


def _positive_duration(value: Any) -> timedelta:
    """A config duration longer than 0s, as a validator error otherwise."""
    try:
        delta = parse_duration(value)
    except ValueError as exc:
        raise invalid(str(exc)) from None
    if delta <= timedelta(0):
        raise invalid(f"duration {value!r} must be longer than 0s")
    if delta > MAX_DURATION:
        raise invalid(f"duration {value!r} is too long: at most {format_duration(MAX_DURATION, exact=True)} (30 days)")
    return delta


def _brief(value: Any, width: int = 80) -> str:
    """repr() of a value from the file, cut short: a message names it, it does not print it all."""
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def _did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _mesh_text(value: str) -> str:
    """A mesh the trainer reads (trainer/meshspec.py); whether it covers the chips is the planner's check."""
    try:
        meshspec.mesh_axes(value)
    except ValueError as exc:
        raise invalid(f"the trainer refuses it: {str(exc).replace('--mesh ', 'mesh ')}") from None
    return value


def _zone_name(zone: str) -> str:
    if not _ZONE.match(zone):
        raise invalid(f"zone {zone!r} is not a zone name like us-west4-a")
    return zone  # one the catalogue does not list for v5e is a warning (Config.warnings)


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SliceConfig(_Section):
    accelerator: str = "v5litepod-64"
    runtime_version: str = catalogue.V5E_RUNTIME
    count: Annotated[StrictInt, Field(ge=1, le=MAX_SLICE_COUNT)] = 1
    capacity: Literal["on-demand", "spot", "reserved"] = "spot"
    reservation: str | None = None
    max_wait: timedelta = timedelta(hours=2)
    network: str = "default"
    subnetwork: str | None = None
    service_account: str | None = None

    @field_validator("accelerator")
    @classmethod
    def _known_accelerator(cls, value: str) -> str:
        if value not in catalogue.ACCELERATORS:
            names = list(catalogue.ACCELERATORS)
            raise invalid(f"unknown accelerator type {value!r}{_did_you_mean(value, names)} "
                        f"(v5e types: {', '.join(names)})")
        return value

    @field_validator("reservation")
    @classmethod
    def _reservation_name(cls, value: str | None) -> str | None:
        """A reservation's name (RFC 1035, like every Compute Engine resource name) or its full
        name projects/PROJECT/locations/ZONE/reservations/NAME (the API's reservation_name)."""
        if value is None:
            return value
        parts = value.split("/")
        full = (len(parts) == 6 and parts[0] == "projects" and parts[2] == "locations"
                and parts[4] == "reservations" and bool(_PROJECT.match(parts[1])) and bool(_ZONE.match(parts[3])))
        name = parts[5] if full else value
        if (len(parts) != 1 and not full) or not _RFC1035.match(name) or len(name) > MAX_ID_LENGTH:
            raise invalid(f"reservation {value!r} is not a reservation name (lowercase letters, digits and "
                        "hyphens, starting with a letter, at most 63) nor "
                        "projects/PROJECT/locations/ZONE/reservations/NAME")
        return value

    @field_validator("max_wait", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> timedelta:
        return _positive_duration(value)

    @field_validator("network")
    @classmethod
    def _network_name(cls, value: str) -> str:
        if not _NETWORK.match(value):
            raise invalid(f"network {_brief(value)} is not a network name (lowercase letters, digits and hyphens, "
                        "starting with a letter, at most 63) nor projects/PROJECT/global/networks/NAME")
        return value

    @field_validator("subnetwork")
    @classmethod
    def _subnetwork_name(cls, value: str | None) -> str | None:
        if value is not None and not _SUBNETWORK.match(value):
            raise invalid(f"subnetwork {_brief(value)} is not a subnetwork name (lowercase letters, digits and "
                        "hyphens, starting with a letter, at most 63) nor "
                        "projects/PROJECT/regions/REGION/subnetworks/NAME")
        return value

    @field_validator("service_account")
    @classmethod
    def _service_account_shape(cls, value: str | None) -> str | None:
        if value is not None and not _SERVICE_ACCOUNT.match(value):
            raise invalid(f"service account {_brief(value)} must be an email like "
                        "trainer@my-project.iam.gserviceaccount.com")
        return value


class VertexConfig(_Section):
    machine_type: str = "ct5lp-hightpu-4t"
    topology: str = "8x8"
    scheduling: Literal["STANDARD", "SPOT", "FLEX_START"] = "STANDARD"
    # How long the job may run in all (Scheduling.timeout), and, for FLEX_START, how long it may
    # wait for capacity (Scheduling.max_wait_duration).
    timeout: timedelta = timedelta(days=7)
    max_wait: timedelta | None = None
    # Restart every worker when one restarts (keeps a multi-host JAX job consistent).
    restart_job_on_worker_restart: bool = True
    service_account: str | None = None
    network: str | None = None  # projects/NUMBER/global/networks/NAME (VPC peering)
    # The Vertex AI TensorBoard the job's events go to (CustomJobSpec.tensorboard); the trainer then
    # writes them where Vertex AI says (AIP_TENSORBOARD_LOG_DIR). Needs service_account.
    tensorboard: str | None = None

    @field_validator("timeout", "max_wait", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> timedelta | None:
        return None if value is None else _positive_duration(value)

    @field_validator("service_account")
    @classmethod
    def _service_account_shape(cls, value: str | None) -> str | None:
        if value is not None and not _SERVICE_ACCOUNT.match(value):
            raise invalid(f"service account {value!r} must be an email like trainer@my-project.iam.gserviceaccount.com")
        return value

    @field_validator("tensorboard")
    @classmethod
    def _tensorboard_shape(cls, value: str | None) -> str | None:
        if value is not None and not _VERTEX_TENSORBOARD.match(value):
            raise invalid(f"tensorboard {_brief(value)} must look like "
                        "projects/PROJECT/locations/REGION/tensorboards/ID (ID: a number)")
        return value

    @field_validator("network")
    @classmethod
    def _network_shape(cls, value: str | None) -> str | None:
        if value is not None and not _VERTEX_NETWORK.match(value):
            raise invalid(f"network {value!r} must look like projects/PROJECT_NUMBER/global/networks/NAME")
        return value

    @field_validator("machine_type")
    @classmethod
    def _known_machine_type(cls, value: str) -> str:
        names = list(catalogue.VERTEX_MACHINE_TOPOLOGIES)
        if value not in names:
            raise invalid(f"unknown Vertex machine type {value!r}{_did_you_mean(value, names)} "
                        f"(v5e machine types: {', '.join(names)})")
        return value

    @field_validator("topology")
    @classmethod
    def _known_topology(cls, value: str) -> str:
        if catalogue.accelerator_for_topology(value) is None:
            topologies = [a.topology for a in catalogue.ACCELERATORS.values()]
            raise invalid(f"unknown v5e topology {value!r} (v5e topologies: {', '.join(topologies)})")
        return value


class ImageConfig(_Section):
    repository: str
    # None: the content-hash tag that `moe-tpu image build` gives this source tree (see provision.image).
    tag: str | None = None
    # Where Cloud Build's source archive goes (gs://BUCKET[/PREFIX]); None: the staging/ prefix of
    # trainer.output_dir's bucket.
    staging: str | None = None
    # The service account Cloud Build runs as (terraform/ makes one); None: the project's default.
    build_service_account: str | None = None

    @field_validator("repository")
    @classmethod
    def _repository_shape(cls, value: str) -> str:
        if not _IMAGE_REPOSITORY.match(value):
            raise invalid(f"image repository {value!r} does not look like HOST/PROJECT/REPOSITORY/IMAGE "
                        "(e.g. us-west4-docker.pkg.dev/my-project/moe/trainer; the tag goes in image.tag)")
        return value

    @field_validator("tag")
    @classmethod
    def _tag_shape(cls, value: str | None) -> str | None:
        if value is not None and not _IMAGE_TAG.match(value):
            raise invalid(f"image tag {value!r} is not a valid tag (letters, digits, '_', '.', '-'; "
                        "at most 128 characters)")
        return value

    @field_validator("staging")
    @classmethod
    def _staging_shape(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^gs://[a-z0-9][a-z0-9._-]{1,220}[a-z0-9](/[^\s]*)?$", value):
            raise invalid(f"image staging {value!r} must be a Cloud Storage location like gs://my-bucket/staging")
        return value.rstrip("/") if value is not None else None

    @field_validator("build_service_account")
    @classmethod
    def _build_account_shape(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^[a-z0-9][a-z0-9-]{4,61}@[a-z0-9.-]+\.gserviceaccount\.com$", value):
            raise invalid(f"service account {value!r} must be an email like builder@my-project.iam.gserviceaccount.com")
        return value

    @property
    def registry_host(self) -> str:
        return self.repository.split("/", 1)[0]


class TrainerConfig(_Section):
    config: str = "tiny"
    output_dir: str
    steps: Positive | None = None
    # The device mesh (`--mesh`), e.g. data=8,expert=8; unset: the trainer puts every chip on data.
    mesh: str | None = None
    overrides: dict[str, str | int | float | bool] = Field(default_factory=dict)

    @field_validator("config", "output_dir")
    @classmethod
    def _not_empty(cls, value: str) -> str:
        if not value.strip():
            raise invalid("must not be empty")
        return value

    @field_validator("output_dir")
    @classmethod
    def _output_location(cls, value: str) -> str:
        """A Cloud Storage location with a valid bucket name, or a local directory that is not a system one."""
        if "://" in value or value.startswith("gs:"):
            if not _GCS_URL.match(value):
                raise invalid(f"output_dir {_brief(value)} is not a Cloud Storage location like gs://my-bucket/run "
                            "(bucket names: 3 to 63 lowercase letters, digits, '-', '_' or '.', starting and "
                            "ending with a letter or digit)")
            return value
        normal = "/" + "/".join(part for part in value.split("/") if part and part != ".") if value.startswith("/") \
            else None
        if normal is not None and (normal in SYSTEM_DIRS or normal.startswith(tuple(t + "/" for t in _SYSTEM_TREES))
                                   or ".." in normal.split("/")):
            raise invalid(f"output_dir {_brief(value)} is a system directory (or inside one): the trainer's VM "
                        "would take it over; use gs://BUCKET/PATH, or a directory of its own such as /mnt/moe")
        return value

    @field_validator("mesh")
    @classmethod
    def _mesh_shape(cls, value: str | None) -> str | None:
        return None if value is None else _mesh_text(value)

    @field_validator("overrides", mode="before")
    @classmethod
    def _override_items(cls, value: Any) -> Any:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise invalid(f"overrides must be a mapping of key: value, got {value!r}")
        for key, item in value.items():
            if not isinstance(key, str) or not _OVERRIDE_KEY.match(key):
                raise invalid(f"override key {key!r} must be a dotted name like model.num_experts")
            if not isinstance(item, (str, int, float, bool)):
                raise invalid(f"override {key!r} must be a string, a number or true/false, got {item!r}")
        return value

    def set_flags(self) -> list[str]:
        """The overrides as `--set key=value` arguments of `python -m trainer`."""
        flags: list[str] = []
        for key, value in self.overrides.items():
            text = ("true" if value else "false") if isinstance(value, bool) else str(value)
            flags += ["--set", f"{key}={text}"]
        return flags


class RecoveryConfig(_Section):
    max_restarts: NonNegative = 3


class DryRunConfig(_Section):
    """How `run --dry-run` trains for real on this machine: the trainer made small enough for a CPU."""

    trainer_config: str = "tiny"
    steps: Positive = 40
    devices: Positive = 8
    mesh: str = "data=2,expert=4"
    checkpoint_every: Positive = 10

    @field_validator("mesh")
    @classmethod
    def _mesh_shape(cls, value: str) -> str:
        return _mesh_text(value)


# GKE names: a cluster or node pool name is at most 40 characters (RFC 1035); a namespace or a
# Kueue queue is an RFC 1123 DNS label (Kubernetes object names).
MAX_GKE_NAME = 40
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LOCATION = re.compile(r"^[a-z]+-[a-z]+[0-9]+(-[a-z])?$")
_IMAGE_REF = re.compile(r"^[a-z0-9]([a-z0-9._-]*[a-z0-9])?(:[0-9]+)?(/[a-z0-9]([a-z0-9._-]*[a-z0-9])?)+"
                        r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}|@sha256:[0-9a-f]{64})?$")
_MACHINE_TYPE = re.compile(r"^[a-z][a-z0-9]*-[a-z0-9-]*[a-z0-9]$")
# The images Google publishes for Pathways on GKE (the server also runs the resource manager).
PATHWAYS_SERVER_IMAGE = "us-docker.pkg.dev/cloud-tpu-v2-images/pathways/server:latest"
PATHWAYS_PROXY_IMAGE = "us-docker.pkg.dev/cloud-tpu-v2-images/pathways/proxy_server:latest"


def _dns_label(value: str, what: str) -> str:
    if not _DNS_LABEL.match(value) or len(value) > MAX_ID_LENGTH:
        raise invalid(f"{what} {value!r} is not a DNS label (lowercase letters, digits and hyphens, starting and "
                    f"ending with a letter or digit, at most {MAX_ID_LENGTH})")
    return value


class PathwaysConfig(_Section):
    """The Pathways head and workers (runtime: pathways only)."""

    server_image: str = PATHWAYS_SERVER_IMAGE
    proxy_image: str = PATHWAYS_PROXY_IMAGE
    # Pathways' scratch space in Cloud Storage; None: the pathways/ prefix of trainer.output_dir.
    gcs_scratch: str | None = None
    cpu_machine_type: str = "n2-standard-64"
    # How long the trainer waits for the proxy before it gives up (PATHWAYS_PROXY_CONNECTION_TIMEOUT_SECS).
    proxy_timeout: timedelta = timedelta(minutes=1)

    @field_validator("server_image", "proxy_image")
    @classmethod
    def _image(cls, value: str) -> str:
        if not _IMAGE_REF.match(value):
            raise invalid(f"image {value!r} is not an image reference like HOST/PATH[:TAG]")
        return value

    @field_validator("gcs_scratch")
    @classmethod
    def _scratch(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^gs://[a-z0-9][a-z0-9._-]{1,220}[a-z0-9](/[^\s]*)?$", value):
            raise invalid(f"gcs_scratch {value!r} must be a Cloud Storage location like gs://my-bucket/pathways")
        return value.rstrip("/") if value is not None else None

    @field_validator("cpu_machine_type")
    @classmethod
    def _machine(cls, value: str) -> str:
        if not _MACHINE_TYPE.match(value):
            raise invalid(f"machine type {value!r} is not a Compute Engine machine type like n2-standard-64")
        return value

    @field_validator("proxy_timeout", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> timedelta:
        return _positive_duration(value)


class GkeConfig(_Section):
    """A GKE Standard cluster: TPU node pools for the slices, the run as a JobSet."""

    cluster: str
    # The cluster's region or zone; the node pools go in `zones` (tried in order on stockout).
    location: str
    create_cluster: bool = False
    runtime: Literal["jax", "pathways"] = "jax"
    namespace: str = "default"
    # A Kueue LocalQueue: set as the JobSet's kueue.x-k8s.io/queue-name label when given.
    queue: str | None = None
    # The slice's topology as GKE names it; default (and it must agree): slice.accelerator's.
    topology: str | None = None
    pathways: PathwaysConfig | None = None

    @field_validator("cluster")
    @classmethod
    def _cluster_name(cls, value: str) -> str:
        if not _RFC1035.match(value) or len(value) > MAX_GKE_NAME:
            raise invalid(f"cluster name {value!r} must be lowercase letters, digits and hyphens, start with a "
                        f"letter, not end with a hyphen, at most {MAX_GKE_NAME} characters")
        return value

    @field_validator("location")
    @classmethod
    def _location(cls, value: str) -> str:
        if not _LOCATION.match(value):
            raise invalid(f"location {value!r} is neither a region (us-west4) nor a zone (us-west4-a)")
        return value

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str) -> str:
        return _dns_label(value, "namespace")

    @field_validator("queue")
    @classmethod
    def _queue(cls, value: str | None) -> str | None:
        return None if value is None else _dns_label(value, "queue")

    @field_validator("topology")
    @classmethod
    def _topology(cls, value: str | None) -> str | None:
        if value is not None and catalogue.accelerator_for_topology(value) is None:
            topologies = [a.topology for a in catalogue.ACCELERATORS.values()]
            raise invalid(f"unknown v5e topology {value!r} (v5e topologies: {', '.join(topologies)})")
        return value

    def pathways_settings(self) -> PathwaysConfig:
        """The pathways section, with its defaults when the config leaves it out."""
        return self.pathways if self.pathways is not None else PathwaysConfig()


_SECTIONS: dict[str, type[_Section]] = {
    "slice": SliceConfig, "vertex": VertexConfig, "image": ImageConfig,
    "trainer": TrainerConfig, "recovery": RecoveryConfig, "dry_run": DryRunConfig,
    "gke": GkeConfig, "pathways": PathwaysConfig,
}


class Config(BaseModel):
    """One run, as the config file describes it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    project: str | None = None
    region: str
    zones: list[Annotated[str, AfterValidator(_zone_name)]]
    run: str
    target: Literal["tpu-vm", "vertex", "gke"] = "tpu-vm"
    slice: SliceConfig = Field(default_factory=SliceConfig)
    vertex: VertexConfig = Field(default_factory=VertexConfig)
    image: ImageConfig
    trainer: TrainerConfig
    recovery: RecoveryConfig = Field(default_factory=RecoveryConfig)
    dry_run: DryRunConfig = Field(default_factory=DryRunConfig)
    gke: GkeConfig | None = None  # target: gke only
    source: Path = Field(default=Path(DEFAULT_CONFIG), exclude=True)

    @field_validator("slice", "vertex", "recovery", "dry_run", mode="before")
    @classmethod
    def _empty_section(cls, value: Any) -> Any:
        return {} if value is None else value

    @field_validator("project")
    @classmethod
    def _project_shape(cls, value: str | None) -> str | None:
        if value is not None and not _PROJECT.match(value):
            raise invalid(f"project id {value!r} must be 6 to 30 lowercase letters, digits or hyphens, "
                        "start with a letter and not end with a hyphen")
        return value

    @field_validator("region")
    @classmethod
    def _region_shape(cls, value: str) -> str:
        if not _REGION.match(value):
            raise invalid(f"region {value!r} is not a region name like us-west4")
        return value

    @field_validator("zones")
    @classmethod
    def _zones(cls, value: list[str]) -> list[str]:
        if not value:
            raise invalid("list at least one zone, e.g. [us-west4-a]")
        twice = sorted({zone for zone in value if value.count(zone) > 1})
        if twice:
            raise invalid(f"zone {twice[0]!r} is listed twice; list each zone once (they are tried in order)")
        return value

    @field_validator("run")
    @classmethod
    def _run_name(cls, value: str) -> str:
        if not _RFC1035.match(value):
            raise invalid(f"run name {value!r} must be lowercase letters, digits and hyphens, start with a "
                        "letter and not end with a hyphen (it becomes resource ids: RFC 1035)")
        if len(value) > MAX_RUN_LENGTH:
            raise invalid(f"run name {value!r} is {len(value)} characters; at most {MAX_RUN_LENGTH}, so that "
                        f"the resource ids derived from it stay within {MAX_ID_LENGTH}")
        return value

    def accelerator_type(self) -> catalogue.AcceleratorType:
        return catalogue.accelerator(self.slice.accelerator)

    def warnings(self) -> list[str]:
        """What is allowed but worth saying: zones the catalogue does not list for v5e (a TPU VM slice)."""
        if self.target != "tpu-vm":
            return []
        return [w for w in map(catalogue.zone_warning, self.zones) if w]


