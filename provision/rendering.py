"""Pure rendering, shared by the kinds: the labels on everything made, the project placeholder, the
templates and image of one invocation (`Renderer`), what a kind's renderers read of the config beside its
own sections (`RenderContext`, made here and nowhere else), and the trainer's argv (provision/container.py
makes the container itself). Each kind renders its own files in its package (provision/kinds/*/), with
these: its renderers take its sections and a `RenderContext`, never the config.

No file writes and no cloud calls here. Templates are Jinja, rendered by one Environment with
StrictUndefined and a `shquote` filter; they receive a typed spec, never a raw dict.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from provision.container import Container, server_container, trainer_container
from provision.resources import MANAGED_BY, RUN_LABEL

if TYPE_CHECKING:
    from provision.config_sections import Config


def labels(cfg: Config) -> dict[str, str]:
    """Labels on everything created: the tool and the run (valid GCP label values by construction)."""
    return {MANAGED_BY[0]: MANAGED_BY[1], RUN_LABEL: cfg.run}


def trainer_argv(cfg: Config, status_file: str | None = None) -> list[str]:
    """The trainer container's whole argv (provision.container.trainer_container: the one place it is made)."""
    return list(trainer_container(cfg, "", status_file).argv)


@dataclass(frozen=True)
class Renderer:
    """The templates of one invocation (`--templates` first, then the builtin ones) and the image
    reference they render, given: every file of the run names the same image, and rendering never
    hashes the source tree (provision.context.renderer_for resolves the image, once per command)."""

    image: str
    templates_dir: Path | None = None


# Stands in for the project in rendered files when the config names none (the real one
# comes from the credentials at run time).
PROJECT_PLACEHOLDER = "PROJECT"


@dataclass(frozen=True)
class RenderContext:
    """What a kind's renderers read of the config beside the kind's own sections, made once from it
    (`render_context`): the run and where it runs, the labels on everything made, the workload's container
    (the trainer's or the server's, its image resolved) and the few facts of the common sections a file
    names. `project` is the config's, else the one the command was given (the credentials', or
    PROJECT_PLACEHOLDER for rendered files); None: neither (provision.resources.resolve_project refuses it
    where a request needs one, naming `source`)."""

    run: str
    project: str | None
    region: str
    zones: tuple[str, ...]
    labels: dict[str, str]
    container: Container
    source: str  # the config file, for the problems a renderer reports
    output_dir: str  # trainer.output_dir: where the trainer writes (and a server reads, by default)
    registry_host: str  # image.repository's registry (a TPU VM signs docker in to it)
    overrides: tuple[str, ...]  # trainer.overrides as --set flags (the startup script says their size)
    max_restarts: int  # recovery.max_restarts


def render_context(cfg: Config, container: Container, project: str | None = None) -> RenderContext:
    """The one place a `RenderContext` is made from the config: `container` is the workload's, `project`
    stands where the config names none."""
    return RenderContext(run=cfg.run, project=cfg.project or project, region=cfg.region, zones=tuple(cfg.zones),
                         labels=labels(cfg), container=container, source=str(cfg.source),
                         output_dir=cfg.trainer.output_dir, registry_host=cfg.image.registry_host,
                         overrides=tuple(cfg.trainer.set_flags()), max_restarts=cfg.recovery.max_restarts)


def trainer_context(cfg: Config, image: str, project: str | None = None,
                    status_file: str | None = None) -> RenderContext:
    """The context of a training workload: the trainer's container on `image` (with `--status-file` where
    the host watches the trainer's state there)."""
    return render_context(cfg, trainer_container(cfg, image, status_file), project)


def server_context(cfg: Config, image: str, project: str | None = None) -> RenderContext:
    """The context of a serving workload: the server's container on `image` (its mesh decided now where
    the config was loaded without it)."""
    return render_context(cfg, server_container(cfg, image), project)


def render_all(cfg: Config, renderer: Renderer) -> dict[str, str]:
    """Every rendered file of the config's target, by file name (its kind's `render`)."""
    return cfg.kind.render(cfg, renderer)
