"""Emulator fidelity: what the real Cloud TPU API accepts and checks, through the real TpuClient.

Sources for each behaviour: docs/emulator-fidelity.md. Confirmed messages are pinned word for word;
unconfirmed ones by status code and key facts.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from google.api_core import exceptions as gexc
from google.cloud import tpu_v2

from provision.catalogue import V5E_RUNTIMES
from provision.emulator import Emulator
from provision.emulator import scenarios as sc
from provision.emulator.server import parse_reservations
from provision.kinds.tpu_vm import slices
from tests.control.cli_helpers import invoke
from tests.control.test_emulator import PARENT, PROJECT, ZONE, create, queued_resource

ROOT = Path(__file__).resolve().parents[2]
RES_ENV = "MOE_TPU_EMULATOR_RESERVATIONS"


@pytest.fixture
def emu():
    with Emulator(scenario="happy", reservations={}) as emulator:
        yield emulator


@pytest.fixture
def client(emu):
    return emu.client()


def parent_of(zone: str) -> str:
    return f"projects/{PROJECT}/locations/{zone}"


# --- 1. what the real API accepts -----------------------------------------------------------

@pytest.mark.parametrize("runtime", ["v2-alpha-tpuv5-lite", "v2-tpuv5-litepod", "tpu-ubuntu2204-base"])
def test_v5e_runs_on_every_documented_runtime_version(client, runtime):
    qr = create(client, runtime=runtime).result()
    assert qr.tpu.node_spec[0].node.runtime_version == runtime
    assert runtime in {v.version for v in client.list_runtime_versions(parent=PARENT)}


def test_a_zone_lists_every_generation_it_offers(client):
    east5a = {a.type_: a.accelerator_configs[0].type_.name for a in client.list_accelerator_types(
        parent=parent_of("us-east5-a"))}
    assert east5a["v5litepod-8"] == "V5LITE_POD" and east5a["v5p-8"] == "V5P"
    central2b = [a.type_ for a in client.list_accelerator_types(parent=parent_of("us-central2-b"))]
    assert "v4-8" in central2b and not any(t.startswith("v5litepod") for t in central2b)
    got = client.get_accelerator_type(name=f"{parent_of('us-central2-b')}/acceleratorTypes/v4-8")
    assert got.accelerator_configs[0].topology == "2x2x1"
    with pytest.raises(gexc.NotFound):
        client.get_accelerator_type(name=f"{PARENT}/acceleratorTypes/v4-8")  # us-west4-a has no v4
    v6e_zone = {v.version for v in client.list_runtime_versions(parent=parent_of("us-east5-b"))}
    assert {"v2-alpha-tpuv6e", "v2-alpha-tpuv5-lite"} <= v6e_zone


def test_a_queued_resource_of_another_generation_is_accepted_where_offered(client):
    parent = parent_of("us-central2-b")
    qr = create(client, parent=parent, accelerator="v4-8", runtime="tpu-ubuntu2204-base").result()
    assert qr.tpu.node_spec[0].node.accelerator_type == "v4-8"


def test_create_node_makes_a_v5e_tpu_vm_without_a_queued_resource(emu, client):
    node = tpu_v2.Node(accelerator_type="v5litepod-4", runtime_version="v2-tpuv5-litepod")
    op = client.create_node(request=tpu_v2.CreateNodeRequest(parent=PARENT, node_id="test-tpu", node=node))
    name = f"{PARENT}/nodes/test-tpu"
    assert client.get_node(name=name).state.name == "CREATING"
    emu.clock.advance(sc.PROVISIONING_S)
    made = op.result()
    assert (made.name, made.state.name, made.queued_resource) == (name, "READY", "")
    assert len(client.get_node(name=name).network_endpoints) == 1
    assert list(client.list_queued_resources(parent=PARENT)) == []
    with pytest.raises(gexc.AlreadyExists):
        client.create_node(request=tpu_v2.CreateNodeRequest(parent=PARENT, node_id="test-tpu", node=node))
    client.delete_node(name=name)
    emu.clock.advance(120)
    assert [n.name for n in client.list_nodes(parent=PARENT)] == []


def test_create_node_in_a_stocked_out_zone_fails_its_operation_with_the_stockout_error():
    with Emulator(scenario="stockout", reservations={}) as emu:
        client = emu.client()
        node = tpu_v2.Node(accelerator_type="v5litepod-4", runtime_version="v2-alpha-tpuv5-lite")
        op = client.create_node(request=tpu_v2.CreateNodeRequest(parent=PARENT, node_id="test-tpu", node=node))
        emu.clock.advance(sc.CREATING_S)
        with pytest.raises(gexc.ResourceExhausted) as info:
            op.result()
        assert info.value.message == sc.STOCKOUT_MESSAGE.format(zone=ZONE)  # confirmed (docs/api-facts.md)
        assert list(client.list_nodes(parent=PARENT)) == []


# --- 2. what the real API checks -------------------------------------------------------------

@pytest.mark.parametrize("bad", ["Moe-demo", "moe_demo", "1moe", "moe-", "m" * 64, "m" * 70])
def test_resource_ids_are_google_cloud_resource_names(client, bad):
    with pytest.raises(gexc.InvalidArgument) as info:
        create(client, qr_id=bad)
    assert "queued_resource_id" in info.value.message and bad in info.value.message
    with pytest.raises(gexc.InvalidArgument) as info:
        create(client, qr_id="moe-demo", node_id=bad)
    assert "node_id" in info.value.message and bad in info.value.message


def test_longest_valid_resource_id_is_accepted(client):
    create(client, qr_id="m" * 63, node_id="n" * 63).result()


def _reserved(client, reservation: str, spot: bool = False, accelerator: str = "v5litepod-16"):
    qr = queued_resource(accelerator=accelerator, spot=spot)
    if not spot:
        qr.guaranteed = tpu_v2.QueuedResource.Guaranteed()
    qr.reservation_name = reservation
    return client.create_queued_resource(request=tpu_v2.CreateQueuedResourceRequest(
        parent=PARENT, queued_resource_id="moe-demo", queued_resource=qr))


@pytest.mark.parametrize("reservation, fact", [
    ("my-res", "projects/{project}/locations/{zone}/reservations/{reservation}"),
    (f"projects/{PROJECT}/reservations/my-res", "projects/{project}/locations/{zone}/reservations/{reservation}"),
    (f"{parent_of('us-east5-a')}/reservations/my-res", "us-east5-a"),
    (f"{PARENT}/reservations/My_Res", "projects/{project}/locations/{zone}/reservations/{reservation}"),
])
def test_a_malformed_or_foreign_reservation_is_invalid(client, reservation, fact):
    with pytest.raises(gexc.InvalidArgument) as info:
        _reserved(client, reservation)
    assert fact in info.value.message and reservation in info.value.message


def test_spot_cannot_consume_a_reservation():
    with Emulator(reservations={f"{ZONE}/my-res": 64}) as emu:
        with pytest.raises(gexc.InvalidArgument) as info:
            _reserved(emu.client(), f"{PARENT}/reservations/my-res", spot=True)
        assert "spot" in info.value.message


def test_a_reservation_the_project_does_not_hold_is_not_found(client):
    with pytest.raises(gexc.NotFound) as info:
        _reserved(client, f"{PARENT}/reservations/my-res")
    assert f"{PARENT}/reservations/my-res" in info.value.message


def test_a_reservation_smaller_than_the_request_fails_with_insufficient_reserved_capacity():
    with Emulator(reservations={f"{ZONE}/small": 8, f"{ZONE}/big": 64}) as emu:
        client = emu.client()
        _reserved(client, f"{PARENT}/reservations/small").result()
        emu.clock.advance(sc.CREATING_S + sc.ACCEPTED_S + sc.STOCKOUT_WAIT_S)
        failed = client.get_queued_resource(name=f"{PARENT}/queuedResources/moe-demo").state
        assert failed.state.name == "FAILED"
        # Confirmed message (docs/api-facts.md, skypilot-org/skypilot#4579).
        assert (failed.failed_data.error.code, failed.failed_data.error.message) == (
            9, "Insufficient reserved capacity. Contact customer support to increase your reservation.")
        client.delete_queued_resource(request=tpu_v2.DeleteQueuedResourceRequest(
            name=f"{PARENT}/queuedResources/moe-demo", force=True))
        emu.clock.advance(120)
        _reserved(client, f"{PARENT}/reservations/big").result()
        emu.clock.advance(3600)
        assert client.get_queued_resource(name=f"{PARENT}/queuedResources/moe-demo").state.state.name == "ACTIVE"


def test_reservations_come_from_the_environment(monkeypatch):
    assert parse_reservations(" us-west4-a/my-res=64, us-east5-b/r2=8 ") == {"us-west4-a/my-res": 64,
                                                                             "us-east5-b/r2": 8}
    with pytest.raises(ValueError, match="ZONE/NAME=CHIPS"):
        parse_reservations("my-res=64")
    monkeypatch.setenv(RES_ENV, f"{ZONE}/my-res=16")
    with Emulator() as emu:
        _reserved(emu.client(), f"{PARENT}/reservations/my-res").result()
    monkeypatch.delenv(RES_ENV)
    with Emulator() as emu, pytest.raises(gexc.NotFound):
        _reserved(emu.client(), f"{PARENT}/reservations/my-res")


# --- 3. expiry is recognised by what the resource says ----------------------------------------

def test_expiry_is_recognised_by_state_initiator_and_times_not_by_code():
    with Emulator(scenario="long-queue", reservations={}) as emu:
        client = emu.client()
        qr = queued_resource()
        qr.queueing_policy.valid_until_duration = {"seconds": 1800}
        client.create_queued_resource(request=tpu_v2.CreateQueuedResourceRequest(
            parent=PARENT, queued_resource_id="moe-demo", queued_resource=qr)).result()
        name = f"{PARENT}/queuedResources/moe-demo"
        emu.clock.advance(1800)
        assert client.get_queued_resource(name=name).state.state.name == "SUSPENDING"
        emu.clock.advance(sc.SUSPENDING_S)
        got = client.get_queued_resource(name=name)
        assert got.state.failed_data.error.code not in slices.STOCKOUT_CODES  # 13: no code says "expired"
        assert slices.expired(got, emu.clock.now())
        assert not slices.expired(got, got.create_time.timestamp() + 1799)
    with Emulator(scenario="stockout", reservations={}) as emu:  # FAILED, but not by expiry
        client = emu.client()
        create(client).result()
        emu.clock.advance(3600)
        got = client.get_queued_resource(name=f"{PARENT}/queuedResources/moe-demo")
        assert got.state.state.name == "FAILED" and not slices.expired(got, emu.clock.now())


# --- the tool: validate and dry runs ------------------------------------------------------------

def _config(tmp_path: Path, **slice_keys) -> Path:
    cfg = yaml.safe_load((ROOT / "examples" / "v5e-64.yaml").read_text())
    cfg["slice"].update(slice_keys)
    path = tmp_path / "moe-tpu.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("runtime", V5E_RUNTIMES)
def test_validate_accepts_every_v5e_runtime_version(tmp_path, runtime):
    code, out, err = invoke("validate", "-c", str(_config(tmp_path, runtime_version=runtime)))
    assert code == 0, out + err


@pytest.mark.parametrize("reservation", ["My_Res", "projects/p/reservations/r", "r" * 64])
def test_validate_rejects_a_malformed_reservation_naming_the_key(tmp_path, reservation):
    path = _config(tmp_path, capacity="reserved", reservation=reservation)
    code, out, err = invoke("validate", "-c", str(path))
    assert code == 2 and "slice.reservation" in out + err


def test_validate_rejects_a_run_name_that_is_not_a_resource_id(tmp_path):
    path = _config(tmp_path)
    cfg = yaml.safe_load(path.read_text())
    cfg["run"] = "Moe_Demo"
    path.write_text(yaml.safe_dump(cfg))
    code, out, err = invoke("validate", "-c", str(path))
    assert code == 2 and re.search(r"\brun\b", out + err)


def test_dry_run_reserved_without_the_reservation_fails_like_the_api(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = _config(tmp_path, capacity="reserved", reservation="my-res")
    code, out, err = invoke("--dry-run", "slice", "up", "-c", str(path), env={RES_ENV: None})
    assert code == 1
    assert "NOT_FOUND" in err and "reservations/my-res" in err and "Traceback" not in out + err


def test_dry_run_reserved_with_the_reservation_held_is_green(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = _config(tmp_path, capacity="reserved", reservation="my-res")
    code, out, err = invoke("--dry-run", "slice", "up", "-c", str(path), env={RES_ENV: "us-west4-a/my-res=64"})
    assert code == 0, out + err


# --- 5. the fidelity table ----------------------------------------------------------------------

def test_the_fidelity_table_names_every_emulator_validation_rule():
    table = (ROOT / "docs" / "emulator-fidelity.md").read_text()
    source = (ROOT / "provision" / "emulator" / "validate.py").read_text()
    rules = re.findall(r"^def (\w+)\(", source, re.M)
    assert rules
    missing = [r for r in rules if f"validate.{r}" not in table]
    assert not missing
    for rule in ("tpu_checks.check_reservation", "tpu_checks.check_node_specs", "tpu.create_node",
                 "tpu_checks.capacity", "scenarios.VALID_UNTIL_CODE", "offerings.types_in", "vertex."):
        assert rule in table
    for row in (line for line in table.splitlines() if line.startswith("| ") and "---" not in line):
        assert row.rstrip().endswith("|") and row.count("|") >= 4


def test_validate_rejects_a_full_reservation_name_for_zones_it_cannot_serve(tmp_path):
    path = _config(tmp_path, capacity="reserved",
                   reservation="projects/my-project/locations/us-east5-a/reservations/my-res")
    cfg = yaml.safe_load(path.read_text())
    cfg.update(region="us-east5", zones=["us-east5-a", "us-east5-b"])
    path.write_text(yaml.safe_dump(cfg))
    code, out, err = invoke("validate", "-c", str(path))
    assert code == 2 and "slice.reservation" in out + err and "us-east5-b" in out + err
    cfg["zones"] = ["us-east5-a"]
    path.write_text(yaml.safe_dump(cfg))
    code, out, err = invoke("validate", "-c", str(path))
    assert code == 0, out + err
