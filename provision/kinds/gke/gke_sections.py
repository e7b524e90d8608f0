"""What `target: gke` adds to the common config: the slice section (provision/kinds/slice_section.py, which
the TPU VM reads too), the gke and pathways sections (a GKE Standard cluster, its names, and the Pathways
images), and their rules against the rest of the config (the region and zones, the run's name as pools
are named after it, the trainer's output, the serve section as a Deployment or LeaderWorkerSet serves it)."""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any, Literal

from pydantic import field_validator

from provision import catalogue
from provision.core import replica_problems
from provision.kinds.slice_section import SliceSections
from provision.shapes import MAX_ID_LENGTH, RFC1035, Section, gcs_location, positive_duration, rule
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
# The serving pools' names, RUN plus a suffix (their renderers name them; the rules here bound their length):
# a Deployment's one pool, a LeaderWorkerSet's pool per group (RUN-serve-0, RUN-serve-1, ...: one slice
# each) and, with Pathways, its leaders' CPU pool.
SERVE_POOL_SUFFIX = "-serve"
GROUP_POOL_SUFFIX = "-serve-"
CPU_POOL_SUFFIX = "-serve-cpu"


def _dns_label(value: str, what: str) -> str:
    if not _DNS_LABEL.match(value) or len(value) > MAX_ID_LENGTH:
        raise invalid(f"{what} {value!r} is not a DNS label (lowercase letters, digits and hyphens, starting and "
                    f"ending with a letter or digit, at most {MAX_ID_LENGTH})")
    return value


class PathwaysConfig(Section):
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
        return positive_duration(value)


class GkeConfig(Section):
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
        if not RFC1035.match(value) or len(value) > MAX_GKE_NAME:
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


