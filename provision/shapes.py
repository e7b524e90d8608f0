"""The shapes of names, durations and ids that the config's rules share, and the base of its sections.

Every rule here raises trainer.schema.invalid (the project's own error kind), which
provision/config/loading.py reports under the dotted key; the rules between keys, validators of the models
that hold those keys, raise theirs together through `broken`."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

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

RFC1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
PROJECT = re.compile(r"^[a-z][a-z0-9-]{4,28}[a-z0-9]$")
REGION = re.compile(r"^[a-z]+-[a-z]+[0-9]+$")
ZONE = catalogue.ZONE_NAME
_DURATION = re.compile(r"^(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?$")
IMAGE_REPOSITORY = re.compile(
    r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?(\.[a-z0-9]([a-z0-9-]*[a-z0-9])?)+(:[0-9]+)?"  # host
    r"(/[a-z0-9]([a-z0-9._-]*[a-z0-9])?){3,}$"  # /project/repository/image[/...]
)
IMAGE_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
SERVICE_ACCOUNT = re.compile(r"^[a-z][a-z0-9-]{4,28}[a-z0-9]@[a-z0-9.-]+\.iam\.gserviceaccount\.com$"
                              r"|^[0-9]+-compute@developer\.gserviceaccount\.com$")
# A Vertex AI TensorBoard instance: projects/PROJECT/locations/REGION/tensorboards/ID (IDs are numbers).
VERTEX_TENSORBOARD = re.compile(r"^projects/[a-z0-9-]+/locations/[a-z]+-[a-z]+[0-9]+/tensorboards/[0-9]+$")
VERTEX_NETWORK = re.compile(r"^projects/[0-9]+/global/networks/[a-z]([-a-z0-9]*[a-z0-9])?$")
# Compute Engine network and subnetwork names (RFC 1035, at most 63), or their resource names.
NETWORK = re.compile(r"^(projects/[a-z][a-z0-9-]{4,28}[a-z0-9]/global/networks/)?[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
SUBNETWORK = re.compile(r"^(projects/[a-z][a-z0-9-]{4,28}[a-z0-9]/regions/[a-z]+-[a-z]+[0-9]+/subnetworks/)?"
                         r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?$")
# Cloud Storage: gs://BUCKET[/PATH]; bucket names are 3 to 63 lowercase letters, digits, '-', '_' and '.'
# (up to 222 with dots), starting and ending with a letter or digit (the path: any object name; control
# characters are refused for every value).
GCS_URL = re.compile(r"^gs://(?=[a-z0-9._-]{3,222}(/|$))[a-z0-9]([a-z0-9_-]|\.(?!\.))*[a-z0-9](/.*)?$")
# Where a local trainer.output_dir must never be: the startup script chowns it and mounts it into
# the container.
SYSTEM_DIRS = ("/", "/bin", "/boot", "/dev", "/etc", "/home", "/lib", "/lib32", "/lib64", "/opt", "/proc",
               "/root", "/run", "/sbin", "/srv", "/sys", "/tmp", "/usr", "/var")
SYSTEM_TREES = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/proc", "/sbin", "/sys", "/usr")
OVERRIDE_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
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


def positive_duration(value: Any) -> timedelta:
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


def brief(value: Any, width: int = 80) -> str:
    """repr() of a value from the file, cut short: a message names it, it does not print it all."""
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def mesh_text(value: str) -> str:
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


def zone_name(zone: str) -> str:
    if not ZONE.match(zone):
        raise invalid(f"zone {zone!r} is not a zone name like us-west4-a")
    return zone  # one the catalogue does not list for v5e is a warning (Config.warnings)


class Section(BaseModel):
    """A section of the config file: its fields' own rules, and its rules between them (`rule`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    @model_validator(mode="after")
    def _rules(self) -> Section:
        broken(check(self))
        return self


# The pydantic error type of a model's broken rules between keys: its context's `found` holds (key, message)
# pairs, each key dotted below the model's own place in the file (provision/config/loading.py reports each).
RULES = "rules_between_keys"


def rule(*reads: str) -> Callable[[Callable], Callable]:
    """Mark a method of a config model as one of its rules between keys: it reads the keys `reads` (dotted
    below the model) and returns what is wrong as (dotted key below the model, message) pairs. A subclass
    replaces a rule by defining one of the same name. The model's validator runs them all (`Section`'s,
    provision.config.Config's); a config whose keys failed their own rules runs them too, each only where
    none of the keys it reads failed (provision.config.loading), so one mistake is reported once."""
    def mark(method: Callable) -> Callable:
        method.reads = reads
        return method
    return mark


def _rules_of(model: type) -> list[Callable]:
    """A model's rules, the base's first, each by its name the most derived one."""
    names = dict.fromkeys(name for cls in reversed(model.__mro__) for name, value in vars(cls).items()
                          if hasattr(value, "reads"))
    return [getattr(model, name) for name in names]


def _failed(read: str, failed: frozenset[str]) -> bool:
    """Whether the key `read` or a section above it failed its own rule (a rule that reads a list or a
    section as a whole passes over what in it is not what its own rules let through)."""
    return any(key == read or read.startswith((f"{key}.", f"{key}[")) for key in failed)


def check(model: BaseModel, failed: frozenset[str] = frozenset(), prefix: str = "") -> list[tuple[str, str]]:
    """What `model`'s rules find, as (dotted key below it, message); with `failed` (dotted keys of the file,
    `prefix` the model's place in it) the model stands in for a config that failed validation: each rule
    that reads a failed key is passed over, and one that cannot read its values (a failed one it did not
    name) finds nothing."""
    found: list[tuple[str, str]] = []
    for method in _rules_of(type(model)):
        if not failed:
            found += method(model)
        elif not any(_failed(prefix + read, failed) for read in method.reads):
            try:
                found += method(model)
            except (AttributeError, TypeError, ValueError, KeyError, IndexError):
                continue
    return found


def broken(found: list[tuple[str, str]]) -> None:
    """Raise the rules between keys that `found` says are broken, (dotted key below the model, message)
    each, as one error: a model validator raises once, so every rule of the model is reported together."""
    if found:
        raise PydanticCustomError(RULES, "{count} rule(s) between keys broken", {"count": len(found),
                                                                              "found": tuple(found)})
