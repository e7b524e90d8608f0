"""The config as frozen pydantic models: the sections every kind of target reads, each field with its own
rule (the shapes they share: provision/shapes.py), the common `Config`, and the union of the kinds'
configs tagged by `target`, built from the kinds it is given (`config_union`: each kind's config is
`Config` plus its `Kind.sections`, the sections of its package and its rules between keys)."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictInt,
    TypeAdapter,
    create_model,
    field_validator,
    model_validator,
)

from provision import catalogue
from provision.shapes import (
    DEFAULT_CONFIG,
    GCS_URL,
    IMAGE_REPOSITORY,
    IMAGE_TAG,
    MAX_ID_LENGTH,
    MAX_RUN_LENGTH,
    OVERRIDE_KEY,
    PROJECT,
    REGION,
    RFC1035,
    SYSTEM_DIRS,
    SYSTEM_TREES,
    ZONE,
    Section,
    brief,
    broken,
    check,
    gcs_location,
    mesh_text,
    rule,
    zone_name,
)
from trainer.schema import NonNegative, Positive, did_you_mean, invalid

# The single-host v5e machine types that serve (Vertex AI online prediction and a GKE serving node
# pool), with the one topology each has on one host.
SERVING_MACHINE_TOPOLOGY: dict[str, str] = {
    "ct5lp-hightpu-1t": "1x1", "ct5lp-hightpu-4t": "2x2", "ct5lp-hightpu-8t": "2x4",
}


class ServeConfig(Section):
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
    # At most the server's --max-len: positions are int32 in its steps, an idle slot's at max_len + 1.
    max_len: Annotated[StrictInt, Field(ge=2, le=2**31 - 2)] = 1024
    weights: Literal["auto", "int8", "int4", "mxfp4"] = "auto"  # trainer/arith/quant.py QUANTIZED_WEIGHTS
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
        return None if value is None else mesh_text(value)

    @field_validator("machine_type")
    @classmethod
    def _serving_machine_type(cls, value: str) -> str:
        names = list(SERVING_MACHINE_TOPOLOGY)
        if value not in names:
            raise invalid(f"machine type {brief(value)} does not serve{did_you_mean(value, names)} "
                          f"(single-host v5e machine types: {', '.join(names)})")
        return value

    @field_validator("topology")
    @classmethod
    def _known_topology(cls, value: str | None) -> str | None:
        if value is not None and catalogue.accelerator_for_topology(value) is None:
            topologies = [a.topology for a in catalogue.ACCELERATORS.values()]
            raise invalid(f"unknown v5e topology {brief(value)} (v5e topologies: {', '.join(topologies)})")
        return value

    @property
    def replica_topology(self) -> str:
        return self.topology or SERVING_MACHINE_TOPOLOGY[self.machine_type]


class ImageConfig(Section):
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
        if not IMAGE_REPOSITORY.match(value):
            raise invalid(f"image repository {value!r} does not look like HOST/PROJECT/REPOSITORY/IMAGE "
                        "(e.g. us-west4-docker.pkg.dev/my-project/moe/trainer; the tag goes in image.tag)")
        return value

    @field_validator("tag")
    @classmethod
    def _tag_shape(cls, value: str | None) -> str | None:
        if value is not None and not IMAGE_TAG.match(value):
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


class TrainerConfig(Section):
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
            if not GCS_URL.match(value):
                raise invalid(f"output_dir {brief(value)} is not a Cloud Storage location like gs://my-bucket/run "
                            "(bucket names: 3 to 63 lowercase letters, digits, '-', '_' or '.', starting and "
                            "ending with a letter or digit)")
            return value
        normal = "/" + "/".join(part for part in value.split("/") if part and part != ".") if value.startswith("/") \
            else None
        if normal is not None and (normal in SYSTEM_DIRS or normal.startswith(tuple(t + "/" for t in SYSTEM_TREES))
                                   or ".." in normal.split("/")):
            raise invalid(f"output_dir {brief(value)} is a system directory (or inside one): the trainer's VM "
                        "would take it over; use gs://BUCKET/PATH, or a directory of its own such as /mnt/moe")
        return value

    @field_validator("mesh")
    @classmethod
    def _mesh_shape(cls, value: str | None) -> str | None:
        return None if value is None else mesh_text(value)

    @field_validator("overrides", mode="before")
    @classmethod
    def _override_items(cls, value: Any) -> Any:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise invalid(f"overrides must be a mapping of key: value, got {value!r}")
        for key, item in value.items():
            if not isinstance(key, str) or not OVERRIDE_KEY.match(key):
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


class RecoveryConfig(Section):
    max_restarts: NonNegative = 3


MAX_TRAINER_STEPS = 2**31 - 1  # trainer.config.MAX_STEPS (not imported: the trainer's config stays unloaded here)


class DryRunConfig(Section):
    """How `run --dry-run` trains for real on this machine: the trainer made small enough for a CPU."""

    trainer_config: str = "tiny"
    steps: Annotated[StrictInt, Field(ge=1, le=MAX_TRAINER_STEPS)] = 40  # the trainer's int32 step counter
    devices: Positive = 8
    mesh: str = "data=2,expert=4"
    checkpoint_every: Positive = 10

    @field_validator("mesh")
    @classmethod
    def _mesh_shape(cls, value: str) -> str:
        return mesh_text(value)


# What a config might call Cloud Run, which serves on GPUs only (refused with the reason and the alternatives).
CLOUD_RUN_NAMES = ("cloud-run", "cloudrun", "run")
# The kind a config without `target:` is of.
DEFAULT_TARGET = "tpu-vm"


def target_problem(value: Any, names: list[str]) -> str | None:
    """What is wrong with `target: value` where the kinds are `names` (None: one of them): the one key
    read before the union of the kinds' configs, which it picks the member of."""
    if isinstance(value, str) and value.replace("_", "-").lower() in CLOUD_RUN_NAMES:
        return ("Cloud Run offers GPUs only, never TPUs: serve on TPU v5e with `target: vertex` (a Vertex "
                "AI endpoint) or `target: gke` (a Deployment), each with a serve section")
    if not isinstance(value, str) or value not in names:
        quoted = [repr(name) for name in names]
        one_of = ", ".join(quoted[:-1]) + f" or {quoted[-1]}" if len(quoted) > 1 else quoted[0]
        return f"must be one of {one_of}, got {brief(value)}"
    return None


