"""The status protocol without jax: status.json written whole, its fields, failures; the exit that never hangs."""

import json
import subprocess
import sys
import textwrap

import pytest

from trainer.metrics import Reporter
from trainer.status import EXIT_STOPPED, RunStatus, StatusError

FIELDS = {"state", "step", "total_steps", "start_step", "loss", "tokens_per_s", "eval_loss", "eval_step", "time",
          "exit_code", "error"}


def test_the_status_object_through_a_run(tmp_path):
    target = tmp_path / "deep" / "status.json"
    status = RunStatus([str(target)], clock=lambda: 1700000000.25)
    status.start(total_steps=20)
    assert json.loads(target.read_text()) == {
        "state": "starting", "step": 0, "total_steps": 20, "start_step": 0, "loss": None, "tokens_per_s": None,
        "eval_loss": None, "eval_step": None, "time": 1700000000.25, "exit_code": None, "error": None}
    status.resumed(8)
    status.running(9, 2.5, 1234.5)
    assert json.loads(target.read_text()) == {**json.loads(target.read_text()), "state": "running", "step": 9,
                                              "start_step": 8, "loss": 2.5, "tokens_per_s": 1234.5}
    status.evaluated(10, 2.75)
    status.running(10, float("nan"), float("inf"))  # JSON has no NaN: null
    assert json.loads(target.read_text())["loss"] is None
    assert {k: json.loads(target.read_text())[k] for k in ("eval_loss", "eval_step")} == \
        {"eval_loss": 2.75, "eval_step": 10}
    status.end("stopped", EXIT_STOPPED)
    final = json.loads(target.read_text())
    assert set(final) == FIELDS and (final["state"], final["step"], final["exit_code"]) == ("stopped", 10, 143)
    assert [p.name for p in target.parent.iterdir()] == ["status.json"]  # no temporary file left behind


def test_a_status_file_that_cannot_be_written_fails_at_start_and_only_warns_later(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(StatusError, match=f"cannot write the status file {tmp_path}/file/status.json: "):
        RunStatus([str(tmp_path / "file" / "status.json")])
    target = tmp_path / "gone" / "status.json"
    warnings = []
    status = RunStatus([str(target)], warn=warnings.append)
    status.start(total_steps=5)
    target.parent.rename(tmp_path / "moved")
    (tmp_path / "gone").write_text("")  # the directory is now a file
    status.running(1, 3.0, 10.0)
    status.end("failed", 1, "boom")
    assert warnings == [f"warning: cannot write the status file {target}: Not a directory"]  # once


def test_metrics_rows_also_land_in_the_output_directory(tmp_path):
    reporter = Reporter(str(tmp_path / "m.jsonl"), output_dir=str(tmp_path / "out"))
    reporter.metrics({"step": 1, "loss": 2.0})
    reporter.close()
    reporter = Reporter(stdout=open(tmp_path / "stdout", "w"), output_dir=str(tmp_path / "out"))  # noqa: SIM115
    reporter.metrics({"step": 2, "loss": float("nan")})
    reporter.close()
    lines = (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [{"step": 1, "loss": 2.0}, {"step": 2, "loss": None}]
    assert not Reporter(is_writer=False, output_dir=str(tmp_path / "other")).log  # only process 0 writes
    assert not (tmp_path / "other").exists()


def test_the_trainer_config_imports_neither_jax_nor_flax():
    code = "import sys, trainer.config; assert not {'jax', 'flax'} & set(sys.modules), sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_the_process_exits_at_once_when_a_library_thread_would_keep_it_alive(tmp_path):
    """After a failure a stuck non-daemon thread (as orbax leaves one) does not hold the exit for minutes."""
    code = textwrap.dedent("""
        import threading
        threading.Thread(target=threading.Event().wait, name="stuck").start()
        from trainer.cli import main
        main(["--steps", "-1"])
    """)
    # The thread waits forever: held, the exit would never come and the timeout would fail this.
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "--steps" in p.stderr
