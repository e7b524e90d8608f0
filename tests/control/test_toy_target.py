"""A fourth kind of target, added the way a new one would be: its module (here, this file: its own config
section, checks, rendered file, hardware, a fake placement and a training workload) and one line in the
registry (provision.targets.KINDS). Every command that takes a config then works with it, unchanged."""

from __future__ import annotations

import json

import pytest
from cli_helpers import ROOT, invoke
from pydantic import BaseModel, ConfigDict, Field

from provision import catalogue
from provision.clock import SimClock
from provision.config import load_config
from provision.console import Console
from provision.context import RunContext
from provision.errors import UsageError
from provision.resources import Resource
from provision.services import READY_TIMEOUT_S, ServiceFollower
from provision.targets import KINDS
from provision.core import Holding, Kind, Report, Scope, ServiceReport

# --- the toy kind's module ------------------------------------------------------------------------


class ToySection(BaseModel):
    """The `toy:` section of the config file."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    chips: int = Field(default=8, ge=1)
    greeting: str = "hello from the toy trainer"


# The toy's "cloud": the placements it made, by run (a fake of a service's API).
PLACED: dict[str, Resource] = {}


def _place(cfg, now: float) -> Resource:
    section = cfg.section("toy")
    PLACED[cfg.run] = Resource(kind="toy_placement", name=f"toys/{cfg.run}", state="READY", zone=cfg.region,
                               run=cfg.run, created=now, chips=section.chips, price_per_chip_hour=1.0)
    return PLACED[cfg.run]


class ToyTarget(Holding):
    """The fake placement, and on it a training workload that reports two steps and finishes."""

    kind = "toy"

    def __init__(self, context, *, output_dir: str | None = None) -> None:
        super().__init__(context, output_dir=output_dir)
        self.chips = self.cfg.section("toy").chips
        self.looks = 0

    def describe(self) -> str:
        return f"{self.chips} toy chips"

    def price(self) -> float:
        return float(self.chips)

    def provision(self, attempt: int = 0) -> list[Resource]:
        return [_place(self.cfg, self.context.clock.now())]

    def report(self) -> Report:
        self.looks += 1
        if self.looks < 3:
            return Report("running", step=self.looks, total_steps=2, start_step=0, loss=3.0 - self.looks)
        return Report("finished", step=2, total_steps=2, start_step=0, loss=1.0)

    def teardown(self) -> list[Resource]:
        gone = PLACED.pop(self.cfg.run, None)
        return [gone] if gone else []

    def left(self) -> list[Resource]:
        return [PLACED[self.cfg.run]] if self.cfg.run in PLACED else []


class ToyService(ToyTarget):
    """The same fake placement with a service on it: starting, then ready at the `ready_after`th look
    (None: never)."""

    def __init__(self, context, ready_after: int | None) -> None:
        super().__init__(context)
        self.ready_after = ready_after

    def report(self) -> ServiceReport:
        self.looks += 1
        if self.ready_after is not None and self.looks >= self.ready_after:
            return ServiceReport("ready", url=f"http://toy/{self.cfg.run}", replicas_ready=2, replicas=2)
        return ServiceReport("starting", replicas_ready=0, replicas=2, detail="loading the weights")


class ToyKind(Kind):
    name = "toy"
    noun = "a toy placement"
    group = "toy"
    up_command = "up"
    sections = ("toy",)
    own_sections = {"toy": ToySection}

    def checks(self, get):
        chips = get("toy.chips")
        return [("toy.chips", f"a toy placement has at most 8 chips, not {chips}")] \
            if isinstance(chips, int) and chips > 8 else []

    def summary(self, cfg) -> str:
        return f"a toy placement of {cfg.section('toy').chips} chips"

    def render(self, cfg, renderer) -> dict[str, str]:
        return {"toy.txt": f"run {cfg.run}: {cfg.section('toy').chips} toy chips, image {renderer.image}\n"}

    def hardware(self, cfg):
        return catalogue.accelerator("v5litepod-8"), 1, "on-demand"

    def target(self, context, *, output_dir: str | None = None) -> ToyTarget:
        return ToyTarget(context, output_dir=output_dir)

    def up(self, context) -> list[Resource]:
        return [_place(context.config, context.clock.now())]

    def service(self, context, ready_after: int | None = 3) -> ToyService:
        return ToyService(context, ready_after)

    def managed(self, session, scope: Scope) -> list[Resource]:
        return [r for r in PLACED.values() if scope.run in (None, r.run)]

    def where(self, cfg) -> str:
        return "the toy world"

    def teardown(self, context) -> list[Resource]:
        gone = PLACED.pop(context.config.run, None)
        return [gone] if gone else []

    def log_source(self, context):
        return lambda: context.config.section("toy").greeting


# --- the registry line, and the tests -----------------------------------------------------------


@pytest.fixture(scope="module")
def toy_kind():
    KINDS["toy"] = ToyKind()  # the one line a new kind adds in provision/targets/__init__.py
    yield KINDS["toy"]
    del KINDS["toy"]
    PLACED.clear()


TOY = """\
project: my-project
region: us-west4
zones: [us-west4-a]
run: toy-run
target: toy
toy:
  chips: {chips}
image:
  repository: us-west4-docker.pkg.dev/my-project/moe/trainer
  tag: v1
trainer:
  config: tiny
  output_dir: gs://my-bucket/toy-run
  steps: 2
