"""Goodput from the timeline and the metrics rows; `logs --plot` draws a run; both after a dry run that
is preempted once."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from cli_helpers import config_from, invoke

from provision import goodput


def event(name, at, **details):
    return {"event": name, "elapsed_s": at, **details}


def test_goodput_splits_the_wall_time_and_counts_recomputed_steps():
    events = [event("provisioning", 0), event("provisioned", 100), event("training started", 130),
              event("preempted", 150, step=8), event("deleted", 160), event("provisioning", 160),
              event("recovered", 260), event("training started", 280), event("finished", 300, step=12)]
    # Attempt 1 logged steps 1..8 at 1 s each and checkpointed at 5; attempt 2 resumed at 5 (6..8 again).
    rows = [{"step": s, "step_time_s": 1.0, **({"start_step": 0, "restore_s": 0.0} if s == 1 else {})}
            for s in range(1, 9)]
    rows += [{"step": s, "step_time_s": 1.0, **({"start_step": 5, "restore_s": 2.0} if s == 6 else {})}
             for s in range(6, 13)]
    result = goodput.compute(events, rows)
    assert result["lost_steps"] == 3
    assert result["seconds"] == {"productive": 12.0, "lost": 3.0, "restore": 2.0,
                                 "startup": (50 + 40) - 12.0 - 3.0 - 2.0, "provisioning": 300 - 90}
    assert sum(result["shares_pct"].values()) == pytest.approx(100.0, abs=0.1)
    assert "goodput: 4.0% of 300s productive" in goodput.summary_line(result)
    # A row logged every 4 steps covers 4 steps' time.
    assert goodput.step_seconds([{"step": 4, "step_time_s": 0.5, "start_step": 0}, {"step": 8, "step_time_s": 0.25}]) \
        == [(4, 4, 2.0), (8, 4, 1.0)]


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_a_preempted_dry_run_reports_goodput_and_its_logs_plot_to_a_png(dry_run, tmp_path, monkeypatch):
    where, code, run, err = dry_run("tpu-vm", "preempt")  # test_run's preempted run
    assert code == 0, err[-3000:]
    training, result = run["training"], run["training"]["goodput"]
    assert training["restarts"] == 1
    assert sum(result["shares_pct"].values()) == pytest.approx(100.0, abs=0.1)
    assert result["shares_pct"]["productive"] > 0 and result["shares_pct"]["provisioning"] > 0
    preempted = next(e for e in run["timeline"] if e["event"] == "preempted")
    assert result["lost_steps"] == preempted["step"] - training["resumed_from_step"]
    assert "goodput: " in err and "step(s) lost to preemption" in err

    monkeypatch.chdir(where)
    code, _, err = invoke("--dry-run", "logs", "--plot", str(tmp_path / "out.png"))
    assert code == 0, err
    assert png_size(tmp_path / "out.png") >= (800, 600)
    from PIL import Image

    image = Image.open(tmp_path / "out.png").convert("RGB")
    width, height = image.size
    for left, top in ((0, 0), (width // 2, 0), (0, height // 2), (width // 2, height // 2)):  # four panels
        panel = image.crop((left, top, left + width // 2, top + height // 2)).get_flattened_data()
        colored = sum(1 for r, g, b in panel if max(r, g, b) - min(r, g, b) > 60)  # lines and cells, not axes
        assert colored > 500, (left, top, colored)
    code, _, err = invoke("--dry-run", "logs", "--plot", str(tmp_path / "none" / "x.png"))
    assert code == 2 and "cannot write the plot" in err
    for bad, why in ((tmp_path, "it is a directory, not a file"), ("/dev/null", "it is a device, not a file"),
                     (tmp_path / "x.jpg", "the plot is a PNG; '.jpg' is not a format it writes: name it x.png")):
        code, _, err = invoke("--dry-run", "logs", "--plot", str(bad))
        assert code == 2 and f"cannot write the plot {bad}: {why}" in err, err
    # No suffix: .png added and said; a link at that name is replaced, the file it led to left alone.
    (tmp_path / "mine.txt").write_text("my own file")
    (tmp_path / "linked.png").symlink_to(tmp_path / "mine.txt")
    code, _, err = invoke("--dry-run", "logs", "--plot", str(tmp_path / "linked"))
    assert code == 0 and f"plot: {tmp_path}/linked.png" in err and "added .png to the name" in err, err
    assert (tmp_path / "mine.txt").read_text() == "my own file" and not (tmp_path / "linked.png").is_symlink()
    assert png_size(tmp_path / "linked.png") >= (800, 600)


def test_a_plot_skips_and_counts_the_rows_it_cannot_read(tmp_path):
    from trainer.plot import plot_metrics

    rows = [{"step": 1, "loss": 3.0}, {"loss": 2.0}, "torn line", None, {"step": True}, {"step": 2, "loss": 2.5}]
    written = plot_metrics(rows, str(tmp_path / "p.png"), title="t")
    assert written.skipped == 4 and written.path == str(tmp_path / "p.png")
    assert "skipped 4 metric row(s) that could not be read" in " ".join(written.notes)
    assert png_size(tmp_path / "p.png") >= (800, 600) and not list(tmp_path.glob(".plot-*"))


def test_logs_plots_rows_edited_by_hand_and_refuses_an_empty_plot_name(workdir):
    config_from(Path(__file__).resolve().parents[2] / "examples" / "v5e-64.yaml", workdir)
    output = workdir / ".moe-tpu" / "runs" / "moe-demo" / "output"
    output.mkdir(parents=True)
    rows = [{"step": 1, "loss": 3.0, "expert_load": [0.5, "a", None]}, {"step": 2, "loss": True, "expert_load": "x"},
            {"step": 3, "loss": 2.0, "expert_load": [0.25, 0.75]}]
    (output / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, err = invoke("--dry-run", "logs", "--plot", str(workdir / "p.png"))
    assert code == 0 and "internal error" not in err, err
    assert png_size(workdir / "p.png") >= (800, 600)
    assert "step 3  loss 2.0000" in out and "step 2  loss" not in out  # true is no loss
    code, _, err = invoke("--dry-run", "logs", "--plot", "")
    assert code == 2 and "cannot write the plot : name a file, e.g. run.png" in err, err
