"""Fixtures the control-plane tests share."""

from __future__ import annotations

import contextlib
import fcntl
import shutil
from pathlib import Path
from typing import NamedTuple

import pytest
from cli_helpers import EXAMPLES, SMALL, invoke, run_json, write_config


@pytest.fixture(autouse=True, scope="module")
def grpc_garbage_collected_here():
    """The gRPC objects a module's tests left (a closed channel's call states, in reference cycles) are
    collected at its end, in this thread. Left to the cyclic collector, their finalizers run in whichever
    thread allocates next, and one that runs in a thread just being started (a data loader's, in a later
    trainer test of the same worker) was seen to wait forever on the channel's lock."""
    yield
    import gc

    gc.collect()


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A fresh working directory for the test (dry-run state and remembered configs land there)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


class Ran(NamedTuple):
    """A dry `run` done: the directory it ran in (its state, its trainer's output), and what it answered."""

    where: Path
    returncode: int
    doc: dict
    stderr: str


@pytest.fixture(scope="session")
def dry_run(tmp_path_factory, worker_id):
    """dry_run(target, scenario, **changes): `moe-tpu --dry-run --scenario SCENARIO --output json run` of
    the target's example made small (cli_helpers.write_config), done once a test run for each such
    argument list, not once per pytest-xdist worker: the first worker to ask runs it in the directory all
    workers share, under a lock the others wait on (test_goodput_plot.py reads test_run.py's preempted run,
    and the two files mostly run on different workers). The tests of one run only read what it left in its
    directory; a test that goes on from there (another command that changes the state) copies the directory
    first."""
    import hashlib
    import json

    shared = tmp_path_factory.getbasetemp() if worker_id == "master" else tmp_path_factory.getbasetemp().parent
    done: dict[str, Ran] = {}

    def run(target: str = "tpu-vm", scenario: str = "happy", **changes) -> Ran:
        key = repr((target, scenario, sorted(changes.items())))
        if key not in done:
            name = f"run-{target}-{scenario}-{hashlib.sha256(key.encode()).hexdigest()[:8]}"
            where, answered = shared / name, shared / f"{name}.json"
            with open(shared / f"{name}.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
                if not answered.exists():
                    shutil.rmtree(where, ignore_errors=True)  # a worker that failed halfway
                    where.mkdir()
                    write_config(where, target, **changes)
                    code, doc, err = run_json(where, scenario)
                    answered.write_text(json.dumps({"returncode": code, "doc": doc, "stderr": err}))
            ran = json.loads(answered.read_text())
            done[key] = Ran(where, ran["returncode"], ran["doc"], ran["stderr"])
        return done[key]

    return run


@pytest.fixture(scope="session")
def trained_demo(tmp_path_factory, worker_id):
    """A fresh directory where examples/v5e-64.yaml's run trained (made small: SMALL) by `moe-tpu --dry-run run
    -c train.yaml`: the serving modules' checkpoint. Its trainer is the one test_run.py's tpu-vm dry runs start
    (the same arguments, XLA's optimisations on), so whichever comes second finds its train step and initial
    state in the run's compilation cache (measured: that dry run's trainer 16.6 -> 6.6 CPU s; compiled without
    the optimisations, as it was, it missed the cache and took 12 of its own). Trained
    once per test run, not once per module or pytest-xdist worker: the first worker to ask trains it in the
    directory all workers share, under a lock the others wait on. Read it, never write into it: a module that
    deploys from it works in a copy (cli_helpers.trained_copy)."""
    import yaml

    shared = tmp_path_factory.getbasetemp() if worker_id == "master" else tmp_path_factory.getbasetemp().parent
    work, done = shared / "trained-demo", shared / "trained-demo.done"
    with open(shared / "trained-demo.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            shutil.rmtree(work, ignore_errors=True)  # a worker that failed halfway
            work.mkdir()
            train = {**yaml.safe_load(EXAMPLES["tpu-vm"].read_text()), "dry_run": SMALL}
            (work / "train.yaml").write_text(yaml.safe_dump(train))
            # the trainer the dry run starts is a process of its own
            with contextlib.chdir(work):
                code, _, err = invoke("--dry-run", "run", "-c", "train.yaml")
            assert code == 0, err[-3000:]
            done.touch()
    return work

