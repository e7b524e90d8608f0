"""A fourth kind of target, added the way a new one would be: its module (tests/control/toy_kind.py: its own
config section, checks, rendered file, hardware, a training and a serving deployment) and one line in the
registry (provision.kinds.KINDS). Every command that takes a config then works with it, unchanged."""

from __future__ import annotations

import json

import pytest
from cli_helpers import ROOT, invoke
from toy_kind import MADE, ToyKind

from provision.clock import SimClock
from provision.config import load_config
from provision.console import Console
from provision.context import RunContext
from provision.errors import UsageError
from provision.kinds import KINDS
from provision.services import READY_TIMEOUT_S, ServiceFollower


@pytest.fixture(scope="module")
def toy_kind():
    KINDS["toy"] = ToyKind()  # the one line a new kind adds in provision/kinds/__init__.py
    yield KINDS["toy"]
    del KINDS["toy"]
    MADE.clear()


TOY = """\
project: my-project
region: us-west4
zones: [us-west4-a]
run: toy-run
target: toy
toy:
  chips: {chips}
  ready_after: {ready_after}
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
    path.write_text(TOY.format(chips=4, ready_after=3))
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


def test_the_toy_kind_brings_its_section_to_the_configs_union(toy_config):
    cfg = load_config(toy_config)
    assert cfg.kind is KINDS["toy"] and cfg.toy.chips == 4 and cfg.section("toy") is cfg.toy
    assert "toy" in type(cfg).model_fields and "slice" not in type(cfg).model_fields


def test_the_toy_section_is_checked_by_its_model_and_its_rules(toy_kind, workdir):
    path = workdir / "bad.yaml"
    path.write_text(TOY.format(chips=99, ready_after=3).replace("  chips: 99", "  chips: 99\n  colour: red"))
    code, _, err = invoke("validate", "-c", str(path))
    assert code == 2
    assert "toy.colour: unknown key 'colour'" in err and "toy.chips: a toy placement has at most 8 chips" in err
    path.write_text(TOY.format(chips=0, ready_after=3))
    code, _, err = invoke("validate", "-c", str(path))
    assert code == 2 and "toy.chips: must be at least 1, got 0" in err


def test_up_status_list_logs_and_down_on_the_toy_placement(toy_config):
    up = _json("up", "-c", str(toy_config))
    assert [(r["kind"], r["state"]) for r in up["resources"]] == [("toy_placement", "READY")]
    assert [r["name"] for r in _json("status", "-c", str(toy_config))["resources"]] == ["toys/toy-run/train"]
    listed = _json("list", "-c", str(toy_config))["resources"]
    assert [r["name"] for r in listed if r["kind"] == "toy_placement"] == ["toys/toy-run/train"]
    code, _, err = invoke("--dry-run", "logs", "-c", str(toy_config))
    assert code == 0 and "hello from the toy trainer" in err
    code, out, err = invoke("--dry-run", "down", "-c", str(toy_config))
    assert code == 0 and "the toy world" in err and "deleted 1 resource(s)" in out
    assert MADE == {} and _json("status", "-c", str(toy_config))["resources"] == []


def test_a_dry_run_run_follows_the_toy_workload_to_its_end(toy_config):
    doc = _json("run", "-c", str(toy_config))
    events = [e["event"] for e in doc["timeline"]]
    assert events[:3] == ["provisioning", "provisioned", "training started"] and events[-2:] == ["finished", "deleted"]
    assert doc["training"]["steps"] == 2 and doc["result"] == "ok" and MADE == {}


def test_the_kind_commands_refuse_a_toy_config(toy_config):
    code, _, err = invoke("--dry-run", "slice", "up", "-c", str(toy_config))
    assert code == 2 and "target is 'toy': a toy placement, not a TPU VM slice" in err
    # A kind's own flag, which the generic `up` offers, is refused for a kind that does not declare it.
    code, _, err = invoke("--dry-run", "up", "--recreate", "-c", str(toy_config))
    assert code == 2 and "--recreate does not apply to target 'toy' (a toy placement)" in err and MADE == {}


def _context(path) -> RunContext:
    clock = SimClock()
    return RunContext(load_config(path), Console(), lambda: type("Session", (), {"clock": clock})())


def test_a_service_is_followed_until_ready_and_left_up(toy_config):
    context = _context(toy_config)
    outcome = ServiceFollower(context, context.config.kind.service(context)).deploy()
    assert outcome.ok and outcome.report.url == "http://toy/toy-run" and outcome.report.replicas_ready == 2
    assert [e["event"] for e in outcome.timeline.events] == ["provisioning", "provisioned", "ready"]
    assert sorted(MADE) == ["toys/toy-run/serve", "toys/toy-run/server"]  # a service lives until `down`
    MADE.clear()


def test_a_service_never_ready_is_torn_down(toy_kind, workdir):
    path = workdir / "never.yaml"
    path.write_text(TOY.format(chips=4, ready_after=0))
    context = _context(path)
    outcome = ServiceFollower(context, context.config.kind.service(context)).deploy()
    assert not outcome.ok and outcome.report.phase == "failed" and "loading the weights" in outcome.report.detail
    assert [e["event"] for e in outcome.timeline.events][-2:] == ["failed", "deleted"] and MADE == {}
    assert outcome.timeline.events[-2]["elapsed_s"] >= READY_TIMEOUT_S  # it waited its whole time first


def test_deploy_and_run_on_the_toy_kind_each_leave_the_others_resources(toy_kind, workdir):
    never, config = workdir / "never.yaml", workdir / "toy.yaml"
    never.write_text(TOY.format(chips=4, ready_after=0))
    config.write_text(TOY.format(chips=4, ready_after=3))
    assert [r["name"] for r in _json("up", "-c", str(config))["resources"]] == ["toys/toy-run/train"]
    code, _, err = invoke("--dry-run", "deploy", "-c", str(never))
    assert code == 1 and "the deploy failed" in err
    assert sorted(MADE) == ["toys/toy-run/train"]  # the failed deploy took only what it made
    deployed = _json("deploy", "-c", str(config))
    assert deployed["url"] == "http://toy/toy-run" and deployed["smoke"]["text"] == " hello from the toy trainer"
    assert _json("run", "-c", str(config))["result"] == "ok"
    status = [r["name"] for r in _json("status", "-c", str(config))["resources"]]
    assert status == ["toys/toy-run/serve", "toys/toy-run/server"]  # the run ended; the service lives on
    assert len(_json("down", "-c", str(config))["deleted"]) == 2
    assert _json("list", "-c", str(config))["resources"] == [] and MADE == {}


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
