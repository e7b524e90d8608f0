"""The gke and pathways sections (target: gke): a GKE Standard cluster, its names, and the Pathways images."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any, Literal

from pydantic import field_validator

from provision import catalogue
from provision.shapes import _RFC1035, MAX_ID_LENGTH, _positive_duration, _Section, gcs_location
from trainer.schema import invalid

# GKE names: a cluster or node pool name is at most catalogue.MAX_GKE_NAME characters (RFC 1035); a
# namespace or a Kueue queue is an RFC 1123 DNS label (Kubernetes object names).
MAX_GKE_NAME = catalogue.MAX_GKE_NAME
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
        return gcs_location(value, "gcs_scratch", "gs://my-bucket/pathways")

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
