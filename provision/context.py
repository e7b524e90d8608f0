"""What one command resolved at its boundary, handed to the lifecycle as one value.

`provision.app.App.context` builds a `RunContext` for the config a command loaded: the config,
the console, the templates (`--templates` first, then the builtin ones), the image reference the
rendered files name, and the cloud session with its clock. The targets, `runs.Runner`, the
slice, job and GKE lifecycles down to their helpers, and the commands take it instead of those
one by one (no function but `RunContext.on` takes a session and a console side by side); below
it the templates directory travels only inside the renderer, and the session's credentials only
inside its clients (Cloud Storage and Cloud Build included).

The image reference and the session are resolved on first use and then kept: a command that
renders nothing never hashes the source tree, one that renders hashes it once, and one that
only reads a config opens no session.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from provision.image import image_reference
from provision.rendering import Renderer

if TYPE_CHECKING:
    from provision.cloud import Session
    from provision.config_sections import Config
    from provision.console import Console


def renderer_for(cfg: Config, templates_dir: Path | None = None) -> Renderer:
    """The renderer of `cfg`: these templates and the image the config runs, resolved now (without
    image.tag that hashes the source tree, with these templates)."""
    return Renderer(image=image_reference(cfg, templates_dir), templates_dir=templates_dir)


@dataclass(frozen=True, eq=False)
class RunContext:
    """One command's config, console, templates, image and session, resolved once.

    `open_session` opens the session (or returns the one already open): the context calls it on
    first use of `session` or `clock`. `image` and `renderer` are resolved on first use, once.
    """

    config: Config
    console: Console
    open_session: Callable[[], Session] = field(repr=False)
    templates_dir: Path | None = None
    # `down --delete-user-pools`: a cluster this tool made goes even with node pools a user added on it.
    delete_user_pools: bool = False

    @classmethod
    def on(cls, config: Config, session: Session, console: Console,
           templates_dir: Path | None = None) -> RunContext:
        """A context on a session that is already open."""
        return cls(config, console, lambda: session, templates_dir)

    @functools.cached_property
    def renderer(self) -> Renderer:
        """The templates and the image every rendered file of the command names."""
        return renderer_for(self.config, self.templates_dir)

    @property
    def image(self) -> str:
        """The trainer image, REPOSITORY:TAG (image.tag, else the content-hash tag of this tree)."""
        return self.renderer.image

    @property
    def session(self) -> Session:
        return self.open_session()

    @property
    def clock(self) -> Any:
        """The session's clock: the real one, or in a dry run the emulator's."""
        return self.session.clock
