"""What users try next (issue 35, class 11): a fine-tune from another run's weights (--init-from), and a
progress line that says how far the run is (eval loss, ETA, last checkpoint) with the JSON rows kept off
a terminal."""

import io
import json
import shutil

from click.testing import CliRunner

from trainer.cli import train_command
from trainer.init_from import fingerprint
from trainer.metrics import Reporter


def _train(tmp_path, *args):
    return CliRunner().invoke(train_command, ["--config", "tiny", "--devices", "1", "--metrics",
                                              str(tmp_path / "m.jsonl"), *args])


def test_init_from_starts_a_new_run_from_another_runs_parameters_with_a_fresh_optimizer(trained_tiny, tmp_path):
    source = trained_tiny.output_dir
    out = tmp_path / "tuned"
    result = _train(tmp_path, "--steps", "2", "--output-dir", str(out), "--init-from", str(source))
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]  # its own steps, from 0
    trained, fresh = trained_tiny.rows[-1]["loss"], trained_tiny.rows[0]["loss"]
    assert rows[0]["loss"] < trained + 0.5 < fresh  # the source's weights, not a new model's
    assert rows[0]["lr"] == trained_tiny.rows[0]["lr"]  # the schedule starts again: a fresh optimizer
    status = json.loads((out / "status.json").read_text())
    assert status["start_step"] == 0 and status["state"] == "finished"
    assert status["init_from"]["path"] == f"{source}/checkpoints/120" and status["init_from"]["step"] == 120
    assert status["init_from"]["fingerprint"].startswith("checkpoint:sha256:")
    assert status["init_from"]["data"]  # the data the source was trained on, as its checkpoint says
    assert f"initialized from {source}/checkpoints/120 ({status['init_from']['fingerprint']})" in result.output
    assert json.loads((out / "config.json").read_text())["train"]["init_from"] == str(source)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["2"]
    # a copy of the source has its fingerprint: it names the weights, not where they lie
    copy = shutil.copytree(source / "checkpoints" / "120", tmp_path / "copy" / "120")
    assert fingerprint(str(copy)) == status["init_from"]["fingerprint"]


def test_init_from_refuses_another_models_checkpoint_naming_the_parameter(trained_tiny, tmp_path, monkeypatch):
    # given relative to the working directory, as a user types it (orbax itself takes absolute paths only)
    monkeypatch.chdir(trained_tiny.output_dir.parent)
    out = tmp_path / "runs" / "tuned"
    result = _train(tmp_path, "--steps", "2", "--set", "model.d_model=32", "--init-from", trained_tiny.output_dir.name,
                    "--output-dir", str(out))
    assert result.exit_code == 2, result.output
    assert not (tmp_path / "runs").exists()  # refused: no half-made run (status.json, config.json) is left
    assert "--init-from: the checkpoint" in result.output and "is of another model: params." in result.output
    assert "params.embed is [256, 64] in it, this config needs [256, 32]" in result.output
    for bad, needle in ((tmp_path / "nowhere", "does not exist"), (tmp_path, "holds no checkpoint")):
        result = _train(tmp_path, "--steps", "1", "--init-from", str(bad))
        assert result.exit_code == 2 and needle in result.output and "Traceback" not in result.output


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_the_progress_line_shows_eval_loss_eta_and_the_last_checkpoint(tmp_path):
    err, now = io.StringIO(), [0.0]
    reporter = Reporter(stderr=err, stdout=_Terminal(), output_dir=str(tmp_path), clock=lambda: now[0])
    row = {"loss": 3.0, "aux_loss": 0.01, "drop_fraction": 0.0, "tokens_per_s": 1000.0, "step_time_s": 0.1}
    for step in (1, 2, 3):
        now[0] = 10.0 * step
        reporter.metrics({**row, "step": step})
        reporter.progress({**row, "step": step, **({"eval_loss": 2.5} if step == 2 else {})}, 11)
        reporter.checkpointed(step) if step == 2 else None
    reporter.close()
    lines = err.getvalue().splitlines()
    assert lines[0] == f"metrics rows: kept in {tmp_path}/metrics.jsonl; --metrics FILE writes them to a file, " \
                       "--metrics - here"
    assert "ETA" not in lines[1] and "eval" not in lines[1]
    assert "eval 2.5000" in lines[2] and "ETA 1m30s" in lines[2] and "ckpt" not in lines[2]
    assert "eval 2.5000" in lines[3] and "ETA 1m20s" in lines[3] and lines[3].endswith("ckpt 2")
    assert reporter.out is None  # no JSON on the terminal; the rows are all in the output directory
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    asked = _Terminal()
    Reporter("-", stdout=asked).metrics({**row, "step": 1})  # --metrics -: the rows here too
    assert json.loads(asked.getvalue())["step"] == 1


def test_resuming_on_changed_data_is_refused_unless_allowed_and_then_the_stream_starts_over(trained_tiny, tmp_path):
    from trainer.checkpoint import Checkpointer

    run = shutil.copytree(trained_tiny.output_dir, tmp_path / "run", ignore=shutil.ignore_patterns(".lock"))
    args = ["--steps", "121", "--output-dir", str(run), "--set", "data.synthetic_branching=2"]
    refused = _train(tmp_path, *args)
    assert refused.exit_code == 2, refused.output
    assert "the data source is markov:v32:k4:" in refused.output and "markov:v32:k2:" in refused.output
    assert "(--allow-data-change resumes the model and optimizer on the new data)" in refused.output
    allowed = _train(tmp_path, *args, "--allow-data-change")
    assert allowed.exit_code == 0, allowed.output
    assert "--allow-data-change: the model and optimizer resume, the data stream starts at the beginning" \
           in allowed.output and "resumed from" in allowed.output
    ckpt = Checkpointer(str(run / "checkpoints"), every=100, keep=3)
    try:
        before, after = ckpt.saved_meta(120), ckpt.saved_meta(121)
    finally:
        ckpt.close()
    assert after["source"].startswith("markov:v32:k2:") and 0 < after["position"] < before["position"]
