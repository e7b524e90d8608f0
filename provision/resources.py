"""What the tool made, as `list`, `status` and the JSON document show it, whatever the service."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from provision.errors import CloudError, UsageError

MANAGED_BY = ("managed-by", "moe-tpu")
RUN_LABEL = "moe-tpu-run"


@dataclass
class Resource:
    """One cloud resource: a queued resource, a node or a custom job.

    Cost accrues from `billed_from` (default: `created`) until `ended` (default: now).
    """

    kind: str
    name: str
    state: str
    zone: str  # the zone, or the region for regional resources (custom jobs)
    run: str | None = None
    accelerator: str | None = None
    created: float | None = None
    chips: int = 0
    price_per_chip_hour: float = 0.0
    workers: list[str] = field(default_factory=list)
    error: str | None = None
    billed_from: float | None = None
    ended: float | None = None

    def as_dict(self, now: float) -> dict[str, Any]:
        doc: dict[str, Any] = {"kind": self.kind, "name": self.name, "state": self.state, "zone": self.zone}
        if self.run:
            doc["run"] = self.run
        if self.accelerator:
            doc["accelerator"] = self.accelerator
        if self.created is not None:
            doc["age_s"] = round(max(0.0, now - self.created), 1)
            if self.chips:
                doc["cost_usd"] = round(self.cost(now), 2)
        if self.workers:
            doc["workers"] = self.workers
        if self.error:
            doc["error"] = self.error
        return doc

    def cost(self, now: float) -> float:
        start = self.billed_from if self.billed_from is not None else self.created
        if start is None:
            return 0.0
        end = self.ended if self.ended is not None else now
        return self.chips * self.price_per_chip_hour * max(0.0, end - start) / 3600.0


def is_managed(labels: dict[str, str], run: str | None = None) -> bool:
    """Made by this tool (and, with `run`, for that run)."""
    return labels.get(MANAGED_BY[0]) == MANAGED_BY[1] and (run is None or labels.get(RUN_LABEL) == run)


def verify_deleted(left: list[Resource]) -> None:
    """After a teardown: CloudError naming whatever the listing still shows."""
    if left:
        names = ", ".join(f"{r.kind} {short(r.name)} ({r.state})" for r in left)
        raise CloudError(f"resources still exist after delete: {names}",
                         hint="run `moe-tpu down` again; if it persists, delete them in the console")


def location_path(project: str, location: str) -> str:
    """The parent of what a Google Cloud API keeps in a zone or a region: projects/P/locations/L."""
    return f"projects/{project}/locations/{location}"


def short(name: str) -> str:
    return name.rsplit("/", 1)[-1]


def project_of(cfg, session) -> str:
    """The project a run's requests go to: the config's, else the one the credentials name."""
    return resolve_project(cfg, session.default_project)


def resolve_project(cfg, fallback: str | None = None) -> str:
    """The config's project, else `fallback` (from credentials, or a placeholder for rendered files)."""
    project = cfg.project or fallback
    if not project:
        raise UsageError(f"{cfg.source}: project: the config names no project, and every request needs one",
                         hint="set `project: YOUR-PROJECT-ID` in the config, or run `gcloud config set project "
                              "ID` so Application Default Credentials name one")
    return project
