"""The v5e catalogue is data: the whole table, compared with ==."""

from __future__ import annotations

import pytest

from provision import catalogue
from provision.catalogue import ACCELERATORS, AcceleratorType

# name: (topology, chips, VMs, chips per VM, Vertex machine type)
TABLE = {
    "v5litepod-1": ("1x1", 1, 1, 1, "ct5lp-hightpu-1t"),
    "v5litepod-4": ("2x2", 4, 1, 4, "ct5lp-hightpu-4t"),
    "v5litepod-8": ("2x4", 8, 1, 8, "ct5lp-hightpu-8t"),
    "v5litepod-16": ("4x4", 16, 4, 4, "ct5lp-hightpu-4t"),
    "v5litepod-32": ("4x8", 32, 8, 4, "ct5lp-hightpu-4t"),
    "v5litepod-64": ("8x8", 64, 16, 4, "ct5lp-hightpu-4t"),
    "v5litepod-128": ("8x16", 128, 32, 4, "ct5lp-hightpu-4t"),
    "v5litepod-256": ("16x16", 256, 64, 4, "ct5lp-hightpu-4t"),
}


def test_the_accelerator_table():
    got = {a.name: (a.topology, a.chips, a.vms, a.chips_per_vm, a.vertex_machine_type)
           for a in ACCELERATORS.values()}
    assert got == TABLE


def test_every_entry_is_a_v5e_chip():
    for acc in ACCELERATORS.values():
        assert (acc.generation, acc.hbm_gib_per_chip, acc.hbm_gbps_per_chip, acc.peak_bf16_tflops_per_chip,
                acc.ici_gbps_per_chip, acc.runtime_versions) == (
            "v5e", 16.0, 819.0, 197.0, 1600.0, ("v2-alpha-tpuv5-lite", "v2-tpuv5-litepod", "tpu-ubuntu2204-base"))


def test_one_entry_in_full():
    assert catalogue.accelerator("v5litepod-64") == AcceleratorType(
        name="v5litepod-64", generation="v5e", topology="8x8", chips=64, vms=16, chips_per_vm=4,
        hbm_gib_per_chip=16.0, hbm_gbps_per_chip=819.0, peak_bf16_tflops_per_chip=197.0,
        ici_gbps_per_chip=1600.0, vertex_machine_type="ct5lp-hightpu-4t",
        runtime_versions=("v2-alpha-tpuv5-lite", "v2-tpuv5-litepod", "tpu-ubuntu2204-base"))


def test_slice_totals():
    acc = catalogue.accelerator("v5litepod-256")
    assert (acc.chips, acc.multi_host) == (256, True)
    assert catalogue.accelerator("v5litepod-8").multi_host is False


def test_topology_matches_chip_count():
    for acc in ACCELERATORS.values():
        x, y = (int(n) for n in acc.topology.split("x"))
        assert x * y == acc.chips == acc.vms * acc.chips_per_vm


def test_unknown_accelerator_is_a_key_error():
    with pytest.raises(KeyError):
        catalogue.accelerator("v5litepod-2")


def test_zones_and_regions():
    assert catalogue.V5E_ZONES == ("us-central1-a", "us-south1-a", "us-west1-c", "us-west4-a", "europe-west4-b",
                                   "asia-southeast1-b")
    assert catalogue.zone_warning("us-west4-a") is None
    assert catalogue.zone_warning("us-east5-a") == (
        "zone 'us-east5-a' is not one of the zones Google documents for TPU v5e (us-central1-a, us-south1-a, "
        "us-west1-c, us-west4-a, europe-west4-b, asia-southeast1-b); the API's list of accelerator types in "
        "that zone decides")
    assert catalogue.zone_region("us-west4-a") == "us-west4"
    assert catalogue.zone_region("asia-southeast1-b") == "asia-southeast1"


def test_prices():
    assert (catalogue.price_per_chip_hour("on-demand"), catalogue.price_per_chip_hour("spot"),
            catalogue.price_per_chip_hour("reserved")) == (1.20, 0.47, 1.20)
    with pytest.raises(KeyError):
        catalogue.price_per_chip_hour("preemptible")


def test_vertex_machine_types():
    assert catalogue.VERTEX_MACHINE_TOPOLOGIES == {
        "ct5lp-hightpu-1t": ("1x1",),
        "ct5lp-hightpu-4t": ("2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16"),
        "ct5lp-hightpu-8t": ("2x4",),
    }
    for acc in ACCELERATORS.values():
        assert acc.topology in catalogue.VERTEX_MACHINE_TOPOLOGIES[acc.vertex_machine_type]
    assert catalogue.accelerator_for_topology("4x8").name == "v5litepod-32"
    assert catalogue.accelerator_for_topology("3x3") is None
