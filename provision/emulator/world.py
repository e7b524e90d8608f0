"""The emulated Cloud TPU world: queued resources, their nodes, operations. No gRPC here.

Records hold what was asked and when; every state is computed from the clock when read
(`state_at`), so the world only changes on create/delete/reset and persists as JSON.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from google.cloud import tpu_v2
from google.longrunning import operations_pb2
from google.protobuf import any_pb2, empty_pb2, timestamp_pb2
from google.rpc import error_details_pb2, status_pb2

from provision.catalogue import ACCELERATORS, V5E_ZONES
from provision.emulator import validate
from provision.emulator.scenarios import DELETING_S, NODE_DELETING_S, Timeline, timeline
from provision.emulator.validate import ApiError

QR = tpu_v2.QueuedResource
QRState = tpu_v2.QueuedResourceState
Node = tpu_v2.Node

NODE_STATE_BY_QR_STATE = {"PROVISIONING": "CREATING", "ACTIVE": "READY", "SUSPENDING": "PREEMPTED"}
STATE_DATA_FIELD = {
    "CREATING": "creating_data", "ACCEPTED": "accepted_data", "PROVISIONING": "provisioning_data",
    "FAILED": "failed_data", "DELETING": "deleting_data", "ACTIVE": "active_data",
    "SUSPENDING": "suspending_data", "SUSPENDED": "suspended_data",
}
SERVICE_INITIATED = ("FAILED", "SUSPENDING", "SUSPENDED")
DELETABLE_WITH_NODES = ("ACCEPTED", "FAILED", "SUSPENDED")
PENDING_STATES = ("CREATING", "ACCEPTED", "WAITING_FOR_RESOURCES")
TPU_PORT = 8470
# Unconfirmed for the TPU API: Google APIs commonly honour a request_id for at least 60 minutes.
REQUEST_ID_TTL_S = 3600.0
STATE_VERSION = 1


def timestamp(t: float) -> timestamp_pb2.Timestamp:
    ts = timestamp_pb2.Timestamp()
    ts.FromNanoseconds(round(t * 1e9))
    return ts


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


def not_found(name: str) -> ApiError:
    return ApiError("NOT_FOUND", f"Resource '{name}' was not found")


@dataclass
class QueuedRecord:
    """One queued resource as created, plus the deletes applied to it."""

    name: str
    request: dict  # the QueuedResource as submitted (proto JSON)
    create_time: float
    timeline: Timeline
    nodes: list[tuple[str, int]]  # (node name, index of its node_spec)
    multislice: bool
    deleted_at: float | None = None
    node_deleted_at: dict[str, float] = field(default_factory=dict)

    def state_at(self, now: float) -> str | None:
        """The queued resource's state at `now`; None once it is gone."""
        if self.deleted_at is not None and now >= self.deleted_at:
            return None if now >= self.deleted_at + DELETING_S else "DELETING"
        return self.timeline.state_at(now - self.create_time)

    def node_state_at(self, node: str, now: float) -> str | None:
        """A node's state at `now`, derived from the queued resource's; None when absent."""
        t_del = self.node_deleted_at.get(node)
        state = self.state_at(now)
        if state is None or (t_del is not None and now >= t_del + NODE_DELETING_S):
            return None
        if state == "DELETING":
            before = self.timeline.state_at(self.deleted_at - self.create_time)
            gone_before = t_del is not None and t_del + NODE_DELETING_S <= self.deleted_at
            return "DELETING" if before in NODE_STATE_BY_QR_STATE and not gone_before else None
        if t_del is not None and now >= t_del:
            return "DELETING"
        return NODE_STATE_BY_QR_STATE.get(state)

    def live_nodes(self, now: float) -> list[str]:
        return [n for n, _ in self.nodes if self.node_state_at(n, now) is not None]

    def to_json(self) -> dict:
        return {"name": self.name, "request": self.request, "create_time": self.create_time,
                "timeline": self.timeline.to_json(), "nodes": [list(n) for n in self.nodes],
                "multislice": self.multislice, "deleted_at": self.deleted_at,
                "node_deleted_at": self.node_deleted_at}

    @classmethod
    def from_json(cls, d: dict) -> QueuedRecord:
        return cls(name=d["name"], request=d["request"], create_time=float(d["create_time"]),
                   timeline=Timeline.from_json(d["timeline"]),
                   nodes=[(str(n), int(i)) for n, i in d["nodes"]], multislice=bool(d["multislice"]),
                   deleted_at=d.get("deleted_at"), node_deleted_at=dict(d.get("node_deleted_at", {})))


