"""The TPU v5e hardware catalogue: plain data, tested with `==`.

Sources: Cloud TPU docs (v5e system architecture, "TPU regions and zones", pricing) and the
Vertex AI docs for the ct5lp machine types ("Configure compute resources for custom training"). Nothing here imports a
cloud library: the CLI's `--help` and the planner read it cheaply.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

V5E_RUNTIME = "v2-alpha-tpuv5-lite"
# TPU VM images that run v5e. v2-alpha-tpuv5-lite: "TPU software versions" page. v2-tpuv5-litepod:
# Google's own samples (python-docs-samples tpu/create_tpu.py, java-docs-samples tpu/ with
# v5litepod-4). tpu-ubuntu2204-base: the base Ubuntu image, used with v5litepod in public setup
# scripts (gcloud ... --accelerator-type=v5litepod-4 --version=tpu-ubuntu2204-base).
V5E_RUNTIMES: tuple[str, ...] = (V5E_RUNTIME, "v2-tpuv5-litepod", "tpu-ubuntu2204-base")

# Per chip, from the v5e system architecture page: 197 TFLOP/s bf16, 16 GB HBM2 at about
# 819 GB/s, 1600 Gbps of ICI per chip, 2D torus, at most 256 chips per pod.
_PEAK_BF16_TFLOPS = 197.0
_HBM_GIB = 16.0
_HBM_GBPS = 819.0
_ICI_GBPS = 1600.0


@dataclass(frozen=True)
class AcceleratorType:
    """One TPU accelerator type (a slice shape) and what it is made of."""

    name: str
    generation: str
    topology: str
    chips: int
    vms: int
    chips_per_vm: int
    hbm_gib_per_chip: float
    hbm_gbps_per_chip: float
    peak_bf16_tflops_per_chip: float
    ici_gbps_per_chip: float
    vertex_machine_type: str
    runtime_versions: tuple[str, ...]

    @property
    def multi_host(self) -> bool:
        return self.vms > 1


def _v5e(name: str, topology: str, chips: int, vms: int, vertex_machine_type: str) -> AcceleratorType:
    return AcceleratorType(
        name=name, generation="v5e", topology=topology, chips=chips, vms=vms,
        chips_per_vm=chips // vms, hbm_gib_per_chip=_HBM_GIB, hbm_gbps_per_chip=_HBM_GBPS,
        peak_bf16_tflops_per_chip=_PEAK_BF16_TFLOPS, ici_gbps_per_chip=_ICI_GBPS,
        vertex_machine_type=vertex_machine_type, runtime_versions=V5E_RUNTIMES,
    )


# Single-host shapes: 1, 4 and 8 chips on one VM. Multi-host slices are VMs of 4 chips.
ACCELERATORS: dict[str, AcceleratorType] = {
    a.name: a
    for a in (
        _v5e("v5litepod-1", "1x1", 1, 1, "ct5lp-hightpu-1t"),
        _v5e("v5litepod-4", "2x2", 4, 1, "ct5lp-hightpu-4t"),
        _v5e("v5litepod-8", "2x4", 8, 1, "ct5lp-hightpu-8t"),
        _v5e("v5litepod-16", "4x4", 16, 4, "ct5lp-hightpu-4t"),
        _v5e("v5litepod-32", "4x8", 32, 8, "ct5lp-hightpu-4t"),
        _v5e("v5litepod-64", "8x8", 64, 16, "ct5lp-hightpu-4t"),
        _v5e("v5litepod-128", "8x16", 128, 32, "ct5lp-hightpu-4t"),
        _v5e("v5litepod-256", "16x16", 256, 64, "ct5lp-hightpu-4t"),
    )
}

# Vertex AI machine type -> the TPU topologies it accepts. ct5lp-hightpu-4t runs 2x2 on one
# host and the multi-host topologies 2x4 to 16x16 (hosts of 4 chips); 2x4 on one host is -8t.
VERTEX_MACHINE_TOPOLOGIES: dict[str, tuple[str, ...]] = {
    "ct5lp-hightpu-1t": ("1x1",),
    "ct5lp-hightpu-4t": ("2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
    "ct5lp-hightpu-8t": ("2x4",),
}

# Zones that Google's "TPU regions and zones" page (cloud.google.com/tpu/docs/regions-zones) lists
# for v5e capacity open to every project. The page lists us-east5-a/b/c for single-tenant
# capacity only, and other catalogues list more zones where the API serves v5e, so a zone not
# here is a warning (`zone_warning`), not a refusal: the API's list of accelerator types in that
# zone decides (provision/zones.py).
V5E_ZONES: tuple[str, ...] = (
    "us-central1-a",
    "us-south1-a",
    "us-west1-c",
    "us-west4-a",
    "europe-west4-b",
    "asia-southeast1-b",
)


ON_DEMAND_PRICE_PER_CHIP_HOUR = 1.20
# Spot v5e is quoted at $0.21 to $0.47 per chip-hour depending on region; we take the top of
# the range so cost estimates never promise less than the bill.
SPOT_PRICE_PER_CHIP_HOUR = 0.47
# A reservation is billed at its committed rate, which the tool cannot know; the on-demand
# price is the upper bound used for estimates.
RESERVED_PRICE_PER_CHIP_HOUR = ON_DEMAND_PRICE_PER_CHIP_HOUR

_PRICES = {
    "on-demand": ON_DEMAND_PRICE_PER_CHIP_HOUR,
    "spot": SPOT_PRICE_PER_CHIP_HOUR,
    "reserved": RESERVED_PRICE_PER_CHIP_HOUR,
}


def accelerator(name: str) -> AcceleratorType:
    """The catalogue entry for an accelerator type; KeyError if unknown."""
    return ACCELERATORS[name]


def accelerator_for_topology(topology: str) -> AcceleratorType | None:
    for acc in ACCELERATORS.values():
        if acc.topology == topology:
            return acc
    return None


# GKE's node label value for TPU v5e (cloud.google.com/gke-tpu-accelerator); the machine types are
# the ct5lp ones above, with the slice's topology as the node pool's placement tpu_topology.
GKE_V5E_ACCELERATOR = "tpu-v5-lite-podslice"


def accelerator_for_machine(machine_type: str, tpu_topology: str = "") -> AcceleratorType | None:
    """The v5e slice a GKE node pool of `machine_type` holds (its placement topology, none for a
    single-host slice), or None (a CPU machine type)."""
    for acc in ACCELERATORS.values():
        if acc.vertex_machine_type == machine_type and (acc.topology == tpu_topology
                                                        or (not tpu_topology and not acc.multi_host)):
            return acc
    return None


# Vertex AI scheduling strategy -> the catalogue price it is billed at: a job's machines are billed
# from its start to its end, STANDARD and FLEX_START at the on-demand rate (an upper bound for
# FLEX_START), SPOT at the spot rate.
CAPACITY_OF_VERTEX_STRATEGY = {"STANDARD": "on-demand", "FLEX_START": "on-demand", "SPOT": "spot"}

# A GKE cluster or node pool name is at most this many characters (RFC 1035).
MAX_GKE_NAME = 40

# Vertex AI CustomJob states (google.cloud.aiplatform.v1.JobState) a job is still live in, and ends in.
VERTEX_JOB_ACTIVE = frozenset({"JOB_STATE_QUEUED", "JOB_STATE_PENDING", "JOB_STATE_RUNNING", "JOB_STATE_CANCELLING",
                               "JOB_STATE_UPDATING", "JOB_STATE_PAUSED"})
VERTEX_JOB_TERMINAL = frozenset({"JOB_STATE_SUCCEEDED", "JOB_STATE_FAILED", "JOB_STATE_CANCELLED", "JOB_STATE_EXPIRED",
                                 "JOB_STATE_PARTIALLY_SUCCEEDED"})


def price_per_chip_hour(capacity: str) -> float:
    """USD per chip-hour for "on-demand", "spot" or "reserved"; KeyError otherwise."""
    return _PRICES[capacity]


# A Google Cloud zone name (us-west4-a): what a zone looks like, whether or not it offers v5e.
ZONE_NAME = re.compile(r"^[a-z]+-[a-z]+[0-9]+-[a-z]$")


def zone_warning(zone: str) -> str | None:
    """The warning for a zone the catalogue does not list for v5e; None for one it lists."""
    if zone in V5E_ZONES:
        return None
    return (f"zone {zone!r} is not one of the zones Google documents for TPU v5e ({', '.join(V5E_ZONES)}); "
            "the API's list of accelerator types in that zone decides")


def zone_region(zone: str) -> str:
    """"us-west4-a" -> "us-west4"."""
    return zone.rsplit("-", 1)[0]
