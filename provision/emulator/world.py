"""The emulated world's state: the TPU API's records, long-running operations, the services' parts,
and their JSON form. No gRPC here.

Records hold what was asked and when; every state is computed from the clock when read
(`state_at`), so the world changes only when something is created, deleted, cancelled or ended,
and persists as JSON. The proto views and the RPCs live in tpu.py, vertex.py and operations.py;
reading and writing the file, in store.py. What another service keeps is its part (`Part`), which its
own module registers: GKE's in gke_world.py, Vertex AI's custom jobs in vertex_world.py, its models and
endpoints in vertex_serving.py.

The hooks at the end (`running_nodes`, `preempt_queued_resource`, `set_guest_attributes`; a part's
own, such as vertex_world's `running` and `end`) let a dry run's local trainer play the workload:
call them through `Emulator.world_call` (or a service's hooks of the same names,
`Emulator.service(name)`, workloads.py), which hold the world's lock and save it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Protocol, TypeVar

from provision.emulator import offerings, scenarios
from provision.emulator.scenarios import DELETING_S, NODE_DELETING_S, Timeline

STATE_VERSION = 2
NODE_STATE_BY_QR_STATE = {"PROVISIONING": "CREATING", "ACTIVE": "READY", "SUSPENDING": "PREEMPTED"}
PENDING_STATES = ("CREATING", "ACCEPTED", "WAITING_FOR_RESOURCES")
# Unconfirmed for the TPU API: Google APIs commonly honour a request_id for at least 60 minutes.
REQUEST_ID_TTL_S = 3600.0
RUN_LABEL = "moe-tpu-run"
# Guest attribute namespaces and keys: letters, digits, - and _ (GCE's rule; the length is unconfirmed).
GUEST_NAME_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
T = TypeVar("T")


# The services whose long-running operations live in `World.operations` (google.longrunning).
OPERATION_SERVICES = ("tpu", "vertex")


class WorldError(ValueError):
    """A hook was asked for something the world cannot do (unknown resource, wrong state)."""


@dataclass
class Operation:
    """A long-running operation: done once `now >= done_at`, then with `response` or `error`.

    `response` is the proto JSON of the response message (None for google.protobuf.Empty);
    `error` is {"code": google.rpc.Code, "message": ...} for an operation that fails. Its proto
    view is its service's (tpu.operation_view, vertex.operation_view; operations.view picks).
    """

    name: str
    service: str  # one of OPERATION_SERVICES
    verb: str
    target: str
    create_time: float
    done_at: float
    response: dict | None = None
    error: dict | None = None
    cancel_requested: bool = False

    def done(self, now: float) -> bool:
        return now >= self.done_at

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Operation:
        op = cls(**data)
        if op.service not in OPERATION_SERVICES:
            raise ValueError(f"operation {op.name!r} of unknown service {op.service!r}")
        return op


@dataclass
class QueuedRecord:
    """One queued resource as created, plus what happened to it since."""

    name: str
    request: dict  # the QueuedResource as submitted (proto JSON, proto field names)
    create_time: float
    timeline: Timeline
    nodes: list[tuple[str, int]]  # (node name, index of its node_spec)
    multislice: bool
    deleted_at: float | None = None
    node_deleted_at: dict[str, float] = field(default_factory=dict)
    # node name -> worker id -> "namespace/key" -> value: what the VMs' guests wrote
    guest_attributes: dict[str, dict[str, dict[str, str]]] = field(default_factory=dict)
    # A node made by CreateNode: no queued resource is visible; the record ends with its node.
    standalone: bool = False

    def state_at(self, now: float) -> str | None:
        """The queued resource's state at `now`; None once it is gone."""
        if self.standalone and any(now >= t + NODE_DELETING_S for t in self.node_deleted_at.values()):
            return None
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
        if state == "SUSPENDING" and self.timeline.first("PROVISIONING", now - self.create_time) is None:
            return None  # suspended while still queued (valid_until passed): no node was ever made
        return NODE_STATE_BY_QR_STATE.get(state)

    def live_nodes(self, now: float) -> list[str]:
        return [n for n, _ in self.nodes if self.node_state_at(n, now) is not None]

    def node_request(self, index: int) -> dict:
        """The Node of node_spec[index] as submitted (proto JSON)."""
        return self.request["tpu"]["node_spec"][index].get("node", {})

    def accelerator(self, index: int):
        """The accelerator type of node_spec[index] (validated at create, which records its name)."""
        return offerings.accelerator_type(self.node_request(index)["accelerator_type"])

    def to_json(self) -> dict:
        return {"name": self.name, "request": self.request, "create_time": self.create_time,
                "timeline": self.timeline.to_json(), "nodes": [list(n) for n in self.nodes],
                "multislice": self.multislice, "deleted_at": self.deleted_at,
                "node_deleted_at": self.node_deleted_at, "guest_attributes": self.guest_attributes,
                "standalone": self.standalone}

    @classmethod
    def from_json(cls, d: dict) -> QueuedRecord:
        return cls(name=d["name"], request=d["request"], create_time=float(d["create_time"]),
                   timeline=Timeline.from_json(d["timeline"]),
                   nodes=[(str(n), int(i)) for n, i in d["nodes"]], multislice=bool(d["multislice"]),
                   deleted_at=d.get("deleted_at"), node_deleted_at=dict(d.get("node_deleted_at", {})),
                   guest_attributes=dict(d.get("guest_attributes", {})), standalone=bool(d.get("standalone")))