class World:
    """Everything the emulator knows; mutated only under the emulator's lock."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.queued: dict[str, QueuedRecord] = {}
        self.operations: dict[str, dict[str, Any]] = {}
        self.request_ids: dict[str, str] = {}
        self.first_zone: str | None = None
        self.op_counter = 0
        # flaky bookkeeping, persisted so a sequence of commands stays deterministic
        self.rpc_count = 0
        self.failures_in_a_row = 0
        self.lost_creates = 0

    # --- persistence -------------------------------------------------------
    def to_json(self, now: float) -> dict:
        return {"version": STATE_VERSION, "now": now, "seed": self.seed,
                "queued_resources": [r.to_json() for r in self.queued.values()],
                "operations": list(self.operations.values()), "request_ids": self.request_ids,
                "first_zone": self.first_zone, "op_counter": self.op_counter,
                "rpc_count": self.rpc_count, "failures_in_a_row": self.failures_in_a_row,
                "lost_creates": self.lost_creates}

    @classmethod
    def from_json(cls, d: dict) -> World:
        if d.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported emulator state version {d.get('version')!r}")
        world = cls(seed=int(d.get("seed", 0)))
        world.queued = {r["name"]: QueuedRecord.from_json(r) for r in d["queued_resources"]}
        world.operations = {op["name"]: op for op in d["operations"]}
        world.request_ids = dict(d["request_ids"])
        world.first_zone = d.get("first_zone")
        for key in ("op_counter", "rpc_count", "failures_in_a_row", "lost_creates"):
            setattr(world, key, int(d.get(key, 0)))
        return world

    def prune(self, now: float) -> None:
        """Forget queued resources that are gone (their operations keep their own snapshots) and
        request ids past their idempotency window."""
        for name in [n for n, r in self.queued.items() if r.state_at(now) is None]:
            del self.queued[name]
        for rid in [r for r, op in self.request_ids.items()
                    if op not in self.operations or now >= self.operations[op]["create_time"] + REQUEST_ID_TTL_S]:
            del self.request_ids[rid]

    def replayed(self, request_id: str, now: float) -> dict | None:
        """The operation a request id already started within its idempotency window, if any."""
        self.prune(now)
        return self.operations[self.request_ids[request_id]] if request_id in self.request_ids else None

    # --- lookups -------------------------------------------------------------
    def live_queued(self, name: str, now: float) -> QueuedRecord:
        rec = self.queued.get(name)
        if rec is None or rec.state_at(now) is None:
            raise not_found(name)
        return rec

    def find_node(self, name: str, now: float) -> tuple[QueuedRecord, int]:
        for rec in self.queued.values():
            for node, index in rec.nodes:
                if node == name and rec.node_state_at(node, now) is not None:
                    return rec, index
        raise not_found(name)

    def node_names_in_use(self, now: float) -> set[str]:
        """Node names taken: nodes that exist, and those a queued resource still waits to create."""
        taken = set()
        for rec in self.queued.values():
            pending = rec.state_at(now) in PENDING_STATES
            taken.update(n for n, _ in rec.nodes if pending or rec.node_state_at(n, now) is not None)
        return taken

    # --- views ---------------------------------------------------------------
    def queued_view(self, rec: QueuedRecord, now: float) -> QR:
        qr = QR.from_json(json.dumps(rec.request), ignore_unknown_fields=True)
        qr.name = rec.name
        qr.create_time = timestamp(rec.create_time)
        state = rec.state_at(now) or "DELETING"
        qr_state = QRState(state=QRState.State[state])
        qr_state.state_initiator = (QRState.StateInitiator.SERVICE if state in SERVICE_INITIATED
                                    else QRState.StateInitiator.USER)
        data_field = STATE_DATA_FIELD.get(state)
        if state == "FAILED":
            failure = rec.timeline.failure or {"code": 13, "message": "an internal error has occurred"}
            qr_state.failed_data = QRState.FailedData(
                error=status_pb2.Status(code=failure["code"], message=failure["message"]))
        elif data_field:
            setattr(qr_state, data_field, getattr(QRState, _class_name(data_field))())
        qr.state = qr_state
        return qr

    def node_view(self, rec: QueuedRecord, node: str, index: int, now: float) -> Node:
        spec = QR.from_json(json.dumps(rec.request), ignore_unknown_fields=True).tpu.node_spec[index]
        view = Node(spec.node)
        acc = ACCELERATORS[_accelerator_name(spec.node)]
        state = rec.node_state_at(node, now) or "DELETING"
        view.name = node
        view.accelerator_type = acc.name
        view.accelerator_config = tpu_v2.AcceleratorConfig(
            type_=tpu_v2.AcceleratorConfig.Type.V5LITE_POD, topology=acc.topology)
        view.state = Node.State[state]
        view.health = Node.Health.HEALTHY if state == "READY" else Node.Health.HEALTH_UNSPECIFIED
        view.api_version = Node.ApiVersion.V2
        view.queued_resource = rec.name
        view.multislice_node = rec.multislice
        provisioning = [at for at, s in rec.timeline.phases if s == "PROVISIONING"]
        view.create_time = timestamp(rec.create_time + (provisioning[0] if provisioning else 0.0))
        digest = _digest(node)
        view.id = int.from_bytes(digest[:7], "big")
        view.cidr_block = f"10.{digest[0]}.0.0/20"
        if capacity(QR.from_json(json.dumps(rec.request), ignore_unknown_fields=True))[0]:
            view.scheduling_config.spot = True
        if state != "CREATING":
            view.network_endpoints = [
                tpu_v2.NetworkEndpoint(ip_address=f"10.{digest[0]}.{digest[1]}.{2 + i}", port=TPU_PORT)
                for i in range(acc.vms)]
        return view

    def operation_view(self, op: dict, now: float) -> operations_pb2.Operation:
        done = now >= op["done_at"]
        metadata = tpu_v2.OperationMetadata(create_time=timestamp(op["create_time"]), target=op["target"],
                                            verb=op["verb"], api_version="v2",
                                            cancel_requested=op.get("cancel_requested", False))
        if done:
            metadata.end_time = timestamp(op["done_at"])
        result = operations_pb2.Operation(name=op["name"], done=done)
        result.metadata.Pack(tpu_v2.OperationMetadata.pb(metadata))
        if done:
            if op["response_type"] == "QueuedResource":
                qr = QR.from_json(json.dumps(op["response"]), ignore_unknown_fields=True)
                result.response.Pack(QR.pb(qr))
            else:
                result.response.Pack(empty_pb2.Empty())
        return result

    # --- mutations -----------------------------------------------------------
    def new_operation(self, parent: str, verb: str, target: str, now: float, done_at: float,
                      response: QR | None, request_id: str = "") -> dict:
        self.op_counter += 1
        tag = hashlib.sha256(f"{self.seed}/{self.op_counter}".encode()).hexdigest()
        name = f"{parent}/operations/operation-{int(now * 1000)}-{tag[:13]}-{tag[13:21]}-{tag[21:29]}"
        op = {"name": name, "verb": verb, "target": target, "create_time": now, "done_at": done_at,
              "response_type": "QueuedResource" if response is not None else "Empty",
              "response": _as_json(response) if response is not None else None,
              "cancel_requested": False}
        self.operations[name] = op
        if request_id:
            self.request_ids[request_id] = name
        return op

    def create_queued_resource(self, req: tpu_v2.CreateQueuedResourceRequest, now: float,
                               scenario: str) -> dict:
        """Validate and accept a create; returns the operation record."""
        project, zone = validate.location(req.parent)
        if req.request_id and (replayed := self.replayed(req.request_id, now)) is not None:
            return replayed
        validate.queued_resource_id(req.queued_resource_id)
        name = f"{req.parent}/queuedResources/{req.queued_resource_id}"
        qr = QR(req.queued_resource)
        nodes, multislice = _check_node_specs(qr, req.parent, zone, req.queued_resource_id)
        spot, reserved = capacity(qr)
        if name in self.queued and self.queued[name].state_at(now) is not None:
            raise ApiError("ALREADY_EXISTS", f"Resource '{name}' already exists")
        in_use = self.node_names_in_use(now)
        for node, _ in nodes:
            if node in in_use:
                raise ApiError("ALREADY_EXISTS", f"Resource '{node}' already exists")
        if scenario == "quota":
            raise quota_error(project, zone, spot)
        if self.first_zone is None:
            self.first_zone = zone
        tl = timeline(scenario, zone=zone, spot=spot, reserved=reserved,
                      stocked_out=scenario == "stockout" and zone == self.first_zone,
                      valid_until_s=_valid_until_s(qr, now))
        qr.name = ""
        rec = QueuedRecord(name=name, request=_as_json(qr), create_time=now, timeline=tl,
                           nodes=nodes, multislice=multislice)
        self.queued[name] = rec
        # The create operation is done at its first poll; its response is the queued resource then.
        return self.new_operation(req.parent, "create", name, now, now, self.queued_view(rec, now),
                                  req.request_id)

    def delete_queued_resource(self, req: tpu_v2.DeleteQueuedResourceRequest, now: float) -> dict:
        _, _zone, _ = validate.resource(req.name, "queuedResources")
        if req.request_id and (replayed := self.replayed(req.request_id, now)) is not None:
            return replayed
        rec = self.live_queued(req.name, now)
        state = rec.state_at(now)
        parent = req.name.rsplit("/queuedResources/", 1)[0]
        if state == "DELETING":
            return self.new_operation(parent, "delete", rec.name, now, rec.deleted_at + DELETING_S, None,
                                      req.request_id)
        if not req.force and rec.live_nodes(now) and state not in DELETABLE_WITH_NODES:
            # Unconfirmed message; the code is the natural one (API-FACTS).
            raise ApiError("FAILED_PRECONDITION",
                           f"Cannot delete queued resource '{rec.name}' in state {state} while it has nodes; "
                           "delete its nodes first or set force=true")
        rec.deleted_at = now
        return self.new_operation(parent, "delete", rec.name, now, now + DELETING_S, None, req.request_id)

    def reset_queued_resource(self, req: tpu_v2.ResetQueuedResourceRequest, now: float,
                              scenario: str) -> dict:
        """Only a FAILED queued resource can be reset (unconfirmed); SUSPENDED must be deleted."""
        _, zone, _ = validate.resource(req.name, "queuedResources")
        rec = self.live_queued(req.name, now)
        state = rec.state_at(now)
        if state != "FAILED":
            raise ApiError("FAILED_PRECONDITION",
                           f"Cannot reset queued resource '{rec.name}' in state {state}; "
                           "delete it and create it again")
        spot, reserved = capacity(QR.from_json(json.dumps(rec.request), ignore_unknown_fields=True))
        fresh = timeline(scenario, zone=zone, spot=spot, reserved=reserved,
                         stocked_out=scenario == "stockout" and zone == self.first_zone)
        offset = now - rec.create_time
        shifted = tuple((offset + at - fresh.phases[1][0], s) for at, s in fresh.phases[1:])
        rec.timeline = Timeline(rec.timeline.phases + shifted, fresh.failure)
        parent = req.name.rsplit("/queuedResources/", 1)[0]
        return self.new_operation(parent, "reset", rec.name, now, now, self.queued_view(rec, now))

    def delete_node(self, name: str, now: float) -> dict:
        validate.resource(name, "nodes")
        rec, _ = self.find_node(name, now)
        if rec.node_state_at(name, now) != "DELETING":
            rec.node_deleted_at[name] = now
        # Already going, on its own or with its queued resource: done when the first of those ends.
        ends = [rec.node_deleted_at[name] + NODE_DELETING_S] if name in rec.node_deleted_at else []
        if rec.deleted_at is not None:
            ends.append(rec.deleted_at + DELETING_S)
        done_at = min(ends)
        return self.new_operation(name.rsplit("/nodes/", 1)[0], "delete", name, now, done_at, None)


def _as_json(qr: QR) -> dict:
    """A queued resource as proto JSON for the state file: set fields only, enums by name."""
    return json.loads(QR.to_json(qr, use_integers_for_enums=False, always_print_fields_with_no_presence=False))


def _class_name(data_field: str) -> str:
    return "".join(part.capitalize() for part in data_field.split("_"))


def _accelerator_name(node: Node) -> str:
    if node.accelerator_type:
        return node.accelerator_type
    if "accelerator_config" in node and node.accelerator_config.topology:
        return validate.accelerator_from_config(node.accelerator_config.topology)
    return ""


def capacity(qr: QR) -> tuple[bool, bool]:
    """(spot?, reserved?) of a queued resource request: its tier or its nodes' scheduling config."""
    scheduling = [spec.node.scheduling_config for spec in qr.tpu.node_spec]
    spot = "spot" in qr or any(s.spot or s.preemptible for s in scheduling)
    reserved = bool(qr.reservation_name) or "guaranteed" in qr or any(s.reserved for s in scheduling)
    return spot, reserved and not spot


