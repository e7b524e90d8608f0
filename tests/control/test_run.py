"""`moe-tpu run` end to end in dry run: the emulator provisions, the trainer really trains on this CPU.

A run that a test signals or kills is a real `moe-tpu` process; the other commands run in this process
through the real entry point (cli_helpers.invoke: an interpreter of their own would cost about a second of
imports each), their trainers processes of their own all the same. The trainer is made smaller than the
examples' dry_run section (cli_helpers.SMALL: fewer steps, two fake devices), the same for every run, so
that the session's compilation cache (conftest) compiles its train step once per target's model. A run
that several tests read is done once (the `dry_run` fixture).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from cli_helpers import ROOT, SMALL, nothing_left, run_here, run_json, write_config

CREATES = ("Tpu/CreateQueuedResource", "JobService/CreateCustomJob")
# A run that trains on while a test signals or kills it; its learning rate decays over SMALL's steps, as
# the short runs' does, so that its train step is theirs (from the compilation cache).
LONG = {"dry_run__steps": 400, "trainer__overrides__optim.decay_steps": SMALL["steps"]}


moe = run_here  # in this process


def events(doc: dict) -> list[str]:
    return [e["event"] for e in doc["timeline"]]


@pytest.mark.parametrize("target", ["tpu-vm", "vertex"])
def test_run_trains_and_tears_down(dry_run, target):
    tmp_path, rc, doc, err = dry_run(target)
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
def test_preemption_is_recovered_from_the_last_checkpoint(dry_run, target):
    tmp_path, rc, doc, err = dry_run(target, "preempt",
                                     **({"vertex__scheduling": "FLEX_START"} if target == "vertex" else {}))
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
    write_config(tmp_path, "tpu-vm", **LONG)
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
    doc["slice"]["count"], doc["trainer"]["mesh"] = 1, "data=64,expert=1"  # one slice of the 16 it needs
    (tmp_path / "moe-tpu.yaml").write_text(yaml.safe_dump(doc))
    out = moe(["--dry-run", "--output", "json", "run"], tmp_path)
    assert out.returncode == 2 and "does not fit" in out.stderr and "--force" in out.stderr
    assert "DOES NOT FIT" in out.stderr and "Traceback" not in out.stderr
    assert not any(c["rpc"].endswith(CREATES) for c in json.loads(out.stdout)["calls"])


# --- a run's lifecycle: signals, kills, a second copy, the user's own `down` -----------------

STATUS = Path(".moe-tpu") / "runs" / "moe-demo" / "output" / "status.json"
RECORD = Path(".moe-tpu") / "runs" / "moe-demo" / "trainer.json"


def start_run(tmp_path: Path, *args: str) -> subprocess.Popen:
    """`moe-tpu --dry-run --output json run ARGS` in the background; its JSON document goes to a file
    (a pipe nobody reads would fill up and stall it), its stderr to a pipe."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MOE_TPU_")}
    out = (tmp_path / f"run-{time.monotonic_ns()}.json").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "provision", "--dry-run", "--output", "json", "run", *args],
                            cwd=tmp_path, stdout=out, stderr=subprocess.PIPE, text=True, env=dict(env, NO_COLOR="1"))
    out.close()
    proc.document = Path(out.name)
    return proc


def finish(proc: subprocess.Popen, timeout: float = 120) -> tuple[dict, str]:
    """Wait for a background run: (its JSON document, its stderr)."""
    _, err = proc.communicate(timeout=timeout)
    try:
        return json.loads(proc.document.read_text()), err
    except ValueError:
        pytest.fail(f"no JSON document (exit {proc.returncode}): {err[-3000:]}")


def wait_training(tmp_path: Path, proc: subprocess.Popen, timeout: float = 300) -> int:
    """Wait until the run's trainer reports running; returns the trainer's pid (from its record)."""
    status = tmp_path / STATUS
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if status.exists() and '"running"' in status.read_text() and (tmp_path / RECORD).exists():
            return json.loads((tmp_path / RECORD).read_text())["pid"]
        time.sleep(0.1)
    err = proc.communicate(timeout=60)[1] if proc.poll() is not None else ""
    pytest.fail(f"the trainer never started (exit {proc.returncode}): {err[-3000:]}")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z")


def gone(pid: int, timeout: float = 30) -> bool:
    deadline = time.monotonic() + timeout
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not alive(pid)


