"""The places a run can train, behind one declared interface (`Target`, in base.py).

One module per kind: tpu_vm.py (a TPU VM slice on a queued resource), vertex.py (a Vertex
AI custom job), gke.py (GKE node pools and a JobSet). `for_config` is the one place that
picks the kind from the config's `target`; a new kind is a module here and one line in KINDS.
"""

from __future__ import annotations

from provision.targets import gke, tpu_vm, vertex
from provision.targets.base import ENDED, Report, Target, combine, report_from_status

# The config's `target` -> the class that implements it.
KINDS: dict[str, type] = {
    "tpu-vm": tpu_vm.SliceTarget,
    "vertex": vertex.JobTarget,
    "gke": gke.GkeTarget,
}


def for_config(context, *, output_dir: str | None = None) -> Target:
    """The target the context's config names (provision.context.RunContext: the config, its session,
    console, templates and image); `output_dir`: where its trainer writes (a dry run's local
    directory; by default trainer.output_dir)."""
    return KINDS[context.config.target](context, output_dir=output_dir)


__all__ = ["ENDED", "KINDS", "Report", "Target", "combine", "for_config", "report_from_status"]