def _check_node_specs(qr: QR, parent: str, zone: str, qr_id: str) -> tuple[list[tuple[str, int]], bool]:
    """Validate every node spec; (node names with their spec index, multislice?)."""
    if not qr.tpu.node_spec:
        raise ApiError("INVALID_ARGUMENT", "queued_resource.tpu.node_spec must name at least one node")
    nodes: list[tuple[str, int]] = []
    multislice = False
    for index, spec in enumerate(qr.tpu.node_spec):
        if spec.parent != parent:
            raise ApiError("INVALID_ARGUMENT",
                           f"node_spec[{index}].parent {spec.parent!r} must equal the request parent {parent!r}")
        strategy = QR.Tpu.NodeSpec.pb(spec).WhichOneof("name_strategy")
        if strategy is None:
            raise ApiError("INVALID_ARGUMENT",
                           f"node_spec[{index}]: exactly one of node_id or multislice_params must be set")
        if strategy == "node_id":
            validate.node_id(spec.node_id)
            ids = [spec.node_id]
        else:
            count = spec.multislice_params.node_count
            if count < 2:
                raise ApiError("INVALID_ARGUMENT",
                               f"node_spec[{index}].multislice_params.node_count must be > 1, got {count}")
            prefix = spec.multislice_params.node_id_prefix or qr_id
            validate.node_id(prefix)
            ids = [f"{prefix}-{i}" for i in range(count)]
            multislice = True
        acc = validate.accelerator(zone, _accelerator_name(spec.node))
        validate.runtime_version(acc, spec.node.runtime_version)
        validate.labels(dict(spec.node.labels))
        validate.metadata(dict(spec.node.metadata))
        nodes.extend((f"{parent}/nodes/{i}", index) for i in ids)
    if len({n for n, _ in nodes}) != len(nodes):
        raise ApiError("INVALID_ARGUMENT", "node ids in queued_resource.tpu.node_spec must be unique")
    return nodes, multislice


