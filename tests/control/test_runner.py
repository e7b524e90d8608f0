"""`runs.Runner` against a scripted target: the loop's decisions without a cloud or an emulator.

The fake target plays back a script of reports per attempt and records what the loop asked
of it; a real config, a simulated clock and a real console stand around it.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

import provision.kinds as targets
from provision.clock import SimClock
from provision.cloud import storage
from provision.config import load_config
from provision.console import Console
from provision.context import RunContext
from provision.core import Report, Target
from provision.errors import CloudError, UsageError
from provision.resources import Resource
from provision.runs import Interrupted, Runner


class ScriptedTarget:
    """A target whose attempts are scripted: each attempt a list of reports (the last repeats),
    or an exception that `provision` raises."""

    kind = "scripted"
    chips = 4

    def __init__(self, *attempts, clock: SimClock, step_s: float = 60.0) -> None:
        self.attempts = list(attempts)
        self.clock = clock
        self.step_s = step_s
        self.calls: list[str] = []
        self._reports: list[Report] = []
        self.up = False

    def describe(self) -> str:
        return "4 scripted chips"

    def price(self) -> float:
        return 3.6  # dollars an hour: 6 cents a minute

    def provision(self, attempt: int = 0) -> list[Resource]:
        self.calls.append(f"provision {attempt}")
        script = self.attempts[attempt]
        if isinstance(script, BaseException):
            raise script
        self._reports = list(script)
        self.up = True
        return [Resource(kind="scripted", name=f"things/run-{attempt}", state="UP", zone="us-west4-a")]

    def report(self) -> Report:
        self.calls.append("report")
        report = self._reports.pop(0) if len(self._reports) > 1 else self._reports[0]
        if isinstance(report, BaseException):
            raise report
        return report

    def teardown(self) -> list[Resource]:
        self.calls.append("teardown")
        deleted = [Resource(kind="scripted", name="x", state="DELETED", zone="us-west4-a")] if self.up else []
        self.up = False
        return deleted

    def left(self) -> list[Resource]:
        return [Resource(kind="scripted", name="x", state="UP", zone="us-west4-a")] if self.up else []


def running(step: int, loss: float, **kw) -> Report:
    return Report("running", step=step, total_steps=10, start_step=kw.pop("start", 0), loss=loss, **kw)


@pytest.fixture
def cfg(tmp_path):
    path = tmp_path / "moe-tpu.yaml"
    path.write_text("project: my-project\nregion: us-west4\nzones: [us-west4-a]\nrun: scripted\n"
                    "slice: {accelerator: v5litepod-8, capacity: spot}\n"
                    "image: {repository: us-west4-docker.pkg.dev/my-project/moe/trainer}\n"
                    "trainer: {config: tiny, output_dir: " + str(tmp_path / "out") + "}\n"
                    "recovery: {max_restarts: 1}\n", encoding="utf-8")
    return load_config(path)


def runner_for(cfg, target, tmp_path, **kw):
    err = io.StringIO()
    session = SimpleNamespace(clock=target.clock, storage=storage.LOCAL)  # the output directory is local
    runner = Runner(RunContext.on(cfg, session, Console(err=err)), target, output_dir=str(tmp_path / "out"), **kw)
    return runner, err


def names(runner) -> list[str]:
    return [e["event"] for e in runner.timeline.events]


def test_a_finished_run_reads_the_metrics_tears_down_and_bills_only_while_up(cfg, tmp_path):
    clock = SimClock(start=0.0)
    target = ScriptedTarget([Report("waiting"), running(2, 5.0, tokens_per_s=1500.0), running(6, 3.0),
                             Report("finished", step=10, total_steps=10, loss=2.0)], clock=clock)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "metrics.jsonl").write_text(
        "\n".join(json.dumps({"step": s, "loss": 6.0 - s * 0.4}) for s in range(1, 11)) + "\n", encoding="utf-8")
    runner, err = runner_for(cfg, target, tmp_path)
    result = runner.run()
    assert result.ok and result.error is None
    assert names(runner) == ["provisioning", "provisioned", "training started", "finished", "deleted"]
    assert target.calls[0] == "provision 0" and target.calls[-1] == "teardown"
    figures = result.training.as_dict()
    assert {k: figures[k] for k in ("steps", "first_loss", "final_loss", "restarts", "resumed_from_step")} == {
        "steps": 10, "first_loss": 5.6, "final_loss": 2.0, "restarts": 0, "resumed_from_step": None}
    assert figures["eval_loss"] is None  # no row was evaluated
    # the rows carry no step times: every second of the attempt is start-up, the rest provisioning
    goodput = figures["goodput"]
    assert goodput["seconds"]["productive"] == 0 and sum(goodput["shares_pct"].values()) == pytest.approx(100, abs=0.1)
    # billed from "provisioned" to "deleted" at $3.60/h: the follow loop's sleeps, nothing before
    billed_s = runner.timeline.events[-1]["elapsed_s"] - runner.timeline.events[1]["elapsed_s"]
    assert runner.timeline.events[-1]["cost_usd"] == pytest.approx(round(billed_s * 3.6 / 3600, 2))
    assert "1,500 tok/s" in err.getvalue()


def test_keep_leaves_a_finished_target_up(cfg, tmp_path):
    target = ScriptedTarget([Report("finished", step=10, total_steps=10, loss=2.0)], clock=SimClock())
    runner, _ = runner_for(cfg, target, tmp_path, keep=True)
    assert runner.run().ok
    assert "teardown" not in target.calls and target.left()


def test_a_preemption_is_recovered_once_then_the_budget_is_spent(cfg, tmp_path):
    clock = SimClock()
    preempted = Report("preempted", step=4, detail="node gone")
    target = ScriptedTarget([running(4, 4.0), preempted], [running(5, 3.5, start=4), preempted], clock=clock)
    runner, _ = runner_for(cfg, target, tmp_path)
    result = runner.run()
    assert not result.ok and "preempted 2 time(s); recovery.max_restarts is 1" in result.error
    assert names(runner) == ["provisioning", "provisioned", "training started", "preempted", "deleted",
                             "provisioning", "recovered", "training started", "preempted", "deleted"]
    assert (result.training.restarts, result.training.resumed_from_step) == (1, 4)
    assert [c for c in target.calls if c != "report"] == ["provision 0", "teardown", "provision 1", "teardown"]


def test_a_failed_trainer_names_its_worker_and_tears_down(cfg, tmp_path):
    target = ScriptedTarget([running(1, 6.0), Report("failed", step=1, worker="n worker 3", detail="exit code 1")],
                            clock=SimClock())
    runner, _ = runner_for(cfg, target, tmp_path)
    result = runner.run()
    assert not result.ok and result.error == "training failed on n worker 3: exit code 1"
    assert target.calls[-1] == "teardown" and not target.left()


def test_a_provisioning_refusal_is_a_usage_error_and_other_failures_fail_the_run(cfg, tmp_path):
    refused = ScriptedTarget(UsageError("the API refused the request"), clock=SimClock())
    runner, _ = runner_for(cfg, refused, tmp_path)
    with pytest.raises(UsageError):
        runner.run()
    assert refused.calls == ["provision 0", "teardown"]
    stockout = ScriptedTarget(CloudError("no capacity in any zone"), clock=SimClock())
    runner, _ = runner_for(cfg, stockout, tmp_path)
    result = runner.run()
    assert not result.ok and result.error == "provisioning failed: no capacity in any zone"
    assert runner.timeline.events[-1]["cost_usd"] == 0.0  # never billed


def test_a_trainer_that_never_starts_fails_after_the_start_timeout(cfg, tmp_path):
    clock = SimClock(start=0.0)
    target = ScriptedTarget([Report("waiting")], clock=clock)
    runner, _ = runner_for(cfg, target, tmp_path)
    result = runner.run()
    assert not result.ok and "did not start within 3h" in result.error
    assert clock.now() >= 3 * 3600


@pytest.mark.parametrize("confirmed, left", [(True, False), (False, True)])
def test_ctrl_c_tears_down_only_when_confirmed(cfg, tmp_path, confirmed, left):
    target = ScriptedTarget([running(1, 6.0), KeyboardInterrupt()], clock=SimClock())
    runner, _ = runner_for(cfg, target, tmp_path, confirm_teardown=lambda: confirmed)
    with pytest.raises(Interrupted) as exc:
        runner.run()
    assert exc.value.exit_code == 130
    assert bool(target.left()) is left
    assert names(runner)[-2 if confirmed else -1] == "interrupted"


def test_the_factory_builds_the_configs_target(cfg, tmp_path):
    session = SimpleNamespace(clock=SimClock(), endpoint=SimpleNamespace(credentials=None))
    slice_target = targets.for_config(RunContext.on(cfg, session, Console()))
    assert (slice_target.kind, slice_target.chips) == ("tpu-vm", 8)
    assert slice_target.price() == pytest.approx(8 * 0.47)
    vertex = cfg.as_kind(targets.KINDS["vertex"])  # the same file read as target: vertex
    job = targets.for_config(RunContext.on(vertex, session, Console()), output_dir="gs://b/out")
    assert (job.kind, job.workload.output_dir) == ("vertex", "gs://b/out")
    assert set(targets.KINDS) == {"tpu-vm", "vertex", "gke"}
    gke_cfg = load_config(Path(__file__).resolve().parents[2] / "examples" / "gke-pathways.yaml")
    gke = targets.for_config(RunContext.on(gke_cfg, session, Console()))
    assert (gke.kind, gke.chips) == ("gke", 64) and gke.price() == pytest.approx(64 * 0.47)
    for target in (slice_target, job, gke, ScriptedTarget([Report("finished")], clock=SimClock())):
        assert isinstance(target, Target)  # every member the Protocol declares
    assert not isinstance(SimpleNamespace(kind="x", chips=1, describe=str, price=float), Target)


def test_a_target_that_restarts_in_place_is_followed_on_without_provisioning_again(cfg, tmp_path):
    clock = SimClock(start=0.0)
    target = ScriptedTarget([running(3, 4.0), Report("restarted", step=3, detail="restarting jobset, attempt 1"),
                             Report("starting"), running(5, 3.0, start=3), Report("finished", step=10, loss=2.0)],
                            clock=clock)
    runner, _ = runner_for(cfg, target, tmp_path)
    result = runner.run()
    assert result.ok and target.calls.count("provision 0") == 1 and "provision 1" not in target.calls
    assert names(runner)[3:5] == ["preempted", "restarted"]
    assert result.training.restarts == 1 and result.training.resumed_from_step == 3


def test_restarts_in_place_past_max_restarts_fail_the_run(cfg, tmp_path):
    clock = SimClock(start=0.0)
    restart = Report("restarted", detail="restarting jobset")
    target = ScriptedTarget([running(1, 4.0), restart, running(2, 3.0), restart], clock=clock)
    runner, _ = runner_for(cfg, target, tmp_path)
    result = runner.run()
    assert not result.ok and "recovery.max_restarts is 1" in result.error
    assert target.calls[-1] == "teardown" and not target.left()


@pytest.mark.parametrize("keep", [False, True])
def test_sigterm_tears_down_unless_keep_and_ends_terminated(cfg, tmp_path, keep):
    import signal

    from provision.runs import Signalled, Terminated

    target = ScriptedTarget([running(1, 6.0), Signalled(signal.SIGTERM)], clock=SimClock())
    runner, _ = runner_for(cfg, target, tmp_path, keep=keep, confirm_teardown=lambda: False)
    with pytest.raises(Terminated) as exc:
        runner.run()
    assert exc.value.exit_code == 143 and "SIGTERM" in exc.value.message
    assert bool(target.left()) is keep  # never asks: a signal has nobody to answer
    assert names(runner)[-1 if keep else -2] == "terminated"


def test_a_deletion_somebody_asked_for_is_not_recovered_from(cfg, tmp_path):
    target = ScriptedTarget([running(2, 5.0), Report("deleted", detail="queued resource x is gone")],
                            [running(3, 4.0)], clock=SimClock())
    runner, _ = runner_for(cfg, target, tmp_path)
    result = runner.run()
    assert not result.ok and "not a preemption" in result.error and "queued resource x is gone" in result.error
    assert [c for c in target.calls if c != "report"] == ["provision 0", "teardown"]
    assert "deleted elsewhere" in names(runner) and "recovered" not in names(runner)


def test_a_run_that_fails_before_training_reports_no_figures_of_an_earlier_one(cfg, tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "metrics.jsonl").write_text(json.dumps({"step": 40, "loss": 1.1}) + "\n", encoding="utf-8")
    target = ScriptedTarget(CloudError("quota exceeded"), clock=SimClock())
    runner, _ = runner_for(cfg, target, tmp_path)
    result = runner.run()
    figures = result.training.as_dict()
    assert not result.ok and (figures["steps"], figures["first_loss"], figures["final_loss"]) == (0, None, None)
