"""What the emulated world's zones offer: TPU accelerator types of every generation, and runtime
versions. Plain data; sources in docs/emulator-fidelity.md.

moe-tpu itself provisions v5e only (provision/catalogue.py; `validate` refuses the rest). v5e is
served in the zones Google documents for it (catalogue.V5E_ZONES) and, as by the real API, in more:
V5E_SERVED_ZONES. The
emulated world is not smaller than the real one for that: a zone that offers other generations lists
them, serves them by name and accepts nodes of them, as the real API does. The other generations are
a representative subset of the "TPU regions and zones" page, not the whole of it.
"""

from __future__ import annotations

from provision.catalogue import ACCELERATORS, V5E_ZONES, AcceleratorType

# us-east5-a/b/c: listed by the "TPU regions and zones" page for single-tenant v5e capacity; the
# API lists v5e there. A zone here and not in the catalogue is what `validate` warns about and asks
# the API (the emulator, in a dry run) about.
V5E_SERVED_ZONES: tuple[str, ...] = (*V5E_ZONES, "us-east5-a", "us-east5-b", "us-east5-c")


def _tpu(name: str, generation: str, topology: str, chips: int, vms: int, runtimes: tuple[str, ...]) -> AcceleratorType:
    # Per-chip figures are not used by the emulator; they are zero for the other generations.
    return AcceleratorType(name=name, generation=generation, topology=topology, chips=chips, vms=vms,
                           chips_per_vm=chips // vms, hbm_gib_per_chip=0.0, hbm_gbps_per_chip=0.0,
                           peak_bf16_tflops_per_chip=0.0, ici_gbps_per_chip=0.0, vertex_machine_type="",
                           runtime_versions=runtimes)


# "TPU software versions" page: v4 and older tpu-ubuntu2204-base, v5p v2-alpha-tpuv5, v6e v2-alpha-tpuv6e.
_V4 = ("tpu-ubuntu2204-base", "tpu-vm-v4-base")
_V5P = ("v2-alpha-tpuv5", "tpu-ubuntu2204-base")
_V6E = ("v2-alpha-tpuv6e", "tpu-ubuntu2204-base")
OTHER_TYPES: dict[str, AcceleratorType] = {a.name: a for a in (
    _tpu("v4-8", "v4", "2x2x1", 4, 1, _V4),
    _tpu("v4-16", "v4", "2x2x2", 8, 2, _V4),
    _tpu("v5p-8", "v5p", "2x2x1", 4, 1, _V5P),
    _tpu("v5p-16", "v5p", "2x2x2", 8, 2, _V5P),
    _tpu("v6e-8", "v6e", "2x4", 8, 1, _V6E),
    _tpu("v6e-16", "v6e", "4x4", 16, 4, _V6E),
)}
ALL_TYPES: dict[str, AcceleratorType] = {**ACCELERATORS, **OTHER_TYPES}

OTHER_GENERATIONS_BY_ZONE: dict[str, tuple[str, ...]] = {
    "us-central1-a": ("v5p",),
    "us-central2-b": ("v4",),
    "us-east5-a": ("v5p",),
    "us-east5-b": ("v6e",),
    "europe-west4-a": ("v6e",),
}

# AcceleratorConfig.Type names by generation.
CONFIG_TYPE = {"v4": "V4", "v5e": "V5LITE_POD", "v5p": "V5P", "v6e": "V6E"}


def types_in(zone: str) -> list[AcceleratorType]:
    """The accelerator types `zone` offers, v5e first, each generation in catalogue order."""
    found = list(ACCELERATORS.values()) if zone in V5E_SERVED_ZONES else []
    generations = OTHER_GENERATIONS_BY_ZONE.get(zone, ())
    return found + [a for a in OTHER_TYPES.values() if a.generation in generations]


def runtime_versions_in(zone: str) -> list[str]:
    versions = {v for a in types_in(zone) for v in a.runtime_versions}
    return sorted(versions)


def by_config(zone: str, config_type: str, topology: str) -> AcceleratorType | None:
    """The type `zone` offers for an AcceleratorConfig (type name, topology); v5e when unspecified."""
    generation = next((g for g, t in CONFIG_TYPE.items() if t == config_type), "v5e")
    return next((a for a in types_in(zone) if a.generation == generation and a.topology == topology), None)


def accelerator_type(name: str) -> AcceleratorType:
    """A type created earlier (validated then): KeyError if unknown."""
    return ALL_TYPES[name]
