"""The prepare's two kinds of failure: input a user can fix (exit 2) and a runtime failure (exit 1)."""

from __future__ import annotations

import click

from trainer.status import EXIT_FAILED, EXIT_USAGE


class PrepareError(click.ClickException):
    """Input or options a user can fix (exit 2): the message names the file, its line or offset, or the
    option; no usage banner, since most are about the data, not the command line."""

    exit_code = EXIT_USAGE


class PrepareFailure(click.ClickException):
    """A runtime failure (a full disk, an I/O error): exit 1, with nothing half-written left behind."""

    exit_code = EXIT_FAILED
