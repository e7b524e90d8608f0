"""Scenarios and their timelines: plain data, no gRPC.

A queued resource or a custom job stores, when it is created, the list of (seconds after
create, state) it will go through and how it ends. Its state at any time is read off that
list, so the emulator needs no background thread and a persisted world replays exactly.

All durations are simulated seconds. They are plausible, not measured: real queues vary
from seconds to days.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from provision import catalogue

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
# A reservation that cannot hold the request (docs/api-facts.md: code 9, seen as 8 too).
RESERVED_STOCKOUT_CODE = 9  # FAILED_PRECONDITION
RESERVED_STOCKOUT_MESSAGE = ("Insufficient reserved capacity. Contact customer support to increase your "
                             "reservation.")
# Unconfirmed what the API does when queueing_policy.valid_until passes first. The one public record
# of the service giving up on a queued request is SUSPENDING (state_initiator SERVICE) -> FAILED with
# code 13 (docs/api-facts.md), so the emulator does that; clients must recognise expiry by the resource's
# state, initiator and times, not by this code (slices.expired).
VALID_UNTIL_CODE = 13  # INTERNAL
VALID_UNTIL_MESSAGE = "an internal error has occurred"


# --- Vertex AI custom jobs (JobState names) -------------------------------------------
JOB_QUEUED_S = 10.0
JOB_PENDING_S = 240.0  # the service provisions the TPU hosts
JOB_RUN_S = 3600.0  # how long a job runs before it succeeds, when nothing drives it
LONG_QUEUE_JOB_QUEUED_S = 2 * 3600.0
LONG_QUEUE_JOB_PENDING_S = 3600.0
JOB_CANCELLING_S = 30.0
JOB_DELETING_S = 10.0
JOB_TERMINAL = catalogue.VERTEX_JOB_TERMINAL
# The proto says a cancelled job gets an error with code 1 (CANCELLED); the message is unconfirmed.
JOB_CANCELLED_ERROR = {"code": 1, "message": "CANCELED"}
# A job that waits for capacity and gives up: code 8 (docs/api-facts.md: "later the job FAILED with code 8").
# The first sentence is the one public reports quote; the second is unconfirmed.
JOB_STOCKOUT_CODE = 8
JOB_STOCKOUT_MESSAGE = "Resources are insufficient in region: {region}. Please try a different region."
# A preempted job: the Vertex docs say preempted Spot VMs fail a prediction job with a STOCKOUT
# error; nothing public shows a training job's. Code 8 follows the prediction docs; the message is
# unconfirmed (shaped like the confirmed "The replica workerpool0-0 exited ..." messages).
JOB_PREEMPTED_ERROR = {"code": 8, "message": "The replica workerpool0-0 was preempted: its VMs were reclaimed by "
                                             "Compute Engine. Termination reason: Preempted."}


def replica_exit_error(exit_code: int, pool: int = 0, replica: int = 0) -> dict:
    """The error of a job whose container exited non-zero (code 3 and this text, as seen publicly)."""
    return {"code": 3, "message": f"The replica workerpool{pool}-{replica} exited with a non-zero status of "
                                  f"{exit_code}. Termination reason: Error."}


def check_scenario(name: str) -> str:
    if name not in SCENARIOS:
        raise ValueError(f"unknown emulator scenario {name!r}; valid scenarios: {', '.join(SCENARIOS)}")
    return name


@dataclass(frozen=True)
class Timeline:
    """What a queued resource or a custom job will do: phases (offset_s, state) and, if it fails,
    the error ({"code": google.rpc.Code, "message": ...})."""

    phases: tuple[tuple[float, str], ...]
    failure: dict | None = field(default=None)

    def state_at(self, offset_s: float) -> str:
        state = self.phases[0][1]
        for at, name in self.phases:
            if offset_s >= at:
                state = name
        return state

    def entered_at(self, offset_s: float) -> float:
        """The offset at which the state in effect at `offset_s` began."""
        start = self.phases[0][0]
        for at, _ in self.phases:
            if offset_s >= at:
                start = at
        return start

    def first(self, state: str, offset_s: float) -> float | None:
        """The offset at which `state` was first entered, if it was by `offset_s`."""
        return next((at for at, s in self.phases if s == state and at <= offset_s), None)

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
             valid_until_s: float | None = None, held: bool = False) -> Timeline:
    """The timeline of a queued resource created now under `scenario`.

    `held`: once ACTIVE it stays so (no timed preemption); only World.preempt_queued_resource ends it.
    """
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
    if scenario == "preempt" and spot and not held:
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
    kept += [(valid_until_s, "SUSPENDING"), (valid_until_s + SUSPENDING_S, "FAILED")]
    return Timeline(tuple(kept), {"code": VALID_UNTIL_CODE, "message": VALID_UNTIL_MESSAGE})


def job_timeline(scenario: str, *, region: str, stocked_out: bool, held: bool = False) -> Timeline:
    """The timeline of a custom job created now under `scenario`: QUEUED -> PENDING -> RUNNING -> end.

    `held`: once RUNNING it stays so; only vertex_world.CustomJobs.end (or a cancel) ends it.
    Every job is preempted under `preempt` (spot or not): the scenario rehearses recovery.
    """
    queued, pending = JOB_QUEUED_S, JOB_PENDING_S
    if scenario == "long-queue":
        queued, pending = LONG_QUEUE_JOB_QUEUED_S, LONG_QUEUE_JOB_PENDING_S
    phases = [(0.0, "JOB_STATE_QUEUED"), (queued, "JOB_STATE_PENDING")]
    if stocked_out:
        phases.append((queued + STOCKOUT_WAIT_S, "JOB_STATE_FAILED"))
        return Timeline(tuple(phases), {"code": JOB_STOCKOUT_CODE,
                                        "message": JOB_STOCKOUT_MESSAGE.format(region=region)})
    t_running = queued + pending
    phases.append((t_running, "JOB_STATE_RUNNING"))
    if held:
        return Timeline(tuple(phases))
    if scenario == "preempt":
        phases.append((t_running + PREEMPT_AFTER_ACTIVE_S, "JOB_STATE_FAILED"))
        return Timeline(tuple(phases), dict(JOB_PREEMPTED_ERROR))
    phases.append((t_running + JOB_RUN_S, "JOB_STATE_SUCCEEDED"))
    return Timeline(tuple(phases))


def ended(tl: Timeline, offset_s: float, final: tuple[tuple[float, str], ...], failure: dict | None) -> Timeline:
    """`tl` up to `offset_s`, then `final` (offsets from create): a state change decided at that moment."""
    kept = tuple((at, s) for at, s in tl.phases if at < offset_s)
    return Timeline(kept + final, failure)
