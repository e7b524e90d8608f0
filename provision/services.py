"""A service's life as the control plane sees it: provision its placement, follow it until it is ready
at its URL (or fails), then leave it up: a service lives until `down`. `provision.runs.Runner` does the
same for a training job, which ends by itself."""

from __future__ import annotations

from dataclasses import dataclass, field

from provision.core import ServiceReport, ServiceTarget
from provision.errors import MoeTpuError
from provision.resources import Resource, short
from provision.runs import RunTimeline
from provision.waiting import PollPolicy, format_duration, poll
from trainer.outputs import Phase

FOLLOW_POLICY = PollPolicy(initial_s=2.0, factor=1.5, cap_s=30.0, jitter=0.0)
# A service whose weights load and whose steps compile for longer than this has failed to start.
READY_TIMEOUT_S = 3600.0
SERVICE_ENDS = (Phase.READY, Phase.FAILED, Phase.DELETED)


@dataclass
class ServiceOutcome:
    """How a deploy ended: ready (with its URL and replicas), or why not."""

    ok: bool
    report: ServiceReport
    timeline: RunTimeline
    resources: list[Resource] = field(default_factory=list)


class ServiceFollower:
    """Deploys one service on its placement and follows it until it is ready."""

    def __init__(self, context, service: ServiceTarget) -> None:
        self.service = service
        self.clock = context.clock
        self.console = context.console
        self.timeline = RunTimeline(self.clock, service.price())

    def deploy(self) -> ServiceOutcome:
        """Provision, then wait for ready; a service that fails to start is torn down (nothing bills
        for a service that never answered); a ready one is left up."""
        self.timeline.add("provisioning", self.console, target=self.service.describe())
        try:
            resources = self.service.provision()
        except MoeTpuError as exc:  # refused (a quota, a bad request): what it made before bills for nothing
            self.timeline.add("failed", self.console, detail=exc.message)
            deleted = self.service.teardown()
            self.timeline.add("deleted", self.console, resources=len(deleted))
            raise
        self.timeline.billing(True)
        where = ", ".join(f"{r.kind} {short(r.name)}" for r in resources[:2])
        self.timeline.add("provisioned", self.console, resources=where)
        report = self._follow()
        if report.phase == Phase.READY:
            self.timeline.add("ready", self.console, url=report.url,
                              replicas=f"{report.replicas_ready}/{report.replicas}")
            return ServiceOutcome(True, report, self.timeline, resources)
        self.timeline.add(str(report.phase), self.console, detail=report.detail)
        deleted = self.service.teardown()
        self.timeline.billing(False)
        self.timeline.add("deleted", self.console, resources=len(deleted))
        return ServiceOutcome(False, report, self.timeline, resources)

    def _follow(self) -> ServiceReport:
        since = self.clock.now()

        def look() -> ServiceReport:
            report = self.service.report()
            if report.phase not in SERVICE_ENDS and self.clock.now() - since > READY_TIMEOUT_S:
                return ServiceReport(Phase.FAILED, detail=f"not ready within {format_duration(READY_TIMEOUT_S)}"
                                                          + (f": {report.detail}" if report.detail else ""))
            return report

        with self.console.progress("  waiting for the service to be ready") as bar:
            return poll(look, lambda report: report.phase in SERVICE_ENDS, self.clock, timeout_s=float("inf"),
                        describe=lambda report, _: f"  {report.phase}: {report.replicas_ready}/{report.replicas} "
                                                   "replicas ready", progress=bar, policy=FOLLOW_POLICY,
                        what="the service")
