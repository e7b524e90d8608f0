"""The shapes of names, durations and ids that the config's rules share, and the base of its sections.

Every rule here raises trainer.schema.invalid (the project's own error kind), which
provision/config/loading.py reports under the dotted key."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict

from provision import catalogue
from provision.waiting import format_duration
from trainer import meshspec
from trainer.schema import invalid

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


def _mesh_text(value: str) -> str:
    """A mesh the trainer reads (trainer/meshspec.py); whether it covers the chips is the planner's check."""
    try:
        meshspec.mesh_axes(value)
    except ValueError as exc:
        raise invalid(f"the trainer refuses it: {str(exc).replace('--mesh ', 'mesh ')}") from None
    return value


# A Cloud Storage location for staging or scratch objects: gs://BUCKET[/PATH], no whitespace.
_GCS_LOCATION = re.compile(r"^gs://[a-z0-9][a-z0-9._-]{1,220}[a-z0-9](/[^\s]*)?$")


def gcs_location(value: str | None, what: str, example: str) -> str | None:
    """A Cloud Storage location (None: not set), without its trailing slash."""
    if value is not None and not _GCS_LOCATION.match(value):
        raise invalid(f"{what} {value!r} must be a Cloud Storage location like {example}")
    return value.rstrip("/") if value is not None else None


def _zone_name(zone: str) -> str:
    if not _ZONE.match(zone):
        raise invalid(f"zone {zone!r} is not a zone name like us-west4-a")
    return zone  # one the catalogue does not list for v5e is a warning (Config.warnings)


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
