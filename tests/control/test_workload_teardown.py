"""A deployment is a placement plus a workload (provision.core.Deployment), and a workload's teardown deletes
that workload and what it made for itself, nothing else: a deploy that fails leaves the run's training
resources up, a training run that ends leaves the run's service up, and only `down` deletes everything of
the run (on GKE the cluster too, when this tool made it and no pool of any run is left on it). The same on
every kind of target."""

from __future__ import annotations

import contextlib
import json

import pytest
import yaml
from cli_helpers import EXAMPLES, invoke

from provision.clock import SimClock
from provision.runs import Runner
from provision.services import ServiceFollower

SERVE = {"tpu-vm": {"machine_type": "ct5lp-hightpu-4t"},
         "vertex": {"machine_type": "ct5lp-hightpu-4t", "min_replicas": 1, "max_replicas": 2},
         "gke": {"machine_type": "ct5lp-hightpu-4t", "checkpoint": "gs://my-bucket/moe-gke", "spot": True}}


def serving_config(where, target: str):
    """The target's example with a serve section, in `where` (the dry runs' state lands beside it)."""
    path = where / "moe-tpu.yaml"
    path.write_text(yaml.safe_dump({**yaml.safe_load(EXAMPLES[target].read_text()), "serve": SERVE[target]}))
    return path


def moe_tpu(*args: str, scenario: str = "happy") -> tuple[int, dict | None, str]:
    code, out, err = invoke("--dry-run", "--scenario", scenario, "--output", "json", *args)
    return code, json.loads(out) if out.strip() else None, err


def names(doc: dict) -> list[tuple[str, str]]:
    return sorted((r["kind"], r["name"]) for r in doc["resources"])


@pytest.mark.parametrize("target, exit_code, words", [
    ("gke", 1, "PREEMPTIBLE_TPU_LITE_PODSLICE_V5"),
    ("vertex", 1, "quota"),
    ("tpu-vm", 2, "runs training jobs only; it serves no model"),
])
def test_a_deploy_that_fails_leaves_the_training_resources_and_down_removes_everything(workdir, target, exit_code,
                                                                                        words):
    config = str(serving_config(workdir, target))
    code, up, err = moe_tpu("up", "-c", config)
    assert code == 0, err[-2000:]
    code, _, err = moe_tpu("deploy", "-c", config, scenario="quota")
    assert code == exit_code and words in err, err[-2000:]
    code, status, err = moe_tpu("status", "-c", config)
    assert code == 0, err[-2000:]
    assert names(status) == names(up) != []  # the training placement (and a GKE cluster made for it) stays
    code, down, err = moe_tpu("down", "-c", config)
    assert code == 0 and down["deleted"], err[-2000:]
    code, listed, err = moe_tpu("list", "-c", config)
    assert code == 0 and listed["resources"] == [], err[-2000:]


class Emulated:
    """A bare emulator (no local trainer or server: jobs and pods end, and servers become ready, on its
    clock) and a command's context on it for `cfg`."""

    def __init__(self, cfg) -> None:
        from provision.cloud import Endpoint, Session
        from provision.console import Console
        from provision.context import RunContext
        from provision.emulator import Emulator

        self.emulator = Emulator(clock=SimClock())
        self.emulator.start()
        self.session = Session(Endpoint(clock=self.emulator.clock, address=self.emulator.address), [], Console())
        self.context = RunContext.on(cfg, self.session, Console(output="json"))

    def close(self) -> None:
        self.session.close()
        self.emulator.stop()


@pytest.mark.parametrize("target", ["gke", "vertex"])
def test_a_finished_training_run_leaves_a_live_service_of_the_same_run_up(tmp_path, target):
    from provision.config import load_config

    cfg = load_config(serving_config(tmp_path, target))
    with contextlib.closing(Emulated(cfg)) as app:
        context, kind = app.context, cfg.kind
        service = kind.service(context)
        served = ServiceFollower(context, service).deploy()
        assert served.ok, served.report
        serving = sorted((r.kind, r.name) for r in service.left())
        output_dir = str(tmp_path / "output")  # as a dry run's: the emulator keeps no bucket
        training = kind.target(context, output_dir=output_dir)
        outcome = Runner(context, training, output_dir=output_dir, keep=False).run()
        assert outcome.ok and [e["event"] for e in outcome.timeline.events][-2:] == ["finished", "deleted"]
        assert training.left() == []  # the run took down what it made for itself...
        assert service.report().phase == "ready"  # ...and the service still answers
        assert sorted((r.kind, r.name) for r in service.left()) == serving
        assert {r.kind for r in kind.status(context)} == {r for r, _ in serving}
        assert kind.teardown(context) and kind.status(context) == []  # `down` takes everything
