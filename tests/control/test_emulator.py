"""The emulator through the real google.cloud.tpu_v2.TpuClient: happy path, deletes, validation,
operations, persistence. No mocks: the generated client talks gRPC to 127.0.0.1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from google.api_core import exceptions as gexc
from google.cloud import tpu_v2
from google.longrunning import operations_pb2
from google.protobuf import duration_pb2

from provision.clock import SimClock
from provision.emulator import SCENARIOS, Emulator
from provision.emulator import scenarios as sc

PROJECT = "my-project"
ZONE = "us-west4-a"
PARENT = f"projects/{PROJECT}/locations/{ZONE}"
RUNTIME = "v2-alpha-tpuv5-lite"
QRState = tpu_v2.QueuedResourceState.State


def queued_resource(parent: str = PARENT, node_id: str | None = "moe-demo", accelerator: str = "v5litepod-16",
                    runtime: str = RUNTIME, spot: bool = True, count: int = 1,
                    labels: dict[str, str] | None = None,
                    metadata: dict[str, str] | None = None) -> tpu_v2.QueuedResource:
    """A queued resource request like the lifecycle sends: one node, or `count` for multislice."""
    node = tpu_v2.Node(accelerator_type=accelerator, runtime_version=runtime,
                       labels=labels if labels is not None else {"moe-tpu-run": "moe-demo"},
                       metadata=metadata if metadata is not None else {"startup-script": "echo hi"})
    spec = tpu_v2.QueuedResource.Tpu.NodeSpec(parent=parent, node=node)
    if count > 1:
        spec.multislice_params = tpu_v2.QueuedResource.Tpu.NodeSpec.MultisliceParams(
            node_count=count, node_id_prefix=node_id or "")
    elif node_id is not None:
        spec.node_id = node_id
    qr = tpu_v2.QueuedResource(tpu=tpu_v2.QueuedResource.Tpu(node_spec=[spec]))
    if spot:
        qr.spot = tpu_v2.QueuedResource.Spot()
    return qr


def create(client, qr_id: str = "moe-demo", parent: str = PARENT, request_id: str = "", **kwargs):
    request = tpu_v2.CreateQueuedResourceRequest(parent=parent, queued_resource_id=qr_id,
                                                 queued_resource=queued_resource(parent=parent, **kwargs),
                                                 request_id=request_id)
    return client.create_queued_resource(request=request)


def state(client, qr_id: str = "moe-demo", parent: str = PARENT) -> str:
    return client.get_queued_resource(name=f"{parent}/queuedResources/{qr_id}").state.state.name


def nodes(client, parent: str = PARENT) -> list[tuple[str, str]]:
    return [(n.name.rsplit("/", 1)[-1], n.state.name) for n in client.list_nodes(parent=parent)]


def delete(client, qr_id: str = "moe-demo", force: bool = True, parent: str = PARENT):
    return client.delete_queued_resource(request=tpu_v2.DeleteQueuedResourceRequest(
        name=f"{parent}/queuedResources/{qr_id}", force=force))


@pytest.fixture
def emu():
    with Emulator(scenario="happy") as emulator:
        yield emulator


@pytest.fixture
def client(emu):
    return emu.client()


def states_over_time(emu, client, checkpoints: list[float], qr_id: str = "moe-demo") -> list[str]:
    """The state at each of `checkpoints` (seconds after now), advancing the simulated clock."""
    start = emu.clock.now()
    seen = []
    for t in checkpoints:
        emu.clock.advance(start + t - emu.clock.now())
        seen.append(state(client, qr_id))
    return seen


# --- happy path -----------------------------------------------------------------------


def test_happy_spot_goes_through_every_state_and_nodes_become_ready(emu, client):
    operation = create(client)
    result = operation.result()
    assert result.name == f"{PARENT}/queuedResources/moe-demo"
    assert result.state.state == QRState.CREATING
    wait_end = sc.CREATING_S + sc.ACCEPTED_S + sc.WAIT_SPOT_S
    checkpoints = [0, sc.CREATING_S, sc.CREATING_S + sc.ACCEPTED_S, wait_end - 1, wait_end,
                   wait_end + sc.PROVISIONING_S - 1, wait_end + sc.PROVISIONING_S, 10 * 3600]
    assert states_over_time(emu, client, checkpoints) == [
        "CREATING", "ACCEPTED", "WAITING_FOR_RESOURCES", "WAITING_FOR_RESOURCES", "PROVISIONING",
        "PROVISIONING", "ACTIVE", "ACTIVE"]
    node = client.get_node(name=f"{PARENT}/nodes/moe-demo")
    assert node.state == tpu_v2.Node.State.READY
    assert node.health == tpu_v2.Node.Health.HEALTHY
    assert node.api_version == tpu_v2.Node.ApiVersion.V2
    assert node.accelerator_type == "v5litepod-16"
    assert node.accelerator_config.type_ == tpu_v2.AcceleratorConfig.Type.V5LITE_POD
    assert node.accelerator_config.topology == "4x4"
    assert len(node.network_endpoints) == 4  # v5litepod-16: 4 VMs of 4 chips
    assert all(e.ip_address.startswith("10.") for e in node.network_endpoints)
    assert len({e.ip_address for e in node.network_endpoints}) == 4
    assert dict(node.labels) == {"moe-tpu-run": "moe-demo"}
    assert dict(node.metadata) == {"startup-script": "echo hi"}
    assert node.runtime_version == RUNTIME
    assert node.queued_resource == f"{PARENT}/queuedResources/moe-demo"
    assert node.scheduling_config.spot


def test_nodes_appear_creating_while_provisioning(emu, client):
    create(client, spot=False)
    emu.clock.advance(sc.CREATING_S + sc.ACCEPTED_S + sc.WAIT_ON_DEMAND_S - 1)
    assert state(client) == "WAITING_FOR_RESOURCES" and nodes(client) == []
    emu.clock.advance(1)
    assert state(client) == "PROVISIONING"
    assert nodes(client) == [("moe-demo", "CREATING")]
    assert list(client.get_node(name=f"{PARENT}/nodes/moe-demo").network_endpoints) == []
    emu.clock.advance(sc.PROVISIONING_S)
    assert nodes(client) == [("moe-demo", "READY")]


def test_ip_addresses_are_deterministic():
    addresses = []
    for _ in range(2):
        with Emulator() as emu:
            client = emu.client()
            create(client, accelerator="v5litepod-64")
            emu.clock.advance(3600)
            addresses.append([e.ip_address for e in client.get_node(name=f"{PARENT}/nodes/moe-demo")
                              .network_endpoints])
    assert addresses[0] == addresses[1] and len(addresses[0]) == 16


def test_list_filters_by_zone(emu, client):
    other = f"projects/{PROJECT}/locations/us-east5-a"
    create(client, "a")
    create(client, "b", parent=other)
    assert [q.name.rsplit("/", 1)[-1] for q in client.list_queued_resources(parent=PARENT)] == ["a"]
    assert [q.name.rsplit("/", 1)[-1] for q in client.list_queued_resources(parent=other)] == ["b"]


def test_list_pages_through_everything(emu, client):
    for i in range(5):
        create(client, f"qr-{i}", node_id=f"node-{i}")
    request = tpu_v2.ListQueuedResourcesRequest(parent=PARENT, page_size=2)
    pages = list(client.list_queued_resources(request=request).pages)
    assert [len(p.queued_resources) for p in pages] == [2, 2, 1]
    assert [q.name.rsplit("/", 1)[-1] for q in client.list_queued_resources(request=request)] == [
        f"qr-{i}" for i in range(5)]


def test_multislice_creates_count_nodes(emu, client):
    create(client, "ms", node_id="ms", count=3, accelerator="v5litepod-64")
    emu.clock.advance(3600)
    found = client.list_nodes(parent=PARENT)
    assert [(n.name.rsplit("/", 1)[-1], n.state.name, len(n.network_endpoints)) for n in found] == [
        ("ms-0", "READY", 16), ("ms-1", "READY", 16), ("ms-2", "READY", 16)]
    assert all(n.multislice_node for n in client.list_nodes(parent=PARENT))


def test_multislice_prefix_defaults_to_the_queued_resource_id(emu, client):
    create(client, "fleet", node_id=None, count=2)
    emu.clock.advance(3600)
    assert nodes(client) == [("fleet-0", "READY"), ("fleet-1", "READY")]


# --- deletes ---------------------------------------------------------------------------


def test_force_delete_is_an_operation_done_when_the_queued_resource_is_gone(emu, client):
    create(client)
    emu.clock.advance(3600)
    operation = delete(client)
    assert not operation.done()
    assert operation.metadata.verb == "delete"
    assert operation.metadata.target == f"{PARENT}/queuedResources/moe-demo"
    assert state(client) == "DELETING"
    assert nodes(client) == [("moe-demo", "DELETING")]
    emu.clock.advance(sc.DELETING_S - 1)
    assert not operation.done()
    emu.clock.advance(1)
    assert operation.result() is not None  # Empty
    with pytest.raises(gexc.NotFound):
        client.get_queued_resource(name=f"{PARENT}/queuedResources/moe-demo")
    assert nodes(client) == []
    assert list(client.list_queued_resources(parent=PARENT)) == []


def test_delete_without_force_while_nodes_exist_is_failed_precondition(emu, client):
    create(client)
    emu.clock.advance(3600)
    with pytest.raises(gexc.FailedPrecondition) as info:
        delete(client, force=False)
    assert "set force=true" in info.value.message
    assert state(client) == "ACTIVE"


@pytest.mark.parametrize("wait_s", [0.0, sc.CREATING_S, sc.CREATING_S + sc.ACCEPTED_S])
def test_delete_without_force_is_allowed_before_nodes_exist(emu, client, wait_s):
    create(client)
    emu.clock.advance(wait_s)
    operation = delete(client, force=False)
    emu.clock.advance(sc.DELETING_S)
    assert operation.done()


def test_delete_missing_is_not_found(client):
    with pytest.raises(gexc.NotFound) as info:
        delete(client, "nope")
    assert info.value.message == f"Resource '{PARENT}/queuedResources/nope' was not found"


def test_delete_twice_answers_the_running_delete(emu, client):
    create(client)
    first = delete(client)
    emu.clock.advance(10)
    second = delete(client)
    emu.clock.advance(sc.DELETING_S - 10)
    assert first.done() and second.done()


def test_the_name_is_free_again_once_deleted(emu, client):
    create(client)
    delete(client)
    emu.clock.advance(sc.DELETING_S)
    create(client).result()
    assert state(client) == "CREATING"


def test_delete_node_then_queued_resource_without_force(emu, client):
    create(client)
    emu.clock.advance(3600)
    operation = client.delete_node(name=f"{PARENT}/nodes/moe-demo")
    assert nodes(client) == [("moe-demo", "DELETING")]
    emu.clock.advance(sc.NODE_DELETING_S)
    assert operation.done() and nodes(client) == []
    delete(client, force=False)
    emu.clock.advance(sc.DELETING_S)
    assert list(client.list_queued_resources(parent=PARENT)) == []


def test_delete_node_while_its_queued_resource_is_deleting(emu, client):
    create(client)
    emu.clock.advance(3600)
    delete(client)
    emu.clock.advance(10)
    operation = client.delete_node(name=f"{PARENT}/nodes/moe-demo")
    emu.clock.advance(sc.DELETING_S - 10)
    assert operation.done() and nodes(client) == []


# --- operations --------------------------------------------------------------------------


def test_create_operation_polls_the_operations_service(emu, client):
    operation = create(client)
    assert operation.operation.done is False  # the create RPC answers with a started operation
    assert operation.operation.name.startswith(f"{PARENT}/operations/operation-")
    assert operation.metadata.verb == "create"
    assert operation.result().name == f"{PARENT}/queuedResources/moe-demo"  # one GetOperation
    ops = client.transport.operations_client
    listed = list(ops.list_operations(PARENT, ""))
    assert [o.name for o in listed] == [operation.operation.name]
    assert ops.get_operation(operation.operation.name).done
    ops.cancel_operation(operation.operation.name)
    ops.delete_operation(operation.operation.name)
    with pytest.raises(gexc.NotFound):
        ops.get_operation(operation.operation.name)


def test_wait_operation_waits_on_the_simulated_clock(emu, client):
    create(client)
    operation = delete(client)
    stub = client.transport.grpc_channel.unary_unary(
        "/google.longrunning.Operations/WaitOperation",
        request_serializer=operations_pb2.WaitOperationRequest.SerializeToString,
        response_deserializer=operations_pb2.Operation.FromString)
    start = emu.clock.now()
    partial = stub(operations_pb2.WaitOperationRequest(name=operation.operation.name,
                                                       timeout=duration_pb2.Duration(seconds=10)))
    assert not partial.done and emu.clock.now() == start + 10
    assert stub(operations_pb2.WaitOperationRequest(name=operation.operation.name)).done
    assert emu.clock.now() == start + sc.DELETING_S


# --- validation --------------------------------------------------------------------------


def test_unknown_accelerator_in_zone_has_the_api_message(client):
    with pytest.raises(gexc.InvalidArgument) as info:
        create(client, parent="projects/p/locations/us-central1-b", accelerator="v5litepod-8")
    assert info.value.message == (
        'Cloud TPU received a bad request. The requested accelerator configuration for accelerator type, '
        '"v5litepod-8", could not be found in the zonal accelerator configurations for "us-central1-b".; '
        "the accelerator v5litepod-8 was not found in zone us-central1-b")


def test_invalid_label_has_the_api_message(client):
    with pytest.raises(gexc.InvalidArgument) as info:
        create(client, labels={"run": "moe.demo"})
    assert info.value.message == (
        "resource labels are invalid: value \"moe.demo\" contains invalid character '.' at index 3 "
        'for key "run"')


def test_duplicate_is_already_exists(client):
    create(client)
    with pytest.raises(gexc.AlreadyExists) as info:
        create(client)
    assert info.value.message == f"Resource '{PARENT}/queuedResources/moe-demo' already exists"


def test_node_name_in_use_is_already_exists(client):
    create(client, "a", node_id="shared")
    with pytest.raises(gexc.AlreadyExists) as info:
        create(client, "b", node_id="shared")
    assert info.value.message == f"Resource '{PARENT}/nodes/shared' already exists"


@pytest.mark.parametrize("kwargs, fragment", [
    ({"accelerator": "v5litepod-3"}, 'accelerator type, "v5litepod-3"'),
    ({"runtime": "tpu-vm-tf-2.15.0"}, 'runtime version "tpu-vm-tf-2.15.0" is not supported'),
    ({"node_id": None}, "exactly one of node_id or multislice_params"),
    ({"node_id": "bad/id"}, "Invalid node_id"),
    ({"qr_id": "bad name"}, "Invalid queued_resource_id"),
    ({"qr_id": ""}, "Invalid queued_resource_id"),
    ({"labels": {"Run": "x"}}, "resource labels are invalid: key \"Run\" contains invalid character 'R'"),
    ({"labels": {"run": "x" * 64}}, "is longer than 63 characters"),
    ({"labels": {f"k{i}": "v" for i in range(65)}}, "65 labels; at most 64"),
    ({"metadata": {"startup-script": "x" * (256 * 1024 + 1)}}, 'metadata value for key "startup-script"'),
])
def test_invalid_requests_are_invalid_argument(client, kwargs, fragment):
    with pytest.raises(gexc.InvalidArgument) as info:
        create(client, **kwargs)
    assert fragment in info.value.message
    assert list(client.list_queued_resources(parent=PARENT)) == []


def test_node_id_and_multislice_are_a_oneof_and_a_multislice_needs_two_nodes(client):
    spec = tpu_v2.QueuedResource.Tpu.NodeSpec(parent=PARENT, node_id="x",
                                              node=tpu_v2.Node(accelerator_type="v5litepod-8",
                                                               runtime_version=RUNTIME))
    spec.multislice_params = tpu_v2.QueuedResource.Tpu.NodeSpec.MultisliceParams(node_count=1)
    assert not spec.node_id  # the proto cannot carry both: setting one clears the other
    qr = tpu_v2.QueuedResource(tpu=tpu_v2.QueuedResource.Tpu(node_spec=[spec]))
    with pytest.raises(gexc.InvalidArgument, match="node_count must be > 1, got 1"):
        client.create_queued_resource(request=tpu_v2.CreateQueuedResourceRequest(
            parent=PARENT, queued_resource_id="x", queued_resource=qr))


@pytest.mark.parametrize("parent, error", [
    ("projects/p/zones/us-west4-a", gexc.InvalidArgument),
    ("projects/p/locations/-", gexc.InvalidArgument),
    ("projects/p/locations/nowhere", gexc.PermissionDenied),
])
def test_bad_parent(client, parent, error):
    with pytest.raises(error):
        create(client, parent=parent)
    with pytest.raises(error):
        list(client.list_queued_resources(parent=parent))


def test_node_spec_parent_must_match(client):
    qr = queued_resource(parent="projects/p/locations/us-east5-a")
    with pytest.raises(gexc.InvalidArgument, match="must equal the request parent"):
        client.create_queued_resource(request=tpu_v2.CreateQueuedResourceRequest(
            parent=PARENT, queued_resource_id="x", queued_resource=qr))


def test_get_missing_is_not_found(client):
    with pytest.raises(gexc.NotFound):
        client.get_queued_resource(name=f"{PARENT}/queuedResources/none")
    with pytest.raises(gexc.NotFound):
        client.get_node(name=f"{PARENT}/nodes/none")
    with pytest.raises(gexc.InvalidArgument):
        client.get_queued_resource(name="queuedResources/none")


def test_same_request_id_returns_the_same_operation(emu, client):
    first = create(client, request_id="4f6c0e1e-1b1a-4c0a-9b7e-000000000001")
    again = create(client, request_id="4f6c0e1e-1b1a-4c0a-9b7e-000000000001")
    assert again.operation.name == first.operation.name
    assert len(list(client.list_queued_resources(parent=PARENT))) == 1
    with pytest.raises(gexc.AlreadyExists):
        create(client, request_id="4f6c0e1e-1b1a-4c0a-9b7e-000000000002")


def test_a_request_id_is_honoured_for_an_hour(emu, client):
    first = create(client, request_id="rid")
    emu.clock.advance(3600 - 1)
    assert create(client, request_id="rid").operation.name == first.operation.name
    emu.clock.advance(1)
    with pytest.raises(gexc.AlreadyExists):
        create(client, request_id="rid")


def test_a_request_id_replayed_after_its_resource_was_deleted_returns_the_old_operation(emu, client):
    first = create(client, request_id="rid")
    delete(client)
    emu.clock.advance(sc.DELETING_S)
    again = create(client, request_id="rid")
    assert again.operation.name == first.operation.name
    assert list(client.list_queued_resources(parent=PARENT)) == []


def test_unknown_scenario_names_the_valid_ones():
    with pytest.raises(ValueError) as info:
        Emulator(scenario="sunny")
    assert all(name in str(info.value) for name in SCENARIOS)
    assert SCENARIOS == ("happy", "stockout", "long-queue", "quota", "flaky", "preempt")


def test_unimplemented_methods(client):
    with pytest.raises(gexc.MethodNotImplemented):
        client.stop_node(request=tpu_v2.StopNodeRequest(name=f"{PARENT}/nodes/x"))


# --- catalogue, guest attributes -------------------------------------------------------


def test_accelerator_types_and_runtime_versions(client):
    types = {a.type_: a.accelerator_configs[0].topology for a in client.list_accelerator_types(parent=PARENT)}
    assert types["v5litepod-64"] == "8x8" and len(types) == 8
    one = client.get_accelerator_type(name=f"{PARENT}/acceleratorTypes/v5litepod-256")
    assert one.accelerator_configs[0].topology == "16x16"
    assert [v.version for v in client.list_runtime_versions(parent=PARENT)] == sorted(
        ["v2-alpha-tpuv5-lite", "v2-tpuv5-litepod", "tpu-ubuntu2204-base"])
    assert client.get_runtime_version(name=f"{PARENT}/runtimeVersions/{RUNTIME}").version == RUNTIME
    assert list(client.list_accelerator_types(parent="projects/p/locations/us-central1-b")) == []
    with pytest.raises(gexc.NotFound):
        client.get_accelerator_type(name=f"{PARENT}/acceleratorTypes/v4-8")


def test_guest_attributes_answer_only_what_the_guests_wrote(emu, client):
    create(client, accelerator="v5litepod-32")
    emu.clock.advance(3600)
    node = f"{PARENT}/nodes/moe-demo"

    def read(query_path: str = "", worker_ids: tuple[str, ...] = ()) -> list[dict[str, str]]:
        response = client.get_guest_attributes(request=tpu_v2.GetGuestAttributesRequest(
            name=node, query_path=query_path, worker_ids=list(worker_ids)))
        assert all(a.query_path == query_path for a in response.guest_attributes)
        return [{f"{e.namespace}/{e.key}": e.value for e in a.query_value.items} for a in response.guest_attributes]

    assert read() == [{}] * 8  # nothing invented: no guest wrote anything yet
    tpu = emu.service("tpu")
    tpu.set_guest_attributes(node, 3, "moe-tpu", {"state": "running", "step": 12, "loss": 2.5})
    tpu.set_guest_attributes(node, 3, "other", {"state": "x"})
    tpu.set_guest_attributes(node, 0, "moe-tpu", {"state": "starting"})
    tpu.set_guest_attributes(node, 3, "moe-tpu", {"step": 13})  # merged into what worker 3 wrote
    everything = read()
    assert len(everything) == 8
    assert everything[3] == {"moe-tpu/state": "running", "moe-tpu/step": "13", "moe-tpu/loss": "2.5",
                             "other/state": "x"}
    assert read("moe-tpu/")[3] == {"moe-tpu/state": "running", "moe-tpu/step": "13", "moe-tpu/loss": "2.5"}
    assert read("moe-tpu/state") == [{"moe-tpu/state": "starting"}] + [{}] * 2 + [{"moe-tpu/state": "running"}] + [
        {}] * 4
    assert read("moe-tpu/state", worker_ids=("3",)) == [{"moe-tpu/state": "running"}]
    with pytest.raises(gexc.InvalidArgument):
        read("moe-tpu/state", worker_ids=("8",))
    with pytest.raises(gexc.InvalidArgument):
        read("a/b/c")


def test_guest_attributes_are_checked_and_go_with_the_node(tmp_path):
    from provision.emulator.world import WorldError

    path = tmp_path / "emulator.json"
    with Emulator(state_path=path) as emu:
        client, tpu = emu.client(), emu.service("tpu")
        node = f"{PARENT}/nodes/moe-demo"
        create(client)  # v5litepod-16: workers 0 to 3
        with pytest.raises(WorldError, match="no TPU node"):
            tpu.set_guest_attributes(node, 0, "moe-tpu", {"state": "running"})
        emu.clock.advance(3600)
        for worker, namespace, values, message in [
                (4, "moe-tpu", {"state": "x"}, "workers 0 to 3, not 4"),
                (0, "moe tpu", {"state": "x"}, "namespace 'moe tpu'"),
                (0, "moe-tpu", {"a/b": "x"}, "key 'a/b'"),
                (0, "moe-tpu", {"state": None}, "a string or a number")]:
            with pytest.raises(WorldError, match=message):
                tpu.set_guest_attributes(node, worker, namespace, values)
        tpu.set_guest_attributes(node, 1, "moe-tpu", {"state": "running"})
    with Emulator(state_path=path) as emu:  # persisted
        client = emu.client()
        response = client.get_guest_attributes(request=tpu_v2.GetGuestAttributesRequest(name=node))
        assert [len(a.query_value.items) for a in response.guest_attributes] == [0, 1, 0, 0]
        delete(client)
        emu.clock.advance(sc.DELETING_S)
        create(client).result()  # the same node name again: a new node, no attributes
        emu.clock.advance(3600)
        response = client.get_guest_attributes(request=tpu_v2.GetGuestAttributesRequest(name=node))
        assert [len(a.query_value.items) for a in response.guest_attributes] == [0, 0, 0, 0]


# --- persistence ------------------------------------------------------------------------


def test_state_persists_across_emulator_restarts(tmp_path: Path):
    path = tmp_path / "emulator.json"
    with Emulator(state_path=path) as emu:
        create(emu.client())
        emu.clock.advance(3600)
        assert state(emu.client()) == "ACTIVE"
        saved_at = emu.clock.now()
    clock = SimClock()
    with Emulator(state_path=path, clock=clock) as emu:
        assert clock.now() == saved_at  # the world's time comes back with it
        client = emu.client()
        assert state(client) == "ACTIVE"
        assert nodes(client) == [("moe-demo", "READY")]
        operation = delete(client)
        clock.advance(sc.DELETING_S)
        assert operation.done()
    with Emulator(state_path=path) as emu:
        assert list(emu.client().list_queued_resources(parent=PARENT)) == []


def test_every_mutation_is_saved_before_the_answer(tmp_path: Path):
    """A command killed right after `create` (no stop, no save on exit) leaves a world `down` can clean."""
    path = tmp_path / "emulator.json"
    killed = Emulator(state_path=path)
    killed.start()
    create(killed.client())
    document = json.loads(path.read_text())  # complete JSON at once
    assert [q["name"] for q in document["tpu"]["queued_resources"]] == [f"{PARENT}/queuedResources/moe-demo"]
    with Emulator(state_path=path) as emu:
        client = emu.client()
        assert state(client) == "CREATING"
        operation = delete(client)
        emu.clock.advance(sc.DELETING_S)
        assert operation.done()
        assert list(client.list_queued_resources(parent=PARENT)) == []
    assert json.loads(path.read_text())["tpu"]["queued_resources"] == []
    assert not list(tmp_path.glob(".emulator-*"))
    killed.stop()


def test_a_corrupt_state_file_is_a_usage_error(tmp_path: Path):
    from provision.errors import UsageError

    path = tmp_path / "emulator.json"
    path.write_text("{not json")
    with pytest.raises(UsageError, match="cannot read the emulator state") as info:
        Emulator(state_path=path).start()
    assert info.value.hint == f"delete {path} to start a fresh emulated world"


# --- the network -----------------------------------------------------------------------


def test_bound_to_loopback_only(emu):
    assert emu.address == f"127.0.0.1:{emu.port}"
    listening = _listening_addresses(emu.port)
    if listening is None:
        pytest.skip("no /proc/net/tcp here")
    assert listening == {"127.0.0.1"}
    with pytest.raises(ValueError, match="loopback"):
        Emulator().start(host="0.0.0.0")
    with pytest.raises(RuntimeError, match="already serving"):
        emu.start()


def _listening_addresses(port: int) -> set[str] | None:
    """Local addresses with a listening TCP socket on `port`, from /proc/net/tcp{,6}."""
    import socket
    import struct

    found: set[str] = set()
    any_table = False
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        any_table = True
        for line in lines:
            local, state_hex = line.split()[1], line.split()[3]
            address_hex, port_hex = local.split(":")
            if state_hex != "0A" or int(port_hex, 16) != port:
                continue
            raw = bytes.fromhex(address_hex)
            words = b"".join(struct.pack("<I", struct.unpack(">I", raw[i:i + 4])[0]) for i in range(0, len(raw), 4))
            address = socket.inet_ntop(family, words)
            found.add(address.removeprefix("::ffff:"))  # a v4-mapped dual-stack socket
    return found if any_table else None
