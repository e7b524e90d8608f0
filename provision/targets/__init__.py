"""The places a run can train, behind one declared interface (`Target`, in base.py).

One module per kind: tpu_vm.py (a TPU VM slice on a queued resource), vertex.py (a Vertex
AI custom job). `for_config` is the one place that picks the kind from the config's
`target`; a new kind is a module here and one line in KINDS.
"""

from __future__ import annotations

from provision.targets import tpu_vm, vertex
from provision.targets.base import ENDED, Report, Target, combine, report_from_status

# The config's `target` -> the class that implements it.
KINDS: dict[str, type] = {
    "tpu-vm": tpu_vm.SliceTarget,
    "vertex": vertex.JobTarget,
}


def for_config(cfg, session, console, *, renderer=None, output_dir: str | None = None) -> Target:
    """The target the config names, on this session. `renderer`: the invocation's templates and
    resolved image (provision.rendering.Renderer; None: the builtin templates); `output_dir`:
    where its trainer writes (a dry run's local directory; by default trainer.output_dir)."""
    return KINDS[cfg.target](cfg, session, console, renderer=renderer, output_dir=output_dir)


__all__ = ["ENDED", "KINDS", "Report", "Target", "combine", "for_config", "report_from_status"]
