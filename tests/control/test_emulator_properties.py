"""Invariants of the emulated world under random sequences of creates, deletes and waiting."""

from __future__ import annotations

import json

from google.cloud import tpu_v2
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from provision.emulator import operations, tpu
from provision.emulator.validate import ApiError
from provision.emulator.world import World

ZONES = ("us-west4-a", "us-east5-a")
IDS = ("a", "b", "c")
START = 1_767_225_600.0
# The order a queued resource moves through on its own (deletes aside).
ORDER = ("CREATING", "ACCEPTED", "WAITING_FOR_RESOURCES", "PROVISIONING", "ACTIVE", "SUSPENDING", "SUSPENDED")


def parent(zone: str) -> str:
    return f"projects/p/locations/{zone}"


def create_request(zone: str, qr_id: str, spot: bool, count: int) -> tpu_v2.CreateQueuedResourceRequest:
    node = tpu_v2.Node(accelerator_type="v5litepod-16", runtime_version="v2-alpha-tpuv5-lite")
    spec = tpu_v2.QueuedResource.Tpu.NodeSpec(parent=parent(zone), node=node)
    if count > 1:
        spec.multislice_params = tpu_v2.QueuedResource.Tpu.NodeSpec.MultisliceParams(node_count=count)
    else:
        spec.node_id = qr_id
    qr = tpu_v2.QueuedResource(tpu=tpu_v2.QueuedResource.Tpu(node_spec=[spec]))
    if spot:
        qr.spot = tpu_v2.QueuedResource.Spot()
    return tpu_v2.CreateQueuedResourceRequest(parent=parent(zone), queued_resource_id=qr_id, queued_resource=qr)


actions = st.lists(st.one_of(
    st.tuples(st.just("create"), st.sampled_from(ZONES), st.sampled_from(IDS), st.booleans(),
              st.integers(1, 3), st.sampled_from(("happy", "stockout", "long-queue", "preempt"))),
    st.tuples(st.just("delete"), st.sampled_from(ZONES), st.sampled_from(IDS), st.booleans()),
    st.tuples(st.just("delete_node"), st.sampled_from(ZONES), st.sampled_from(IDS)),
    st.tuples(st.just("wait"), st.floats(0, 4 * 3600)),
), max_size=15)


def snapshot(world: World, now: float) -> dict:
    """Everything a client could read: queued resources, nodes and operations, as JSON."""
    out = {}
    for rec in world.queued.values():
        if rec.state_at(now) is None:
            continue
        out[rec.name] = tpu_v2.QueuedResource.to_json(tpu.queued_view(rec, now))
        for node, index in rec.nodes:
            if rec.node_state_at(node, now) is not None:
                out[node] = tpu_v2.Node.to_json(tpu.node_view(rec, node, index, now))
    for op in world.operations.values():
        out[op.name] = str(operations.view(op, now))
    return out


def apply(world: World, action: tuple, now: float) -> float:
    kind = action[0]
    try:
        if kind == "create":
            _, zone, qr_id, spot, count, scenario = action
            tpu.create_queued_resource(world, create_request(zone, qr_id, spot, count), now, scenario)
        elif kind == "delete":
            _, zone, qr_id, force = action
            tpu.delete_queued_resource(world, tpu_v2.DeleteQueuedResourceRequest(
                name=f"{parent(zone)}/queuedResources/{qr_id}", force=force), now)
        elif kind == "delete_node":
            _, zone, qr_id = action
            tpu.delete_node(world, f"{parent(zone)}/nodes/{qr_id}", now)
        else:
            return now + action[1]
    except ApiError as error:
        assert error.code in ("ALREADY_EXISTS", "NOT_FOUND", "FAILED_PRECONDITION"), error
    return now


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(actions)
def test_world_invariants(steps):
    world = World()
    now = START
    last_state: dict[str, str] = {}
    for action in steps:
        now = apply(world, action, now)
        world.prune(now)
        # 1. a save and load changes nothing a client can see, now or later
        reloaded = World.from_json(json.loads(json.dumps(world.to_json(now))))
        for later in (now, now + 600, now + 10 * 3600):
            assert snapshot(reloaded, later) == snapshot(world, later)
        live_nodes = []
        for rec in world.queued.values():
            state = rec.state_at(now)
            # 2. left alone, a queued resource only moves forward (FAILED and DELETING end it)
            previous = last_state.get(rec.name + str(rec.create_time))
            if previous in ORDER and state in ORDER:
                assert ORDER.index(state) >= ORDER.index(previous)
            last_state[rec.name + str(rec.create_time)] = state
            for node, _ in rec.nodes:
                node_state = rec.node_state_at(node, now)
                if node_state is not None:
                    live_nodes.append(node)
                # 3. nodes are READY only while their queued resource is ACTIVE
                if node_state == "READY":
                    assert state == "ACTIVE"
        # 4. node names are unique among live nodes
        assert len(live_nodes) == len(set(live_nodes))


def test_a_services_part_of_the_world_is_its_own_and_kept_whether_or_not_its_module_is_loaded():
    """The world names no service beside the TPU API: each registers its part, found by its key, saved under
    it; a saved part of a service that no module registered (here `elsewhere`) is written back as it was."""
    from provision.emulator.gke_world import GkeWorld
    from provision.emulator.vertex_world import CustomJobs, JobRecord
    from provision.emulator.scenarios import Timeline
    from provision.emulator.world import PARTS

    assert {PARTS["gke"], PARTS["vertex"]} == {GkeWorld, CustomJobs}
    world = World()
    jobs = CustomJobs.of(world)
    jobs.jobs["j"] = JobRecord(name="j", request={}, create_time=START, timeline=Timeline(((0.0, "JOB_STATE_QUEUED"),)))
    jobs.first_region = "us-east5"
    saved = {**world.to_json(START), "elsewhere": {"records": [1, 2]}}
    reloaded = World.from_json(json.loads(json.dumps(saved)))
    assert CustomJobs.of(reloaded).first_region == "us-east5" and list(CustomJobs.of(reloaded).jobs) == ["j"]
    assert isinstance(reloaded.part("gke"), GkeWorld)
    assert reloaded.to_json(START)["elsewhere"] == {"records": [1, 2]}
