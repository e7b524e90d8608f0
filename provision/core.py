"""The core every kind of target and the run loop share: placements, workloads, the deployment that
composes one of each, the reports the run loop and the service follower read, and what a kind declares.

A placement is where things run (a queued resource's slice, GKE node pools, a Vertex AI job's or
endpoint's machines): it is provisioned, torn down, priced, and says what of it is left. A workload
is what runs there: a training job (reports step, loss, tokens/s; ends) or a service (reports ready,
URL, replicas; lives until `down`). A `Deployment` is one placement plus one workload, composed: its
teardown deletes the workload and then what the placement made for that workload, nothing else, so a
service that fails to deploy never takes a training run's placement with it, nor a finished run a live
service. Only a kind's `teardown` (`down`) deletes everything of the run. `provision.runs.Runner`
follows a training deployment (a `Target`), `provision.services.ServiceFollower` a service (a
`ServiceTarget`). This module imports no kind and no package that imports one: the kinds
(provision/kinds/) and the lifecycle modules all stand on it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

from provision.errors import UsageError
from provision.resources import Resource
from trainer.outputs import ENDED, STATUS_FILE, Phase  # noqa: F401 - the trainer's outputs, one contract


@dataclass
class Report:
    """What a target says about training right now.

    phase: a trainer/outputs.Phase: waiting (no trainer yet), starting, running, finished, failed,
    preempted, restarted (the target recovered from a preemption in place, as a JobSet's failure
    policy does: the run loop records it and follows on without provisioning again), or deleted (by
    a person: a deletion or cancellation that the service did not initiate; never recovered from).
    """

    phase: str
    step: int | None = None
    total_steps: int | None = None
    start_step: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    worker: str | None = None
    detail: str | None = None


@dataclass
class ServiceReport:
    """What a service says right now: phase (a trainer/outputs.Phase: starting, ready, failed or
    deleted), the URL it answers at once ready, its replicas ready of those asked for, and why."""

    phase: str
    url: str | None = None
    replicas_ready: int = 0
    replicas: int = 0
    detail: str | None = None


@runtime_checkable
class Placement(Protocol):
    """Where a workload runs: what it is, what it costs, and what of it this tool makes and deletes.

    kind: the config's `target` value; chips: the chips it bills for while it runs.
    """

    kind: str
    chips: int

    def describe(self) -> str:
        """One line on what is provisioned (the timeline's `target`)."""

    def price(self) -> float:
        """US dollars per hour while it is up (the catalogue's upper bound)."""

    def provision(self, attempt: int = 0) -> list[Resource]:
        """Create (or adopt) it and wait until a workload can start on it. A refusal by the API is a
        UsageError; any other failure a MoeTpuError."""

    def teardown(self) -> list[Resource]:
        """Delete what it made for its workload (and what they shared, once nothing else uses it);
        the resources deleted."""

    def left(self) -> list[Resource]:
        """What its teardown would delete that exists now."""


@runtime_checkable
class Workload(Protocol):
    """What runs on a placement: a training job (`report` -> Report) or a service (-> ServiceReport)."""

    def start(self) -> list[Resource]:
        """Start it on its placement, provisioned (or adopt what an earlier attempt started)."""

    def report(self) -> Report | ServiceReport:
        """Its state now."""

    def teardown(self) -> list[Resource]:
        """Delete it and what it made for itself, nothing else; the resources deleted."""

    def left(self) -> list[Resource]:
        """What of it exists now."""


class Bundled:
    """A placement or a workload that the other half of its deployment makes and deletes with itself (a TPU VM's
    trainer with its slice, a Vertex AI job's machines with the job): nothing of its own to make, delete or
    find."""

    def provision(self, attempt: int = 0) -> list[Resource]:
        return []

    def start(self) -> list[Resource]:
        return []

    def teardown(self) -> list[Resource]:
        return []

    def left(self) -> list[Resource]:
        return []


class Deployment:
    """A workload on a placement, composed: what `run` follows (a training job: a `Target`) and what
    `deploy` follows (a service: a `ServiceTarget`, whose workload also predicts). Neither part knows
    the other's teardown: the deployment deletes its workload, then what its placement made for it."""

    def __init__(self, placement: Placement, workload: Workload) -> None:
        self.placement = placement
        self.workload = workload

    @property
    def kind(self) -> str:
        return self.placement.kind

    @property
    def chips(self) -> int:
        return self.placement.chips

    def describe(self) -> str:
        return self.placement.describe()

    def price(self) -> float:
        return self.placement.price()

    def provision(self, attempt: int = 0) -> list[Resource]:
        """The placement (for this attempt), then the workload on it; what they made or adopted."""
        placed = self.placement.provision(attempt)
        return [*self.workload.start(), *placed]

    def report(self):
        return self.workload.report()

    def teardown(self) -> list[Resource]:
        return [*self.workload.teardown(), *self.placement.teardown()]

    def left(self) -> list[Resource]:
        return [*self.workload.left(), *self.placement.left()]

    def predict(self, request: dict, stream: bool = False) -> Iterator[dict]:
        """A service's prediction (ServiceTarget.predict): its workload's."""
        return self.workload.predict(request, stream)

    def examples(self, url: str, body: str) -> list[str]:
        """How to call a service at `url` (a console line each): its workload's, or a plain curl."""
        own = getattr(self.workload, "examples", None)
        return own(url, body) if own is not None else [
            f"  curl -X POST {url} -H 'content-type: application/json' -d '{body}'"]


@runtime_checkable
class Target(Placement, Protocol):
    """A placement with a training job on it (a Deployment): what `run` follows until training ends."""

    def report(self) -> Report:
        """The trainer's state on it now; `preempted` when the capacity went away."""


@runtime_checkable
class ServiceTarget(Placement, Protocol):
    """A placement with a service on it (a Deployment): ready at a URL until somebody takes it down."""

    def report(self) -> ServiceReport:
        """The service's state now."""

    def predict(self, request: dict, stream: bool = False) -> Iterator[dict]:
        """Send one OpenAI completions request body through the platform's own prediction path (Vertex
        AI: PredictionService RawPredict, or StreamRawPredict when `stream`; GKE: the Service, through
        the Kubernetes API server's service proxy); yields the response document, or each streamed
        chunk (the server-sent events' JSON, `[DONE]` not included). A refusal by the server is a
        CloudError with its message."""

    def examples(self, url: str, body: str) -> list[str]:
        """How to call it at `url` with `body` (console lines)."""


@dataclass(frozen=True)
class Scope:
    """Where `list` looks: the project, the zones and regions asked for, the run (None: every run),
    and the config when there is one (a kind whose resources live elsewhere, like a GKE cluster,
    finds them through it)."""

    project: str
    zones: tuple[str, ...]
    regions: tuple[str, ...]
    run: str | None = None
    config: Any = None


@dataclass(frozen=True)
class Flag:
    """A flag that only one kind's command has (`--recreate` on a TPU VM's up, `--wait` on a Vertex AI
    job's): declared by the kind, offered by the generic command and by the kind's own group."""

    name: str  # the flag without its dashes
    help: str


@dataclass(frozen=True)
class Verb:
    """One command of a kind's own group (`slice up`, `job submit`, `job cancel`): `does` is `up`,
    `status` or `down` (the generic command under the kind's name) or an action of the kind's own
    (`Kind.act`); `trainer`: its config is loaded with the trainer's checks (it starts the trainer)."""

    name: str
    does: str
    help: str
    flags: tuple[Flag, ...] = ()
    trainer: bool = False


GENERIC_VERBS = ("up", "status", "down")


class Kind:
    """Everything the commands ask about one kind of target; `provision.kinds.KINDS` holds one of
    each, by the config's `target` value. The commands (validate, render, plan, list, down, logs,
    up, status, run) ask the kind of the config in hand and never name one.

    name: the config's `target` value; noun: what it is, in a sentence; group: its own command group
    (an alias of `up | status | down`, with actions of its own), group_help its help, verbs its commands
    (provision/cli/kind_cmds.py makes them), up_flags the flags its `up` takes (the generic `up`
    offers them too), up_command its group's `up`; sections: the model of what the kind adds to the
    common config (provision.config.Config), in its package: its sections as fields (pydantic models),
    its rules between keys as `rules` and where its zones may lie as `zone_region` (both read the
    validated config); the config of the kind is the common one plus it (provision.config.kind_config);
    serve_platform, serve_price_basis: what `plan --serve` says a replica is billed on and what its
    price is (by default a Cloud TPU VM's, at the catalogue's chip-hour price); serves_multi_host:
    whether it serves a replica over several hosts (GKE's LeaderWorkerSet).
    """

    name: ClassVar[str] = ""
    noun: ClassVar[str] = ""
    group: ClassVar[str] = ""
    group_help: ClassVar[str] = ""
    verbs: ClassVar[tuple[Verb, ...]] = ()
    up_flags: ClassVar[tuple[Flag, ...]] = ()
    up_command: ClassVar[str] = ""  # its own group's `up` (e.g. "slice up")
    sections: ClassVar[type | None] = None
    serve_platform: ClassVar[str] = "Cloud TPU VM"
    serve_price_basis: ClassVar[str] = "the catalogue's Cloud TPU v5e chip-hour price"
    serves_multi_host: ClassVar[bool] = False

    # --- the config ----------------------------------------------------------------------------
    def warnings(self, cfg) -> list[str]:
        """What is allowed but worth saying about a config of this kind."""
        return []

    def check_offer(self, cfg, session) -> None:
        """Ask the API whether what `warnings` doubted is offered (`validate` in a dry run); a UsageError
        where it is not."""

    def summary(self, cfg) -> str:
        """One line on what the config asks for (`validate`)."""
        raise NotImplementedError

    def render(self, cfg, renderer) -> dict[str, str]:
        """Every file it renders, by file name (`render`, `validate`)."""
        raise NotImplementedError

    def hardware(self, cfg) -> tuple[Any, int, str]:
        """(catalogue.AcceleratorType, slices, capacity) the planner plans for."""
        raise NotImplementedError

    # --- the lifecycle --------------------------------------------------------------------------
    def target(self, context, *, output_dir: str | None = None) -> Target:
        """The placement and its training workload (a Deployment), as `run` follows it."""
        raise NotImplementedError

    def service(self, context) -> ServiceTarget:
        """The placement and a service on it (a Deployment), for a kind that serves."""
        raise UsageError(f"target {self.name!r} runs training jobs only; it serves no model",
                         hint="serving targets: see `moe-tpu --help`")

    def up_line(self, cfg) -> str:
        """What `up` is about to make, for the console."""
        return f"{self.name} for run {cfg.run}"

    def up(self, context, **flags: bool) -> list[Resource]:
        """Make what the config asks for (without following a workload to its end); `flags`: its
        `up_flags`, as given."""
        raise NotImplementedError

    def up_lines(self, resources: list[Resource]) -> list[str]:
        """What `up` says of what it made (console lines)."""
        return [f"  {res.kind} {res.name.rsplit('/', 1)[-1]} {res.state}" + (f" in {res.zone}" if res.zone else "")
                for res in resources]

    def act(self, action: str, context) -> tuple[list[Resource], list[str]]:
        """One of its own actions (a `Verb` whose `does` is none of GENERIC_VERBS): the resources it
        touched and what to say of them."""
        raise NotImplementedError(action)

    def status(self, context) -> list[Resource]:
        """What of the run exists now (`status`)."""
        return self.target(context).left()

    def managed(self, session, scope: Scope) -> list[Resource]:
        """Everything this tool manages of this kind where `scope` says (`list`)."""
        return []

    def where(self, cfg) -> str | None:
        """Where `down` looks besides the config's zones (a clause), or None."""
        return None

    def teardown(self, context) -> list[Resource]:
        """Delete every resource of the run of this kind, whatever the config's target (`down`)."""
        return []

    def log_source(self, context) -> Callable[[], str | None] | None:
        """What reads the trainer's console output while the run is up, when it is not in its output
        directory (`logs`; opens the context's session only when called); None: the output
        directory's trainer.log."""
        return None


def replica_problems(serve, scaler: str) -> list[tuple[str, str]]:
    """The serve section's replica rule, the same on every kind that serves: min_replicas <= max_replicas."""
    low, high = serve.min_replicas, serve.max_replicas
    if low > high:
        return [("serve.max_replicas", f"max_replicas ({high}) is below min_replicas ({low}): {scaler} scales "
                                       "between them")]
    return []


def last_zone_first(zones: list[str], last: str | None) -> list[str]:
    """The config's zones with the one the run last ran in first (a recovery tries it first)."""
    return [last, *(z for z in zones if z != last)] if last in zones else list(zones)


class Holding:
    """What every placement and workload holds: the command's context (provision.context.RunContext:
    the config, the session, the console, the renderer) and where its trainer writes (a dry run's local
    directory; by default trainer.output_dir)."""

    def __init__(self, context, *, output_dir: str | None = None) -> None:
        self.context = context
        self.output_dir = output_dir or context.config.trainer.output_dir

    @property
    def cfg(self):
        return self.context.config

    @property
    def session(self):
        return self.context.session

    @property
    def console(self):
        return self.context.console


def _number(value, kind=float):
    try:
        return kind(value) if value not in (None, "", "null", "None") else None
    except (TypeError, ValueError):
        return None


def report_from_status(status: dict, worker: str | None = None) -> Report:
    """A Report from one trainer status (status.json fields, or guest attributes with dashes)."""
    get = lambda key: status.get(key, status.get(key.replace("_", "-")))  # noqa: E731
    state = str(get("state") or Phase.STARTING)
    phase = Phase.PREEMPTED if state == Phase.STOPPED else state
    detail = get("error") or (f"exit code {get('exit_code')}" if state == Phase.FAILED else None)
    if state == Phase.STOPPED and not detail:
        detail = f"the trainer was stopped by a signal at step {get('step')} (a preemption notice)"
    return Report(phase=phase, step=_number(get("step"), int), total_steps=_number(get("total_steps"), int),
                  start_step=_number(get("start_step"), int), loss=_number(get("loss")),
                  tokens_per_s=_number(get("tokens_per_s")), worker=worker, detail=detail)


def combine(reports: list[Report]) -> Report:
    """One run's report from its workers': any failure fails it, all must finish, worker 0 speaks."""
    if not reports:
        return Report(Phase.STARTING)
    for phase in (Phase.FAILED, Phase.PREEMPTED):
        bad = [r for r in reports if r.phase == phase]
        if bad:
            return bad[0]
    if all(r.phase == Phase.FINISHED for r in reports):
        return reports[0]
    lead = reports[0]
    if lead.phase == Phase.FINISHED:  # worker 0 is done, others are still writing their last checkpoint
        lead = Report(**{**lead.__dict__, "phase": Phase.RUNNING})
    return lead