@pytest.mark.parametrize("signum, keep", [(signal.SIGTERM, False), (signal.SIGHUP, True)])
def test_sigterm_and_sighup_tear_down_unless_keep_and_a_second_copy_is_refused(tmp_path, signum, keep):
    write_config(tmp_path, "tpu-vm", **LONG)
    proc = start_run(tmp_path, *(["--keep"] if keep else []))
    trainer = wait_training(tmp_path, proc)
    second = moe(["--dry-run", "--output", "json", "run"], tmp_path)  # the same run, from the same directory
    assert second.returncode == 2, second.stderr[-2000:]
    assert f"moe-tpu pid {proc.pid}" in second.stderr and "already running" in second.stderr
    assert not any(c["rpc"].endswith(CREATES) for c in json.loads(second.stdout)["calls"])
    assert proc.poll() is None and alive(trainer)  # nothing of the first was touched
    proc.send_signal(signum)
    doc, err = finish(proc)
    assert proc.returncode == 143, err[-3000:]
    assert doc["result"] == "terminated" and "terminated" in events(doc)
    assert signal.Signals(signum).name in doc["error"] and "Traceback" not in err
    assert gone(trainer)  # the local trainer does not outlive its run
    if keep:
        assert "deleted after signal" not in events(doc) and not nothing_left(tmp_path)
        assert moe(["--dry-run", "down"], tmp_path).returncode == 0
    else:
        assert events(doc)[-1] == "deleted after signal"
    assert nothing_left(tmp_path)


def test_a_killed_run_is_followed_by_its_rerun_and_down_stops_its_trainer(tmp_path):
    write_config(tmp_path, "tpu-vm", **LONG)
    first = start_run(tmp_path)
    trainer = wait_training(tmp_path, first)
    first.kill()
    first.wait(timeout=30)
    assert alive(trainer)  # SIGKILL leaves what it made, and the trainer runs on
    rerun = start_run(tmp_path)
    seen = ""
    deadline = time.monotonic() + 120
    while "following the trainer already running" not in seen and time.monotonic() < deadline:
        line = rerun.stderr.readline()
        if not line:
            break
        seen += line
    assert f"following the trainer already running on this machine (pid {trainer})" in seen, seen[-3000:]
    assert "trainer started on this machine" not in seen  # no second trainer on the same checkpoints
    assert json.loads((tmp_path / RECORD).read_text())["pid"] == trainer
    rerun.kill()
    rerun.wait(timeout=30)
    down = moe(["--dry-run", "down"], tmp_path)
    assert down.returncode == 0, down.stderr
    assert f"stopped the dry run's local trainer (pid {trainer})" in down.stderr
    assert gone(trainer) and nothing_left(tmp_path)



def test_down_stops_a_trainer_whose_run_was_killed_before_recording_it(tmp_path):
    """A kill between starting the trainer and writing its record leaves a trainer no record names: `down`
    finds it by the output directory in its command line, and leaves a process of another run alone."""
    write_config(tmp_path, "tpu-vm")
    runs = (tmp_path / RECORD).parent.parent
    sleep = [sys.executable, "-c", "import time; time.sleep(120)", "--output-dir"]
    ours = subprocess.Popen([*sleep, str(runs / "moe-demo" / "output")], start_new_session=True)
    other = subprocess.Popen([*sleep, str(runs / "another-run" / "output")], start_new_session=True)
    try:
        down = moe(["--dry-run", "down"], tmp_path)
        assert down.returncode == 0, down.stderr
        assert f"stopped the dry run's local trainer (pid {ours.pid})" in down.stderr
        assert ours.wait(timeout=30) == -signal.SIGTERM and other.poll() is None
    finally:
        for proc in (ours, other):
            proc.kill()
            proc.wait()

def test_a_run_killed_right_after_provisioning_is_found_by_status_and_taken_down_by_down(tmp_path):
    """kill -9 leaves the queued resource and its node up (nothing runs to delete them): the next `status`
    lists them by the run's labels and `down` deletes them, and a trainer started meanwhile with them."""
    write_config(tmp_path, "tpu-vm", **LONG)
    run = start_run(tmp_path)
    seen = ""
    while "provisioned:" not in seen and (line := run.stderr.readline()):
        seen += line
    run.kill()
    run.wait(timeout=30)
    assert "provisioned:" in seen, seen[-3000:]
    status = moe(["--dry-run", "--output", "json", "status"], tmp_path)
    assert status.returncode == 0, status.stderr[-2000:]
    assert {(r["kind"], r["state"]) for r in json.loads(status.stdout)["resources"]} == {
        ("queued_resource", "ACTIVE"), ("node", "READY")}
    down = moe(["--dry-run", "down"], tmp_path)
    assert down.returncode == 0 and "nothing of run moe-demo is left" in down.stdout, down.stderr[-2000:]
    assert nothing_left(tmp_path) and not (tmp_path / RECORD).exists()


