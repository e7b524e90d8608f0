"""The pieces of `run` that need no cloud: reading trainer reports, combining workers, the timeline's cost."""

from __future__ import annotations

import pytest

from provision.clock import SimClock
from provision.runs import RunTimeline, Training, _Rate
from provision.core import Report, combine, report_from_status


def test_guest_attributes_read_as_a_report():
    report = report_from_status({"state": "running", "step": "15", "total-steps": "20", "start-step": "10",
                                 "loss": "2.5", "updated": "1700000015"}, worker="n worker 3")
    assert report == Report("running", step=15, total_steps=20, start_step=10, loss=2.5, worker="n worker 3")


def test_a_status_file_reads_as_a_report_and_stopped_means_preempted():
    report = report_from_status({"state": "stopped", "step": 7, "total_steps": 40, "start_step": 0,
                                 "loss": None, "exit_code": 143, "error": None})
    assert (report.phase, report.step, report.loss) == ("preempted", 7, None)
    assert "step 7" in report.detail
    failed = report_from_status({"state": "failed", "step": 3, "exit_code": 1, "error": None})
    assert (failed.phase, failed.detail) == ("failed", "exit code 1")


def test_garbage_in_a_report_is_no_number():
    report = report_from_status({"state": "running", "step": "x", "loss": "nan?"})
    assert (report.step, report.loss) == (None, None)


@pytest.mark.parametrize("phases, expected", [
    (["running", "running"], "running"),
    (["finished", "finished"], "finished"),
    (["finished", "running"], "running"),  # worker 0 done, another still saving
    (["running", "failed"], "failed"),
    (["running", "preempted"], "preempted"),
    (["failed", "preempted"], "failed"),
    ([], "starting"),
])
def test_one_report_for_all_workers(phases, expected):
    reports = [Report(p, step=i, worker=f"w{i}") for i, p in enumerate(phases)]
    combined = combine(reports)
    assert combined.phase == expected
    if expected == "failed":
        assert combined.worker == f"w{phases.index('failed')}"


def test_cost_accrues_only_while_billing():
    clock = SimClock(start=0.0)
    timeline = RunTimeline(clock, usd_per_hour=36.0)
    clock.advance(600)  # queued: free
    timeline.billing(True)
    clock.advance(3600)
    timeline.billing(False)
    clock.advance(600)  # deleted: free again
    entry = timeline.add("deleted")
    assert entry["cost_usd"] == 36.0 and entry["elapsed_s"] == 4800.0 and entry["at"] == "1970-01-01T01:20:00Z"


def test_training_figures_across_a_restart():
    training = Training()
    training.see(Report("running", step=5, total_steps=40, start_step=0, loss=6.0), attempt=0)
    training.see(Report("running", step=12, total_steps=40, start_step=0, loss=3.0), attempt=0)
    training.see(Report("running", step=13, total_steps=40, start_step=12, loss=2.9), attempt=1)
    training.see(Report("finished", step=40, total_steps=40, start_step=12, loss=1.5), attempt=1)
    assert training.as_dict() == {"steps": 40, "first_loss": 6.0, "final_loss": 1.5, "eval_loss": None,
                                  "restarts": 0, "resumed_from_step": 12, "goodput": None}
    training.from_metrics([{"step": 1, "loss": 6.2}, {"step": 40, "loss": 1.4}, {"step": 20, "loss": 2.0}])
    assert (training.first_loss, training.final_loss) == (6.2, 1.4)


def test_eta_from_the_steps_seen():
    rate = _Rate()
    assert rate.eta(100.0, 10, 40) is None  # one point is no rate
    assert rate.eta(110.0, 20, 40) == pytest.approx(20.0)  # 10 steps in 10 s, 20 to go
    assert rate.eta(111.0, 5, 40) is None  # a restart from an earlier step starts over