dry_run:
  steps: 2
  devices: 8
  mesh: data=8,expert=1
"""


@pytest.fixture
def toy_config(toy_kind, workdir):
    path = workdir / "toy.yaml"
    path.write_text(TOY.format(chips=4))
    return path


def _json(*args: str) -> dict:
    code, out, err = invoke("--dry-run", "--output", "json", *args)
    assert code == 0, err
    return json.loads(out)


def test_validate_render_and_plan_ask_the_toy_kind(toy_config, tmp_path):
    code, out, _ = invoke("validate", "-c", str(toy_config))
    assert code == 0 and "a toy placement of 4 chips" in out and "toy.txt" in out
    code, out, _ = invoke("render", "-c", str(toy_config), "--out", str(tmp_path / "r"))
    assert code == 0 and (tmp_path / "r" / "toy.txt").read_text().startswith("run toy-run: 4 toy chips")
    code, out, err = invoke("--output", "json", "plan", "-c", str(toy_config))
    assert code == 0, err
    assert json.loads(out)["target"] == {"accelerator": "v5litepod-8", "topology": "2x4", "slices": 1, "chips": 8,
                                         "capacity": "on-demand"}


def test_the_toy_section_is_checked_by_its_model_and_its_rules(toy_kind, workdir):
    path = workdir / "bad.yaml"
    path.write_text(TOY.format(chips=99).replace("  chips: 99", "  chips: 99\n  colour: red"))
    code, _, err = invoke("validate", "-c", str(path))
    assert code == 2
    assert "toy.colour: unknown key 'colour'" in err and "toy.chips: a toy placement has at most 8 chips" in err
    path.write_text(TOY.format(chips=0))
    code, _, err = invoke("validate", "-c", str(path))
    assert code == 2 and "toy.chips: must be at least 1, got 0" in err


def test_up_status_list_logs_and_down_on_the_toy_placement(toy_config):
    up = _json("up", "-c", str(toy_config))
    assert [(r["kind"], r["state"]) for r in up["resources"]] == [("toy_placement", "READY")]
    assert [r["name"] for r in _json("status", "-c", str(toy_config))["resources"]] == ["toys/toy-run"]
    listed = _json("list", "-c", str(toy_config))["resources"]
    assert [r["name"] for r in listed if r["kind"] == "toy_placement"] == ["toys/toy-run"]
    code, _, err = invoke("--dry-run", "logs", "-c", str(toy_config))
    assert code == 0 and "hello from the toy trainer" in err
    code, out, err = invoke("--dry-run", "down", "-c", str(toy_config))
    assert code == 0 and "the toy world" in err and "deleted 1 resource(s)" in out
    assert PLACED == {} and _json("status", "-c", str(toy_config))["resources"] == []


def test_a_dry_run_run_follows_the_toy_workload_to_its_end(toy_config):
    doc = _json("run", "-c", str(toy_config))
    events = [e["event"] for e in doc["timeline"]]
    assert events[:3] == ["provisioning", "provisioned", "training started"] and events[-2:] == ["finished", "deleted"]
    assert doc["training"]["steps"] == 2 and doc["result"] == "ok" and PLACED == {}


def test_the_kind_commands_refuse_a_toy_config(toy_config):
    code, _, err = invoke("--dry-run", "slice", "up", "-c", str(toy_config))
    assert code == 2 and "target is 'toy': a toy placement, not a TPU VM slice" in err


def _context(path) -> RunContext:
    clock = SimClock()
    return RunContext(load_config(path), Console(), lambda: type("Session", (), {"clock": clock})())


def test_a_service_is_followed_until_ready_and_left_up(toy_config):
    context = _context(toy_config)
    outcome = ServiceFollower(context, context.config.kind.service(context)).deploy()
    assert outcome.ok and outcome.report.url == "http://toy/toy-run" and outcome.report.replicas_ready == 2
    assert [e["event"] for e in outcome.timeline.events] == ["provisioning", "provisioned", "ready"]
    assert list(PLACED) == ["toy-run"]  # a service lives until `down`
    PLACED.clear()


def test_a_service_never_ready_is_torn_down(toy_config):
    context = _context(toy_config)
    outcome = ServiceFollower(context, context.config.kind.service(context, ready_after=None)).deploy()
    assert not outcome.ok and outcome.report.phase == "failed" and "loading the weights" in outcome.report.detail
    assert [e["event"] for e in outcome.timeline.events][-2:] == ["failed", "deleted"] and PLACED == {}
    assert outcome.timeline.events[-2]["elapsed_s"] >= READY_TIMEOUT_S  # it waited its whole time first


def test_a_kind_that_serves_nothing_says_so(toy_config):
    context = _context(toy_config)
    with pytest.raises(UsageError, match="runs training jobs only"):
        KINDS["tpu-vm"].service(context)


@pytest.mark.parametrize("example, made", [("v5e-64.yaml", [("queued_resource", "ACTIVE"), ("node", "READY")]),
                                           ("vertex.yaml", [("custom_job", "JOB_STATE_QUEUED")])])
def test_the_generic_commands_on_the_kinds_that_exist(workdir, example, made):
    config = str(ROOT / "examples" / example)
    for command in ("up", "status"):
        assert [(r["kind"], r["state"]) for r in _json(command, "-c", config)["resources"]] == made
    assert len(_json("down", "-c", config)["deleted"]) == 1
    assert _json("status", "-c", config)["resources"] == []
