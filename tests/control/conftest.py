"""Fixtures the control-plane tests share."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest
from cli_helpers import run_json, write_config


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
def dry_run(tmp_path_factory):
    """dry_run(target, scenario, **changes): `moe-tpu --dry-run --scenario SCENARIO --output json run` of
    the target's example made small (cli_helpers.write_config), done once a session for each such
    argument list. The tests of one run only read what it left in its directory; a test that goes on
    from there (another command that changes the state) copies the directory first."""
    done: dict[str, Ran] = {}

    def run(target: str = "tpu-vm", scenario: str = "happy", **changes) -> Ran:
        key = repr((target, scenario, sorted(changes.items())))
        if key not in done:
            where = tmp_path_factory.mktemp(f"run-{target}-{scenario}")
            write_config(where, target, **changes)
            done[key] = Ran(where, *run_json(where, scenario))
        return done[key]

    return run
