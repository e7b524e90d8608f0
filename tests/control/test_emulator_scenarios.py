"""Every emulator scenario through the real google.cloud.tpu_v2.TpuClient (no mocks)."""

from __future__ import annotations

import pytest
from google.api_core import exceptions as gexc
from google.cloud import tpu_v2
from google.rpc import error_details_pb2

from provision.emulator import Emulator
from provision.emulator import scenarios as sc

PROJECT = "my-project"
ZONE_A = "us-west4-a"
ZONE_B = "us-east5-a"
RUNTIME = "v2-alpha-tpuv5-lite"


def parent(zone: str = ZONE_A) -> str:
    return f"projects/{PROJECT}/locations/{zone}"


def request(zone: str = ZONE_A, qr_id: str = "moe-demo", spot: bool = True, request_id: str = "",
            accelerator: str = "v5litepod-64") -> tpu_v2.CreateQueuedResourceRequest:
    node = tpu_v2.Node(accelerator_type=accelerator, runtime_version=RUNTIME, labels={"moe-tpu-run": qr_id})
    spec = tpu_v2.QueuedResource.Tpu.NodeSpec(parent=parent(zone), node_id=qr_id, node=node)
    qr = tpu_v2.QueuedResource(tpu=tpu_v2.QueuedResource.Tpu(node_spec=[spec]))
    if spot:
        qr.spot = tpu_v2.QueuedResource.Spot()
    return tpu_v2.CreateQueuedResourceRequest(parent=parent(zone), queued_resource_id=qr_id, queued_resource=qr,
                                              request_id=request_id)


def get(client, zone: str = ZONE_A, qr_id: str = "moe-demo") -> tpu_v2.QueuedResource:
    return client.get_queued_resource(name=f"{parent(zone)}/queuedResources/{qr_id}")


def node_states(client, zone: str = ZONE_A) -> list[str]:
    return [n.state.name for n in client.list_nodes(parent=parent(zone))]


HAPPY_ACTIVE_SPOT_S = sc.CREATING_S + sc.ACCEPTED_S + sc.WAIT_SPOT_S + sc.PROVISIONING_S


# --- stockout ---------------------------------------------------------------------------------


def test_stockout_fails_the_first_zone_with_code_8_and_the_second_zone_works():
    with Emulator(scenario="stockout") as emu:
        client = emu.client()
        client.create_queued_resource(request=request(ZONE_A)).result()
        emu.clock.advance(sc.CREATING_S + sc.ACCEPTED_S + sc.STOCKOUT_WAIT_S - 1)
        assert get(client).state.state.name == "WAITING_FOR_RESOURCES"
        emu.clock.advance(1)
        failed = get(client)
        assert failed.state.state.name == "FAILED"
        assert failed.state.state_initiator == tpu_v2.QueuedResourceState.StateInitiator.SERVICE
        assert failed.state.failed_data.error.code == 8
        assert failed.state.failed_data.error.message == (
            f'There is no more capacity in the zone "{ZONE_A}"; you can try in another zone where '
            "Cloud TPU Nodes are offered")
        assert node_states(client) == []

        client.create_queued_resource(request=request(ZONE_B)).result()
        emu.clock.advance(HAPPY_ACTIVE_SPOT_S)
        assert get(client, ZONE_B).state.state.name == "ACTIVE"
        assert node_states(client, ZONE_B) == ["READY"]

        # a FAILED queued resource can be deleted without force; it keeps counting until then
        operation = client.delete_queued_resource(request=tpu_v2.DeleteQueuedResourceRequest(
            name=failed.name, force=False))
        emu.clock.advance(sc.DELETING_S)
        assert operation.done()


def test_stockout_zone_stays_out_of_capacity_for_later_creates():
    with Emulator(scenario="stockout") as emu:
        client = emu.client()
        client.create_queued_resource(request=request(ZONE_A, "first")).result()
        client.create_queued_resource(request=request(ZONE_A, "second")).result()
        emu.clock.advance(3600)
        assert [get(client, qr_id=q).state.state.name for q in ("first", "second")] == ["FAILED", "FAILED"]


def test_a_failed_queued_resource_can_be_reset_but_a_stocked_out_zone_fails_again():
    with Emulator(scenario="stockout") as emu:
        client = emu.client()
        client.create_queued_resource(request=request(ZONE_A)).result()
        emu.clock.advance(3600)
        client.reset_queued_resource(request=tpu_v2.ResetQueuedResourceRequest(
            name=get(client).name)).result()
        assert get(client).state.state.name == "ACCEPTED"
        emu.clock.advance(3600)
        assert get(client).state.state.name == "FAILED"


# --- long queue --------------------------------------------------------------------------------


