"""The config file: YAML in, one frozen, validated `Config` out.

Every problem is collected and reported together (`ConfigError`, exit 2), each naming the
file and the dotted key, in the order the keys appear in the file. The config is a union of the
kinds' configs tagged by `target` (each the common `Config` plus its kind's `sections`, built from
the registry, provision.kinds.KINDS). Field rules live on the models, and so do the rules that tie
keys together (zone inside region, runtime fits accelerator, ...): methods marked with the keys they
read (provision.shapes.rule) on the model that holds those keys. Where keys failed their own rules,
every rule whose keys passed still runs, on the file's values, and one that reads a failed key is
passed over, so one mistake is reported once.

Modules: sections.py (the common models and their field rules, the union of the kinds' configs; the
shapes of names, durations and ids they share in provision/shapes.py; a kind's own sections and rules
in its package, provision/kinds/), loading.py (the file read through the bounded YAML reader, validated
as the union, errors and broken rules translated) and starter.py (what `init` writes). Everything is
importable from here.
"""

from __future__ import annotations

from provision.config.loading import (  # noqa: F401 - the config's API, one import away
    config_from_dict,
    load_config,
    top_sections,
    trainer_problems,
    with_planned_mesh,
    with_serving_mesh,
)
from provision.config.sections import (  # noqa: F401 - the config's API, one import away
    Config,
    DryRunConfig,
    ImageConfig,
    RecoveryConfig,
    ServeConfig,
    TrainerConfig,
)
from provision.config.starter import (  # noqa: F401 - the config's API, one import away
    starter_config,
)
from provision.shapes import (  # noqa: F401 - the config's API, one import away
    DEFAULT_CONFIG,
    MAX_DURATION,
    MAX_ID_LENGTH,
    MAX_RUN_LENGTH,
    MAX_SLICE_COUNT,
    PROJECT,
    parse_duration,
)
