"""The config file: YAML in, one frozen, validated `Config` out.

Every problem is collected and reported together (`ConfigError`, exit 2), each naming the
file and the dotted key, in the order the keys appear in the file. The config is a union of the
kinds' configs tagged by `target` (each the common `Config` plus its kind's `sections`, built from
the registry, provision.kinds.KINDS). Field rules live on the models, and so do the rules that tie
keys together (zone inside region, runtime fits accelerator, ...): methods marked with the keys they
read (provision.shapes.rule) on the model that holds those keys. Where keys failed their own rules,
every rule whose keys passed still runs, on the file's values, and one that reads a failed key is
passed over, so one mistake is reported once.

This package is the config's composition root: the one place that knows the registry of kinds and the
planner, and hands them to what reads the file. The models (the common sections and the union of the
kinds' configs) are provision/config_sections.py, below every layer that reads a config; the shapes of
names, durations and ids they share, provision/shapes.py; a kind's own sections and rules, its package
(provision/kinds/). Here: loading.py (the file read through the bounded YAML reader, validated as the
union of the kinds it is handed, errors and broken rules translated), meshes.py (the trainer's checks and
the meshes the plan decides) and starter.py (what `init` writes). Everything is importable from here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel

from provision.config import loading, meshes
from provision.config.meshes import (  # noqa: F401 - the config's API, one import away
    trainer_problems,
    with_planned_mesh,
    with_serving_mesh,
)
from provision.config.starter import (  # noqa: F401 - the config's API, one import away
    starter_config,
)
from provision.config_sections import (  # noqa: F401 - the config's API, one import away
    Config,
    DryRunConfig,
    ImageConfig,
    RecoveryConfig,
    ServeConfig,
    TrainerConfig,
)
from provision.kinds import KINDS
from provision.shapes import (  # noqa: F401 - the config's API, one import away
    DEFAULT_CONFIG,
    MAX_DURATION,
    MAX_ID_LENGTH,
    MAX_RUN_LENGTH,
    MAX_SLICE_COUNT,
    PROJECT,
    parse_duration,
)


def load_config(path: Path | str, check_trainer: bool = False, plan_mesh: bool = False,
                serve_mesh: bool = False) -> Config:
    """Read and validate a config file, one of the registry's kinds'. ConfigError (exit 2) lists every
    problem at once.

    `check_trainer` also runs the trainer's own checks on the trainer section and decides the mesh the
    trainer is started with (`with_planned_mesh`): commands that start training ask for it; `down` and
    `list` must work whatever the trainer thinks. `plan_mesh` decides the mesh alone (`render`). Each
    also decides the serving replica's mesh where the config has a serve section (`with_serving_mesh`),
    and `serve_mesh` that alone (`deploy`)."""
    return meshes.decided(loading.read_config(path, KINDS), check_trainer, plan_mesh, serve_mesh)


def config_from_dict(raw: Any, source: Path | str = DEFAULT_CONFIG) -> Config:
    """Validate already-parsed YAML as one of the registry's kinds' configs; ConfigError lists every problem."""
    return loading.validated(raw, KINDS, source)


def top_sections() -> dict[str, type[BaseModel]]:
    """The sections a config file may have at its top, by key: the common ones and every kind's."""
    return loading.top_sections(KINDS)
