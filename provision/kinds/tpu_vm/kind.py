"""A TPU v5e slice on a queued resource (`target: tpu-vm`).

The startup script runs the trainer on every worker; each worker publishes the trainer's
state as guest attributes (provision/guest_attributes.py), which `report` reads and combines.
"""

from __future__ import annotations

from provision import catalogue, guest_attributes
from provision.core import (
    Bundled,
    Deployment,
    Flag,
    Holding,
    Kind,
    Phase,
    Report,
    Scope,
    Verb,
    combine,
    last_zone_first,
    report_from_status,
)
from provision.kinds.tpu_vm import slices
from provision.kinds.tpu_vm.slice_render import STATUS_FILE, render_slice_files
from provision.kinds.tpu_vm.slice_sections import TpuVmSections
from provision.rendering import PROJECT_PLACEHOLDER, trainer_context
from provision.resources import Resource, project_of, short

GUEST_NAMESPACE = guest_attributes.NAMESPACE + "/"


class Slice(Holding):
    """The placement: a TPU v5e slice on a queued resource, made for the run's training (its startup
    script runs the trainer on every worker); its teardown deletes the run's queued resources."""

    kind = "tpu-vm"

    def __init__(self, context) -> None:
        super().__init__(context)
        cfg = context.config
        self.zone: str | None = None
        self.queued_resource: str | None = None
        self.chips = cfg.accelerator_type().chips * cfg.slice.count

    def describe(self) -> str:
        return f"{self.cfg.slice.count} x {self.cfg.slice.accelerator} ({self.cfg.slice.capacity})"

    def price(self) -> float:
        return self.chips * catalogue.price_per_chip_hour(self.cfg.slice.capacity)

    def provision(self, attempt: int = 0) -> list[Resource]:
        """Provision the slice: the zone it last ran in first, then the others in config order."""
        zones = last_zone_first(self.cfg.zones, self.zone)
        resources = slices.slice_up(self.context, attempt=attempt, zones=zones)
        self.zone, self.queued_resource = resources[0].zone, resources[0].name
        return resources

    def teardown(self) -> list[Resource]:
        return slices.slice_down(self.context)

    def left(self) -> list[Resource]:
        return slices.slice_status(self.context)


class SliceTrainer(Bundled):
    """The training workload: the trainer the slice's startup script runs on every worker, which publishes
    its state as guest attributes; it starts and ends with the slice, so it has nothing of its own to
    make or delete."""

    def __init__(self, placement: Slice) -> None:
        self.slice = placement

    def report(self) -> Report:
        session, name, zone = self.slice.session, self.slice.queued_resource, self.slice.zone
        tpu = session.tpu
        qr = tpu.get_queued_resource(name)
        deleted = self._deleted(qr)
        if deleted is not None:
            return deleted
        state = slices.state_name(qr)
        if state != "ACTIVE":
            code, message = slices.failure_of(qr)
            initiator = qr.state.state_initiator.name
            return Report(Phase.PREEMPTED, detail=f"queued resource {state} (by {initiator})"
                                              + (f": code {code}: {message}" if message else ""))
        reports = []
        for node in slices.nodes_of(session, project_of(self.slice.cfg, session), zone, qr):
            workers = tpu.get_guest_attributes(node.name, GUEST_NAMESPACE) if node.state.name == "READY" else None
            if workers is None:
                # A deletion between the two looks takes the nodes too: the queued resource says which it was.
                deleted = self._deleted(tpu.get_queued_resource(name))
                now = "gone" if node.state.name == "READY" else node.state.name
                return deleted or Report(Phase.PREEMPTED, detail=f"node {short(node.name)} is {now}")
            for index, attrs in enumerate(workers):
                if attrs:
                    reports.append(report_from_status(attrs, worker=f"{short(node.name)} worker {index}"))
        return combine(reports) if reports else Report(Phase.WAITING)

    def _deleted(self, qr) -> Report | None:
        """A "deleted" report when the queued resource is gone or DELETING: only a delete (somebody's
        `down`, the console) does that; the service suspends a preempted one instead."""
        name = short(self.slice.queued_resource)
        if qr is None:
            return Report(Phase.DELETED, detail=f"queued resource {name} is gone")
        if slices.state_name(qr) == "DELETING":
            return Report(Phase.DELETED, detail=f"queued resource {name} is DELETING "
                                            f"(by {qr.state.state_initiator.name})")
        return None


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