def test_long_queue_waits_hours_then_becomes_active():
    with Emulator(scenario="long-queue") as emu:
        client = emu.client()
        client.create_queued_resource(request=request()).result()
        emu.clock.advance(2 * 3600)
        assert get(client).state.state.name == "WAITING_FOR_RESOURCES"
        emu.clock.advance(sc.LONG_QUEUE_WAIT_S - 2 * 3600 + sc.CREATING_S + sc.ACCEPTED_S + sc.PROVISIONING_S)
        assert get(client).state.state.name == "ACTIVE"
        assert node_states(client) == ["READY"]


def test_valid_until_fails_a_request_still_queued():
    with Emulator(scenario="long-queue") as emu:
        client = emu.client()
        create = request()
        create.queued_resource.queueing_policy.valid_until_duration = {"seconds": 3600}
        client.create_queued_resource(request=create).result()
        emu.clock.advance(3600 - 1)
        assert get(client).state.state.name == "WAITING_FOR_RESOURCES"
        emu.clock.advance(1)
        suspending = get(client).state
        assert (suspending.state.name, suspending.state_initiator.name) == ("SUSPENDING", "SERVICE")
        assert node_states(client) == []  # never provisioned: no node
        emu.clock.advance(sc.SUSPENDING_S)
        failed = get(client).state
        assert (failed.state.name, failed.state_initiator.name) == ("FAILED", "SERVICE")
        assert failed.failed_data.error.code == sc.VALID_UNTIL_CODE == 13


# --- quota -------------------------------------------------------------------------------------


@pytest.mark.parametrize("spot, quota_id", [
    (True, "TPUV5sPreemptibleLitepodPerProjectPerZoneForTPUAPI"),
    (False, "TPUV5sLitepodPerProjectPerZoneForTPUAPI"),
])
def test_quota_is_resource_exhausted_at_once_with_a_quota_failure(spot, quota_id):
    with Emulator(scenario="quota") as emu:
        client = emu.client()
        with pytest.raises(gexc.ResourceExhausted) as info:
            client.create_queued_resource(request=request(spot=spot))
        message = f"Quota limit '{quota_id}' has been exceeded. Limit: 0 in zone {ZONE_A}."
        assert info.value.message == message
        failures = [d for d in info.value.details if isinstance(d, error_details_pb2.QuotaFailure)]
        assert len(failures) == 1
        violation = failures[0].violations[0]
        assert violation.description == message
        assert violation.quota_id == quota_id
        assert dict(violation.quota_dimensions) == {"zone": ZONE_A}
        assert list(client.list_queued_resources(parent=parent())) == []


def test_quota_still_validates_first():
    with Emulator(scenario="quota") as emu, pytest.raises(gexc.InvalidArgument):
        emu.client().create_queued_resource(request=request(accelerator="v5litepod-3"))


# --- flaky -------------------------------------------------------------------------------------


def _outcomes(emu, n: int) -> list[bool]:
    """True where a GetAcceleratorType answered, False where it was UNAVAILABLE."""
    client = emu.client()
    seen = []
    for _ in range(n):
        try:
            client.get_accelerator_type(name=f"{parent()}/acceleratorTypes/v5litepod-8")
            seen.append(True)
        except gexc.ServiceUnavailable as exc:
            assert exc.message == "The service is currently unavailable."
            seen.append(False)
    return seen


def test_flaky_fails_a_deterministic_share_of_rpcs_never_three_in_a_row():
    with Emulator(scenario="flaky", seed=7) as emu:
        seen = _outcomes(emu, 400)
    share = seen.count(False) / len(seen)
    assert 0.2 <= share <= 0.35
    assert "FFF" not in "".join("T" if ok else "F" for ok in seen)
    with Emulator(scenario="flaky", seed=7) as emu:
        assert _outcomes(emu, 400) == seen
    with Emulator(scenario="flaky", seed=8) as emu:
        assert _outcomes(emu, 400) != seen


def test_flaky_create_is_applied_but_its_answer_lost():
    with Emulator(scenario="flaky") as emu:
        client = emu.client()
        with pytest.raises(gexc.ServiceUnavailable):
            client.create_queued_resource(request=request())
        # the create went through: a retry without the request id finds it
        for _ in range(sc.FLAKY_MAX_IN_A_ROW + 1):
            try:
                client.create_queued_resource(request=request())
            except gexc.ServiceUnavailable:
                continue
            except gexc.AlreadyExists as exc:
                assert exc.message == f"Resource '{parent()}/queuedResources/moe-demo' already exists"
                break
        else:
            pytest.fail("the retries never got an answer")


