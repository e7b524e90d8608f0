"""Scenarios and their timelines: plain data, no gRPC.

A queued resource stores, when it is created, the list of (seconds after create, state) it
will go through and how it ends. Its state at any time is read off that list, so the
emulator needs no background thread and a persisted world replays exactly.

All durations are simulated seconds. They are plausible, not measured: real queues vary
from seconds to days.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass, field

SCENARIOS: tuple[str, ...] = ("happy", "stockout", "long-queue", "quota", "flaky", "preempt")

CREATING_S = 10.0
ACCEPTED_S = 20.0
WAIT_SPOT_S = 300.0
WAIT_ON_DEMAND_S = 120.0
PROVISIONING_S = 180.0
LONG_QUEUE_WAIT_S = 3 * 3600.0
STOCKOUT_WAIT_S = 600.0
PREEMPT_AFTER_ACTIVE_S = 1800.0
SUSPENDING_S = 60.0
DELETING_S = 60.0
NODE_DELETING_S = 60.0

FLAKY_SHARE = 0.3
# At most this many RPCs in a row fail in `flaky`, so a client retrying 3+ times always
# gets through and a dry run stays bounded.
FLAKY_MAX_IN_A_ROW = 2

STOCKOUT_CODE = 8  # google.rpc.Code.RESOURCE_EXHAUSTED
STOCKOUT_MESSAGE = ('There is no more capacity in the zone "{zone}"; you can try in another zone '
                    'where Cloud TPU Nodes are offered')
# A reservation that cannot hold the request (API-FACTS: code 9, seen as 8 too).
RESERVED_STOCKOUT_CODE = 9  # FAILED_PRECONDITION
RESERVED_STOCKOUT_MESSAGE = ("Insufficient reserved capacity. Contact customer support to increase your "
                             "reservation.")
# Unconfirmed: the message the API gives when queueing_policy.valid_until passes first.
VALID_UNTIL_CODE = 4  # DEADLINE_EXCEEDED
VALID_UNTIL_MESSAGE = "The queued resource could not be provisioned before its valid_until time"


def check_scenario(name: str) -> str:
    if name not in SCENARIOS:
        raise ValueError(f"unknown emulator scenario {name!r}; valid scenarios: {', '.join(SCENARIOS)}")
    return name


@dataclass(frozen=True)
class Timeline:
    """What a queued resource will do: phases (offset_s, state) and, if it fails, the error."""

    phases: tuple[tuple[float, str], ...]
    failure: dict | None = field(default=None)

    def state_at(self, offset_s: float) -> str:
        state = self.phases[0][1]
        for at, name in self.phases:
            if offset_s >= at:
                state = name
        return state

    def to_json(self) -> dict:
        return {"phases": [list(p) for p in self.phases], "failure": self.failure}

    @classmethod
    def from_json(cls, data: dict) -> Timeline:
        return cls(tuple((float(a), str(s)) for a, s in data["phases"]), data.get("failure"))


def _phases(wait_s: float) -> list[tuple[float, str]]:
    t_accepted = CREATING_S
    t_waiting = t_accepted + ACCEPTED_S
    t_provisioning = t_waiting + wait_s
    return [(0.0, "CREATING"), (t_accepted, "ACCEPTED"), (t_waiting, "WAITING_FOR_RESOURCES"),
            (t_provisioning, "PROVISIONING"), (t_provisioning + PROVISIONING_S, "ACTIVE")]


def timeline(scenario: str, *, zone: str, spot: bool, stocked_out: bool, reserved: bool = False,
             valid_until_s: float | None = None) -> Timeline:
    """The timeline of a queued resource created now under `scenario`."""
    if stocked_out:
        phases = _phases(STOCKOUT_WAIT_S)[:3]
        phases.append((CREATING_S + ACCEPTED_S + STOCKOUT_WAIT_S, "FAILED"))
        failure = ({"code": RESERVED_STOCKOUT_CODE, "message": RESERVED_STOCKOUT_MESSAGE} if reserved
                   else {"code": STOCKOUT_CODE, "message": STOCKOUT_MESSAGE.format(zone=zone)})
        return _cap(Timeline(tuple(phases), failure), valid_until_s)
    wait = WAIT_SPOT_S if spot else WAIT_ON_DEMAND_S
    if scenario == "long-queue":
        wait = LONG_QUEUE_WAIT_S
    phases = _phases(wait)
    if scenario == "preempt" and spot:
        t_active = phases[-1][0]
        phases.append((t_active + PREEMPT_AFTER_ACTIVE_S, "SUSPENDING"))
        phases.append((t_active + PREEMPT_AFTER_ACTIVE_S + SUSPENDING_S, "SUSPENDED"))
    return _cap(Timeline(tuple(phases)), valid_until_s)


def _cap(tl: Timeline, valid_until_s: float | None) -> Timeline:
    """Fail the request at valid_until if it would still be queued then."""
    if valid_until_s is None:
        return tl
    starts = [at for at, s in tl.phases if s in ("PROVISIONING", "FAILED")]
    if starts and starts[0] <= valid_until_s:
        return tl
    kept = [(at, s) for at, s in tl.phases if at < valid_until_s]
    kept.append((valid_until_s, "FAILED"))
    return Timeline(tuple(kept), {"code": VALID_UNTIL_CODE, "message": VALID_UNTIL_MESSAGE})


def flaky_roll(seed: int, n: int) -> bool:
    """Whether RPC number n fails in `flaky`: deterministic for a seed."""
    digest = hashlib.sha256(f"{seed}/{n}".encode()).digest()
    return random.Random(digest).random() < FLAKY_SHARE
