"""The config file: YAML in, one frozen, validated `Config` out.

Every problem is collected and reported together (`ConfigError`, exit 2), each naming the
file and the dotted key, in the order the keys appear in the file. Field rules live on the
models; rules that tie two keys together (zone inside region, runtime fits accelerator, ...)
run afterwards on the raw values, and a key that already failed its own rule is skipped
there, so one mistake is reported once.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from provision import catalogue
from provision.errors import ConfigError, Problem
from trainer import safeyaml

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
_MESH = re.compile(r"^[a-z]+=[0-9]+(,[a-z]+=[0-9]+)*$")
_OVERRIDE_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
# Config durations stay far below what a request's Duration can hold; nobody queues or trains for longer.
MAX_DURATION = timedelta(days=30)
# Slices in one multislice queued resource; more is no quota anyone has, and no longer a valid request.
MAX_SLICE_COUNT = 256


def _fail(message: str) -> PydanticCustomError:
    return PydanticCustomError("moe_tpu", message)  # type: ignore[arg-type]


def parse_duration(value: Any) -> timedelta:
    """"2h", "30m", "90s", "1h30m" -> timedelta. Bare numbers are refused: their unit is a guess."""
    if isinstance(value, timedelta):
        return value
    text = value.strip() if isinstance(value, str) else None
    match = _DURATION.match(text) if text else None
    if not match:
        raise ValueError(f"duration {_brief(value)} must look like 2h, 30m, 90s or 1h30m")
    hours, minutes, seconds = (int(g or 0) for g in match.groups())
    try:
        return timedelta(hours=hours, minutes=minutes, seconds=seconds)
    except OverflowError:
        raise ValueError(f"duration {_brief(value)} is too long (at most {format_duration(MAX_DURATION)})") from None


def format_duration(delta: timedelta) -> str:
    """timedelta -> "1h30m" (the inverse of parse_duration)."""
    from provision.waiting import format_duration as format_seconds

    return format_seconds(delta.total_seconds(), exact=True)


def _positive_duration(value: Any) -> timedelta:
    """A config duration longer than 0s, as a validator error otherwise."""
    try:
        delta = parse_duration(value)
    except ValueError as exc:
        raise _fail(str(exc)) from None
    if delta <= timedelta(0):
        raise _fail(f"duration {_brief(value)} must be longer than 0s")
    if delta > MAX_DURATION:
        raise _fail(f"duration {_brief(value)} is too long: at most {format_duration(MAX_DURATION)} (30 days)")
    return delta


def _did_you_mean(word: str, choices: list[str]) -> str:
    close = difflib.get_close_matches(word, choices, n=1, cutoff=0.6)
    return f"; did you mean {close[0]!r}?" if close else ""


def _zone_name(zone: str) -> str:
    if not _ZONE.match(zone):
        raise _fail(f"zone {_brief(zone)} is not a zone name like us-west4-a")
    return zone  # one the catalogue does not list for v5e is a warning (Config.warnings)


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class SliceConfig(_Section):
    accelerator: str = "v5litepod-64"
    runtime_version: str = catalogue.V5E_RUNTIME
    count: StrictInt = 1
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
            raise _fail(f"unknown accelerator type {_brief(value)}{_did_you_mean(value, names)} "
                        f"(v5e types: {', '.join(names)})")
        return value

    @field_validator("count")
    @classmethod
    def _positive_count(cls, value: int) -> int:
        if value < 1:
            raise _fail(f"slice count must be at least 1, got {value}")
        if value > MAX_SLICE_COUNT:
            raise _fail(f"slice count must be at most {MAX_SLICE_COUNT}, got {value}")
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
            raise _fail(f"reservation {_brief(value)} is not a reservation name (lowercase letters, digits and "
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
            raise _fail(f"network {_brief(value)} is not a network name (lowercase letters, digits and hyphens, "
                        "starting with a letter, at most 63) nor projects/PROJECT/global/networks/NAME")
        return value

    @field_validator("subnetwork")
    @classmethod
    def _subnetwork_name(cls, value: str | None) -> str | None:
        if value is not None and not _SUBNETWORK.match(value):
            raise _fail(f"subnetwork {_brief(value)} is not a subnetwork name (lowercase letters, digits and "
                        "hyphens, starting with a letter, at most 63) nor "
                        "projects/PROJECT/regions/REGION/subnetworks/NAME")
        return value

    @field_validator("service_account")
    @classmethod
    def _service_account_shape(cls, value: str | None) -> str | None:
        if value is not None and not _SERVICE_ACCOUNT.match(value):
            raise _fail(f"service account {_brief(value)} must be an email like "
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

    @field_validator("timeout", "max_wait", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> timedelta | None:
        return None if value is None else _positive_duration(value)

    @field_validator("service_account")
    @classmethod
    def _service_account_shape(cls, value: str | None) -> str | None:
        if value is not None and not _SERVICE_ACCOUNT.match(value):
            raise _fail(f"service account {_brief(value)} must be an email like "
                        "trainer@my-project.iam.gserviceaccount.com")
        return value

    @field_validator("network")
    @classmethod
    def _network_shape(cls, value: str | None) -> str | None:
        if value is not None and not _VERTEX_NETWORK.match(value):
            raise _fail(f"network {_brief(value)} must look like projects/PROJECT_NUMBER/global/networks/NAME")
        return value

    @field_validator("machine_type")
    @classmethod
    def _known_machine_type(cls, value: str) -> str:
        names = list(catalogue.VERTEX_MACHINE_TOPOLOGIES)
        if value not in names:
            raise _fail(f"unknown Vertex machine type {_brief(value)}{_did_you_mean(value, names)} "
                        f"(v5e machine types: {', '.join(names)})")
        return value

    @field_validator("topology")
    @classmethod
    def _known_topology(cls, value: str) -> str:
        if catalogue.accelerator_for_topology(value) is None:
            topologies = [a.topology for a in catalogue.ACCELERATORS.values()]
            raise _fail(f"unknown v5e topology {_brief(value)} (v5e topologies: {', '.join(topologies)})")
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
            raise _fail(f"image repository {_brief(value)} does not look like HOST/PROJECT/REPOSITORY/IMAGE "
                        "(e.g. us-west4-docker.pkg.dev/my-project/moe/trainer; the tag goes in image.tag)")
        return value

    @field_validator("tag")
    @classmethod
    def _tag_shape(cls, value: str | None) -> str | None:
        if value is not None and not _IMAGE_TAG.match(value):
            raise _fail(f"image tag {_brief(value)} is not a valid tag (letters, digits, '_', '.', '-'; "
                        "at most 128 characters)")
        return value

    @field_validator("staging")
    @classmethod
    def _staging_shape(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^gs://[a-z0-9][a-z0-9._-]{1,220}[a-z0-9](/[^\s]*)?$", value):
            raise _fail(f"image staging {_brief(value)} must be a Cloud Storage location like gs://my-bucket/staging")
        return value.rstrip("/") if value is not None else None

    @field_validator("build_service_account")
    @classmethod
    def _build_account_shape(cls, value: str | None) -> str | None:
        if value is not None and not re.match(r"^[a-z0-9][a-z0-9-]{4,61}@[a-z0-9.-]+\.gserviceaccount\.com$", value):
            raise _fail(f"service account {_brief(value)} must be an email like "
                        "builder@my-project.iam.gserviceaccount.com")
        return value

    @property
    def registry_host(self) -> str:
        return self.repository.split("/", 1)[0]


class TrainerConfig(_Section):
    config: str = "tiny"
    output_dir: str
    steps: StrictInt | None = None
    # The device mesh (`--mesh`), e.g. data=8,expert=8; unset: the trainer puts every chip on data.
    mesh: str | None = None
    overrides: dict[str, str | int | float | bool] = Field(default_factory=dict)

    @field_validator("config", "output_dir")
    @classmethod
    def _not_empty(cls, value: str) -> str:
        if not value.strip():
            raise _fail("must not be empty")
        return value

    @field_validator("output_dir")
    @classmethod
    def _output_location(cls, value: str) -> str:
        """A Cloud Storage location with a valid bucket name, or a local directory that is not a system one."""
        if "://" in value or value.startswith("gs:"):
            if not _GCS_URL.match(value):
                raise _fail(f"output_dir {_brief(value)} is not a Cloud Storage location like gs://my-bucket/run "
                            "(bucket names: 3 to 63 lowercase letters, digits, '-', '_' or '.', starting and "
                            "ending with a letter or digit)")
            return value
        normal = "/" + "/".join(part for part in value.split("/") if part and part != ".") if value.startswith("/") \
            else None
        if normal is not None and (normal in SYSTEM_DIRS or normal.startswith(tuple(t + "/" for t in _SYSTEM_TREES))
                                   or ".." in normal.split("/")):
            raise _fail(f"output_dir {_brief(value)} is a system directory (or inside one): the trainer's VM "
                        "would take it over; use gs://BUCKET/PATH, or a directory of its own such as /mnt/moe")
        return value

    @field_validator("mesh")
    @classmethod
    def _mesh_shape(cls, value: str | None) -> str | None:
        if value is not None and not _MESH.match(value):
            raise _fail(f"mesh {_brief(value)} must look like data=8,expert=8")
        return value

    @field_validator("steps")
    @classmethod
    def _positive_steps(cls, value: int | None) -> int | None:
        if value is not None and value < 1:
            raise _fail(f"steps must be at least 1, got {value}")
        return value

    @field_validator("overrides", mode="before")
    @classmethod
    def _override_items(cls, value: Any) -> Any:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise _fail(f"overrides must be a mapping of key: value, got {_brief(value)}")
        for key, item in value.items():
            if not isinstance(key, str) or not _OVERRIDE_KEY.match(key):
                raise _fail(f"override key {_brief(key)} must be a dotted name like model.num_experts")
            if not isinstance(item, (str, int, float, bool)):
                raise _fail(f"override {_brief(key)} must be a string, a number or true/false, got {_brief(item)}")
        return value

    def set_flags(self) -> list[str]:
        """The overrides as `--set key=value` arguments of `python -m trainer`."""
        flags: list[str] = []
        for key, value in self.overrides.items():
            text = ("true" if value else "false") if isinstance(value, bool) else str(value)
            flags += ["--set", f"{key}={text}"]
        return flags


class RecoveryConfig(_Section):
    max_restarts: StrictInt = 3

    @field_validator("max_restarts")
    @classmethod
    def _not_negative(cls, value: int) -> int:
        if value < 0:
            raise _fail(f"max_restarts must be 0 or more, got {value}")
        return value


class DryRunConfig(_Section):
    """How `run --dry-run` trains for real on this machine: the trainer made small enough for a CPU."""

    trainer_config: str = "tiny"
    steps: StrictInt = 40
    devices: StrictInt = 8
    mesh: str = "data=2,expert=4"
    checkpoint_every: StrictInt = 10

    @field_validator("steps", "devices", "checkpoint_every")
    @classmethod
    def _positive(cls, value: int) -> int:
        if value < 1:
            raise _fail(f"must be at least 1, got {value}")
        return value

    @field_validator("mesh")
    @classmethod
    def _mesh_shape(cls, value: str) -> str:
        if not _MESH.match(value):
            raise _fail(f"mesh {_brief(value)} must look like data=2,expert=4")
        return value


_SECTIONS: dict[str, type[_Section]] = {
    "slice": SliceConfig, "vertex": VertexConfig, "image": ImageConfig,
    "trainer": TrainerConfig, "recovery": RecoveryConfig, "dry_run": DryRunConfig,
}


class Config(BaseModel):
    """One run, as the config file describes it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    project: str | None = None
    region: str
    zones: list[Annotated[str, AfterValidator(_zone_name)]]
    run: str
    target: Literal["tpu-vm", "vertex"] = "tpu-vm"
    slice: SliceConfig = Field(default_factory=SliceConfig)
    vertex: VertexConfig = Field(default_factory=VertexConfig)
    image: ImageConfig
    trainer: TrainerConfig
    recovery: RecoveryConfig = Field(default_factory=RecoveryConfig)
    dry_run: DryRunConfig = Field(default_factory=DryRunConfig)
    source: Path = Field(default=Path(DEFAULT_CONFIG), exclude=True)

    @field_validator("slice", "vertex", "recovery", "dry_run", mode="before")
    @classmethod
    def _empty_section(cls, value: Any) -> Any:
        return {} if value is None else value

    @field_validator("project")
    @classmethod
    def _project_shape(cls, value: str | None) -> str | None:
        if value is not None and not _PROJECT.match(value):
            raise _fail(f"project id {_brief(value)} must be 6 to 30 lowercase letters, digits or hyphens, "
                        "start with a letter and not end with a hyphen")
        return value

    @field_validator("region")
    @classmethod
    def _region_shape(cls, value: str) -> str:
        if not _REGION.match(value):
            raise _fail(f"region {_brief(value)} is not a region name like us-west4")
        return value

    @field_validator("zones")
    @classmethod
    def _zones(cls, value: list[str]) -> list[str]:
        if not value:
            raise _fail("list at least one zone, e.g. [us-west4-a]")
        twice = sorted({zone for zone in value if value.count(zone) > 1})
        if twice:
            raise _fail(f"zone {twice[0]!r} is listed twice; list each zone once (they are tried in order)")
        return value

    @field_validator("run")
    @classmethod
    def _run_name(cls, value: str) -> str:
        if not _RFC1035.match(value):
            raise _fail(f"run name {_brief(value)} must be lowercase letters, digits and hyphens, start with a "
                        "letter and not end with a hyphen (it becomes resource ids: RFC 1035)")
        if len(value) > MAX_RUN_LENGTH:
            raise _fail(f"run name {_brief(value)} is {len(value)} characters; at most {MAX_RUN_LENGTH}, so that "
                        f"the resource ids derived from it stay within {MAX_ID_LENGTH}")
        return value

    def accelerator_type(self) -> catalogue.AcceleratorType:
        return catalogue.accelerator(self.slice.accelerator)

    def warnings(self) -> list[str]:
        """What is allowed but worth saying: zones the catalogue does not list for v5e (a TPU VM slice)."""
        if self.target != "tpu-vm":
            return []
        return [w for w in map(catalogue.zone_warning, self.zones) if w]


