"""What `target: vertex` adds to the common config: the vertex section (the Vertex AI custom job's
machines, scheduling and limits), its own rules, and its rules against the rest of the config (the
region, the trainer's output, the serve section as Vertex AI serves it)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from provision import catalogue
from provision.core import replica_problems
from provision.shapes import (
    SERVICE_ACCOUNT,
    VERTEX_NETWORK,
    VERTEX_TENSORBOARD,
    Section,
    brief,
    positive_duration,
    rule,
)
from trainer.schema import did_you_mean, invalid


class VertexConfig(Section):
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
        return None if value is None else positive_duration(value)

    @field_validator("service_account")
    @classmethod
    def _service_account_shape(cls, value: str | None) -> str | None:
        if value is not None and not SERVICE_ACCOUNT.match(value):
            raise invalid(f"service account {value!r} must be an email like trainer@my-project.iam.gserviceaccount.com")
        return value

    @field_validator("tensorboard")
    @classmethod
    def _tensorboard_shape(cls, value: str | None) -> str | None:
        if value is not None and not VERTEX_TENSORBOARD.match(value):
            raise invalid(f"tensorboard {brief(value)} must look like "
                        "projects/PROJECT/locations/REGION/tensorboards/ID (ID: a number)")
        return value

    @field_validator("network")
    @classmethod
    def _network_shape(cls, value: str | None) -> str | None:
        if value is not None and not VERTEX_NETWORK.match(value):
            raise invalid(f"network {value!r} must look like projects/PROJECT_NUMBER/global/networks/NAME")
        return value

    @field_validator("machine_type")
    @classmethod
    def _known_machine_type(cls, value: str) -> str:
        names = list(catalogue.VERTEX_MACHINE_TOPOLOGIES)
        if value not in names:
            raise invalid(f"unknown Vertex machine type {value!r}{did_you_mean(value, names)} "
                        f"(v5e machine types: {', '.join(names)})")
        return value

    @field_validator("topology")
    @classmethod
    def _known_topology(cls, value: str) -> str:
        if catalogue.accelerator_for_topology(value) is None:
            topologies = [a.topology for a in catalogue.ACCELERATORS.values()]
            raise invalid(f"unknown v5e topology {value!r} (v5e topologies: {', '.join(topologies)})")
        return value

    @rule("machine_type", "topology")
    def _topology_fits(self) -> list[tuple[str, str]]:
        allowed = catalogue.VERTEX_MACHINE_TOPOLOGIES.get(self.machine_type)
        if allowed and self.topology not in allowed:
            return [("topology", f"topology {self.topology!r} does not fit machine type {self.machine_type!r}; "
                                 f"it takes {', '.join(allowed)}")]
        return []

    @rule("tensorboard", "service_account")
    def _tensorboard_account(self) -> list[tuple[str, str]]:
        if self.tensorboard is not None and self.service_account is None:
            return [("tensorboard", "a Vertex AI TensorBoard needs vertex.service_account (the job writes to "
                                    "TensorBoard as that account)")]
        return []

    @rule("scheduling", "topology")
    def _spot_on_one_host(self) -> list[tuple[str, str]]:
        acc = catalogue.accelerator_for_topology(self.topology)
        if self.scheduling == "SPOT" and acc is not None and acc.multi_host:
            return [("scheduling", f"Vertex AI does not offer SPOT for multi-host TPU topologies "
                                   f"({self.topology}); use STANDARD or FLEX_START")]
        return []


class VertexSections(BaseModel):
    """The vertex section, and its rules against the rest of the config (Kind.sections of `vertex`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    vertex: VertexConfig = Field(default_factory=VertexConfig)

    @field_validator("vertex", mode="before")
    @classmethod
    def _empty_vertex(cls, value: Any) -> Any:
        return {} if value is None else value

    @rule("vertex.tensorboard", "region")
    def _tensorboard_region(self) -> list[tuple[str, str]]:
        tensorboard = self.vertex.tensorboard
        if tensorboard is not None and f"/locations/{self.region}/" not in tensorboard:
            return [("vertex.tensorboard", f"TensorBoard {tensorboard!r} is not in the job's region {self.region!r}")]
        return []

    @rule("serve.min_replicas", "serve.max_replicas")
    def _replicas(self) -> list[tuple[str, str]]:
        return replica_problems(self.serve, "Vertex AI's autoscaler") if self.serve is not None else []

    @rule("serve.autoscale_target")
    def _duty_cycle(self) -> list[tuple[str, str]]:
        target = self.serve.autoscale_target if self.serve is not None else 0
        if target <= 100:
            return []
        return [("serve.autoscale_target", f"Vertex AI's autoscaling target is the accelerators' duty cycle in "
                                           f"percent, at most 100, not {target} (60: a replica is added above 60% "
                                           "busy)")]

    @rule("serve.topology", "serve.machine_type")
    def _one_host(self) -> list[tuple[str, str]]:
        """A replica on one host, the machine type's own: online prediction serves single-host v5e only."""
        if self.serve is None or self.serve.topology is None:
            return []
        topology, machine = self.serve.topology, self.serve.machine_type
        single = catalogue.accelerator_for_machine(machine, "")
        acc = catalogue.accelerator_for_topology(topology)
        if acc is not None and acc.multi_host:
            return [("serve.topology", f"Vertex AI online prediction serves single-host TPU v5e only (1x1, 2x2, "
                                       f"2x4), not {topology} ({acc.chips} chips on {acc.vms} hosts): a replica "
                                       "over several hosts is served on GKE (target: gke, a LeaderWorkerSet: see "
                                       "examples/serve-gke-multihost.yaml); or leave serve.topology unset and fit "
                                       "the model on one host (serve.machine_type ct5lp-hightpu-8t: 8 chips; "
                                       "serve.weights: int8 or int4)")]
        if single is not None and acc is not None and topology != single.topology:
            return [("serve.topology", f"topology {topology!r} is not the one host of {machine} "
                                       f"({single.topology}, {single.chips} chip(s)): leave serve.topology unset, "
                                       f"or give serve.machine_type: {acc.vertex_machine_type}")]
        return []

    @rule("trainer.output_dir")
    def _checkpoints_in_storage(self) -> list[tuple[str, str]]:
        output_dir = self.trainer.output_dir
        if output_dir.startswith("gs://"):
            return []
        return [("trainer.output_dir", f"a Vertex AI job keeps its checkpoints in Cloud Storage: use a gs:// path, "
                                       f"not {output_dir!r} (a local path vanishes with the job)")]
