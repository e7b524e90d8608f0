"""The slice section, which two kinds read and no one kind owns: the TPU v5e slice (its accelerator type,
count, capacity and network) that `target: tpu-vm` makes as a queued resource and `target: gke` as node
pools. Its own rules between keys are its model's; its rule against the zones is `SliceSections`', which
each of the two kinds' configs inherits. A kind imports this module, never another kind."""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, field_validator

from provision import catalogue
from provision.shapes import (
    MAX_ID_LENGTH,
    MAX_SLICE_COUNT,
    NETWORK,
    PROJECT,
    RFC1035,
    SERVICE_ACCOUNT,
    SUBNETWORK,
    ZONE,
    Section,
    brief,
    positive_duration,
    rule,
)
from trainer.schema import did_you_mean, invalid


class SliceConfig(Section):
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
                and parts[4] == "reservations" and bool(PROJECT.match(parts[1])) and bool(ZONE.match(parts[3])))
        name = parts[5] if full else value
        if (len(parts) != 1 and not full) or not RFC1035.match(name) or len(name) > MAX_ID_LENGTH:
            raise invalid(f"reservation {value!r} is not a reservation name (lowercase letters, digits and "
                        "hyphens, starting with a letter, at most 63) nor "
                        "projects/PROJECT/locations/ZONE/reservations/NAME")
        return value

    @field_validator("max_wait", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> timedelta:
        return positive_duration(value)

    @field_validator("network")
    @classmethod
    def _network_name(cls, value: str) -> str:
        if not NETWORK.match(value):
            raise invalid(f"network {brief(value)} is not a network name (lowercase letters, digits and hyphens, "
                        "starting with a letter, at most 63) nor projects/PROJECT/global/networks/NAME")
        return value

    @field_validator("subnetwork")
    @classmethod
    def _subnetwork_name(cls, value: str | None) -> str | None:
        if value is not None and not SUBNETWORK.match(value):
            raise invalid(f"subnetwork {brief(value)} is not a subnetwork name (lowercase letters, digits and "
                        "hyphens, starting with a letter, at most 63) nor "
                        "projects/PROJECT/regions/REGION/subnetworks/NAME")
        return value

    @field_validator("service_account")
    @classmethod
    def _service_account_shape(cls, value: str | None) -> str | None:
        if value is not None and not SERVICE_ACCOUNT.match(value):
            raise invalid(f"service account {brief(value)} must be an email like "
                        "trainer@my-project.iam.gserviceaccount.com")
        return value

    @rule("accelerator", "runtime_version")
    def _runtime_fits(self) -> list[tuple[str, str]]:
        fits = catalogue.accelerator(self.accelerator).runtime_versions
        if self.runtime_version in fits:
            return []
        return [("runtime_version", f"runtime version {self.runtime_version!r} does not fit {self.accelerator}; "
                                    f"use {', '.join(fits)}")]

    @rule("capacity", "reservation")
    def _reservation_capacity(self) -> list[tuple[str, str]]:
        if self.capacity == "reserved" and self.reservation is None:
            return [("reservation", "capacity 'reserved' needs slice.reservation (the reservation's name)")]
        if self.capacity in ("spot", "on-demand") and self.reservation is not None:
            return [("reservation", f"a reservation is only used with capacity 'reserved' "
                                    f"(capacity is {self.capacity!r})")]
        return []


class SliceSections(BaseModel):
    """What a kind's config that makes a slice adds to the common one: the slice section, its accelerator
    type, and the slice's rule against the zones."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    slice: SliceConfig = Field(default_factory=SliceConfig)

    @field_validator("slice", mode="before")
    @classmethod
    def _empty_slice(cls, value: Any) -> Any:
        return {} if value is None else value

    def accelerator_type(self) -> catalogue.AcceleratorType:
        return catalogue.accelerator(self.slice.accelerator)

    @rule("slice.reservation", "zones")
    def _reservation_zone(self) -> list[tuple[str, str]]:
        """A reservation given by its full name against the zones: a TPU consumes one in its own zone only."""
        reservation = self.slice.reservation
        if reservation is None or reservation.count("/") != 5:
            return []
        res_zone = reservation.split("/")[3]
        others = [z for z in self.zones if isinstance(z, str) and z != res_zone]
        if not others:
            return []
        return [("slice.reservation", f"reservation {reservation!r} is in {res_zone}; it cannot serve "
                                      f"zone(s) {', '.join(others)} (list only {res_zone} in `zones:`, "
                                      "or give the reservation's short name)")]
