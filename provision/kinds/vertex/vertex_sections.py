"""The vertex section (target: vertex): the Vertex AI custom job's machines, scheduling and limits."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

from pydantic import field_validator

from provision import catalogue
from provision.shapes import (
    _SERVICE_ACCOUNT,
    _VERTEX_NETWORK,
    _VERTEX_TENSORBOARD,
    _brief,
    _positive_duration,
    _Section,
)
from trainer.schema import did_you_mean, invalid


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
