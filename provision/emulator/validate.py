"""Request validation shared by the emulated services, and the Cloud TPU API's own checks, with the
API's messages (see docs/api-facts.md). Vertex AI's checks live in vertex.py.

Messages marked "unconfirmed" have no public record; they are the most plausible shape.
"""

from __future__ import annotations

import re

from provision import catalogue
from provision.catalogue import AcceleratorType
from provision.emulator import offerings


class ApiError(Exception):
    """An RPC error: a gRPC status code name, a message, and optional google.rpc detail messages."""

    def __init__(self, code: str, message: str, details: list | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.details = list(details or [])


LOCATION_RE = re.compile(r"^projects/([^/]+)/locations/([^/]+)$")
ZONE_RE = catalogue.ZONE_NAME
# Queued resource and node ids are Google Cloud resource names (RFC 1035 labels, as Compute Engine
# names are): a lowercase letter, then lowercase letters, digits and hyphens, not ending in a hyphen,
# 1 to 63 characters. The protos' looser ^[A-Za-z0-9_.~+%-]+$ is the URL-safe set, not the server's
# rule (see docs/emulator-fidelity.md); the message is unconfirmed.
RESOURCE_ID_RE = re.compile(r"^[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?$")
QR_ID_RE = NODE_ID_RE = RESOURCE_ID_RE
RESOURCE_ID_RULE = ("a lowercase letter, then up to 62 lowercase letters, digits or hyphens, not ending "
                    "in a hyphen")
RESERVATION_RE = re.compile(r"^projects/([^/]+)/locations/([^/]+)/reservations/([a-z](?:[-a-z0-9]{0,61}[a-z0-9])?)$")
LABEL_KEY_RE = re.compile(r"^[a-z][a-z0-9_-]{0,62}$")
LABEL_CHARS = set("abcdefghijklmnopqrstuvwxyz0123456789_-")


def location(parent: str) -> tuple[str, str]:
    """(project, zone) of "projects/P/locations/Z"; INVALID_ARGUMENT or PERMISSION_DENIED otherwise."""
    match = LOCATION_RE.match(parent or "")
    if not match:
        raise ApiError("INVALID_ARGUMENT",
                       f"Invalid resource field value in the request: parent {parent!r} is not of the form "
                       "'projects/{project}/locations/{zone}'")
    project, zone = match.groups()
    if zone == "-":
        # Unconfirmed: the v2 API serves one zone per call; we refuse the wildcard.
        raise ApiError("INVALID_ARGUMENT", f"Location '-' is not supported in {parent!r}; name a zone")
    if not ZONE_RE.match(zone):
        raise ApiError("PERMISSION_DENIED", f"Permission denied on 'locations/{zone}' (or it may not exist).")
    return project, zone


REGION_RE = re.compile(r"^[a-z]+-[a-z]+[0-9]+$")


def any_location(name: str) -> tuple[str, str]:
    """(project, location) of "projects/P/locations/L" where L is a zone or a region."""
    match = LOCATION_RE.match(name or "")
    if not match:
        raise ApiError("INVALID_ARGUMENT",
                       f"Invalid resource field value in the request: name {name!r} is not of the form "
                       "'projects/{project}/locations/{location}'")
    project, where = match.groups()
    if not (ZONE_RE.match(where) or REGION_RE.match(where)):
        raise ApiError("PERMISSION_DENIED", f"Permission denied on 'locations/{where}' (or it may not exist).")
    return project, where


def resource(name: str, collection: str) -> tuple[str, str, str]:
    """(project, zone, id) of "projects/P/locations/Z/{collection}/ID"."""
    head, sep, rid = (name or "").rpartition(f"/{collection}/")
    if not sep or not rid or "/" in rid:
        raise ApiError("INVALID_ARGUMENT",
                       f"Invalid resource field value in the request: name {name!r} is not of the form "
                       f"'projects/{{project}}/locations/{{zone}}/{collection}/{{id}}'")
    project, zone = location(head)
    return project, zone, rid


def queued_resource_id(qr_id: str) -> None:
    if not QR_ID_RE.match(qr_id or ""):
        raise ApiError("INVALID_ARGUMENT",
                       f"Invalid queued_resource_id {qr_id!r}: a resource id is {RESOURCE_ID_RULE}")


def node_id(value: str, what: str = "node_id") -> None:
    if not NODE_ID_RE.match(value or ""):
        raise ApiError("INVALID_ARGUMENT", f"Invalid {what} {value!r}: a resource id is {RESOURCE_ID_RULE}")


def reservation(name: str, project: str, zone: str) -> tuple[str, str, str]:
    """(project, zone, id) of a reservation_name; INVALID_ARGUMENT (unconfirmed messages) when it is
    malformed or names another zone: a TPU consumes a reservation in its own zone."""
    match = RESERVATION_RE.match(name)
    if not match:
        raise ApiError("INVALID_ARGUMENT",
                       f"Invalid reservation_name {name!r}: it must be of the form "
                       "'projects/{project}/locations/{zone}/reservations/{reservation}'")
    if match.group(2) != zone:
        raise ApiError("INVALID_ARGUMENT",
                       f"Invalid reservation_name {name!r}: the reservation is in {match.group(2)}, "
                       f"the queued resource in {zone}")
    return match.groups()


def accelerator(zone: str, accelerator_type: str) -> AcceleratorType:
    """The catalogue entry if `zone` offers it; the API's INVALID_ARGUMENT message otherwise."""
    for acc in offerings.types_in(zone):
        if acc.name == accelerator_type:
            return acc
    raise ApiError(
        "INVALID_ARGUMENT",
        "Cloud TPU received a bad request. The requested accelerator configuration for accelerator type, "
        f'"{accelerator_type}", could not be found in the zonal accelerator configurations for "{zone}".; '
        f"the accelerator {accelerator_type} was not found in zone {zone}")


def accelerator_from_config(zone: str, config_type: str, topology: str) -> str:
    acc = offerings.by_config(zone, config_type, topology)
    if acc is not None:
        return acc.name
    return f"v5litepod-{topology}"  # not offered: accelerator() refuses it with the API's message


def runtime_version(acc: AcceleratorType, version: str) -> None:
    if version not in acc.runtime_versions:
        # Unconfirmed message shape.
        raise ApiError("INVALID_ARGUMENT",
                       f'Cloud TPU received a bad request. runtime version "{version}" is not supported for '
                       f'accelerator type "{acc.name}"; supported: {", ".join(acc.runtime_versions)}')


MAX_LABELS = 64
# GCE metadata limits: 256 KiB per value, 512 KiB in all.
MAX_METADATA_VALUE_BYTES = 256 * 1024
MAX_METADATA_BYTES = 512 * 1024


def metadata(values: dict[str, str]) -> None:
    """GCE metadata limits (the message is unconfirmed for the TPU API)."""
    total = 0
    for key, value in values.items():
        size = len(key.encode()) + len(value.encode())
        total += size
        if len(value.encode()) > MAX_METADATA_VALUE_BYTES:
            raise ApiError("INVALID_ARGUMENT",
                           f'metadata value for key "{key}" is {len(value.encode())} bytes; the limit is '
                           f"{MAX_METADATA_VALUE_BYTES} bytes")
    if total > MAX_METADATA_BYTES:
        raise ApiError("INVALID_ARGUMENT",
                       f"metadata is {total} bytes in all; the limit is {MAX_METADATA_BYTES} bytes")


def labels(values: dict[str, str]) -> None:
    """GCE label rules: keys start with a lowercase letter; lowercase letters, digits, - and _; <= 63."""
    if len(values) > MAX_LABELS:
        # Unconfirmed message shape.
        raise ApiError("INVALID_ARGUMENT",
                       f"resource labels are invalid: {len(values)} labels; at most {MAX_LABELS} are allowed")
    for key, value in values.items():
        for what, text in (("key", key), ("value", value)):
            for index, char in enumerate(text):
                if char not in LABEL_CHARS:
                    raise ApiError("INVALID_ARGUMENT",
                                   f'resource labels are invalid: {what} "{text}" contains invalid character '
                                   f"'{char}' at index {index} for key \"{key}\"")
            if len(text) > 63:
                raise ApiError("INVALID_ARGUMENT",
                               f'resource labels are invalid: {what} "{text}" is longer than 63 characters '
                               f'for key "{key}"')
        if not LABEL_KEY_RE.match(key):
            raise ApiError("INVALID_ARGUMENT",
                           f'resource labels are invalid: key "{key}" must start with a lowercase letter')


def not_found(name: str) -> ApiError:
    return ApiError("NOT_FOUND", f"Resource '{name}' was not found")