class GkeSections(SliceSections):
    """The slice and gke sections of GKE node pools, and their rules against the rest of the config: the gke
    section against the slice, the region and the trainer (with a gke section only), the serve section on
    GKE (one host per replica, a Deployment's pod, or a group of hosts, a LeaderWorkerSet's; pool names GKE
    takes; a checkpoint the pods can read)."""

    gke: GkeConfig | None = None

    @rule("gke")
    def _gke_given(self) -> list[tuple[str, str]]:
        return [("gke", "target 'gke' needs a gke section (at least cluster and location)")] if self.gke is None \
            else []

    @rule("gke.runtime", "gke.pathways")
    def _pathways_runtime(self) -> list[tuple[str, str]]:
        if self.gke is not None and self.gke.runtime == "jax" and self.gke.pathways is not None:
            return [("gke.pathways", "a pathways section is only used with runtime 'pathways' (runtime is 'jax')")]
        return []

    @rule("gke.location", "region", "zones")
    def _location(self) -> list[tuple[str, str]]:
        if self.gke is None:
            return []
        location, region = self.gke.location, self.region
        if location.rsplit("-", 1)[0] != region and location != region:
            return [("gke.location", f"location {location!r} is not in region {region!r}")]
        others = [z for z in self.zones if isinstance(z, str) and z != location] if location != region else []
        if others:  # a zonal cluster has its node pools in its own zone
            return [("zones", f"the cluster is zonal ({location}): its node pools cannot go in "
                              f"{', '.join(others)}; list only {location} in `zones:`")]
        return []

    @rule("slice.accelerator", "gke.topology")
    def _topology(self) -> list[tuple[str, str]]:
        acc, topology = self.accelerator_type(), self.gke.topology if self.gke is not None else None
        if topology is not None and topology != acc.topology:
            return [("gke.topology", f"topology {topology!r} is not that of slice.accelerator {acc.name} "
                                     f"({acc.topology}); set one of them")]
        return []

    @rule("run", "slice.count")
    def _pool_names(self) -> list[tuple[str, str]]:
        longest = len(self.run) + len(f"-s{self.slice.count - 1}")
        if self.gke is None or longest <= catalogue.MAX_GKE_NAME:
            return []
        return [("run", f"run name {self.run!r} is too long for GKE: node pools are named RUN-sN, at most "
                        f"{catalogue.MAX_GKE_NAME} characters (use at most "
                        f"{len(self.run) - longest + catalogue.MAX_GKE_NAME})")]

    @rule("trainer.output_dir")
    def _output_in_storage(self) -> list[tuple[str, str]]:
        if self.gke is None or self.trainer.output_dir.startswith("gs://"):
            return []
        return [("trainer.output_dir", f"pods on GKE keep nothing when they end: use a gs:// path, not "
                                       f"{self.trainer.output_dir!r}")]

    def _serving(self) -> bool:
        return self.gke is not None and self.serve is not None

    @rule("serve.machine_type", "serve.topology", "serve.max_replicas", "run")
    def _serve_hosts(self) -> list[tuple[str, str]]:
        if not self._serving():
            return []
        serve = self.serve
        acc = catalogue.accelerator_for_topology(serve.topology) if serve.topology is not None else None
        if acc is not None and acc.multi_host:  # a LeaderWorkerSet: one group of pods per replica
            return _group_rules(self.run, serve, acc)
        single = catalogue.accelerator_for_machine(serve.machine_type, "")
        host = single.topology if single is not None else None
        if host is not None and serve.topology is not None and serve.topology != host:
            return [("serve.topology", f"topology {serve.topology!r} is not its one host: a GKE Deployment gives "
                                       f"each replica one host of {serve.machine_type} ({host}); leave "
                                       "serve.topology unset, or give a multi-host topology (4x4 and up: a "
                                       "LeaderWorkerSet)")]
        return []

    @rule("serve.min_replicas", "serve.max_replicas")
    def _serve_replicas(self) -> list[tuple[str, str]]:
        return replica_problems(self.serve, "the HorizontalPodAutoscaler") if self._serving() else []

    @rule("run", "serve.topology")
    def _serve_pool_name(self) -> list[tuple[str, str]]:
        if not self._serving():
            return []
        acc = catalogue.accelerator_for_topology(self.serve.topology) if self.serve.topology is not None else None
        if len(self.run) + len(SERVE_POOL_SUFFIX) <= catalogue.MAX_GKE_NAME \
                or (acc is not None and acc.multi_host):
            return []
        return [("run", f"run name {self.run!r} is too long to serve on GKE: the serving node pool is named "
                        f"RUN{SERVE_POOL_SUFFIX}, at most {catalogue.MAX_GKE_NAME} characters")]

    @rule("serve.checkpoint")
    def _serve_checkpoint(self) -> list[tuple[str, str]]:
        checkpoint = self.serve.checkpoint if self._serving() else None
        if checkpoint is None or checkpoint.startswith("gs://"):
            return []
        return [("serve.checkpoint", f"pods on GKE read the checkpoint from Cloud Storage: use a gs:// path, not "
                                     f"{checkpoint!r}")]


def _group_rules(run: str, serve, acc: catalogue.AcceleratorType) -> list[tuple[str, str]]:
    """The serve section over a multi-host slice: hosts of its machine type, pool names GKE takes."""
    found: list[tuple[str, str]] = []
    if serve.machine_type != acc.vertex_machine_type:
        found.append(("serve.machine_type", f"topology {acc.topology} is a multi-host slice of "
                                            f"{acc.vertex_machine_type} hosts ({acc.chips_per_vm} chips each), not "
                                            f"{serve.machine_type}: set serve.machine_type: {acc.vertex_machine_type}"))
    longest = max(len(f"{GROUP_POOL_SUFFIX}{serve.max_replicas - 1}"),
                  len(CPU_POOL_SUFFIX))
    if len(run) + longest > catalogue.MAX_GKE_NAME:
        found.append(("run", f"run name {run!r} is too long to serve on GKE: the groups' node pools are named "
                             f"RUN{GROUP_POOL_SUFFIX}N, at most {catalogue.MAX_GKE_NAME} "
                             f"characters (use at most {catalogue.MAX_GKE_NAME - longest})"))
    return found