@dataclass(frozen=True)
class RunningNode:
    """A TPU node that is READY now: where a dry run's trainer would run."""

    node: str
    queued_resource: str
    run: str | None  # the moe-tpu-run label
    labels: dict[str, str]
    metadata: dict[str, str]
    accelerator_type: str
    workers: int  # TPU VMs (network endpoints)


@dataclass
class FaultState:
    """`flaky` bookkeeping, persisted so a sequence of commands stays deterministic."""

    rpc_count: int = 0
    failures_in_a_row: int = 0
    lost_creates: dict[str, int] = field(default_factory=dict)  # method -> answers lost


class Part(Protocol):
    """What one service keeps in the shared world beside the TPU API's records (GKE's clusters and
    Kubernetes objects, Vertex AI's custom jobs, its models and endpoints): saved as JSON under its `KEY`,
    read back (`from_json(None)`: an empty one), and pruned with the world. A service's module registers
    its part (`@register_part`), and finds it with `World.part(KEY)`; the world names none."""

    KEY: ClassVar[str]

    def to_json(self) -> Any: ...

    @classmethod
    def from_json(cls, d: Any) -> Part: ...

    def prune(self, now: float) -> None: ...


PARTS: dict[str, type[Part]] = {}  # KEY -> the part's class, as the services' modules register them


def register_part(cls: T) -> T:
    """Register a service's part of the world under its KEY (a class decorator)."""
    PARTS[cls.KEY] = cls  # type: ignore[attr-defined]
    return cls


# The world's own keys in its JSON; any other key is a service's part.
OWN_KEYS = frozenset({"version", "now", "seed", "tpu", "operations", "request_ids", "id_counter", "faults"})


