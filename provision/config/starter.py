"""The starter config `moe-tpu init` writes: templates/moe-tpu.yaml.j2 (tests/control/goldens/moe-tpu.yaml.golden),
and with `init --from-terraform` the same template given the foundation's values."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

STARTER_TEMPLATE = "moe-tpu.yaml.j2"


@dataclass
class StarterValues:
    """What the starter template receives: values to write instead of its examples (dotted key -> value).

    The template names each key it has a line for (`value`, `given`); `rest` and `sections_left` hand it
    the given keys it has no line for, so that none is lost."""

    values: dict[str, Any] = field(default_factory=dict)
    written: set[str] = field(default_factory=set)

    def value(self, key: str, example: str) -> str:
        """The given value as YAML (JSON is valid YAML, scalars and lists alike), else the example."""
        self.written.add(key)
        return json.dumps(self.values[key], ensure_ascii=False) if key in self.values else example

    def given(self, key: str) -> bool:
        self.written.add(key)
        return key in self.values

    def rest(self, section: str) -> list[tuple[str, str]]:
        """(key, YAML value) of the given keys of `section` ("": the top level) not written yet."""
        names = [key for key in self.values if key not in self.written
                 and (key.rpartition(".")[0] == section)]
        return [(key.rpartition(".")[2], self.value(key, "")) for key in names]

    def sections_left(self) -> list[tuple[str, list[tuple[str, str]]]]:
        """The sections the template has no block for, with their given keys."""
        sections = dict.fromkeys(key.rpartition(".")[0] for key in self.values if key not in self.written)
        return [(section, self.rest(section)) for section in sections if section]


def starter_config(values: dict[str, Any] | None = None) -> str:
    """The commented YAML that `moe-tpu init` writes; `values` (dotted key -> value) replace its examples."""
    from provision.templates import render

    return render(STARTER_TEMPLATE, StarterValues(dict(values or {})))