def _valid_until_s(qr: QR, now: float) -> float | None:
    if "queueing_policy" not in qr:
        return None
    policy = qr.queueing_policy
    if "valid_until_duration" in policy:
        return policy.valid_until_duration.total_seconds()
    if "valid_until_time" in policy:
        return policy.valid_until_time.timestamp() - now
    return None


def quota_error(project: str, zone: str, spot: bool) -> ApiError:
    quota_id = ("TPUV5sPreemptibleLitepodPerProjectPerZoneForTPUAPI" if spot
                else "TPUV5sLitepodPerProjectPerZoneForTPUAPI")
    message = f"Quota limit '{quota_id}' has been exceeded. Limit: 0 in zone {zone}."
    failure = error_details_pb2.QuotaFailure(violations=[error_details_pb2.QuotaFailure.Violation(
        subject=f"project:{project}", description=message, api_service="tpu.googleapis.com",
        quota_id=quota_id, quota_dimensions={"zone": zone}, quota_value=0)])
    return ApiError("RESOURCE_EXHAUSTED", message, [failure])


def accelerator_types(parent: str, zone: str) -> list[tpu_v2.AcceleratorType]:
    if zone not in V5E_ZONES:
        return []
    return [tpu_v2.AcceleratorType(
        name=f"{parent}/acceleratorTypes/{a.name}", type_=a.name,
        accelerator_configs=[tpu_v2.AcceleratorConfig(type_=tpu_v2.AcceleratorConfig.Type.V5LITE_POD,
                                                       topology=a.topology)])
        for a in ACCELERATORS.values()]


def runtime_versions(parent: str, zone: str) -> list[tpu_v2.RuntimeVersion]:
    if zone not in V5E_ZONES:
        return []
    versions = sorted({v for a in ACCELERATORS.values() for v in a.runtime_versions})
    return [tpu_v2.RuntimeVersion(name=f"{parent}/runtimeVersions/{v}", version=v) for v in versions]


def pack_any(message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed
