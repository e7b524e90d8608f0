"""What `target: tpu-vm` adds to the common config: the slice section (provision/kinds/slice_section.py,
which GKE's node pools read too), where the slice's zones may lie, and its rules between keys."""

from __future__ import annotations

from provision import catalogue
from provision.kinds.slice_section import SliceSections
from provision.shapes import ZONE, rule


class TpuVmSections(SliceSections):
    """The slice section of a queued resource's TPU VMs, and its rules against the rest of the config."""

    @rule("zones", "region", "slice.subnetwork")
    def _zones_in_region(self) -> list[tuple[str, str]]:
        """A queued resource is zonal and v5e is in one zone per region, so a slice fails over across
        regions: its zones lie anywhere, unless `slice.subnetwork` ties them to its region."""
        subnetwork = self.slice.subnetwork
        if subnetwork is None:
            return []
        region = subnetwork.split("/")[3] if subnetwork.startswith("projects/") else self.region
        return [(f"zones[{i}]", f"zone {zone!r} is not in region {region!r}, where slice.subnetwork "
                                f"{subnetwork!r} is (a subnetwork serves its own region only)")
                for i, zone in enumerate(self.zones)
                if isinstance(zone, str) and ZONE.match(zone) and catalogue.zone_region(zone) != region]

    @rule("slice.accelerator", "slice.count", "trainer.output_dir")
    def _one_disk(self) -> list[tuple[str, str]]:
        """A local output directory on a slice of several TPU VMs."""
        acc, count, output_dir = self.accelerator_type(), self.slice.count, self.trainer.output_dir
        if (acc.multi_host or count > 1) and not output_dir.startswith("gs://"):
            return [("trainer.output_dir", f"{acc.name} x {count} has several TPU VMs, each with its own disk: "
                                           f"checkpoints in {output_dir!r} would be split between them; use a "
                                           "gs:// path")]
        return []