# --- loading ---------------------------------------------------------------------------

def _key_lines(root: yaml.Node | None, lines: dict[str, int]) -> list[tuple[str, int]]:
    """Fill `lines` (dotted key -> line) and return (dotted key, line) of every key given twice.

    Walks the document as aliases expand it (safeyaml.compose bounded its size first)."""
    duplicates: list[tuple[str, int]] = []
    stack: list[tuple[yaml.Node | None, str]] = [(root, "")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, yaml.MappingNode):
            for key_node, value_node in node.value:
                dotted = f"{path}.{key_node.value}" if path else str(key_node.value)
                if dotted in lines:
                    duplicates.append((dotted, key_node.start_mark.line + 1))
                lines[dotted] = key_node.start_mark.line + 1
                stack.append((value_node, dotted))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                lines[f"{path}[{i}]"] = item.start_mark.line + 1
                stack.append((item, f"{path}[{i}]"))
    return duplicates


def _load_yaml(text: str, lines: dict[str, int]) -> tuple[Any, list[tuple[str, int]]]:
    """Parse once, every bound checked first (trainer/safeyaml.py), then the keys' lines."""
    root = safeyaml.compose(text)
    duplicates = _key_lines(root, lines)
    return safeyaml.construct(root), duplicates


def _parse_yaml(text: str, file: str, lines: dict[str, int]) -> tuple[Any, list[Problem]]:
    try:
        data, duplicates = _load_yaml(text, lines)
    except safeyaml.Unbounded as exc:
        return None, [Problem(file, "", f"YAML is not a config: {exc}")]
    except yaml.YAMLError as exc:
        return None, [Problem(file, "", safeyaml.describe(exc))]
    return data, [Problem(file, key, f"key appears twice (again at line {line})") for key, line in duplicates]


