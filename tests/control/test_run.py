"""`moe-tpu run` end to end in dry run: the emulator provisions, the trainer really trains on this CPU.

Each run is a real `moe-tpu` process; the trainer is made smaller than the examples' dry_run
section (fewer steps, two fake devices) so the whole file stays around a minute or two.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from cli_helpers import run_process

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = {"tpu-vm": ROOT / "examples" / "v5e-64.yaml", "vertex": ROOT / "examples" / "vertex.yaml"}
CREATES = ("Tpu/CreateQueuedResource", "JobService/CreateCustomJob")
SMALL = {"steps": 12, "devices": 2, "mesh": "data=1,expert=2", "checkpoint_every": 4}


def write_config(tmp_path: Path, target: str, **changes) -> Path:
    doc = yaml.safe_load(EXAMPLES[target].read_text())
    doc["dry_run"] = dict(SMALL)
    for dotted, value in changes.items():
        node = doc
        *parents, last = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    path = tmp_path / "moe-tpu.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def moe(args: list[str], cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    return run_process(args, cwd, timeout=timeout)


def run_json(tmp_path: Path, scenario: str = "happy") -> tuple[int, dict, str]:
    out = moe(["--dry-run", "--scenario", scenario, "--output", "json", "run"], tmp_path)
    try:
        doc = json.loads(out.stdout)
    except ValueError:
        pytest.fail(f"no JSON document (exit {out.returncode}): {out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    return out.returncode, doc, out.stderr


def nothing_left(tmp_path: Path) -> bool:
    listed = moe(["--dry-run", "--output", "json", "list"], tmp_path)
    return listed.returncode == 0 and json.loads(listed.stdout)["resources"] == []


def events(doc: dict) -> list[str]:
    return [e["event"] for e in doc["timeline"]]


@pytest.mark.parametrize("target", ["tpu-vm", "vertex"])
def test_run_trains_and_tears_down(tmp_path, target):
    write_config(tmp_path, target)
    rc, doc, err = run_json(tmp_path)
    assert rc == 0, err[-3000:]
    assert doc["result"] == "ok" and all("event" in e and "at" in e for e in doc["timeline"])
    assert events(doc)[0] == "provisioning" and "training started" in events(doc)
    assert events(doc)[-2:] == ["finished", "deleted"]
    training = doc["training"]
    assert training["steps"] == SMALL["steps"] and training["restarts"] == 0
    assert training["resumed_from_step"] is None
    assert training["final_loss"] < training["first_loss"]
    assert sum(c["rpc"].endswith(CREATES) for c in doc["calls"]) == 1
    assert nothing_left(tmp_path)
    logs = moe(["--dry-run", "logs", "--tail", "3"], tmp_path)
    assert logs.returncode == 0, logs.stderr
    lines = logs.stdout.splitlines()
    assert lines[-1] == f"trainer: finished at step {SMALL['steps']}/{SMALL['steps']}"
    assert [line.split()[:2] for line in lines[:-1]] == [["step", str(n)] for n in range(SMALL["steps"] - 2,
                                                                                          SMALL["steps"] + 1)]


@pytest.mark.parametrize("target", ["tpu-vm", "vertex"])
def test_preemption_is_recovered_from_the_last_checkpoint(tmp_path, target):
    write_config(tmp_path, target, **({"vertex__scheduling": "FLEX_START"} if target == "vertex" else {}))
    rc, doc, err = run_json(tmp_path, "preempt")
    assert rc == 0, err[-3000:]
    names = events(doc)
    assert "preempted" in names and "recovered" in names
    assert names.index("preempted") < names.index("recovered") < names.index("finished")
    training = doc["training"]
    assert training["restarts"] == 1 and training["steps"] == SMALL["steps"]
    assert 0 < training["resumed_from_step"] < SMALL["steps"]
    assert sum(c["rpc"].endswith(CREATES) for c in doc["calls"]) == 2
    assert nothing_left(tmp_path)


@pytest.mark.parametrize("target", ["tpu-vm", "vertex"])
def test_no_restarts_allowed_fails_on_preemption(tmp_path, target):
    write_config(tmp_path, target, recovery__max_restarts=0)
    rc, doc, err = run_json(tmp_path, "preempt")
    assert rc == 1 and doc["result"] == "error" and "max_restarts" in doc["error"]
    assert "preempted" in events(doc) and "recovered" not in events(doc)
    assert nothing_left(tmp_path)


def test_a_config_the_trainer_rejects_exits_2_before_any_create(tmp_path):
    write_config(tmp_path, "tpu-vm", trainer__overrides={"moe.num_expertz": 8})
    for args in (["validate"], ["--dry-run", "--output", "json", "run"]):
        out = moe(args, tmp_path)
        assert out.returncode == 2, out.stderr
        assert "moe.num_expertz" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / ".moe-tpu" / "emulator.json").exists() or nothing_left(tmp_path)


def test_sigint_with_yes_tears_everything_down(tmp_path):
    write_config(tmp_path, "tpu-vm", dry_run__steps=400)
    proc = subprocess.Popen([sys.executable, "-m", "provision", "--dry-run", "--output", "json", "run", "--yes"],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, NO_COLOR="1"))
    status = tmp_path / ".moe-tpu" / "runs" / "moe-demo" / "output" / "status.json"
    deadline = time.monotonic() + 300
    running = lambda: status.exists() and '"running"' in status.read_text()  # noqa: E731
    while time.monotonic() < deadline and proc.poll() is None and not running():
        time.sleep(0.1)
    assert status.exists(), "the trainer never started"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    doc = json.loads(out)
    assert doc["result"] == "interrupted" and "interrupted" in events(doc)
    assert nothing_left(tmp_path)


@pytest.mark.parametrize("target", ["tpu-vm", "vertex"])
def test_quota_fails_the_run_before_any_training(tmp_path, target):
    write_config(tmp_path, target)
    rc, doc, err = run_json(tmp_path, "quota")
    assert rc == 1 and doc["result"] == "error" and "quota" in doc["error"]
    assert events(doc)[:2] == ["provisioning", "failed"] and "training started" not in events(doc)
    assert doc["training"]["steps"] == 0 and not (tmp_path / ".moe-tpu" / "runs").exists()
    assert nothing_left(tmp_path)


def test_a_model_that_does_not_fit_is_refused_before_anything_is_created(tmp_path):
    doc = yaml.safe_load((ROOT / "examples" / "moe-1.2t.yaml").read_text())
    (tmp_path / "moe-tpu.yaml").write_text(yaml.safe_dump(doc))
    out = moe(["--dry-run", "--output", "json", "run"], tmp_path)
    assert out.returncode == 2 and "does not fit" in out.stderr and "--force" in out.stderr
    assert "DOES NOT FIT" in out.stderr and "Traceback" not in out.stderr
    assert not any(c["rpc"].endswith(CREATES) for c in json.loads(out.stdout)["calls"])
