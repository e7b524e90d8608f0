"""Two runs (two `run` names) rehearsed in one directory at once: one emulated world, each run's own
resources, trainer and output, and neither fails because of the other (issue 35, class 9)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

from cli_helpers import CLEAN_ENV, EXAMPLES, SMALL, check_no_crash, config_from, invoke, nothing_left


def _configs(where, target: str, steps: dict[str, int]) -> dict[str, str]:
    """One config file per run name, the target's example with the tests' small trainer."""
    for run, n in steps.items():
        # The learning rate decays over SMALL's steps, as in the other dry runs: the train step is theirs,
        # from the session's compilation cache, not one compiled for each step count.
        config_from(EXAMPLES[target], where, name=f"{run}.yaml", run=run, dry_run={**SMALL, "steps": n},
                    **{"trainer__overrides__optim.decay_steps": SMALL["steps"]})
    return {run: f"{run}.yaml" for run in steps}


def _json(*args: str) -> dict:
    code, out, err = invoke("--dry-run", "--output", "json", *args)
    assert code == 0, err[-3000:]
    return json.loads(out)


def test_a_gke_cluster_made_for_one_run_stays_while_another_run_has_pools_on_it(tmp_path):
    configs = _configs(tmp_path, "gke", {"gke-a": 4, "gke-b": 4})
    with contextlib.chdir(tmp_path):
        made = _json("up", "-c", configs["gke-a"])
        assert "gke_cluster" in {r["kind"] for r in made["resources"]}
        _json("up", "-c", configs["gke-b"])
        code, _, err = invoke("--dry-run", "down", "-c", configs["gke-a"])
        assert code == 0, err[-3000:]
        assert "keeping cluster moe-gke-cluster (this tool created it for run gke-a): run(s) gke-b" in err
        left = _json("list")["resources"]
        assert {(r["kind"], r["run"]) for r in left} == {("node_pool", "gke-b"), ("gke_cluster", "gke-a")}
        assert _json("status", "-c", configs["gke-a"])["resources"] == []  # the cluster is not a's to report
        code, _, err = invoke("--dry-run", "down", "-c", configs["gke-b"])
        assert code == 0, err[-3000:]
        assert "deleting cluster moe-gke-cluster (this tool created it for run gke-a, which no run uses" in err
    assert nothing_left(tmp_path)


def test_two_runs_rehearsed_at_once_in_one_directory_each_finish_with_their_own_output(tmp_path):
    # Two TPU VM runs started together (the cheapest target: the test above covers what GKE runs share),
    # the second one hours in the queue (`long-queue`): the emulated clock is the directory's, and its
    # leaps must not age the first run past its trainer's start timeout.
    steps = {"moe-a": 4, "moe-b": 6}
    scenarios = {"moe-a": "happy", "moe-b": "long-queue"}
    configs = _configs(tmp_path, "tpu-vm", steps)
    env = {k: v for k, v in {**os.environ, **CLEAN_ENV}.items() if v is not None}
    procs = {run: subprocess.Popen([sys.executable, "-m", "provision", "--dry-run", "--scenario", scenarios[run],
                                    "--output", "json", "run", "-c", config], cwd=tmp_path, env=env, text=True,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for run, config in configs.items()}
    done = {run: proc.communicate(timeout=300) for run, proc in procs.items()}
    for run, (out, err) in done.items():
        check_no_crash(["run", "-c", configs[run]], out, err)
        assert procs[run].returncode == 0, f"{run}: {err[-3000:]}"
        doc = json.loads(out)
        assert doc["result"] == "ok" and doc["training"]["steps"] == steps[run]
        assert doc["resources"] and all(r["run"] == run for r in doc["resources"]), doc["resources"]
        output = tmp_path / ".moe-tpu" / "runs" / run / "output"
        status = json.loads((output / "status.json").read_text())
        assert (status["state"], status["step"], status["total_steps"]) == ("finished", steps[run], steps[run])
        rows = [json.loads(line) for line in (output / "metrics.jsonl").read_text().splitlines()]
        assert max(row.get("step", 0) for row in rows) == steps[run]
    assert nothing_left(tmp_path)


def test_while_another_runs_trainer_runs_here_the_emulated_clock_follows_real_time(tmp_path):
    from provision.clock import SimClock
    from provision.emulator.local_trainer import OthersGate, local_output_dir, trainer_record

    output = local_output_dir(tmp_path / ".moe-tpu", "other")
    output.mkdir(parents=True)
    trainer = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()", str(output)],
                               stdin=subprocess.PIPE)  # a trainer of run `other`: its cmdline names its output
    trainer_record(output).write_text(json.dumps({"pid": trainer.pid}))
    clock = SimClock()
    clock.gate = OthersGate(tmp_path / ".moe-tpu", run="mine")
    try:
        start = clock.now()
        clock.sleep(3 * 3600)  # a queue of hours, while `other` trains: real time only
        assert clock.now() - start < 5
        assert not OthersGate(tmp_path / ".moe-tpu", run="other").active()  # a run's own trainer: not another's
    finally:
        trainer.communicate(b"")
    start = clock.now()
    clock.sleep(3 * 3600)  # that trainer ended: simulated time leaps again
    assert clock.now() - start == 3 * 3600


def test_a_container_operation_is_found_after_the_world_is_reloaded_from_its_file():
    # Two commands share the world through its file: each transaction after the other's reloads it,
    # and a node pool's operation must still answer GetOperation (it answered NOT_FOUND).
    from provision.emulator.container import _operation
    from provision.emulator.gke_world import GkeWorld

    gke = GkeWorld()
    location = "projects/p/locations/us-west4"
    op = _operation(gke, location, "CREATE_NODE_POOL", f"{location}/clusters/c/nodePools/x", 0.0, 60.0)
    reloaded = GkeWorld.from_json(json.loads(json.dumps(gke.to_json())))
    assert reloaded.operations.keys() == gke.operations.keys() == {f"{location}/operations/{op.name}"}
