"""`logs --follow` ends when nothing can write any more: with no run at all, and with a status that says
running while nothing of the run is up (its trainer killed before it wrote its end). Both hung."""

from __future__ import annotations

import json

from cli_helpers import EXAMPLES, invoke


def test_follow_with_no_run_at_all_says_so_and_exits(workdir):
    code, out, err = invoke("--dry-run", "logs", "--follow", "-c", str(EXAMPLES["tpu-vm"]))
    assert (code, out) == (2, "") and "nothing to follow: run moe-demo has no trainer output" in err
    assert "start it with `moe-tpu --dry-run run`" in err


def test_follow_of_a_status_left_running_with_nothing_up_says_so_and_exits(workdir):
    output = workdir / ".moe-tpu" / "runs" / "moe-demo" / "output"
    output.mkdir(parents=True)
    (output / "status.json").write_text(json.dumps({"state": "running", "step": 5, "total_steps": 40}))
    code, _, err = invoke("--dry-run", "logs", "--follow", "-c", str(EXAMPLES["tpu-vm"]))
    assert code == 1 and "the trainer's status says 'running' at step 5, but nothing of run moe-demo is up" in err
    code, out, _ = invoke("--dry-run", "logs", "-c", str(EXAMPLES["tpu-vm"]))  # without --follow: as before
    assert code == 0 and "trainer: running at step 5/40" in out
