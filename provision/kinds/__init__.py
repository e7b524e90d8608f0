"""The places a run can train and serve: one kind of target is one unit (a `provision.core.Kind`), in one
package, and this package is their registry.

tpu_vm/ (a TPU VM slice on a queued resource), vertex/ (a Vertex AI custom job, and an endpoint), gke/
(GKE node pools with a JobSet, and a serving pool with a Deployment). Each owns its config sections and
checks, what it renders, the planner's hardware, what it makes, lists and deletes, its log source, and
the deployments (a placement plus a workload, provision.core.Deployment) that `run` and `deploy` follow.
A new kind is a package here and one line in KINDS; no command names a kind, and no kind imports another.
"""

from __future__ import annotations

from provision.core import Kind, Target
from provision.errors import UsageError
from provision.kinds.gke import kind as gke
from provision.kinds.tpu_vm import kind as tpu_vm
from provision.kinds.vertex import kind as vertex

# The config's `target` -> its kind (in this order `list` and `down` go through them).
KINDS: dict[str, Kind] = {kind.name: kind for kind in (tpu_vm.KIND, vertex.KIND, gke.KIND)}


def kind_of(cfg) -> Kind:
    """The kind the config's `target` names (validated against KINDS when the config was loaded)."""
    return cfg.kind


def by_group(group: str) -> Kind:
    """The kind whose own command group is `group` (`slice`, `job`, `gke`)."""
    return next(kind for kind in KINDS.values() if kind.group == group)


def require(cfg, group: str) -> Kind:
    """The config's kind when `group` is its own command group; else a UsageError that says what the
    config's target is and which commands act on it."""
    kind, wanted = kind_of(cfg), by_group(group)
    if kind is not wanted:
        raise UsageError(f"{cfg.source}: target is {cfg.target!r}: {kind.noun}, not {wanted.noun}",
                         hint=f"use `moe-tpu {kind.up_command} -c {cfg.source}` (or `moe-tpu up`), "
                              f"or set `target: {wanted.name}`")
    return kind


def for_config(context, *, output_dir: str | None = None) -> Target:
    """The target the context's config names (provision.context.RunContext: the config, its session,
    console, templates and image); `output_dir`: where its trainer writes (a dry run's local
    directory; by default trainer.output_dir)."""
    return kind_of(context.config).target(context, output_dir=output_dir)


__all__ = ["KINDS", "by_group", "for_config", "kind_of", "require"]
