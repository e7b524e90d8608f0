"""A fourth kind of target, written the way a new one would be: its own config section and rule, a rendered
file, the planner's hardware, and two deployments (provision.core.Deployment) on a fake "cloud": a training
placement with a training job that reports two steps and finishes, and a serving placement with a server
that becomes ready (or never does). All it needs besides this module is one line in the registry
(provision.kinds.KINDS), which tests/control/test_toy_target.py adds."""

from __future__ import annotations

from collections.abc import Iterator

from pydantic import BaseModel, ConfigDict, Field

from provision import catalogue
from provision.core import Deployment, Holding, Kind, Report, Scope, ServiceReport
from provision.resources import Resource
from provision.shapes import rule


class ToySection(BaseModel):
    """The `toy:` section of the config file. ready_after: the look at which the server is ready (0: never)."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    chips: int = Field(default=8, ge=1)
    greeting: str = "hello from the toy trainer"
    ready_after: int = Field(default=3, ge=0)


class ToySections(BaseModel):
    """What `target: toy` adds to the config (the kind's `sections`): its section, and its rule."""

    toy: ToySection = Field(default_factory=ToySection)

    @rule("toy.chips")
    def _few_chips(self) -> list[tuple[str, str]]:
        chips = self.toy.chips
        return [("toy.chips", f"a toy placement has at most 8 chips, not {chips}")] if chips > 8 else []


# The toy's "cloud": what it made, by name (a fake of a service's API).
MADE: dict[str, Resource] = {}


def _make(context, kind: str, name: str, chips: int = 0) -> Resource:
    cfg = context.config
    MADE[name] = Resource(kind=kind, name=name, state="READY", zone=cfg.region, run=cfg.run,
                          created=context.clock.now(), chips=chips, price_per_chip_hour=1.0)
    return MADE[name]


def _pop(*names: str) -> list[Resource]:
    return [MADE.pop(name) for name in names if name in MADE]


class ToyPlacement(Holding):
    """Toy chips for one purpose of the run ("train" or "serve"): made, priced and deleted on its own."""

    kind = "toy"

    def __init__(self, context, purpose: str) -> None:
        super().__init__(context)
        self.chips = self.cfg.section("toy").chips
        self.name = f"toys/{self.cfg.run}/{purpose}"

    def describe(self) -> str:
        return f"{self.chips} toy chips ({self.name})"

    def price(self) -> float:
        return float(self.chips)

    def provision(self, attempt: int = 0) -> list[Resource]:
        return [_make(self.context, "toy_placement", self.name, self.chips)]

    def teardown(self) -> list[Resource]:
        return _pop(self.name)

    def left(self) -> list[Resource]:
        return [MADE[self.name]] if self.name in MADE else []


class ToyTraining(Holding):
    """The training job: it runs on its placement, reports two steps and finishes; nothing of its own."""

    def __init__(self, context, *, output_dir: str | None = None) -> None:
        super().__init__(context, output_dir=output_dir)
        self.looks = 0

    def start(self) -> list[Resource]:
        return []

    def report(self) -> Report:
        self.looks += 1
        if self.looks < 3:
            return Report("running", step=self.looks, total_steps=2, start_step=0, loss=3.0 - self.looks)
        return Report("finished", step=2, total_steps=2, start_step=0, loss=1.0)

    def teardown(self) -> list[Resource]:
        return []

    def left(self) -> list[Resource]:
        return []


class ToyServer(Holding):
    """The service: a toy server object, starting, then ready at the section's ready_after-th look."""

    def __init__(self, context) -> None:
        super().__init__(context)
        self.name = f"toys/{self.cfg.run}/server"
        self.ready_after = self.cfg.section("toy").ready_after
        self.looks = 0

    def start(self) -> list[Resource]:
        return [_make(self.context, "toy_server", self.name)]

    def report(self) -> ServiceReport:
        self.looks += 1
        if self.ready_after and self.looks >= self.ready_after:
            return ServiceReport("ready", url=f"http://toy/{self.cfg.run}", replicas_ready=2, replicas=2)
        return ServiceReport("starting", replicas_ready=0, replicas=2, detail="loading the weights")

    def predict(self, request: dict, stream: bool = False) -> Iterator[dict]:
        yield {"choices": [{"text": f" {self.cfg.section('toy').greeting}"}]}

    def teardown(self) -> list[Resource]:
        return _pop(self.name)

    def left(self) -> list[Resource]:
        return [MADE[self.name]] if self.name in MADE else []


class ToyKind(Kind):
    name = "toy"
    noun = "a toy placement"
    group = "toy"
    up_command = "up"
    sections = ToySections

    def summary(self, cfg) -> str:
        return f"a toy placement of {cfg.section('toy').chips} chips"

    def render(self, cfg, renderer) -> dict[str, str]:
        return {"toy.txt": f"run {cfg.run}: {cfg.section('toy').chips} toy chips, image {renderer.image}\n"}

    def hardware(self, cfg):
        return catalogue.accelerator("v5litepod-8"), 1, "on-demand"

    def target(self, context, *, output_dir: str | None = None) -> Deployment:
        return Deployment(ToyPlacement(context, "train"), ToyTraining(context, output_dir=output_dir))

    def service(self, context) -> Deployment:
        return Deployment(ToyPlacement(context, "serve"), ToyServer(context))

    def up(self, context) -> list[Resource]:
        return ToyPlacement(context, "train").provision()

    def status(self, context) -> list[Resource]:
        return self.managed(context.session, Scope("", (), (), run=context.config.run))

    def managed(self, session, scope: Scope) -> list[Resource]:
        return sorted((r for r in MADE.values() if scope.run in (None, r.run)), key=lambda r: r.name)

    def where(self, cfg) -> str:
        return "the toy world"

    def teardown(self, context) -> list[Resource]:
        return _pop(*[r.name for r in self.status(context)])

    def log_source(self, context):
        return lambda: context.config.section("toy").greeting