def test_the_users_own_down_during_a_run_is_not_a_preemption(tmp_path):
    write_config(tmp_path, "tpu-vm", **LONG)
    proc = start_run(tmp_path)
    trainer = wait_training(tmp_path, proc)
    down = moe(["--dry-run", "down"], tmp_path)
    assert down.returncode == 0, down.stderr
    doc, err = finish(proc)
    assert proc.returncode == 1, err[-3000:]
    assert "deleted elsewhere" in events(doc) and "preempted" not in events(doc)
    assert "not a preemption" in doc["error"] and "recovered" not in events(doc)
    assert sum(c["rpc"].endswith(CREATES) for c in doc["calls"]) == 1  # nothing new provisioned
    assert gone(trainer) and nothing_left(tmp_path)


def test_a_finished_run_trains_nothing_again_unless_restart(dry_run, tmp_path):
    finished = dry_run("tpu-vm")  # the happy run of test_run_trains_and_tears_down, gone on from in a copy
    assert finished.returncode == 0, finished.stderr[-3000:]
    shutil.copytree(finished.where, tmp_path, dirs_exist_ok=True)
    again = moe(["--dry-run", "--output", "json", "run"], tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert f"run moe-demo already finished at step {SMALL['steps']} on " in again.stderr
    assert "--dry-run run --restart" in again.stderr
    doc = json.loads(again.stdout)
    assert doc["already_finished"] is True and not any(c["rpc"].endswith(CREATES) for c in doc["calls"])
    # More steps: not finished any more; a run that fails before training shows no figures of the last one.
    write_config(tmp_path, "tpu-vm", dry_run__steps=2 * SMALL["steps"])
    rc, doc, err = run_json(tmp_path, "quota")
    assert rc == 1 and doc["training"]["first_loss"] is None and doc["training"]["final_loss"] is None
    assert "training:" not in err
    write_config(tmp_path, "tpu-vm")
    out = moe(["--dry-run", "--scenario", "quota", "run", "--restart"], tmp_path)
    assert "moved the finished run's output to" in out.stderr and out.returncode == 1
    runs = sorted(p.name for p in (tmp_path / ".moe-tpu" / "runs" / "moe-demo").iterdir())
    assert runs[0] == "output-" + runs[0].split("-", 1)[1] and not (tmp_path / STATUS).exists()
    assert nothing_left(tmp_path)


@pytest.mark.parametrize("target", ["tpu-vm", "vertex", "gke"])
def test_a_run_that_finished_unwatched_is_torn_down_by_its_rerun(dry_run, tmp_path, target):
    # What a run killed before its end leaves once its trainer finished on its own: the finished output
    # (the target's happy run, copied) and the placement still up (`up`: the slice, job or node pools).
    finished = dry_run(target)
    assert finished.returncode == 0, finished.stderr[-3000:]
    shutil.copytree(finished.where, tmp_path, dirs_exist_ok=True)
    up = moe(["--dry-run", "--output", "json", "up"], tmp_path)
    assert up.returncode == 0, up.stderr[-3000:]
    left = {(r["kind"], r["name"]) for r in json.loads(up.stdout)["resources"]}
    assert left
    again = moe(["--dry-run", "--output", "json", "run"], tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    run = yaml.safe_load((tmp_path / "moe-tpu.yaml").read_text())["run"]
    assert f"run {run} already finished at step {SMALL['steps']}" in again.stderr
    deleted = next(line for line in again.stderr.splitlines() if line.startswith(f"deleted what run {run} left up: "))
    doc = json.loads(again.stdout)
    assert doc["result"] == "ok" and doc["already_finished"] is True and doc["step"] == SMALL["steps"]
    assert {(r["kind"], r["name"]) for r in doc["resources"]} >= {r for r in left if r[0] != "gke_cluster"}
    assert all(f"{r['kind']} " in deleted for r in doc["resources"])
    assert doc["training"]["final_loss"] < doc["training"]["first_loss"]  # the run's result, from its metrics
    assert events(doc) == ["already finished", "deleted"]
    assert not any(c["rpc"].endswith((*CREATES, "CreateNodePool")) for c in doc["calls"])
    assert nothing_left(tmp_path)


def test_the_local_trainer_keeps_a_compilation_cache_unless_the_environment_names_one(tmp_path):
    from provision.emulator.local_trainer import compilation_cache_env

    cache = {"JAX_COMPILATION_CACHE_DIR": str(tmp_path / "moe-tpu" / "jax")}
    assert compilation_cache_env({"XDG_CACHE_HOME": str(tmp_path), "HOME": "/nowhere"}) == cache
    assert compilation_cache_env({})["JAX_COMPILATION_CACHE_DIR"] == str(Path.home() / ".cache" / "moe-tpu" / "jax")
    assert compilation_cache_env({"XDG_CACHE_HOME": str(tmp_path), "JAX_COMPILATION_CACHE_DIR": "/mine"}) == {}
