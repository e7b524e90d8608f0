"""The config's sections as frozen pydantic models, each field with its own rule (the shapes they share:
provision/shapes.py; the gke and pathways sections: provision/kinds/gke/gke_sections.py; the vertex
section: provision/kinds/vertex/vertex_sections.py)."""

from __future__ import annotations

import re
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictInt, field_validator

from provision import catalogue
from provision.kinds import KINDS
from provision.kinds.gke.gke_sections import GkeConfig, PathwaysConfig
from provision.kinds.vertex.vertex_sections import VertexConfig
from provision.shapes import (
    _GCS_URL,
    _IMAGE_REPOSITORY,
    _IMAGE_TAG,
    _NETWORK,
    _OVERRIDE_KEY,
    _PROJECT,
    _REGION,
    _RFC1035,
    _SERVICE_ACCOUNT,
    _SUBNETWORK,
    _SYSTEM_TREES,
    _ZONE,
    DEFAULT_CONFIG,
    MAX_ID_LENGTH,
    MAX_RUN_LENGTH,
    MAX_SLICE_COUNT,
    SYSTEM_DIRS,
    _brief,
    _mesh_text,
    _positive_duration,
    _Section,
    _zone_name,
    gcs_location,
)
from trainer.schema import NonNegative, Positive, did_you_mean, invalid


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
            raise invalid(f"unknown accelerator type {value!r}{did_you_mean(value, names)} "
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


# The single-host v5e machine types that serve (Vertex AI online prediction and a GKE serving node
# pool), with the one topology each has on one host.
SERVING_MACHINE_TOPOLOGY: dict[str, str] = {
    "ct5lp-hightpu-1t": "1x1", "ct5lp-hightpu-4t": "2x2", "ct5lp-hightpu-8t": "2x4",
}


class ServeConfig(_Section):
    """How `deploy` serves a checkpoint (read by the kinds that serve: `vertex`, an endpoint; `gke`, a
    Deployment): where, on how many replicas, and the engine's limits (trainer/serve's flags)."""

    # The run directory whose latest checkpoint is served [trainer.output_dir: the config's own run].
    checkpoint: str | None = None
    machine_type: str = "ct5lp-hightpu-4t"
    # The slice each replica gets [the machine type's single-host topology]; a multi-host shape is
    # refused by the kind that cannot serve it (Vertex AI), with the reason.
    topology: str | None = None
    min_replicas: Positive = 1
    max_replicas: Positive = 1
    # What the autoscaler holds each replica at: Vertex AI, its accelerator duty cycle in percent;
    # GKE, the requests waiting for a decode slot (vllm:num_requests_waiting) per replica.
    autoscale_target: Positive = 60
    slots: Positive = 8
    max_len: Annotated[StrictInt, Field(ge=2)] = 1024
    weights: Literal["auto", "int8", "int4"] = "auto"  # trainer/serve/memory.py QUANTIZED_WEIGHTS
    kv_cache_dtype: Literal["auto", "bfloat16", "float32", "int8"] = "auto"
    spot: bool = False
    # The server's device mesh on one replica (`--mesh`, e.g. model=4); unset: the mesh `plan --serve`
    # chooses for the replica (Config.serve_mesh), rendered into every serving container's argv.
    mesh: str | None = None

    @field_validator("checkpoint")
    @classmethod
    def _checkpoint_named(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise invalid("is empty: name the run directory to serve, or leave the key out to serve "
                          "trainer.output_dir")
        return value

    @field_validator("mesh")
    @classmethod
    def _mesh_shape(cls, value: str | None) -> str | None:
        return None if value is None else _mesh_text(value)

    @field_validator("machine_type")
    @classmethod
    def _serving_machine_type(cls, value: str) -> str:
        names = list(SERVING_MACHINE_TOPOLOGY)
        if value not in names:
            raise invalid(f"machine type {_brief(value)} does not serve{did_you_mean(value, names)} "
                          f"(single-host v5e machine types: {', '.join(names)})")
        return value

    @field_validator("topology")
    @classmethod
    def _known_topology(cls, value: str | None) -> str | None:
        if value is not None and catalogue.accelerator_for_topology(value) is None:
            topologies = [a.topology for a in catalogue.ACCELERATORS.values()]
            raise invalid(f"unknown v5e topology {_brief(value)} (v5e topologies: {', '.join(topologies)})")
        return value

    @property
    def replica_topology(self) -> str:
        return self.topology or SERVING_MACHINE_TOPOLOGY[self.machine_type]


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
        return gcs_location(value, "image staging", "gs://my-bucket/staging")

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
    # The device mesh (`--mesh`), e.g. data=8,expert=8 or data=4,expert=8,model=2; unset: the plan's choice
    # for the target (Config.trainer_mesh), passed to the trainer as --mesh.
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


MAX_TRAINER_STEPS = 2**31 - 1  # trainer.config.MAX_STEPS (not imported: the trainer's config stays unloaded here)


class DryRunConfig(_Section):
    """How `run --dry-run` trains for real on this machine: the trainer made small enough for a CPU."""

    trainer_config: str = "tiny"
    steps: Annotated[StrictInt, Field(ge=1, le=MAX_TRAINER_STEPS)] = 40  # the trainer's int32 step counter
    devices: Positive = 8
    mesh: str = "data=2,expert=4"
    checkpoint_every: Positive = 10

    @field_validator("mesh")
    @classmethod
    def _mesh_shape(cls, value: str) -> str:
        return _mesh_text(value)


_SECTIONS: dict[str, type[_Section]] = {
    "slice": SliceConfig, "vertex": VertexConfig, "image": ImageConfig,
    "trainer": TrainerConfig, "recovery": RecoveryConfig, "dry_run": DryRunConfig,
    "gke": GkeConfig, "pathways": PathwaysConfig, "serve": ServeConfig,
}


# What a config might call Cloud Run, which serves on GPUs only (refused with the reason and the alternatives).
CLOUD_RUN_NAMES = ("cloud-run", "cloudrun", "run")


class Config(BaseModel):
    """One run, as the config file describes it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    project: str | None = None
    region: str
    zones: list[Annotated[str, AfterValidator(_zone_name)]]
    run: str
    # The kind of target (provision.kinds.KINDS): which of the sections below it reads, its rules
    # between keys, what it renders and makes.
    target: str = "tpu-vm"
    slice: SliceConfig = Field(default_factory=SliceConfig)
    vertex: VertexConfig = Field(default_factory=VertexConfig)
    image: ImageConfig
    trainer: TrainerConfig
    recovery: RecoveryConfig = Field(default_factory=RecoveryConfig)
    dry_run: DryRunConfig = Field(default_factory=DryRunConfig)
    gke: GkeConfig | None = None  # target: gke only
    serve: ServeConfig | None = None  # `deploy`: how the kind that serves (vertex, gke) serves a checkpoint
    # The sections a kind brings to the file itself (Kind.own_sections), validated by loading.py
    # with the kind's model: key -> the section.
    kind_sections: dict[str, Any] = Field(default_factory=dict, exclude=True)
    source: Path = Field(default=Path(DEFAULT_CONFIG), exclude=True)
    # Where trainer.mesh is unset: the mesh the plan chose for this config's target, decided once by
    # provision.config.loading.with_planned_mesh (never read from the file); see `trainer_mesh`.
    planned_mesh: str | None = Field(default=None, exclude=True)
    # Where a serve section is present: the serving replica's mesh as `plan --serve` states it (serve.mesh
    # filled out, or the plan's choice), decided once by provision.config.loading.with_serving_mesh.
    planned_serve_mesh: str | None = Field(default=None, exclude=True)
    # How a config loaded without its serving mesh decided gets it when a renderer needs it: load_config
    # sets it to provision.config.loading.with_serving_mesh (a value, so the renderers, a layer below the
    # config, import neither it nor the planner). See `with_serve_mesh`.
    serve_mesh_decider: Callable[[Any], Any] | None = Field(default=None, exclude=True, repr=False)

    @property
    def trainer_mesh(self) -> str | None:
        """The mesh the trainer is started with (`--mesh`): trainer.mesh, else the plan's choice. None
        only for a config loaded without its mesh resolved (`down`, `list`: nothing is started)."""
        return self.trainer.mesh or self.planned_mesh

    @property
    def serve_mesh(self) -> str | None:
        """The mesh every serving container's server is started with (`--mesh`): the plan's statement of
        serve.mesh, or its choice for the replica. None without a serve section, or for a config loaded
        without it decided (`down`, `list`, `predict`: no server is started)."""
        return self.planned_serve_mesh if self.serve is not None else None

    def with_serve_mesh(self) -> Config:
        """This config with its serving replica's mesh decided (`serve_mesh` set), as deploy and render load
        it; itself where it has no serve section or the mesh is decided already."""
        if self.serve is None or self.planned_serve_mesh is not None:
            return self
        if self.serve_mesh_decider is None:
            raise ValueError("a config with a serve section was built without load_config: its serving mesh "
                             "cannot be decided")
        return self.serve_mesh_decider(self)

    @field_validator("target", mode="before")
    @classmethod
    def _known_kind(cls, value: Any) -> Any:
        if isinstance(value, str) and value.replace("_", "-").lower() in CLOUD_RUN_NAMES:
            raise invalid("Cloud Run offers GPUs only, never TPUs: serve on TPU v5e with `target: vertex` (a Vertex "
                          "AI endpoint) or `target: gke` (a Deployment), each with a serve section")
        if not isinstance(value, str) or value not in KINDS:
            names = [repr(name) for name in KINDS]
            one_of = ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else names[0]
            raise invalid(f"must be one of {one_of}, got {_brief(value)}")
        return value

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

    @property
    def kind(self) -> Any:
        """The config's kind of target (a provision.kinds.Kind): what the commands ask about it."""
        return KINDS[self.target]

    def warnings(self) -> list[str]:
        """What is allowed but worth saying, as its kind of target says (a TPU VM slice: zones the
        catalogue does not list for v5e)."""
        return self.kind.warnings(self)

    def section(self, key: str) -> Any:
        """A section that the config's kind of target brings to the file (Kind.own_sections), or None."""
        return self.kind_sections.get(key)