def test_flaky_lost_create_retried_with_its_request_id_gets_the_same_operation():
    with Emulator(scenario="flaky") as emu:
        client = emu.client()
        with pytest.raises(gexc.ServiceUnavailable):
            client.create_queued_resource(request=request(request_id="rid-1"))
        for _ in range(sc.FLAKY_MAX_IN_A_ROW + 1):
            try:
                operation = client.create_queued_resource(request=request(request_id="rid-1"))
                break
            except gexc.ServiceUnavailable:
                continue
        else:
            pytest.fail("the retries never got an answer")
        assert operation.metadata.target == f"{parent()}/queuedResources/moe-demo"


# --- preempt -----------------------------------------------------------------------------------


def test_preempt_suspends_a_spot_slice_after_it_was_ready():
    with Emulator(scenario="preempt") as emu:
        client = emu.client()
        client.create_queued_resource(request=request(spot=True)).result()
        emu.clock.advance(HAPPY_ACTIVE_SPOT_S)
        assert get(client).state.state.name == "ACTIVE" and node_states(client) == ["READY"]
        emu.clock.advance(sc.PREEMPT_AFTER_ACTIVE_S)
        suspending = get(client).state
        assert suspending.state.name == "SUSPENDING"
        assert suspending.state_initiator == tpu_v2.QueuedResourceState.StateInitiator.SERVICE
        assert node_states(client) == ["PREEMPTED"]
        emu.clock.advance(sc.SUSPENDING_S)
        suspended = get(client)
        assert suspended.state.state.name == "SUSPENDED"
        assert suspended.state.state_initiator == tpu_v2.QueuedResourceState.StateInitiator.SERVICE
        assert node_states(client) == []
        with pytest.raises(gexc.FailedPrecondition, match="delete it and create it again"):
            client.reset_queued_resource(request=tpu_v2.ResetQueuedResourceRequest(name=suspended.name))
        operation = client.delete_queued_resource(request=tpu_v2.DeleteQueuedResourceRequest(
            name=suspended.name, force=False))
        emu.clock.advance(sc.DELETING_S)
        assert operation.done()


def test_preempt_leaves_on_demand_alone():
    with Emulator(scenario="preempt") as emu:
        client = emu.client()
        client.create_queued_resource(request=request(spot=False)).result()
        emu.clock.advance(24 * 3600)
        assert get(client).state.state.name == "ACTIVE" and node_states(client) == ["READY"]


def test_spot_via_scheduling_config_counts_as_spot():
    with Emulator(scenario="preempt") as emu:
        client = emu.client()
        create = request(spot=False)
        create.queued_resource.tpu.node_spec[0].node.scheduling_config.spot = True
        client.create_queued_resource(request=create).result()
        emu.clock.advance(HAPPY_ACTIVE_SPOT_S + sc.PREEMPT_AFTER_ACTIVE_S + sc.SUSPENDING_S)
        assert get(client).state.state.name == "SUSPENDED"


# --- scenarios are per command; the world persists -----------------------------------------------


def test_a_world_created_under_one_scenario_keeps_its_timelines_under_another(tmp_path):
    path = tmp_path / "emulator.json"
    with Emulator(state_path=path, scenario="preempt") as emu:
        emu.client().create_queued_resource(request=request()).result()
    with Emulator(state_path=path, scenario="happy") as emu:
        emu.clock.advance(HAPPY_ACTIVE_SPOT_S + sc.PREEMPT_AFTER_ACTIVE_S + sc.SUSPENDING_S)
        assert get(emu.client()).state.state.name == "SUSPENDED"


def test_a_preempted_node_name_is_free_for_the_replacement():
    with Emulator(scenario="preempt") as emu:
        client = emu.client()
        client.create_queued_resource(request=request(qr_id="moe-demo")).result()
        emu.clock.advance(HAPPY_ACTIVE_SPOT_S + sc.PREEMPT_AFTER_ACTIVE_S)
        replacement = request(qr_id="moe-demo-r1")
        replacement.queued_resource.tpu.node_spec[0].node_id = "moe-demo"
        with pytest.raises(gexc.AlreadyExists):  # the preempted node is still there
            client.create_queued_resource(request=replacement)
        emu.clock.advance(sc.SUSPENDING_S)
        client.create_queued_resource(request=replacement).result()


def test_stockout_of_a_reservation_is_insufficient_reserved_capacity():
    with Emulator(scenario="stockout") as emu:
        client = emu.client()
        create = request(spot=False)
        create.queued_resource.guaranteed = tpu_v2.QueuedResource.Guaranteed()
        client.create_queued_resource(request=create).result()
        emu.clock.advance(3600)
        error = get(client).state.failed_data.error
        assert (error.code, error.message) == (
            9, "Insufficient reserved capacity. Contact customer support to increase your reservation.")
