"""Pure rendering, shared by the kinds: the labels on everything made, the project placeholder, the
templates and image of one invocation (`Renderer`), and the trainer's argv (provision/container.py makes
the container itself). Each kind renders its own files in its package (provision/kinds/*/), with these.

No file writes and no cloud calls here. Templates are Jinja, rendered by one Environment with
StrictUndefined and a `shquote` filter; they receive a typed spec, never a raw dict.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from provision.container import trainer_container
from provision.resources import MANAGED_BY, RUN_LABEL

if TYPE_CHECKING:
    from provision.config import Config


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


def render_all(cfg: Config, renderer: Renderer) -> dict[str, str]:
    """Every rendered file of the config's target, by file name (its kind's `render`)."""
    return cfg.kind.render(cfg, renderer)