class TpuVmKind(Kind):
    """`target: tpu-vm`: the slice section, rendered as the startup script and the QueuedResource requests."""

    name = "tpu-vm"
    noun = "a TPU VM slice on a queued resource"
    group = "slice"
    group_help = """TPU v5e slices on queued resources.

    \b
    Examples:
      moe-tpu slice up -c examples/v5e-64.yaml
      moe-tpu slice status -c examples/v5e-64.yaml
      moe-tpu slice down -c examples/v5e-64.yaml
      moe-tpu --dry-run --scenario stockout slice up -c examples/v5e-64.yaml
    """
    up_flags = (Flag("recreate", "Delete a queued resource of the run that no longer matches the config, and create "
                                 "it anew."),)
    verbs = (
        Verb("up", "up", "Provision the slice and wait until every node is READY.\n\nTries each zone of `zones:` in "
                         "order when one has no capacity. A re-run after a crash adopts the queued resource it "
                         "already made instead of making another.", up_flags, trainer=True),
        Verb("status", "status", "Show the run's queued resource and nodes, with state, age and cost so far."),
        Verb("down", "down", "Delete the slice (force: its nodes go with it) and wait until it is gone."),
    )
    up_command = "slice up"
    sections = TpuVmSections

    def warnings(self, cfg) -> list[str]:
        return [w for w in map(catalogue.zone_warning, cfg.zones) if w]

    def check_offer(self, cfg, session) -> None:
        slices.check_zones_offer(cfg, session)

    def summary(self, cfg) -> str:
        acc = cfg.accelerator_type()
        return (f"{cfg.slice.count} x {acc.name} ({acc.topology}, {_plural(acc.chips, 'chip')}, "
                f"{_plural(acc.vms, 'VM')}), {cfg.slice.capacity}, zones {', '.join(cfg.zones)}")

    def render(self, cfg, renderer) -> dict[str, str]:
        ctx = trainer_context(cfg, renderer.image, PROJECT_PLACEHOLDER, status_file=STATUS_FILE)
        return render_slice_files(cfg.slice, ctx, renderer)

    def hardware(self, cfg):
        return cfg.accelerator_type(), cfg.slice.count, cfg.slice.capacity

    def target(self, context, *, output_dir: str | None = None) -> Deployment:
        placement = Slice(context)
        return Deployment(placement, SliceTrainer(placement))

    def up_line(self, cfg) -> str:
        accel = cfg.accelerator_type()
        return (f"run {cfg.run}, {cfg.slice.count} x {accel.name} ({accel.topology}, {accel.chips} chips, "
                f"{accel.vms} VMs), {cfg.slice.capacity}")

    def up(self, context, recreate: bool = False) -> list[Resource]:
        """The slice; `recreate`: a queued resource of the run that no longer matches the config is made anew."""

        return slices.slice_up(context, recreate=recreate)

    def up_lines(self, resources: list[Resource]) -> list[str]:
        qr, nodes = resources[0], resources[1:]
        return [f"slice ready: {short(qr.name)} in {qr.zone}",
                *(f"  node {short(node.name)} {node.state}: {len(node.workers)} workers: {' '.join(node.workers)}"
                  for node in nodes)]

    def status(self, context) -> list[Resource]:

        return slices.slice_status(context)

    def managed(self, session, scope: Scope) -> list[Resource]:

        return slices.managed_resources(session, scope.project, list(scope.zones), run=scope.run)

    def teardown(self, context) -> list[Resource]:

        return slices.slice_down(context)


KIND = TpuVmKind()