def _dotted(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    if not loc:
        return Config
    if len(loc) == 1 and loc[0] in _SECTIONS:
        return _SECTIONS[loc[0]]
    return None


def _message(err: dict[str, Any]) -> str:
    kind, loc = err["type"], err["loc"]
    if kind == "extra_forbidden":
        model = _model_at(loc[:-1])
        names = [n for n in (model.model_fields if model else {}) if n != "source"]
        hint = _did_you_mean(str(loc[-1]), names) or (f"; valid keys: {', '.join(names)}" if names else "")
        return f"unknown key {loc[-1]!r}{hint}"
    if kind == "missing":
        return "missing required key"
    if kind == "literal_error":
        return f"must be one of {err['ctx']['expected']}, got {_brief(err['input'])}"
    if kind == "model_type":
        return f"expected a mapping of keys, got {_brief(err['input'])}"
    if kind == "moe_tpu":
        return err["msg"]
    return f"{err['msg'][0].lower()}{err['msg'][1:]}, got {_brief(err['input'])}"


def _brief(value: Any, width: int = 80) -> str:
    """repr() of a value from the file, cut short: a message names it, it does not print it all."""
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def _get(raw: dict[str, Any], failed: set[str], key: str) -> Any:
    """The raw value of a dotted key (or its schema default); _BAD where that key failed."""
    parts = key.split(".")
    if any(".".join(parts[:i]) in failed for i in range(1, len(parts) + 1)):
        return _BAD
    node: Any = raw
    model: type[BaseModel] = Config
    for part in parts:
        field = model.model_fields[part]
        if isinstance(node, dict) and node.get(part) is not None:
            node = node[part]
        else:
            node = None if field.is_required() else field.get_default(call_default_factory=True)
            if isinstance(node, BaseModel):
                node = node.model_dump()
        model = _SECTIONS.get(part, model)
    return node


_BAD = object()


def _cross_checks(get: Callable[[str], Any]) -> list[tuple[str, str]]:
    """Rules between keys, as (dotted key, message)."""
    found: list[tuple[str, str]] = []
    region, zones = get("region"), get("zones")
    if isinstance(region, str) and isinstance(zones, list):
        for i, zone in enumerate(zones):
            if isinstance(zone, str) and _ZONE.match(zone) and catalogue.zone_region(zone) != region:
                found.append((f"zones[{i}]", f"zone {_brief(zone)} is not in region {_brief(region)}"))
    acc_name, runtime = get("slice.accelerator"), get("slice.runtime_version")
    if isinstance(acc_name, str) and isinstance(runtime, str) and acc_name in catalogue.ACCELERATORS:
        fits = catalogue.accelerator(acc_name).runtime_versions
        if runtime not in fits:
            found.append(("slice.runtime_version", f"runtime version {_brief(runtime)} does not fit {acc_name}; "
                                                   f"use {', '.join(fits)}"))
    capacity, reservation = get("slice.capacity"), get("slice.reservation")
    if capacity == "reserved" and reservation is None:
        found.append(("slice.reservation",
                      "capacity 'reserved' needs slice.reservation (the reservation's name)"))
    if capacity in ("spot", "on-demand") and isinstance(reservation, str):
        found.append(("slice.reservation", f"a reservation is only used with capacity 'reserved' "
                                           f"(capacity is {capacity!r})"))
    if isinstance(reservation, str) and reservation.count("/") == 5 and isinstance(zones, list):
        res_zone = reservation.split("/")[3]
        others = [z for z in zones if isinstance(z, str) and z != res_zone]
        if others:  # a TPU consumes a reservation in its own zone only
            found.append(("slice.reservation", f"reservation {_brief(reservation)} is in {res_zone}; it cannot serve "
                                               f"zone(s) {', '.join(others)} (list only {res_zone} in `zones:`, "
                                               "or give the reservation's short name)"))
    machine, topology = get("vertex.machine_type"), get("vertex.topology")
    allowed = catalogue.VERTEX_MACHINE_TOPOLOGIES.get(machine) if isinstance(machine, str) else None
    if allowed and isinstance(topology, str) and topology not in allowed:
        found.append(("vertex.topology", f"topology {topology!r} does not fit machine type {machine!r}; "
                                         f"it takes {', '.join(allowed)}"))
    scheduling = get("vertex.scheduling")
    if (get("target") == "vertex" and scheduling == "SPOT" and isinstance(topology, str)
            and (acc := catalogue.accelerator_for_topology(topology)) and acc.multi_host):
        found.append(("vertex.scheduling", f"Vertex AI does not offer SPOT for multi-host TPU topologies "
                                           f"({topology}); use STANDARD or FLEX_START"))
    output_dir = get("trainer.output_dir")
    count = get("slice.count")
    multi_host = (isinstance(acc_name, str) and acc_name in catalogue.ACCELERATORS
                  and (catalogue.accelerator(acc_name).multi_host or (isinstance(count, int) and count > 1)))
    if (get("target") == "tpu-vm" and multi_host and isinstance(output_dir, str)
            and not output_dir.startswith("gs://")):
        found.append(("trainer.output_dir", f"{acc_name} x {count} has several TPU VMs, each with its own disk: "
                                            f"checkpoints in {output_dir!r} would be split between them; use a "
                                            "gs:// path"))
    if get("target") == "vertex" and isinstance(output_dir, str) and not output_dir.startswith("gs://"):
        found.append(("trainer.output_dir", f"a Vertex AI job keeps its checkpoints in Cloud Storage: use a gs:// "
                                            f"path, not {output_dir!r} (a local path vanishes with the job)"))
    return found


def trainer_problems(cfg: Config) -> list[Problem]:
    """The trainer section checked by the trainer's own config code (which imports no jax)."""
    try:
        from trainer import config as trainer_config
    except ImportError:  # an install without the trainer package: the container will check it
        return []
    overrides = [flag for flag in cfg.trainer.set_flags() if flag != "--set"]
    try:
        trainer_config.check(cfg.trainer.config, overrides, cfg.trainer.steps)
    except trainer_config.ConfigError as exc:
        message = str(exc)
        key = next((f"trainer.overrides.{k}" for k in cfg.trainer.overrides if k in message), None)
        if key is None:
            key = "trainer.steps" if "steps" in message and cfg.trainer.steps is not None else "trainer.config"
        return [Problem(str(cfg.source), key, f"the trainer rejects it: {message}")]
    try:
        from provision.planner import mesh_problems
    except ImportError:  # the planner needs the trainer's packages too
        return []
    return [Problem(str(cfg.source), key, message) for key, message in mesh_problems(cfg)]


def config_from_dict(raw: Any, source: Path | str = DEFAULT_CONFIG) -> Config:
    """Validate already-parsed YAML; ConfigError lists every problem."""
    file = str(source)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError([Problem(file, "", "the config must be a YAML mapping of keys "
                                             "(project, region, zones, run, ...)")])
    return _validate(dict(raw), file, [], {})


def _control_characters(raw: Any, path: str = "") -> list[tuple[str, str]]:
    """(dotted key, message) for every string value (or key) holding a NUL or another control character:
    values reach templates, a shell script and request bodies, where such a character is never meant."""
    found: list[tuple[str, str]] = []
    stack: list[tuple[Any, str]] = [(raw, path)]
    while stack:
        node, where = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                dotted = f"{where}.{key}" if where else str(key)
                if isinstance(key, str) and not key.isprintable():
                    found.append((dotted, f"key {_brief(key)} holds control characters"))
                stack.append((value, dotted))
        elif isinstance(node, list):
            stack.extend((item, f"{where}[{i}]") for i, item in enumerate(node))
        elif isinstance(node, str) and not node.isprintable():
            found.append((where, f"{_brief(node)} holds a control character (NUL, a newline, an escape...); "
                                 "values reach templates and a shell script, so they must be plain text"))
    return found


def _in_file_order(problems: list[Problem], lines: dict[str, int]) -> list[Problem]:
    """Problems sorted by where their key is in the file; keys not in it (missing) go last."""
    def line(problem: Problem) -> int:
        key = problem.key
        while key:
            if key in lines:
                return lines[key]
            key = key.rsplit(".", 1)[0] if "." in key else (key.rsplit("[", 1)[0] if "[" in key else "")
        return 0 if not problem.key else 1 << 30
    return sorted(problems, key=line)


def _validate(raw: dict[str, Any], file: str, problems: list[Problem], lines: dict[str, int]) -> Config:
    if "source" in raw:
        raw.pop("source")
        problems.append(Problem(file, "source", "unknown key 'source'"))
    config: Config | None = None
    failed: set[str] = set()
    try:
        config = Config.model_validate({**raw, "source": Path(file)})
    except ValidationError as exc:
        for err in exc.errors():
            key = _dotted(err["loc"])
            failed.add(key)
            problems.append(Problem(file, key, _message(err)))
    problems += [Problem(file, key, msg) for key, msg in _control_characters(raw) if key not in failed]
    problems += [Problem(file, key, msg) for key, msg in _cross_checks(lambda k: _get(raw, failed, k))]
    if problems or config is None:
        raise ConfigError(_in_file_order(problems, lines))
    return config


def load_config(path: Path | str, check_trainer: bool = False) -> Config:
    """Read and validate a config file. ConfigError (exit 2) lists every problem at once.

    `check_trainer` also runs the trainer's own checks on the trainer section (commands that
    start training ask for it; `down` and `list` must work whatever the trainer thinks)."""
    path = Path(path)
    file = str(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        missing = Problem(file, "", "file not found (write a starter config with `moe-tpu init`)")
        raise ConfigError([missing]) from None
    except IsADirectoryError:
        raise ConfigError([Problem(file, "", "is a directory, not a config file")]) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError([Problem(file, "", f"cannot read the file: {exc}")]) from None
    lines: dict[str, int] = {}
    raw, problems = _parse_yaml(text, file, lines)
    if raw is None and problems:
        raise ConfigError(problems)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(problems + [Problem(file, "", "the config must be a YAML mapping of keys "
                                                        "(project, region, zones, run, ...)")])
    cfg = _validate(raw, file, problems, lines)
    if check_trainer and (trainer := trainer_problems(cfg)):
        raise ConfigError(trainer)
    return cfg


def starter_config() -> str:
    """The commented YAML that `moe-tpu init` writes."""
    return STARTER


STARTER = """\
# moe-tpu run config. Check it with `moe-tpu validate`; see every rendered request and
# script with `moe-tpu render --out rendered/`; rehearse without a cloud account with
# `moe-tpu --dry-run slice up`.

project: my-project            # Google Cloud project id
region: us-west4
zones: [us-west4-a]            # tried in order on stockout; each must offer TPU v5e
run: moe-demo                  # resource names and labels derive from it (lowercase, <= 50 chars)
target: tpu-vm                 # tpu-vm (queued resource) or vertex (Vertex AI custom job)

slice:
  accelerator: v5litepod-64    # 8x8: 16 VMs of 4 chips
  runtime_version: v2-alpha-tpuv5-lite
  count: 1                     # more than 1: multislice
  capacity: spot               # on-demand | spot | reserved (reserved needs `reservation:`)
  max_wait: 2h                 # give up queueing after this long (2h, 30m, 1h30m, 90s)
  network: default
  # subnetwork: my-subnet
  # service_account: trainer@my-project.iam.gserviceaccount.com

vertex:                        # used when target is vertex
  machine_type: ct5lp-hightpu-4t
  topology: 8x8
  scheduling: STANDARD         # STANDARD | SPOT | FLEX_START

image:
  repository: us-west4-docker.pkg.dev/my-project/moe/trainer
  tag: latest

trainer:
  config: v5e-64               # a named trainer config (this one is sized for v5litepod-64), or a path
  output_dir: gs://my-bucket/moe-demo
  mesh: data=8,expert=8        # the device mesh; `moe-tpu plan` suggests one (unset: all chips on data)
  # steps: 1000
  # overrides:                 # trainer config keys, passed as `--set key=value`
  #   moe.num_experts: 32

recovery:
  max_restarts: 3              # recreate the slice at most this often after preemption
"""