class World:
    """Everything the emulator knows; changed only inside an Emulator transaction (or a test)."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self.queued: dict[str, QueuedRecord] = {}
        self.first_zone: str | None = None  # the zone `stockout` keeps out of capacity
        self.operations: dict[str, Operation] = {}
        self.request_ids: dict[str, str] = {}  # request id -> operation name
        self.id_counter = 0
        self.faults = FaultState()
        # "ZONE/NAME" -> chips: the reservations the emulated project holds. Not saved with the world:
        # the emulator sets them from its own configuration (MOE_TPU_EMULATOR_RESERVATIONS).
        self.reservations: dict[str, int] = {}
        # The services' parts by KEY, those registered when the world was made or read; `unread`: the
        # saved parts of services not registered then, kept as saved until one asks for its part.
        self.parts: dict[str, Part] = {key: cls.from_json(None) for key, cls in PARTS.items()}
        self.unread: dict[str, Any] = {}

    def part(self, key: str) -> Any:
        """The part of the service registered under `key` (its module's class says its type)."""
        if key not in self.parts:
            self.parts[key] = PARTS[key].from_json(self.unread.pop(key, None))
        return self.parts[key]

    # --- persistence -------------------------------------------------------
    def to_json(self, now: float) -> dict:
        return {"version": STATE_VERSION, "now": now, "seed": self.seed,
                "tpu": {"queued_resources": [r.to_json() for r in self.queued.values()],
                        "first_zone": self.first_zone},
                "operations": [op.to_json() for op in self.operations.values()],
                **self.unread, **{key: p.to_json() for key, p in self.parts.items()},
                "request_ids": self.request_ids, "id_counter": self.id_counter,
                "faults": {"rpc_count": self.faults.rpc_count, "failures_in_a_row": self.faults.failures_in_a_row,
                           "lost_creates": self.faults.lost_creates}}

    @classmethod
    def from_json(cls, d: dict) -> World:
        """The world saved by to_json; ValueError (or KeyError, TypeError) when it is not one."""
        if not isinstance(d, dict) or d.get("version") != STATE_VERSION:
            version = d.get("version") if isinstance(d, dict) else None
            raise ValueError(f"it holds emulator state version {version!r}; this moe-tpu reads version "
                             f"{STATE_VERSION}")
        world = cls(seed=int(d.get("seed", 0)))
        world.queued = {r["name"]: QueuedRecord.from_json(r) for r in d["tpu"]["queued_resources"]}
        world.first_zone = d["tpu"].get("first_zone")
        world.operations = {op["name"]: Operation.from_json(op) for op in d["operations"]}
        world.parts = {key: kind.from_json(d.get(key)) for key, kind in PARTS.items()}
        world.unread = {key: value for key, value in d.items() if key not in OWN_KEYS and key not in PARTS}
        world.request_ids = {str(k): str(v) for k, v in d["request_ids"].items()}
        world.id_counter = int(d["id_counter"])
        faults = d["faults"]
        world.faults = FaultState(int(faults["rpc_count"]), int(faults["failures_in_a_row"]),
                                  {str(k): int(v) for k, v in faults["lost_creates"].items()})
        return world

    def prune(self, now: float) -> None:
        """Forget resources that are gone (their operations keep their own snapshots) and request
        ids past their idempotency window."""
        for name in [n for n, r in self.queued.items() if r.state_at(now) is None]:
            del self.queued[name]
        for p in self.parts.values():
            p.prune(now)
        for rid in [r for r, op in self.request_ids.items()
                    if op not in self.operations or now >= self.operations[op].create_time + REQUEST_ID_TTL_S]:
            del self.request_ids[rid]

    # --- operations and ids ----------------------------------------------------
    def next_token(self) -> str:
        """A fresh hex token, deterministic for the world's seed and history."""
        self.id_counter += 1
        return hashlib.sha256(f"{self.seed}/{self.id_counter}".encode()).hexdigest()

    def add_operation(self, op: Operation, request_id: str = "") -> Operation:
        self.operations[op.name] = op
        if request_id:
            self.request_ids[request_id] = op.name
        return op

    def replayed(self, request_id: str, now: float) -> Operation | None:
        """The operation a request id already started within its idempotency window, if any."""
        self.prune(now)
        return self.operations[self.request_ids[request_id]] if request_id in self.request_ids else None

    # --- lookups (None or WorldError rather than an RPC status: the services map them) ----
    def queued_at(self, name: str, now: float) -> QueuedRecord | None:
        rec = self.queued.get(name)
        return rec if rec is not None and rec.state_at(now) is not None else None

    def node_at(self, name: str, now: float) -> tuple[QueuedRecord, int] | None:
        for rec in self.queued.values():
            for node, index in rec.nodes:
                if node == name and rec.node_state_at(node, now) is not None:
                    return rec, index
        return None

    def node_names_in_use(self, now: float) -> set[str]:
        """Node names taken: nodes that exist, and those a queued resource still waits to create."""
        taken = set()
        for rec in self.queued.values():
            pending = rec.state_at(now) in PENDING_STATES
            taken.update(n for n, _ in rec.nodes if pending or rec.node_state_at(n, now) is not None)
        return taken

    # --- hooks for a dry run's local workload ------------------------------------
    def running_nodes(self, now: float) -> list[RunningNode]:
        """Every TPU node READY at `now`, by name."""
        found = []
        for rec in self.queued.values():
            for node, index in rec.nodes:
                if rec.node_state_at(node, now) != "READY":
                    continue
                spec = rec.node_request(index)
                labels = dict(spec.get("labels", {}))
                found.append(RunningNode(node=node, queued_resource=rec.name, run=labels.get(RUN_LABEL),
                                         labels=labels, metadata=dict(spec.get("metadata", {})),
                                         accelerator_type=rec.accelerator(index).name,
                                         workers=rec.accelerator(index).vms))
        return sorted(found, key=lambda n: n.node)

    def preempt_queued_resource(self, name: str, now: float) -> bool:
        """Preempt a queued resource at `now`: SUSPENDING (its nodes PREEMPTED) for SUSPENDING_S, then
        SUSPENDED with its nodes gone, whatever its timeline said. False when it is not PROVISIONING
        or ACTIVE (nothing to preempt); WorldError when there is no such queued resource."""
        rec = self.queued_at(name, now)
        if rec is None:
            raise WorldError(f"no queued resource {name!r} in the emulated world")
        if rec.state_at(now) not in ("PROVISIONING", "ACTIVE"):
            return False
        offset = now - rec.create_time
        rec.timeline = scenarios.ended(rec.timeline, offset, (
            (offset, "SUSPENDING"), (offset + scenarios.SUSPENDING_S, "SUSPENDED")), None)
        return True

    def set_guest_attributes(self, node_name: str, worker_id: int, namespace: str,
                             values: Mapping[str, str | int | float], now: float) -> None:
        """Write guest attributes as a TPU VM's guest would (PUT .../guest-attributes/NAMESPACE/KEY):
        `values` are merged into what worker `worker_id` of `node_name` already wrote. The node must
        be READY or PREEMPTED (a guest writes while its VM runs)."""
        found = self.node_at(node_name, now)
        if found is None:
            raise WorldError(f"no TPU node {node_name!r} in the emulated world")
        rec, index = found
        if rec.node_state_at(node_name, now) not in ("READY", "PREEMPTED"):
            raise WorldError(f"TPU node {node_name!r} is {rec.node_state_at(node_name, now)}: no guest runs on it")
        workers = rec.accelerator(index).vms
        if not 0 <= worker_id < workers:
            raise WorldError(f"TPU node {node_name!r} has workers 0 to {workers - 1}, not {worker_id}")
        for what, text in (("namespace", namespace), *(("key", k) for k in values)):
            if not isinstance(text, str) or not GUEST_NAME_RE.match(text):
                raise WorldError(f"guest attribute {what} {text!r}: use 1 to 64 letters, digits, - and _")
        for key, value in values.items():
            if isinstance(value, bool) or not isinstance(value, str | int | float):
                raise WorldError(f"guest attribute {namespace}/{key}: a value is a string or a number, "
                                 f"not {type(value).__name__}")
        entries = rec.guest_attributes.setdefault(node_name, {}).setdefault(str(worker_id), {})
        entries.update({f"{namespace}/{key}": str(value) for key, value in values.items()})