class Config(BaseModel):
    """One run, as the config file describes it: what every kind of target reads. A loaded config is
    one kind's (`config_union`): this plus the kind's sections and rules between keys."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # The config's kind (a provision.core.Kind), on each kind's config class (`kind_config`).
    of_kind: ClassVar[Any] = None

    project: str | None = None
    region: str
    zones: list[Annotated[str, AfterValidator(zone_name)]]
    run: str
    # The kind of target (provision.kinds.KINDS): which sections the config has besides these, its rules
    # between keys, what it renders and makes.
    target: str = DEFAULT_TARGET
    image: ImageConfig
    trainer: TrainerConfig
    recovery: RecoveryConfig = Field(default_factory=RecoveryConfig)
    dry_run: DryRunConfig = Field(default_factory=DryRunConfig)
    serve: ServeConfig | None = None  # `deploy`: how the kind that serves (vertex, gke) serves a checkpoint
    # Sections of other kinds left in the file (as the starter's `vertex:` for a switch of target), each
    # validated by its model by provision.config.loading: key -> the section. `down` and `list` read
    # them (`as_kind`): they look for the run's resources of every kind.
    other_sections: dict[str, Any] = Field(default_factory=dict, exclude=True)
    source: Path = Field(default=Path(DEFAULT_CONFIG), exclude=True)
    # Where trainer.mesh is unset: the mesh the plan chose for this config's target, decided once by
    # provision.config.meshes.with_planned_mesh (never read from the file); see `trainer_mesh`.
    planned_mesh: str | None = Field(default=None, exclude=True)
    # Where a serve section is present: the serving replica's mesh as `plan --serve` states it (serve.mesh
    # filled out, or the plan's choice), decided once by provision.config.meshes.with_serving_mesh.
    planned_serve_mesh: str | None = Field(default=None, exclude=True)
    # How a config loaded without its serving mesh decided gets it when a renderer needs it: load_config
    # sets it to provision.config.meshes.with_serving_mesh (a value, so the renderers, a layer below the
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

    @field_validator("recovery", "dry_run", mode="before")
    @classmethod
    def _empty_section(cls, value: Any) -> Any:
        return {} if value is None else value

    @field_validator("project")
    @classmethod
    def _project_shape(cls, value: str | None) -> str | None:
        if value is not None and not PROJECT.match(value):
            raise invalid(f"project id {value!r} must be 6 to 30 lowercase letters, digits or hyphens, "
                        "start with a letter and not end with a hyphen")
        return value

    @field_validator("region")
    @classmethod
    def _region_shape(cls, value: str) -> str:
        if not REGION.match(value):
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
        if not RFC1035.match(value):
            raise invalid(f"run name {value!r} must be lowercase letters, digits and hyphens, start with a "
                        "letter and not end with a hyphen (it becomes resource ids: RFC 1035)")
        if len(value) > MAX_RUN_LENGTH:
            raise invalid(f"run name {value!r} is {len(value)} characters; at most {MAX_RUN_LENGTH}, so that "
                        f"the resource ids derived from it stay within {MAX_ID_LENGTH}")
        return value

    @model_validator(mode="after")
    def _rules(self) -> Config:
        """The rules between keys (`provision.shapes.rule`): the common ones and the kind's, raised together."""
        broken(check(self))
        return self

    @rule("zones", "region")
    def _zones_in_region(self) -> list[tuple[str, str]]:
        """Each zone in the config's region (a kind's config whose zones lie elsewhere replaces this rule)."""
        return [(f"zones[{i}]", f"zone {zone!r} is not in region {self.region!r}")
                for i, zone in enumerate(self.zones)
                if isinstance(zone, str) and ZONE.match(zone) and catalogue.zone_region(zone) != self.region]

    @property
    def kind(self) -> Any:
        """The config's kind of target (a provision.kinds.Kind): what the commands ask about it."""
        if self.of_kind is None:
            raise TypeError("a Config of no kind: load one (provision.config.load_config)")
        return self.of_kind

    def warnings(self) -> list[str]:
        """What is allowed but worth saying, as its kind of target says (a TPU VM slice: zones the
        catalogue does not list for v5e)."""
        return self.kind.warnings(self)

    def section(self, key: str) -> Any:
        """A section of the file by its key: the config's kind's own, another kind's left in the file, or None."""
        return getattr(self, key) if key in type(self).model_fields else self.other_sections.get(key)

    def as_kind(self, kind: Any) -> Config:
        """This config as `kind` reads it (itself where it is of that kind): the common keys, and the
        kind's sections from its own or those left in the file (their defaults where absent). For `down`
        and `list`, which look for every kind's resources of the run; its rules between keys unchecked."""
        if kind is self.of_kind:
            return self
        model = kind_config(kind)
        common = {name: getattr(self, name) for name in Config.model_fields if name != "target"}
        sections = {name: self.section(name) for name in model.model_fields if name not in Config.model_fields}
        return model.model_construct(**common, **{k: v for k, v in sections.items() if v is not None},
                                     target=kind.name)


@functools.cache
def kind_config(kind: Any) -> type[Config]:
    """The config of one kind of target: `Config` plus the kind's sections model (`Kind.sections`: its
    sections as fields, its rules between keys as `rules`), `target` the kind's name."""
    bases = (kind.sections, Config) if kind.sections is not None else (Config,)
    model = create_model(f"Config_{kind.name.replace('-', '_')}", __base__=bases, __module__=__name__,
                         target=(Literal[kind.name], kind.name))
    model.of_kind = kind
    return model


def config_union(kinds: tuple[Any, ...]) -> TypeAdapter:
    """The config as a union of the kinds' configs, tagged by `target` (the registry's kinds, given by the
    loader: this module imports none)."""
    members = tuple(kind_config(kind) for kind in kinds)
    if len(members) == 1:
        return TypeAdapter(members[0])
    return TypeAdapter(Annotated[Union[members], Field(discriminator="target")])  # noqa: UP007 - a tuple of members


def common_sections() -> dict[str, type[BaseModel]]:
    """The sections every kind reads, by key (provision.config.loading adds the kinds')."""
    return {name: field.annotation for name, field in Config.model_fields.items()
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)} | \
        {"serve": ServeConfig}
