"""Options shared by several commands."""

from __future__ import annotations

import click

config_option = click.option(
    "--config", "-c", "config_path", default="moe-tpu.yaml", show_default=True, envvar="MOE_TPU_CONFIG",
    help="The run's config file.")
